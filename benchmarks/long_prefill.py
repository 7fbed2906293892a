"""A `llama_tiny` prefill of a long prompt: the tiled kernel's logits against the dense path's.

    python benchmarks/long_prefill.py [--length 8192] [--seed 0]

Random N(0, 0.2) weights for llama_tiny (RoPE, GQA 4 heads / 2 kv), one prompt of
--length random tokens. Runs `decode.prefill` (the KV-cache path: one call writes the
whole prompt into the cache, then the next-token logits) with model.attention_impl=tiled,
and the full teacher-forced forward pass with =tiled and =einsum (the dense path, with its
causal blocks). Prints the largest differences: every position's logits (tiled vs dense
forward) and the prefill's next-token logits against the dense forward's last position.
"""

import argparse
import os
import resource
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flax.linen as nn  # pylint: disable=g-import-not-at-top
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
from jaxformer import config, decode  # pylint: disable=g-import-not-at-top
from jaxformer.model import build_model  # pylint: disable=g-import-not-at-top


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--length", type=int, default=8192)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)
  models = {impl: build_model(config.load_config("llama_tiny", [f"model.attention_impl={impl}",
                                                                f"model.max_len={args.length}"]).model)
            for impl in ("tiled", "einsum")}
  ids = jnp.ones((1, 4), jnp.int32)
  shapes = jax.eval_shape(lambda: nn.unbox(models["tiled"].init(jax.random.key(0), ids))["params"])
  rng = np.random.default_rng(args.seed)
  params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.2, s.shape), jnp.float32), shapes)
  prompt = rng.integers(1, 68, size=(1, args.length)).astype(np.int32)
  print(f"jax {jax.__version__}, load {os.getloadavg()[0]:.1f}; llama_tiny, random weights, one prompt of "
        f"{args.length} tokens", flush=True)
  logits = {}
  for impl, model in models.items():
    start = time.perf_counter()
    logits[impl] = np.asarray(jax.jit(lambda p, x, m=model: m.apply({"params": p}, x))(params, jnp.asarray(prompt)))
    print(f"forward, {impl:>6}: {time.perf_counter() - start:.1f} s", flush=True)
  start = time.perf_counter()
  last, _ = decode.prefill(models["tiled"], params, [list(prompt[0])])
  last = np.asarray(last)
  print(f"decode.prefill, tiled: {time.perf_counter() - start:.1f} s")
  scale = np.abs(logits["einsum"]).max()
  print(f"max |logits tiled - dense| over all {args.length} positions: "
        f"{np.abs(logits['tiled'] - logits['einsum']).max():.2e} (logits up to {scale:.1f})")
  print(f"max |prefill next-token logits (tiled, KV cache) - dense forward's last|: "
        f"{np.abs(last[0] - logits['einsum'][0, -1]).max():.2e}; same argmax: "
        f"{int(last[0].argmax()) == int(logits['einsum'][0, -1].argmax())}")
  print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  main()
