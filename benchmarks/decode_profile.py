"""Where a beam-search step's time goes: XLA:CPU's own per-kernel times from a profiler trace.

    python benchmarks/decode_profile.py [--batch 64] [--src-len 14] [--options default,ours]

One batch of `--batch` random sentences of `--src-len` tokens, beam 4, `wmt_base` shapes in
Marian's layout (37k vocabulary, random weights; as `decode_vs_hf.py --translation`).
For each set of XLA options (`ours`: what `decode.beam_search` compiles with; `default`:
XLA's defaults), the search runs once to compile and warm up, once timed, and once under
`jax.profiler.trace`; the table sums the trace's kernel times per kind of fused kernel
(`ynn_fusion`: YNNPACK matmuls with what XLA fused into them; `gather_*`: the beam reorder
of the KV cache; `dot`: the attention products; `custom-call`: top-k) per decode step.
Nothing is asserted.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def kernel_times(trace_dir):
  """{kernel kind: seconds} summed over a perfetto trace's complete events (XLA thunks only)."""
  path = glob.glob(os.path.join(trace_dir, "**", "*perfetto_trace.json.gz"), recursive=True)[0]
  with gzip.open(path) as f:
    events = json.load(f)
  events = events["traceEvents"] if isinstance(events, dict) else events
  total = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and not e["name"].startswith(("Thunk", "$", "Slinky")):
      total[re.sub(r"\.\d+$", "", e["name"])] += e.get("dur", 0) / 1e6
  return total


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--src-len", type=int, default=14)
  parser.add_argument("--extra", type=int, default=50)
  parser.add_argument("--options", default="ours,default", help="ours | default, comma-separated")
  parser.add_argument("--top", type=int, default=8)
  args = parser.parse_args(argv)
  sys.path.insert(0, ROOT)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  import jax
  import jax.numpy as jnp
  from decode_vs_hf import build_marian
  from jaxformer import decode
  from jaxformer import runtime
  runtime.keep_freed_memory()
  cfg, model, params = build_marian()
  params = jax.device_put(params)
  rng = np.random.default_rng(0)
  inputs = jnp.asarray(np.concatenate([rng.integers(1, 8000, (args.batch, args.src_len - 1)),
                                       np.full((args.batch, 1), cfg.model.eos_id)], 1), jnp.int32)
  kwargs = dict(beam_size=4, alpha=1.0, max_extra_len=args.extra, length_penalty_kind="hf", early_stopping="false")
  fn = decode.beam_search.__wrapped__
  static = ("model", *kwargs)
  reference = None
  for name in args.options.split(","):
    options = decode._CPU_OPTIONS if name == "ours" else None  # pylint: disable=protected-access
    search = jax.jit(fn, static_argnames=static, compiler_options=options)
    tokens, _ = jax.block_until_ready(search(model, params, inputs, **kwargs))
    t = time.perf_counter()
    tokens, _ = jax.block_until_ready(search(model, params, inputs, **kwargs))
    seconds = time.perf_counter() - t
    with tempfile.TemporaryDirectory() as trace_dir:
      with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        jax.block_until_ready(search(model, params, inputs, **kwargs))
      kernels = kernel_times(trace_dir)
    tokens = np.asarray(tokens)
    steps = int((tokens[:, 0] != cfg.model.pad_id).sum(-1).max())
    same = "" if reference is None else f", same tokens as {args.options.split(',')[0]}: {np.array_equal(tokens, reference)}"
    reference = tokens if reference is None else reference
    print(f"\n{name}: {seconds:.2f} s for {steps} steps, {1e3 * seconds / steps:.1f} ms/step "
          f"({args.batch} sentences x 4 beams){same}")
    for kind, s in kernels.most_common(args.top):
      print(f"  {1e3 * s / steps:8.1f} ms/step  {kind}")


if __name__ == "__main__":
  main()
