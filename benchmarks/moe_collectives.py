"""What GSPMD does with expert parallelism: collectives in the compiled MoE train step per mesh.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/moe_collectives.py \\
        [--config llama_tiny] [overrides ...]

Compiles (does not run) the train step of the config with model.moe_experts=8 under each mesh
and counts the collective instructions of XLA's optimized program, with the bytes their results
hold per device; also each expert weight's per-device shape, so it shows whether the experts
stay sharded (tokens moved to them) or are gathered (weights moved to the tokens).
"""

import argparse
import collections
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxformer import config as config_lib, model as model_lib, optim, sharding, tasks, train  # noqa: E402

MESHES = {"data8": ["mesh.data=8"], "expert8": ["mesh.data=1", "mesh.expert=8"],
          "expert4_data2": ["mesh.data=2", "mesh.expert=4"], "expert2_fsdp4": ["mesh.data=1", "mesh.expert=2", "mesh.fsdp=4"]}
OPS = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")
BYTES = {"f32": 4, "bf16": 2, "s32": 4, "u32": 4, "pred": 1, "f16": 2}


def collectives(hlo):
  """{op: (count, result bytes)} over the optimized HLO's instructions."""
  out = collections.defaultdict(lambda: [0, 0])
  for line in hlo.splitlines():
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
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args(argv)
  print(f"{jax.device_count()} devices; load average {os.getloadavg()}")
  for name, mesh_args in MESHES.items():
    cfg = config_lib.load_config(args.config, ["model.moe_experts=8", "data.batch_size=16", "data.block_size=64",
                                               *args.overrides, *mesh_args])
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
      hlo = step.lower(state, batch).compile().as_text()
    wo = state_sharding["params"]["decoder"]["layer_0"]["moe"]["wo"]
    per_device = wo.shard_shape(abstract["params"]["decoder"]["layer_0"]["moe"]["wo"].value.shape)
    found = collectives(hlo)
    print(f"{name:<15} wo per device {per_device}  " +
          "  ".join(f"{op} {found[op][0]} ({found[op][1] / 2**10:.0f} KiB)" for op in OPS if op in found))


if __name__ == "__main__":
  main()
