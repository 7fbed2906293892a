"""Quality of quantized weights on a trained LM: validation NLL and greedy agreement, float32 vs int8/int4.

    python benchmarks/quantize_quality.py --workdir runs/shakespeare_char [--bits 8,4] [--group-size 128] \
        [--prompts 20] [--prompt-len 32] [--new-tokens 100] [--embedding int8|int4|float] [--activations float,int8,int16]

Quantizes the run's latest checkpoint with `jaxformer.quantize` into temporary workdirs, reads
each back with `evaluate.load_run` (as eval.py and generate do), and reports per variant:
the validation split's NLL per token (`evaluate.perplexity`, eval.py's number) and its change
against float32; and greedy continuations (`decode.generate`, temperature 0) of `--prompts`
prompts cut from the validation text at even spacing: the share of the new tokens equal to
float32's at the same position (strict: after a first difference the rest rarely match), and
the mean position of the first difference. `--activations float,int8,int16` adds each scheme with int8 / int16
activations (`model.quant_activations`: the products of `qmatmul.ACT_MIN_ROWS` rows or more on the kernel's VNNI
product: the validation NLL's, the prompts' prefill, and the decode steps of the 20 prompts).
"""

import argparse
import os
import sys
import tempfile
import time

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxformer import decode  # pylint: disable=g-import-not-at-top
from jaxformer import evaluate
from jaxformer import qmatmul
from jaxformer import quantize
from jaxformer import tasks


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--bits", default="8,4")
  parser.add_argument("--group-size", type=int, default=128)
  parser.add_argument("--embedding", default="int8", choices=qmatmul.EMBEDDINGS)
  parser.add_argument("--prompts", type=int, default=20)
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--new-tokens", type=int, default=100)
  parser.add_argument("--activations", default="float", help="float, int8, int16 or a list (float,int8,int16)")
  args = parser.parse_args(argv)
  quiet = lambda *a, **k: None
  cfg, model, params, tok, meta = evaluate.load_run(args.workdir, log=quiet)
  val = "".join(tasks.LMTask(cfg, args.workdir, log=quiet).val_blocks())
  ids = tok.encode(val)
  starts = np.linspace(0, len(ids) - args.prompt_len - 1, args.prompts).astype(int)
  prompts = [list(ids[s:s + args.prompt_len]) for s in starts]
  print(f"{args.workdir} step {meta.get('step')}: {len(ids):,} validation tokens, {args.prompts} prompts x "
        f"{args.prompt_len} tokens, {args.new_tokens} new tokens greedy; int4 group {args.group_size}, "
        f"embeddings {args.embedding}")
  runs = {"float32": (model, params)}
  with tempfile.TemporaryDirectory() as tmp:
    for bits in (int(b) for b in args.bits.split(",")):
      out = os.path.join(tmp, f"int{bits}")
      quantize.quantize_run(args.workdir, out, bits, args.group_size, embedding=args.embedding, log=print)
      for act in args.activations.split(","):
        _, qmodel, qparams, _, _ = evaluate.load_run(out, log=quiet, overrides=[f"model.quant_activations={act}"])
        runs[f"int{bits}" + (f" + {act} activations" if act != "float" else "")] = (qmodel, qparams)
    results = {}
    for name, (m, p) in runs.items():
      t = time.perf_counter()
      nll = evaluate.perplexity(m, p, tok, val, cfg.data.block_size)["nll_per_token"]
      tokens = np.asarray(decode.generate(m, p, prompts, args.new_tokens, jax.random.key(0), temperature=0.0))
      results[name] = (nll, tokens)
      print(f"  {name}: evaluated in {time.perf_counter() - t:.0f} s")
  base_nll, base_tokens = results["float32"]
  print(f"\n| weights | val NLL | vs float32 | greedy tokens equal to float32 | mean first difference |")
  print("|---|---|---|---|---|")
  for name, (nll, tokens) in results.items():
    same = tokens == base_tokens
    first = np.where(same.all(1), tokens.shape[1], np.argmin(same, axis=1))
    print(f"| {name} | {nll:.5f} | {100 * (nll / base_nll - 1):+.3f}% | {100 * same.mean():.1f}% | "
          f"{first.mean():.1f} of {tokens.shape[1]} |")


if __name__ == "__main__":
  main()
