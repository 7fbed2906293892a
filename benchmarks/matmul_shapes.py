"""The baby GPT's matmul shapes alone: JAX (XLA:CPU) vs PyTorch, each at its best.

    python benchmarks/matmul_shapes.py [--dtype bfloat16]   # JAX
    TORCH_PY benchmarks/matmul_shapes.py --torch            # the same shapes in PyTorch (2 threads)

Times one [m, k] x [k, n] product per call (float32; --dtype bfloat16: bf16 operands with
float32 accumulation and output, as on CPUs with AMX) (median of 7 rounds of 200 calls,
per-call dispatch included: ~10 us on either side) for the products in one
`shakespeare_char` training step (12 x 64 = 768 tokens, d_model 128, d_ff 512, vocab
68), plus the 2048^3 product that `train_step.py` uses as the CPU peak. It shows where
the step's time goes when the model is this small: the matmul library, not the model code.
"""

import argparse
import os
import statistics
import time

SHAPES = [  # (m, k, n, what)
    (768, 128, 128, "q/k/v/out projection"),
    (768, 128, 512, "FFN in"),
    (768, 512, 128, "FFN out"),
    (768, 128, 68, "logits (tied embedding)"),
    (2048, 2048, 2048, "peak probe"),
]


def timer(matmul, make):
  """Median seconds per call of matmul(a, b) over 7 rounds."""
  def run(m, k, n):
    a, b = make(m, k), make(k, n)
    reps = 5 if m >= 2048 else 200
    for _ in range(3):
      matmul(a, b)
    rounds = []
    for _ in range(7):
      t = time.perf_counter()
      for _ in range(reps):
        out = matmul(a, b)
      matmul.sync(out)
      rounds.append((time.perf_counter() - t) / reps)
    return statistics.median(rounds)
  return run


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--torch", action="store_true", help="time PyTorch instead of JAX")
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="JAX operand dtype")
  args = parser.parse_args()
  if args.torch:
    import torch  # pylint: disable=g-import-not-at-top
    torch.set_num_threads(os.cpu_count())
    matmul = lambda a, b: a @ b
    matmul.sync = lambda out: None  # eager CPU ops are synchronous
    make = lambda r, c: torch.randn(r, c)
    name = f"torch {torch.__version__}, {torch.get_num_threads()} threads"
  else:
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
    matmul.sync = lambda out: out.block_until_ready()
    make = lambda r, c: jax.random.normal(jax.random.key(r * c), (r, c), jnp.float32).astype(args.dtype)
    name = f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {args.dtype} operands"
  run = timer(matmul, make)
  print(f"{name} ({os.cpu_count()} CPUs)")
  for m, k, n, what in SHAPES:
    s = run(m, k, n)
    print(f"{m:5d} x {k:5d} x {n:5d}  {what:24s} {1e6 * s:9.1f} us  {2 * m * k * n / s / 1e9:6.1f} GFLOP/s")


if __name__ == "__main__":
  main()
