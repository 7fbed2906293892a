"""Fingerprints of the programs a model compiles, to show a change left them alone.

    python benchmarks/hlo_fingerprint.py                      # this checkout
    git worktree add /tmp/old OLD_COMMIT && cp benchmarks/hlo_fingerprint.py /tmp/old/benchmarks/ && \
        python /tmp/old/benchmarks/hlo_fingerprint.py          # an older one (the script imports its own checkout)

Prints, per recipe (and variant), a hash of the StableHLO of the jitted gradient of the summed logits
(the forward and backward of the model, as a train step runs them), with source locations stripped.
Equal hashes in two checkouts mean the same program; issue 36 used it to show that the new model
fields, left at their defaults, trace what the models traced before (BENCHMARKS.md).
"""

import hashlib
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

from jaxformer import model as model_lib  # pylint: disable=g-import-not-at-top
from jaxformer.config import load_config  # pylint: disable=g-import-not-at-top

CASES = (("llama_tiny", []), ("gpt2_tiny", []), ("tiny_encdec", []), ("moe_shakespeare", []),
         ("llama_tiny", ["model.attention_impl=tiled"]), ("llama_tiny", ["model.scan_layers=true"]))


def fingerprint(name, overrides, length=64):
  """sha256 (16 hex digits) of the gradient program's StableHLO for a recipe at [2, length] tokens."""
  cfg = load_config(name, overrides).model
  model = model_lib.build_model(cfg)
  ids = jnp.ones((2, length), jnp.int32)
  args = (ids, ids) if cfg.arch == "encoder_decoder" else (ids,)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), *args))["params"]
  text = jax.jit(jax.grad(lambda p: model.apply({"params": p}, *args).sum())).lower(params).as_text()
  text = re.sub(r" loc\([^)]*\)", "", "\n".join(l for l in text.splitlines() if not l.startswith("#loc")))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


if __name__ == "__main__":
  for name, overrides in CASES:
    print(f"{name:<16} {' '.join(overrides) or '(recipe)':<32} {fingerprint(name, overrides)}")
