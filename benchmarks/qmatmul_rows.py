"""The quantized product alone, by rows: the CPU kernel and the XLA path against float32's dot.

    python benchmarks/qmatmul_rows.py [--k 768 --n 3072] [--rows 1,8,16,32,64,128] [--activations int8,int16]

One [rows, K] x [K, N] product (default: GPT-2 124M's FFN input projection), jitted, medians of 10
calls after a compiling one; int8 per channel, int4 group 128 and float32 output-major (the serving
engine's layout; `jaxformer.qmatmul`), each through the kernel (`qkernel.call`, whatever the rows: from
JF_GEMM_ROWS rows on, its blocked product; float32 keeps the streaming loop) and the XLA path. One product with its
weights in cache; a model's prefill (`benchmarks/prefill_rows.py`) is what sets `qmatmul.GEMM_MAX_ROWS`.
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxformer import qkernel  # pylint: disable=g-import-not-at-top
from jaxformer import qmatmul


def timed(f, *a):
  """Median seconds of 10 calls after a compiling one."""
  f(*a).block_until_ready()
  ts = []
  for _ in range(10):
    s = time.perf_counter()
    f(*a).block_until_ready()
    ts.append(time.perf_counter() - s)
  return float(np.median(ts))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--k", type=int, default=768)
  parser.add_argument("--n", type=int, default=3072)
  parser.add_argument("--rows", default="1,8,16,32,64,128")
  parser.add_argument("--activations", default="", help="also int8 / int16 activations, e.g. int8,int16 (AVX-512 "
                      "VNNI builds): their ratio and rate (GOP/s, 2 ops a multiply-add)")
  args = parser.parse_args(argv)
  acts = [a for a in args.activations.split(",") if a]
  print(f"CPU kernel: {qkernel.unavailable() or 'built'} | [rows, {args.k}] x [{args.k}, {args.n}]")
  rng = np.random.default_rng(0)
  w = rng.standard_normal((args.k, args.n)).astype(np.float32)
  quantized = {8: qmatmul.quantize_int8(w), 4: qmatmul.quantize_int4(w, 128),
               32: (np.ascontiguousarray(w.T), np.ones(args.n, np.float32))}   # float32 output-major (serving)
  for m in (int(r) for r in args.rows.split(",")):
    x = rng.standard_normal((m, args.k)).astype(np.float32)
    tf = timed(jax.jit(lambda x, w: x @ w), x, jnp.asarray(w))
    row = [f"rows {m:4d}: float32 {tf * 1e3:6.2f} ms ({2 * m * args.k * args.n / tf / 1e9:.0f} GFLOP/s)"]
    for bits, (q, s) in quantized.items():
      q, s = jnp.asarray(q), jnp.asarray(s)
      tk, tx = timed(jax.jit(qkernel.call), x, q, s), timed(jax.jit(qmatmul.xla_matmul), x, q, s)
      row.append(f"{'float32 output-major' if bits == 32 else f'int{bits}'} kernel {tk / tf:.2f}x, XLA path {tx / tf:.2f}x")
      for act in acts if bits != 32 else ():
        ta = timed(jax.jit(lambda x, q, s, act=act: qkernel.call(x, q, s, activations=act)), x, q, s)
        row[-1] += f", {act} activations {ta / tf:.2f}x ({2 * m * args.k * args.n / ta / 1e9:.0f} GOP/s)"
    print(" | ".join(row), flush=True)


if __name__ == "__main__":
  main()
