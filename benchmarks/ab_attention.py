"""Before/after for `layers.dot_product_attention`: an older revision's against today's.

    python benchmarks/ab_attention.py --before fd1a016~1 [--config shakespeare_char]
        [overrides ...] [--steps-per-call 25] [--rounds 8] [--steps 50]

Loads `jaxformer/layers.py` as it was at git revision --before, traces one jitted train
step with that revision's attention function and one with today's (same model, data,
optimizer, state), and times them in interleaved rounds in this process. Prints both
series, their medians and the median of the per-round ratios (after / before).
"""

import argparse
import importlib.util
import inspect
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_step as bench  # pylint: disable=g-import-not-at-top
from jaxformer import config as config_lib, layers, sharding, train  # pylint: disable=g-import-not-at-top


def load_revision(rev):
  """jaxformer/layers.py at git revision `rev`, as a module."""
  source = subprocess.run(["git", "show", f"{rev}:jaxformer/layers.py"], cwd=ROOT, capture_output=True,
                          text=True, check=False)
  if source.returncode:
    sys.exit(f"error: cannot read jaxformer/layers.py at {rev}: {source.stderr.strip()}")
  path = os.path.join(tempfile.mkdtemp(), "layers_before.py")
  with open(path, "w") as f:
    f.write(source.stdout)
  spec = importlib.util.spec_from_file_location("layers_before", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--before", required=True, help="git revision of the 'before' attention")
  parser.add_argument("--config", default="shakespeare_char")
  parser.add_argument("overrides", nargs="*")
  parser.add_argument("--steps-per-call", type=int, default=None, help="default: the config's")
  parser.add_argument("--rounds", type=int, default=8)
  parser.add_argument("--steps", type=int, default=50)
  args = parser.parse_args()
  train.keep_freed_memory()
  old = load_revision(args.before).dot_product_attention
  new = layers.dot_product_attention
  cfg = config_lib.load_config(args.config, args.overrides)
  k = args.steps_per_call or cfg.train.steps_per_call
  mesh, task, model, tx, schedule, init_fn, rng, _, state_sharding = train.setup(cfg, tempfile.mkdtemp(),
                                                                                 log=lambda *a: None)
  batches = [sharding.global_batch(task.train_batch(i), sharding.batch_sharding(mesh)) for i in range(2 * k)]
  parts = (mesh, task, model, tx, schedule, init_fn, rng, state_sharding)
  # The model looks the function up in `layers` when it is traced (at the first call).
  # Keyword arguments newer than REV (causal, matmul_dtype) are dropped for the old function.
  known = inspect.signature(old).parameters
  layers.dot_product_attention = lambda *a, **kw: old(*a, **{k: v for k, v in kw.items() if k in known})
  before = bench.Variant("before", k, {}, cfg, parts, batches)
  layers.dot_product_attention = new
  after = bench.Variant("after", k, {}, cfg, parts, batches)
  for _ in range(args.rounds):
    before.run(args.steps)
    after.run(args.steps)
  b, a = 1e3 * np.array(before.wall), 1e3 * np.array(after.wall)
  print(f"config {cfg.name} {' '.join(args.overrides)}, K={k}; ms/step per round")
  print("before", np.round(b, 1), f"median {np.median(b):.1f}")
  print("after ", np.round(a, 1), f"median {np.median(a):.1f}")
  print(f"after / before: median of per-round ratios {np.median(a / b):.3f}")


if __name__ == "__main__":
  main()
