"""XLA:CPU's batched matmul against block size: why `moe.block_rows` grows the blocks.

    python benchmarks/block_matmul.py [--rows 6144] [--d-in 128] [--d-out 512] [--experts 8]

The MoE CPU layout's matmul, forward only: [blocks, b, d_in] x [blocks, d_in, d_out] with
blocks = rows / b + experts, for b = 32 ... 512, the weights gathered per block (as the layer
does) and pre-gathered (the matmul alone), against one dense [rows, d_in] x [d_in, d_out]
matmul of about the same FLOPs. Medians of 20 calls after a compiling one.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def median_ms(fn, *args, n=20):
  """Median wall ms of jit(fn)(*args) over n calls after the compiling one."""
  fn = jax.jit(fn)
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(n):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return 1e3 * float(np.median(times))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", type=int, default=6144)
  parser.add_argument("--d-in", type=int, default=128)
  parser.add_argument("--d-out", type=int, default=512)
  parser.add_argument("--experts", type=int, default=8)
  args = parser.parse_args(argv)
  key = jax.random.key(0)
  w = jax.random.normal(key, (args.experts, args.d_in, args.d_out))
  x = jax.random.normal(key, (args.rows, args.d_in))
  print(f"dense [{args.rows}, {args.d_in}] x [{args.d_in}, {args.d_out}]: {median_ms(lambda x, w: x @ w[0], x, w):.2f} ms")
  for b in (32, 64, 128, 256, 512):
    blocks = args.rows // b + args.experts
    xb = jax.random.normal(key, (blocks, b, args.d_in))
    group = jnp.sort(jax.random.randint(key, (blocks,), 0, args.experts))
    gathered = median_ms(lambda xb, w, g: jnp.einsum("bri,bio->bro", xb, w[g]), xb, w, group)
    pre = median_ms(lambda xb, wg: jnp.einsum("bri,bio->bro", xb, wg), xb, w[group])
    print(f"b={b:4d} ({blocks:3d} blocks, {blocks * b / args.rows:.2f}x the rows): "
          f"weights gathered {gathered:6.2f} ms, pre-gathered {pre:6.2f} ms")


if __name__ == "__main__":
  main()
