"""Attention alone, forward + backward: the dense path vs the tiled kernel, by length.

    python benchmarks/attention_speed.py [--lengths 256,512,1024,2048,4096,8192] [--dense-max 4096]
        [--heads 4] [--kv-heads 4] [--head-dim 64] [--batch 1] [--rounds 5]

Causal self-attention over one document per row (the training case), jitted
value_and_grad of sum(out * w) with respect to q, k and v through
`layers.dot_product_attention` with implementation=einsum (today's dense path, with its
causal blocks) and =tiled (jaxformer.attention). Each round runs every variant once, in
turn (A, B, A, B ...: the machine's load hits both alike); prints the per-round ms, their
medians and the median of the per-round ratios tiled / dense, with the load average.
"""

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
from jaxformer import layers  # pylint: disable=g-import-not-at-top


def step_fn(impl):
  """jit(value_and_grad) of the attention for one implementation."""
  def loss(q, k, v, w, seg):
    slots = jnp.arange(q.shape[1])
    out = layers.dot_product_attention(q, k, v, seg, seg, slots, slots, implementation=impl, causal=True)
    return jnp.sum(out * w)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--lengths", default="256,512,1024,2048,4096,8192")
  parser.add_argument("--dense-max", type=int, default=4096, help="longest length for the dense path (memory)")
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv-heads", type=int, default=4)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--rounds", type=int, default=5)
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; batch {args.batch}, "
        f"{args.heads} heads ({args.kv_heads} kv) x {args.head_dim}, causal; fwd+bwd ms")
  print(f"{'length':>7} {'dense ms':>9} {'tiled ms':>9} {'tiled/dense':>12}  per-round dense | tiled")
  rng = np.random.default_rng(0)
  for t in (int(x) for x in args.lengths.split(",")):
    b, h, kvh, d = args.batch, args.heads, args.kv_heads, args.head_dim
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kvh, d)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    seg = jnp.ones((b, t), jnp.int32)
    impls = ["einsum", "tiled"] if t <= args.dense_max else ["tiled"]
    fns = {impl: step_fn(impl) for impl in impls}
    for fn in fns.values():
      jax.block_until_ready(fn(q, k, v, w, seg))  # compile and warm up
    times = {impl: [] for impl in impls}
    for _ in range(args.rounds):
      for impl, fn in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(q, k, v, w, seg))
        times[impl].append(1e3 * (time.perf_counter() - start))
    tiled = np.array(times["tiled"])
    if "einsum" in times:
      dense = np.array(times["einsum"])
      print(f"{t:>7} {np.median(dense):>9.1f} {np.median(tiled):>9.1f} {np.median(tiled / dense):>12.2f}  "
            f"{np.round(dense, 0)} | {np.round(tiled, 0)}", flush=True)
    else:
      print(f"{t:>7} {'-':>9} {np.median(tiled):>9.1f} {'-':>12}  - | {np.round(tiled, 0)}", flush=True)
  print(f"load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  main()
