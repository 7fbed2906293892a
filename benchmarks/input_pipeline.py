"""Input pipeline throughput: tokens/s the batchers deliver (host only, no device).

    python benchmarks/input_pipeline.py [--data DIR] [--steps 200] [--copies 10] [--fast]

Translation: WMT-like text (DIR/wmt14/train_sample.{en,de}, skipped if absent), a
joint BPE tokenizer (trained once, kept in --workdir), tokenized through the on-disk
cache (the cold and the cached load are timed too), then `data.Batcher` with the
paper's 25k-token buckets. The sample is repeated --copies times so an epoch is long
enough for the per-epoch shuffle to weigh as it would on the full corpus. Counted are
real source + target tokens per second (the trainer's tokens/s); padded slots are
shown too. The target is >= 1M tokens/s on 2 cores, well above what a step consumes.

Language model: `data.LMBatcher` random windows of Tiny Shakespeare (characters) at
nanoGPT's baby-GPT shape (12 x 64) and a bigger one (64 x 256).
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxformer import data as data_lib  # pylint: disable=g-import-not-at-top
from jaxformer import tokenizer as tokenizer_lib

DEFAULT_DATA = os.environ.get("JAXFORMER_DATA", os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                             "..", "..", "shared", "data"))


def rate(batch_at, steps, count):
  """(tokens/s, padded slots/s) of `batch_at(step)` over `steps` steps (median of 3 passes)."""
  rates = []
  for start in (0, steps, 2 * steps):
    t, tokens, slots = time.perf_counter(), 0, 0
    for step in range(start, start + steps):
      real, padded = count(batch_at(step))
      tokens, slots = tokens + real, slots + padded
    dt = time.perf_counter() - t
    rates.append((tokens / dt, slots / dt))
  return sorted(rates)[1]


def translation(args):
  src_path = os.path.join(args.data, "wmt14", "train_sample.en")
  tgt_path = os.path.join(args.data, "wmt14", "train_sample.de")
  if not os.path.isfile(src_path):
    print(f"translation: skipped ({src_path} not found)")
    return
  src, tgt = data_lib.read_parallel(src_path, tgt_path)
  src, tgt = src * args.copies, tgt * args.copies
  os.makedirs(args.workdir, exist_ok=True)
  tok_path = os.path.join(args.workdir, f"wmt_sample_bpe{args.vocab}.model")
  t = time.perf_counter()
  trained = not os.path.isfile(tok_path)
  tokenizer_lib.load_or_train_tokenizer("sentencepiece", tok_path, [src_path, tgt_path], args.vocab)
  t_tok = time.perf_counter() - t
  cache = os.path.join(args.workdir, "cache")
  for f in (os.listdir(cache) if os.path.isdir(cache) else []):
    os.remove(os.path.join(cache, f))  # a cold first pass
  t = time.perf_counter()
  data_lib.tokenize_corpus(tok_path, [src, tgt], cache_path=cache, num_proc=-1)
  t_cold = time.perf_counter() - t
  t = time.perf_counter()
  src_ids, tgt_ids = data_lib.tokenize_corpus(tok_path, [src, tgt], cache_path=cache)
  t_cached = time.perf_counter() - t
  n_tokens = len(src_ids.flat) + len(tgt_ids.flat)
  kept, _ = data_lib.filter_pairs(src_ids, tgt_ids, 256)
  t = time.perf_counter()
  batcher = data_lib.Batcher(src_ids, tgt_ids, 25000, 256, seed=0, batch_multiple=8, indices=kept)
  t_init = time.perf_counter() - t
  print(f"translation: {len(src):,} pairs ({args.copies} x the WMT14 sample), {n_tokens:,} BPE tokens "
        f"(vocab {args.vocab}); {batcher.steps_per_epoch} batches/epoch, "
        f"padding {100 * batcher.padding_fraction():.1f}%")
  print(f"  tokenizer {'trained' if trained else 'loaded'} in {t_tok:.2f} s; tokenization cold "
        f"{t_cold:.2f} s ({n_tokens / t_cold:,.0f} tokens/s), from cache {t_cached:.3f} s; "
        f"Batcher init {t_init:.3f} s")
  count = lambda b: (int(b["inputs_segmentation"].sum() + b["targets_segmentation"].sum()),
                     2 * b["inputs"].size)
  real, slots = rate(batcher.batch_at, args.steps, count)
  verdict = "meets" if real >= 1e6 else "below"
  print(f"  Batcher.batch_at: {real:,.0f} real tokens/s ({slots:,.0f} padded slots/s) over {args.steps} steps"
        f" -> {verdict} the 1M tokens/s target")


def language_model(args):
  path = os.path.join(args.data, "tinyshakespeare", "input.txt")
  if not os.path.isfile(path):
    print(f"lm: skipped ({path} not found)")
    return
  text = open(path, encoding="utf-8").read()
  tok = tokenizer_lib.CharTokenizer.train([text])
  stream = data_lib.lm_token_stream([text], tok, add_eos=False)
  print(f"lm: Tiny Shakespeare, {len(stream):,} characters")
  for batch_size, block in ((12, 64), (64, 256)):
    batcher = data_lib.LMBatcher(stream, block, batch_size, seed=0)
    real, _ = rate(batcher.batch_at, args.steps, lambda b: (b["inputs"].size, b["inputs"].size))
    print(f"  LMBatcher {batch_size} x {block}: {real:,.0f} tokens/s ({real / (batch_size * block):,.0f} batches/s)")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--data", default=DEFAULT_DATA, help="the shared data folder")
  parser.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "jaxformer_bench_input"),
                      help="where the tokenizer and token cache are kept between runs")
  parser.add_argument("--steps", type=int, default=200, help="batches per timed pass")
  parser.add_argument("--copies", type=int, default=10, help="repeat the WMT sample this many times")
  parser.add_argument("--vocab", type=int, default=8000, help="BPE vocabulary of the sample tokenizer")
  parser.add_argument("--fast", action="store_true", help="smoke run: 20 steps, 1 copy")
  args = parser.parse_args(argv)
  if args.fast:
    args.steps, args.copies = 20, 1
  translation(args)
  language_model(args)


if __name__ == "__main__":
  main()
