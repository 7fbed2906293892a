"""Where the MoE train step's time goes on CPU: XLA ops by kind, and step time against block size.

    JAXFORMER_DATA=/work/shared/data python benchmarks/moe_step_profile.py [--rounds 7] [--blocks 32,64,128] [--batch 12]

`shakespeare_char` (dense) against `moe_shakespeare` (8 experts, top 2, the same active FFN
weights), batch --batch x 64, one step per call:
1. each train step once under jax.profiler: the XLA:CPU thunks' time summed over threads, by kind
   (matmul = dot / YNNPACK fusions, gather, scatter, sort, other) and the five slowest ops;
2. interleaved rounds in this process of dense, dropless at each block size in --blocks (moe.block_rows's choice: auto), and
   capacity 1.25, from one state and batch (after 1 step): median ms and per-round ratio to dense.
"""

import argparse
import collections
import glob
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
from jax._src.lib import _profile_data  # noqa: E402

from jaxformer import config as config_lib, moe, train  # noqa: E402


def build(recipe, overrides, block=None):
  """A jitted train step (traced with `block` rows per CPU block, None: moe.block_rows's), its state after one step, a batch."""
  cfg = config_lib.load_config(recipe, overrides)
  _, task, model, tx, schedule, init_fn, rng, _, _ = train.setup(cfg, tempfile.mkdtemp(), lambda *a: None)
  state = jax.jit(lambda r: nn.unbox(init_fn(r)))(rng)
  batch = jax.device_put(task.train_batch(0))
  step = jax.jit(train.make_train_step(model, task, cfg, tx, schedule))
  saved = moe.block_rows
  if block:
    moe.block_rows = lambda rows, num_e: block
  try:
    state, metrics = step(state, batch)  # traced and compiled now, with this block size
    jax.block_until_ready(metrics)
  finally:
    moe.block_rows = saved
  return step, state, batch


def op_profile(step, state, batch, iters=5):
  """{kind: thread-ms per step} and the slowest ops, from the profiler's XLA:CPU thunk events."""
  out = tempfile.mkdtemp()
  jax.profiler.start_trace(out)
  for _ in range(iters):
    _, metrics = step(state, batch)
  jax.block_until_ready(metrics)
  jax.profiler.stop_trace()
  data = _profile_data.ProfileData.from_file(glob.glob(f"{out}/**/*.xplane.pb", recursive=True)[0])
  ops, kinds = collections.Counter(), collections.Counter()
  for plane in data.planes:
    for line in plane.lines:
      if not line.name.startswith("tf_XLA"):  # the XLA:CPU client's worker threads
        continue
      for ev in line.events:
        if ev.name.startswith("end:") or any(s in ev.name for s in ("ThunkExecutor", "Threadpool", "Slinky")):
          continue
        ms = ev.duration_ns / 1e6 / iters
        ops[ev.name] += ms
        kind = next((k for k, keys in (("matmul", ("dot", "ynn")), ("gather", ("gather",)),
                                         ("scatter", ("scatter",)), ("sort", ("sort",))) if any(s in ev.name for s in keys)),
                    "other")
        kinds[kind] += ms
  return kinds, ops


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=7)
  parser.add_argument("--steps-per-round", type=int, default=5)
  parser.add_argument("--blocks", default="32,64,128", help="fixed block sizes to time beside auto ('' for none)")
  parser.add_argument("--batch", type=int, default=12, help="sequences of 64 tokens per step (the recipes': 12)")
  args = parser.parse_args(argv)
  print(f"load average {os.getloadavg()}", flush=True)
  batch = [f"data.batch_size={args.batch}"]
  variants = {"dense": ("shakespeare_char", batch, None), "dropless_auto": ("moe_shakespeare", batch, None)}
  for b in (int(b) for b in args.blocks.split(",") if b):
    variants[f"dropless_block{b}"] = ("moe_shakespeare", batch, b)
  variants["capacity_1.25"] = ("moe_shakespeare", batch + ["model.moe_capacity_factor=1.25"], None)
  built = {name: build(*v) for name, v in variants.items()}
  print(f"batch {args.batch} x 64: moe.block_rows picks {moe.block_rows(args.batch * 64 * 2, 8)} rows per block", flush=True)
  for name in ("dense", "dropless_auto", "capacity_1.25"):
    if name in built:
      kinds, ops = op_profile(*built[name])
      print(f"{name:<18} thread-ms/step {sum(kinds.values()):7.1f}: "
            + ", ".join(f"{k} {v:.1f}" for k, v in kinds.most_common())
            + "; slowest " + ", ".join(f"{k} {v:.1f}" for k, v in ops.most_common(5)), flush=True)
  times = {name: [] for name in built}
  for _ in range(args.rounds):
    for name, (step, state, batch) in built.items():
      t0 = time.perf_counter()
      s = state
      for _ in range(args.steps_per_round):
        s, metrics = step(s, batch)
      jax.block_until_ready(metrics)
      times[name].append(1e3 * (time.perf_counter() - t0) / args.steps_per_round)
  dense = np.array(times["dense"])
  for name, t in times.items():
    t = np.array(t)
    print(f"  {name:<18} {np.median(t):8.1f} ms/step  per-round ratio to dense {np.median(t / dense):.2f}  "
          f"rounds {np.round(t, 1).tolist()}")
  print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
  main()
