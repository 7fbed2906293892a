"""One model's prefill in a loop of its own: float32, int8 or int4 weights, each in a process of its own.

    python benchmarks/prefill_alone.py --bits 32|8|4 [--batch 8] [--prompt-len 16] [--seconds 5]

`benchmarks/decode.py --quantize` interleaves the variants, so each prefill follows another model's and finds
its weights evicted from cache (GPT-2's float32 weights, 494 MB, pass this CPU's 480 MB L3): there the scheme
run right after float32 measured ~10% slower than the same scheme run second. Here one model runs alone, as a
server keeps one model: the median of `decode.prefill` calls over --seconds, after a compiling one (GPT-2 124M
shapes, random weights, int8 tables with --bits 8|4).
"""

import argparse
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxformer import config as config_lib  # pylint: disable=g-import-not-at-top
from jaxformer import decode, quantize
from jaxformer import model as model_lib


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--bits", type=int, choices=(32, 8, 4), required=True)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=16)
  parser.add_argument("--seconds", type=float, default=5.0)
  args = parser.parse_args()
  cfg = config_lib.load_config("gpt2_small", ["model.dtype=float32"])
  model = model_lib.build_model(cfg.model)
  params = jax.tree.map(np.asarray, nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]))
  if args.bits != 32:
    params = quantize.quantize_params(params, cfg.model, args.bits, 128, "int8")[0]
  params = jax.tree.map(jnp.asarray, params)
  prompts = [np.random.default_rng(i).integers(3, 5000, args.prompt_len).tolist() for i in range(args.batch)]
  run = lambda: jax.block_until_ready(decode.prefill(model, params, prompts, max_len=args.prompt_len + 8))
  run()
  times, end = [], time.time() + args.seconds
  while time.time() < end:
    start = time.perf_counter()
    run()
    times.append(time.perf_counter() - start)
  print(f"{'float32' if args.bits == 32 else f'int{args.bits}'}: prefill of {args.batch} x {args.prompt_len} tokens "
        f"{np.median(times) * 1e3:.1f} ms (median of {len(times)})", flush=True)


if __name__ == "__main__":
  main()
