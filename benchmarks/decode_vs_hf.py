"""Decode speed against the machine's memory-bandwidth roofline and Hugging Face `generate`, side by side.

    # The peer lives outside this repository (nothing of it is committed here):
    python -m venv ~/peer/hf && ~/peer/hf/bin/pip install torch==2.13.0 transformers safetensors numpy
    python benchmarks/decode_vs_hf.py --python ~/peer/hf/bin/python [--models gpt2,llama] [--batch 1,8]
        [--prompt 128] [--new 256] [--rounds 2] [--prefix 1000] [--translation] [--bf16] [--fast]

One run measures, in this order:
- The limit: memory bandwidth of this machine now (STREAM-style copy and triad over arrays
  of 512 MiB, numpy on one thread per core, and a jitted read-and-sum), and the float32
  matmul peak (`inspect.matmul_peak`). The roofline time of a decode step is
  (weight bytes + KV-cache bytes read) / bandwidth, or FLOPs / peak when that is larger;
  the best bandwidth measured is used, so the percentages are conservative.
- Decoder-only models with random weights (N(0, 0.02) as the recipes initialise them, the
  final norm scaled x4 so greedy choices are not near-ties): `gpt2_small` (124M) and a
  Llama-style model with GQA (~200M), float32, greedy, `--prompt` tokens then `--new`
  tokens, at each `--batch`: prefill time, ms per token after it, tokens/s, % of the
  roofline. Ours is `decode.generate`; the peer is `transformers`' `generate(do_sample=False)`
  with its KV cache, torch on as many threads as cores, the same weights written through
  `jaxformer.convert`'s tensor tables. The two alternate within each round (A, B, A, B) and
  the generated tokens are compared.
- `--bf16`: ours again with bfloat16 weights, compute and KV cache (half the bytes a step reads),
  its roofline from those bytes, its tokens compared with float32's.
- Prefix caching (`--prefix N`): 8 prompts sharing an N-token prefix, time to first token
  with the prefix prefilled once (`decode.prefill_prefix`) against prefilling it per prompt.
- Translation (`--translation`): beam 4 over Multi30k test2016 (1,000 sentences, a
  sentencepiece model trained on Multi30k's train side) with `wmt_base` shapes in Marian's
  layout (37k vocabulary, random weights), ours `decode.beam_search` with
  `decode.length_penalty=hf` against `MarianMTModel.generate(num_beams=4)`, sentences
  batched by equal source length so both sides have the same length limit per sentence.

Times are medians over rounds; nothing is asserted.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


# ----------------------------------------------------------------------------- the peer (Hugging Face)


def hf_worker():
  """Runs in the peer's interpreter: reads one JSON job per line from stdin, answers one JSON line."""
  import torch
  import transformers
  torch.set_num_threads(os.cpu_count() or 1)
  models = {}
  for line in sys.stdin:
    job = json.loads(line)
    path = job["model"]
    if path not in models:
      cls = transformers.MarianMTModel if job.get("kind") == "marian" else transformers.AutoModelForCausalLM
      models[path] = cls.from_pretrained(path, dtype=torch.float32).eval()
    model = models[path]
    with torch.inference_mode():
      if job.get("kind") == "marian":
        out = []
        t = time.perf_counter()
        for batch in job["batches"]:
          ids = torch.tensor(batch["ids"])
          gen = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=job["beam"],
                               max_new_tokens=batch["max_new"], length_penalty=job["alpha"],
                               early_stopping=job["early_stopping"], do_sample=False)
          out += gen[:, 1:].tolist()  # without the decoder start token
        reply = {"seconds": time.perf_counter() - t, "tokens": out}
      else:
        ids = torch.tensor(job["prompts"])
        t = time.perf_counter()
        model(ids, use_cache=True)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=job["new"],
                             min_new_tokens=job["new"], do_sample=False, use_cache=True,
                             pad_token_id=0, eos_token_id=None)
        reply = {"prefill": prefill, "total": time.perf_counter() - t, "tokens": gen[:, ids.shape[1]:].tolist()}
    print(json.dumps(reply), flush=True)


class Peer:
  """The Hugging Face worker process, kept alive across jobs (models load once)."""

  def __init__(self, python):
    self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--hf-worker"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)

  def run(self, job):
    self.proc.stdin.write(json.dumps(job) + "\n")
    self.proc.stdin.flush()
    line = self.proc.stdout.readline()
    if not line:
      raise SystemExit("the Hugging Face worker died (see its error above)")
    return json.loads(line)

  def close(self):
    self.proc.stdin.close()
    self.proc.wait()


# ----------------------------------------------------------------------------- the machine's limits


def stream_bandwidth(mib=512, repeats=5):
  """Best bytes/s of STREAM copy (2 arrays) and triad (3 arrays) in numpy, one thread per core,
  and of a jitted sum over one array (read only); arrays of `mib` MiB, far above the caches."""
  import jax
  import jax.numpy as jnp
  n = mib * 2**20 // 4
  a, b, c = (np.full(n, v, np.float32) for v in (1.0, 2.0, 0.0))
  cores = os.cpu_count() or 1
  parts = [slice(i * n // cores, (i + 1) * n // cores) for i in range(cores)]

  def threaded(fn):
    best = float("inf")
    for _ in range(repeats):
      threads = [threading.Thread(target=fn, args=(p,)) for p in parts]
      t = time.perf_counter()
      for th in threads:
        th.start()
      for th in threads:
        th.join()
      best = min(best, time.perf_counter() - t)
    return best

  def triad(p):  # c = a + 3 b, STREAM's triad, without a temporary
    np.multiply(b[p], 3.0, out=c[p])
    np.add(c[p], a[p], out=c[p])

  copy = 2 * n * 4 / threaded(lambda p: np.copyto(c[p], a[p]))
  tri = 3 * n * 4 / threaded(triad)
  x = jnp.asarray(a)
  total = jax.jit(jnp.sum)
  total(x).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    total(x).block_until_ready()
    best = min(best, time.perf_counter() - t)
  return {"copy": copy, "triad": tri, "read": n * 4 / best}


# ----------------------------------------------------------------------------- our side


def build(name, overrides, seed=0, final_norm=True):
  """(cfg, model, params as numpy) with random weights; the final norm scaled x4 (peaky greedy choices)."""
  import jax
  import jax.numpy as jnp
  from jaxformer import config as config_lib
  from jaxformer import model as model_lib
  import flax.linen as nn
  cfg = config_lib.load_config(name, list(overrides))
  model = model_lib.build_model(cfg.model)
  ids = jnp.ones((1, 8), jnp.int32)
  args = (ids, ids) if cfg.model.arch == "encoder_decoder" else (ids,)
  params = jax.jit(lambda r: nn.unbox(model.init(r, *args)["params"]))(jax.random.key(seed))
  params = jax.tree.map(np.asarray, params)
  if final_norm:
    params["decoder"]["final_norm"]["scale"] = params["decoder"]["final_norm"]["scale"] * 4.0
  return cfg, model, params


def build_marian(vocab=37000):
  """`wmt_base` shapes in Marian's layout (pad = decoder start = vocab - 1, EOS 0), random weights -> as `build`."""
  return build("wmt_base", [
      "model.sinusoidal_layout=marian", "model.norm_eps=1e-5", "model.logits_bias=true", "model.dropout_rate=0",
      f"model.pad_id={vocab - 1}", f"model.bos_id={vocab - 1}", "model.eos_id=0", "model.max_len=512"],
      final_norm=False)


def write_hf(cfg, params, kind, out):
  """Our params as a Hugging Face folder (config.json + model.safetensors), through convert's tables."""
  from safetensors.numpy import save_file
  from jaxformer import convert
  tensors = {}
  for t in convert.FAMILIES[kind].tensors(cfg.model):
    value = t.to_hf(tuple(np.asarray(convert.get(params, p)) for p in t.ours))
    tensors[t.hf] = np.ascontiguousarray(value, np.float32)
  os.makedirs(out, exist_ok=True)
  save_file(tensors, os.path.join(out, "model.safetensors"))
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(convert.hf_config_for(cfg, kind), f, indent=2)
  return out


def roofline(cfg, params, batch, context, bandwidth, peak, cache_dtype="float32"):
  """Seconds of one decode step (a token for each of `batch` rows at `context` cached keys):
  max(bytes read / bandwidth, FLOPs / peak). Bytes: every weight once, except the input
  embedding and position tables (a row each; the tied table is read whole as the output
  layer), plus each row's KV cache."""
  from jaxformer import inspect as inspect_lib
  import jax
  m = cfg.model
  weights = sum(x.size * x.itemsize for x in jax.tree.leaves(params))
  if not m.tie_output:
    weights -= params["embed"]["embedding"].nbytes
  if "position_embedding" in params.get("decoder", {}):
    weights -= params["decoder"]["position_embedding"].nbytes
  kv = inspect_lib.kv_cache_bytes_per_token(cfg, cache_dtype) * context * batch
  flops = batch * inspect_lib.flops_per_token(cfg, context, context)["decode"]
  return max((weights + kv) / bandwidth, flops / peak), weights, kv


def ours_lm(model, params, prompts, new):
  """(prefill s, total s, tokens) of greedy `decode.generate` (compiled beforehand by the caller)."""
  import jax
  from jaxformer import decode
  total = prompts.shape[1] + new - 1
  t = time.perf_counter()
  jax.block_until_ready(decode.prefill(model, params, prompts, max_len=total))
  prefill = time.perf_counter() - t
  t = time.perf_counter()
  tokens = jax.block_until_ready(decode.generate(model, params, prompts, new, jax.random.key(0), temperature=0.0))
  return prefill, time.perf_counter() - t, np.asarray(tokens)


def compare(a, b):
  """'identical' or where the first row differs first."""
  a, b = np.asarray(a), np.asarray(b)
  if a.shape == b.shape and (a == b).all():
    return "identical"
  same = (a == b).all(0) if a.shape == b.shape else np.zeros(1, bool)
  return f"differ from token {int(np.argmin(same))}"


MODELS = {
    "gpt2": ("gpt2_small", ["model.dtype=float32"]),
    "llama": ("llama_7b", ["model.dtype=float32", "model.d_model=1024", "model.num_heads=16", "model.num_kv_heads=4",
                           "model.num_layers=12", "model.d_ff=2816", "model.max_len=4096"]),
}


def lm_section(args, peer, bandwidth, peak, tmp):
  import dataclasses
  import jax
  from jaxformer import convert
  from jaxformer import model as model_lib
  rows = []
  for name in args.models.split(","):
    recipe, overrides = MODELS[name]
    cfg, model, params = build(recipe, overrides)
    params_jax = jax.device_put(params)
    kind = convert.infer_model_type(cfg)
    hf_dir = write_hf(cfg, params, kind, os.path.join(tmp, name))
    n_params = sum(x.size for x in jax.tree.leaves(params))
    if args.bf16:  # bf16 weights, bf16 compute and cache: half the bytes per step, compared with float32's tokens
      bf16_model = model_lib.build_model(dataclasses.replace(cfg.model, dtype="bfloat16"))
      bf16_params = jax.device_put(jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), params))
    for batch in (int(b) for b in args.batch.split(",")):
      prompts = np.random.default_rng(batch).integers(3, cfg.model.vocab_size, (batch, args.prompt)).astype(np.int32)
      ours_lm(model, params_jax, prompts, args.new)  # compile
      times = {"ours": [], "hf": []}
      if args.bf16:
        ours_lm(bf16_model, bf16_params, prompts, args.new)  # compile
        times["ours-bf16"] = []
      for _ in range(args.rounds):
        prefill, total, ours_tokens = ours_lm(model, params_jax, prompts, args.new)
        times["ours"].append((prefill, total))
        if args.bf16:
          prefill, total, bf16_tokens = ours_lm(bf16_model, bf16_params, prompts, args.new)
          times["ours-bf16"].append((prefill, total))
        if peer:
          reply = peer.run({"model": hf_dir, "prompts": prompts.tolist(), "new": args.new})
          times["hf"].append((reply["prefill"], reply["total"]))
          hf_tokens = reply["tokens"]
      step, weights, kv = roofline(cfg, params, batch, args.prompt + args.new // 2, bandwidth, peak)
      for who in times:
        if not times[who]:
          continue
        bound = step
        if who == "ours-bf16":
          bound = roofline(cfg, jax.tree.map(np.asarray, bf16_params), batch, args.prompt + args.new // 2,
                           bandwidth, peak, "bfloat16")[0]
        prefill, total = (float(np.median(x)) for x in zip(*times[who]))
        per_token = (total - prefill) / (args.new - 1)
        rows.append(dict(model=f"{name} ({n_params / 1e6:.0f}M)", batch=batch, who=who, prefill_s=prefill,
                         ms_per_token=1e3 * per_token, tokens_per_s=batch * args.new / total,
                         roofline_pct=100 * bound / per_token, roofline_ms=1e3 * bound,
                         same=(compare(bf16_tokens, ours_tokens) + " to float32's" if who == "ours-bf16" else
                               compare(ours_tokens, hf_tokens) if peer else "-")))
      print(f"  {name} batch {batch}: weights {weights / 2**20:.0f} MiB, KV read {kv / 2**20:.1f} MiB per step, "
            f"roofline {1e3 * step:.1f} ms/step", flush=True)
  print(f"\n{'model':<14}{'batch':>6}{'who':>10}{'prefill s':>11}{'ms/token':>10}{'tokens/s':>10}"
        f"{'roofline':>10}  tokens")
  for r in rows:
    print(f"{r['model']:<14}{r['batch']:>6}{r['who']:>10}{r['prefill_s']:>11.3f}{r['ms_per_token']:>10.1f}"
          f"{r['tokens_per_s']:>10.1f}{r['roofline_pct']:>9.0f}%  {r['same']}")
  return rows


def prefix_section(args):
  """Time to first token for 8 prompts sharing a prefix: prefilled once vs with each prompt."""
  import jax
  from jaxformer import decode
  recipe, overrides = MODELS["llama"]
  cfg, model, params = build(recipe, overrides)
  params = jax.device_put(params)
  rng = np.random.default_rng(0)
  prefix = rng.integers(3, cfg.model.vocab_size, args.prefix).tolist()
  prompts = [rng.integers(3, cfg.model.vocab_size, 16).tolist() for _ in range(8)]

  def first_token(fn):
    fn()  # compile
    times = []
    for _ in range(args.rounds):
      t = time.perf_counter()
      out = jax.block_until_ready(fn())
      times.append(time.perf_counter() - t)
    return float(np.median(times)), np.asarray(out)

  size = args.prefix + 16
  whole, a = first_token(lambda: decode.generate(model, params, [prefix + p for p in prompts], 1, jax.random.key(0),
                                                 temperature=0.0))
  cache = jax.block_until_ready(decode.prefill_prefix(model, params, prefix, len(prompts), size))  # compile
  t = time.perf_counter()
  cache = jax.block_until_ready(decode.prefill_prefix(model, params, prefix, len(prompts), size))
  once = time.perf_counter() - t
  cached, b = first_token(lambda: decode.generate(model, params, prompts, 1, jax.random.key(0), temperature=0.0,
                                                  prefix_cache=cache))
  print(f"\nprefix caching ({args.prefix}-token prefix, 8 prompts of 16 tokens, llama {cfg.model.num_layers} layers): "
        f"first token {whole:.3f} s prefilling prefix + prompt for all 8; with the prefix prefilled once "
        f"({once:.3f} s, batch 1): {cached:.3f} s ({whole / cached:.1f}x less); same first tokens: "
        f"{'yes' if (a == b).all() else 'no'}")
  return {"whole_s": whole, "prefix_once_s": once, "cached_s": cached}


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--python", help="the peer's interpreter (torch + transformers); none: ours only")
  parser.add_argument("--models", default="gpt2,llama", help='decoder-only models to time ("": none)')
  parser.add_argument("--batch", default="1,8")
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=256)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--prefix", type=int, default=1000, help="shared prefix tokens (0: skip)")
  parser.add_argument("--translation", action="store_true", help="also beam search over Multi30k test2016")
  parser.add_argument("--sentences", type=int, default=1000, help="translation: the first N of test2016")
  parser.add_argument("--extra", type=int, default=50, help="translation: max length = source + this")
  parser.add_argument("--beam-batch", type=int, default=64, help="translation: sentences per batch")
  parser.add_argument("--bf16", action="store_true", help="also ours with bfloat16 weights, compute and cache")
  parser.add_argument("--fast", action="store_true", help="smoke run: tiny shapes")
  parser.add_argument("--hf-worker", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.hf_worker:
    return hf_worker()
  sys.path.insert(0, ROOT)
  from jaxformer import inspect as inspect_lib
  from jaxformer import runtime
  runtime.keep_freed_memory()  # as jaxformer.generate does
  if args.fast:
    args.prompt, args.new, args.rounds, args.sentences, args.extra = 16, 16, 1, 40, 5
    args.prefix = min(args.prefix, 64)
  bw = stream_bandwidth(128 if args.fast else 512)
  peak = inspect_lib.matmul_peak()
  bandwidth = max(bw.values())
  print(f"memory bandwidth: copy {bw['copy'] / 1e9:.1f}, triad {bw['triad'] / 1e9:.1f}, read {bw['read'] / 1e9:.1f} "
        f"GB/s (roofline uses {bandwidth / 1e9:.1f}); float32 matmul peak {peak / 1e12:.3f} TFLOP/s", flush=True)
  peer = Peer(args.python) if args.python else None
  try:
    with tempfile.TemporaryDirectory() as tmp:
      rows = lm_section(args, peer, bandwidth, peak, tmp) if args.models else []
      prefix = prefix_section(args) if args.prefix else None
      translation = translation_section(args, peer, tmp) if args.translation else None
  finally:
    if peer:
      peer.close()
  return {"bandwidth": bw, "peak": peak, "lm": rows, "prefix": prefix, "translation": translation}


def translation_section(args, peer, tmp):
  """Beam 4 over Multi30k test2016, ours and MarianMTModel.generate, the same weights and batches."""
  import jax
  from jaxformer import decode
  from jaxformer import tokenizer as tokenizer_lib
  from jaxformer.configs import _paths
  from jaxformer.data import read_lines
  src_file = _paths.data("multi30k/test2016.en")
  if not os.path.isfile(src_file):
    print(f"\ntranslation: {src_file} not found (set JAXFORMER_DATA); skipped")
    return None
  cfg, model, params = build_marian()
  hf_dir = write_hf(cfg, params, "marian", os.path.join(tmp, "marian"))
  params = jax.device_put(params)
  spm = tokenizer_lib.train_sentencepiece([_paths.data("multi30k/train.en"), _paths.data("multi30k/train.de")],
                                          8000, os.path.join(tmp, "spm.model"))
  sources = read_lines(src_file)[:args.sentences]
  ids = [[i + 1 for i in spm.encode(s)] + [cfg.model.eos_id] for s in sources]  # ids >= 1: 0 is Marian's EOS
  # Batches of equal source length: our limit (source + extra, per sentence) is then HF's max_new_tokens.
  by_length = {}
  for i, x in enumerate(ids):
    by_length.setdefault(len(x), []).append(i)
  batches = [(length, members[j:j + args.beam_batch]) for length, members in sorted(by_length.items())
             for j in range(0, len(members), args.beam_batch)]
  extra, alpha = args.extra, 1.0

  def ours():
    out = {}
    for length, members in batches:
      inputs = jax.numpy.asarray([ids[i] for i in members], jax.numpy.int32)
      tokens, _ = decode.beam_search(model, params, inputs, beam_size=4, alpha=alpha, max_extra_len=extra,
                                     length_penalty_kind="hf", early_stopping="false")
      for i, row in zip(members, np.asarray(tokens)[:, 0]):
        out[i] = row
    return out

  def trim(row):
    row = [int(t) for t in row]
    end = row.index(cfg.model.eos_id) + 1 if cfg.model.eos_id in row else len(row)
    return [t for t in row[:end] if t != cfg.model.pad_id]

  t = time.perf_counter()
  ours()  # compiles one program per batch shape: not timed
  print(f"\ntranslation: {len(sources)} sentences in {len(batches)} batches of equal source length, "
        f"compiled in {time.perf_counter() - t:.0f} s", flush=True)
  times = {"ours": [], "hf": []}
  job = {"kind": "marian", "model": hf_dir, "beam": 4, "alpha": alpha, "early_stopping": False,
         "batches": [{"ids": [ids[i] for i in members], "max_new": length + extra} for length, members in batches]}
  for _ in range(args.rounds):
    t = time.perf_counter()
    mine = ours()
    times["ours"].append(time.perf_counter() - t)
    if peer:
      reply = peer.run(job)
      times["hf"].append(reply["seconds"])
      theirs = dict(zip([i for _, members in batches for i in members], reply["tokens"]))
  steps = sum(len(members) and max(len(trim(mine[i])) for i in members) for _, members in batches)
  same = sum(trim(mine[i]) == trim(theirs[i]) for i in mine) if peer else None
  print(f"{'':6}{'sentences/s':>12}{'ms/step':>9}  (wmt_base shapes in Marian's layout, 37k vocabulary, beam 4, "
        f"{steps} decode steps over all batches)")
  result = {}
  for who, ts in times.items():
    if ts:
      median = float(np.median(ts))
      result[who] = {"seconds": median, "sentences_per_s": len(sources) / median, "ms_per_step": 1e3 * median / steps}
      print(f"{who:6}{len(sources) / median:>12.1f}{1e3 * median / steps:>9.1f}")
  if peer:
    print(f"same best hypothesis: {same} of {len(sources)} sentences")
    result["same"] = same
  return result


if __name__ == "__main__":
  main()
