"""Before/after for one function of the package: an older revision's against today's.

    python benchmarks/ab_function.py --before fd1a016~1 [--function layers.dot_product_attention]
        [--config shakespeare_char] [overrides ...] [--steps-per-call 25] [--rounds 8] [--steps 50]
        [--batch B,S,T]

Loads `jaxformer/MODULE.py` as it was at git revision --before, traces one jitted train
step with that revision's MODULE.NAME and one with today's (same model, data, optimizer,
state), and times them in interleaved rounds in this process. Prints both series, their
medians, the median of the per-round ratios (after / before) and each step's temporary
memory (XLA's memory_analysis). The model must look the function up as MODULE.NAME when
it is traced (as it does for layers.dot_product_attention and losses.cross_entropy).
"""

import argparse
import importlib
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
from jaxformer import config as config_lib, runtime, sharding, train  # pylint: disable=g-import-not-at-top


def load_revision(rev, module_name):
  """jaxformer/<module_name>.py at git revision `rev`, as a module."""
  source = subprocess.run(["git", "show", f"{rev}:jaxformer/{module_name}.py"], cwd=ROOT, capture_output=True,
                          text=True, check=False)
  if source.returncode:
    sys.exit(f"error: cannot read jaxformer/{module_name}.py at {rev}: {source.stderr.strip()}")
  path = os.path.join(tempfile.mkdtemp(), f"{module_name}_before.py")
  with open(path, "w") as f:
    f.write(source.stdout)
  spec = importlib.util.spec_from_file_location(f"{module_name}_before", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--before", required=True, help="git revision of the 'before' function")
  parser.add_argument("--function", default="layers.dot_product_attention", help="MODULE.NAME in jaxformer/")
  parser.add_argument("--config", default="shakespeare_char")
  parser.add_argument("overrides", nargs="*")
  parser.add_argument("--steps-per-call", type=int, default=None, help="default: the config's")
  parser.add_argument("--rounds", type=int, default=8)
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--batch", help="random batches of this shape, as in train_step.py (B,S,T or B,T)")
  args = parser.parse_intermixed_args(argv)
  runtime.keep_freed_memory()
  module_name, _, name = args.function.partition(".")
  if not name:
    sys.exit(f"error: --function {args.function!r} must look like MODULE.NAME, e.g. losses.cross_entropy")
  module = importlib.import_module(f"jaxformer.{module_name}")
  new = getattr(module, name, None)
  old = getattr(load_revision(args.before, module_name), name, None)
  if new is None or old is None:
    sys.exit(f"error: jaxformer/{module_name}.py has no {name} {'today' if new is None else 'at ' + args.before}")
  cfg = config_lib.load_config(args.config, args.overrides)
  k = args.steps_per_call or cfg.train.steps_per_call
  mesh, task, model, tx, schedule, init_fn, rng, _, state_sharding = train.setup(cfg, tempfile.mkdtemp(),
                                                                                 log=lambda *a: None)
  batches = [task.train_batch(i) for i in range(2 * k)]
  if args.batch:
    batches = [bench.random_batch(batches[0], [int(x) for x in args.batch.split(",")], cfg.model.vocab_size, i)
               for i in range(2 * k)]
  batches = [sharding.global_batch(b, sharding.batch_sharding(mesh)) for b in batches]
  parts = (mesh, task, model, tx, schedule, init_fn, rng, state_sharding)
  # The model looks the function up in its module when it is traced (at the first call).
  # Keyword arguments newer than REV (e.g. attention's causal, matmul_dtype) are dropped
  # for the old function.
  known = inspect.signature(old).parameters
  setattr(module, name, lambda *a, **kw: old(*a, **{k: v for k, v in kw.items() if k in known}))
  before = bench.Variant("before", k, {}, cfg, parts, batches)
  setattr(module, name, new)
  after = bench.Variant("after", k, {}, cfg, parts, batches)
  for _ in range(args.rounds):
    before.run(args.steps)
    after.run(args.steps)
  b, a = 1e3 * np.array(before.wall), 1e3 * np.array(after.wall)
  print(f"{args.function} at {args.before} vs today; config {cfg.name} {' '.join(args.overrides)}, K={k}; "
        f"temp memory {before.temp_mib:,.0f} -> {after.temp_mib:,.0f} MiB; ms/step per round")
  print("before", np.round(b, 1), f"median {np.median(b):.1f}")
  print("after ", np.round(a, 1), f"median {np.median(a):.1f}")
  print(f"after / before: median of per-round ratios {np.median(a / b):.3f}")


if __name__ == "__main__":
  main()
