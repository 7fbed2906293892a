"""Expert parallelism, GSPMD against the shard_map all-to-all: collectives in the compiled MoE
train step per mesh and dispatch, and (--rounds) the step time on simulated devices.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/moe_collectives.py \\
        [--config llama_tiny] [--dispatch gspmd,all_to_all] [--rounds 0] [overrides ...]

Compiles the train step of the config with model.moe_experts=8 under each mesh and each
model.moe_dispatch, and counts the collective instructions of XLA's optimized program, with the
bytes their results hold per device; also each expert weight's per-device shape, so it shows
whether the experts stay sharded (tokens moved to them) or are gathered (weights moved to the
tokens). --rounds R > 0 also runs each step from the same state and batch, R interleaved rounds
of 3 steps, and prints the median ms per step (8 simulated devices share this CPU's cores:
a comparison of the two programs, not a cluster's speed).
"""

import argparse
import collections
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jaxformer import config as config_lib, model as model_lib, optim, sharding, tasks, train  # noqa: E402

MESHES = {"data8": ["mesh.data=8"], "expert8": ["mesh.data=1", "mesh.expert=8"],
          "expert4_data2": ["mesh.data=2", "mesh.expert=4"], "expert2_fsdp4": ["mesh.data=1", "mesh.expert=2", "mesh.fsdp=4"]}
OPS = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")
BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f16": 2}


def collectives(hlo):
  """{op: (count, result bytes)} over the optimized HLO's instructions."""
  out = collections.defaultdict(lambda: [0, 0])
  for line in hlo.splitlines():
    line = re.sub(r"/\*.*?\*/", "", line)  # tuple shapes carry /*index=5*/ comments
    m = re.search(r"=\s*(\(?[a-z0-9]+\[[^=]*?)\s+(" + "|".join(OPS) + r")(-start)?\(", line)
    if not m:
      continue
    size = 0
    for dtype, dims in re.findall(r"([a-z0-9]+)\[([0-9,]*)\]", m.group(1)):
      n = 1
      for d in filter(None, dims.split(",")):
        n *= int(d)
      size += n * BYTES.get(dtype, 4)
    out[m.group(2)][0] += 1
    out[m.group(2)][1] += size
  return dict(out)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="llama_tiny")
  parser.add_argument("--dispatch", default="gspmd,all_to_all", help="model.moe_dispatch values (comma-separated)")
  parser.add_argument("--rounds", type=int, default=0, help="> 0: also time the steps, this many rounds")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args(argv)
  print(f"{jax.device_count()} devices; load average {os.getloadavg()}")
  runs = {}
  for name, mesh_args in MESHES.items():
    for dispatch in args.dispatch.split(","):
      cfg = config_lib.load_config(args.config, ["model.moe_experts=8", "data.batch_size=16", "data.block_size=64",
                                                 *args.overrides, f"model.moe_dispatch={dispatch}", *mesh_args])
      mesh = sharding.make_mesh(cfg.mesh)
      model = model_lib.build_model(cfg.model)
      tx, schedule = optim.build_optimizer(cfg)
      ids = jnp.ones((1, 4), jnp.int32)
      abstract = jax.eval_shape(lambda: train.init_state(model, tx, (ids,), jax.random.key(0)))
      state_sharding = sharding.logical_sharding(abstract, mesh)
      state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(abstract),
                           state_sharding)
      shape = (cfg.data.batch_size, cfg.data.block_size)
      batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding.batch_sharding(mesh))
               for k in ("inputs", "targets")}
      step = jax.jit(train.make_train_step(model, tasks.LMTask, cfg, tx, schedule),
                     in_shardings=(state_sharding, sharding.batch_sharding(mesh)), out_shardings=(state_sharding, None))
      with sharding.use_mesh(mesh):
        compiled = step.lower(state, batch).compile()
      wo = state_sharding["params"]["decoder"]["layer_0"]["moe"]["wo"]
      per_device = wo.shard_shape(abstract["params"]["decoder"]["layer_0"]["moe"]["wo"].value.shape)
      found = collectives(compiled.as_text())
      print(f"{name:<15} {dispatch:<10} wo per device {per_device}  " +
            "  ".join(f"{op} {found[op][0]} ({found[op][1] / 2**10:.0f} KiB)" for op in OPS if op in found), flush=True)
      if args.rounds:
        real = jax.jit(lambda r: nn.unbox(train.init_state(model, tx, (ids,), r)), out_shardings=state_sharding)(
            jax.random.key(0))
        tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, shape, dtype=np.int32)
        data = jax.device_put({"inputs": tokens, "targets": tokens}, sharding.batch_sharding(mesh))
        runs[(name, dispatch)] = (compiled, real, data, [])
  for _ in range(args.rounds):
    for (name, dispatch), (compiled, real, data, times) in runs.items():
      t0 = time.perf_counter()
      s = real
      for _ in range(3):
        s, metrics = compiled(s, data)
      jax.block_until_ready(metrics)
      times.append(1e3 * (time.perf_counter() - t0) / 3)
  for (name, dispatch), (_, _, _, times) in runs.items():
    print(f"{name:<15} {dispatch:<10} {np.median(times):8.1f} ms/step  rounds {np.round(times, 1).tolist()}")
  if runs:
    print(f"load average {os.getloadavg()}")


if __name__ == "__main__":
  main()
