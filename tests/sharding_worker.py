"""Sharding scenarios on 8 simulated CPU devices, for `test_sharding.py`.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/sharding_worker.py MODEL TMPDIR

A separate process because the device count is fixed when JAX starts. Trains MODEL 4 steps
from the same initial state on the same global batches on one device and under several
meshes (calling the jitted step as `train_and_evaluate` builds it), and records losses and
parameter shardings. For tiny_encdec it also runs `train_and_evaluate` under fsdp=4 x data=2,
restores that checkpoint on one device and under tensor=2 x data=4, and trains on under the
latter. Writes TMPDIR/MODEL.json.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxformer import checkpoint as checkpoint_lib  # noqa: E402
from jaxformer import config as config_lib  # noqa: E402
from jaxformer import sharding  # noqa: E402
from jaxformer import train  # noqa: E402

MESHES = {"1dev": (1, 1, 1), "data8": (8, 1, 1), "fsdp4_data2": (2, 4, 1), "tensor2_data4": (4, 1, 2)}
STEPS = 4
# data.batch_multiple=8: every mesh sees the same global batches.
COMMON = ["model.num_layers=1", "data.batch_multiple=8", "train.log_every=1", "train.eval_every=1000",
          "train.eval_batches=1", "train.sample_every_eval=false", "train.checkpoint_every=1000"]
MODELS = {
    "tiny_encdec": ["data.synthetic_size=1000", "data.max_len=24", "data.tokens_per_batch=256"],
    # Dropout on: its random bits must not depend on the sharding either.
    "gpt2_tiny": ["data.batch_size=8", "data.block_size=16", "model.dropout_rate=0.1"],
}
TEXT = "the quick brown fox jumps over the lazy dog.\nsphinx of black quartz, judge my vow.\n" * 40
QUIET = lambda *a: None


def config(name, mesh, *extra):
  sizes = [f"mesh.{k}={v}" for k, v in zip(("data", "fsdp", "tensor"), MESHES[mesh])]
  return config_lib.load_config(name, [*COMMON, *MODELS[name], *sizes, *extra])


def device_mesh(mesh):
  """The named mesh; 1dev is device 0 alone (the other 7 idle)."""
  devices = jax.devices()[:1] if mesh == "1dev" else None
  return sharding.make_mesh(config_lib.MeshConfig(*MESHES[mesh]), devices)


def shard_info(state):
  """Spec, global and per-device shape of the first decoder layer's query and FFN kernels."""
  layer = state["params"]["decoder"]["layer_0"]
  out = {}
  for name, leaf in (("query", layer["self_attention"]["query"]["kernel"]), ("wi", layer["ffn"]["wi"]["kernel"])):
    out[name] = {"spec": [a if a is None or isinstance(a, str) else list(a) for a in leaf.sharding.spec],
                 "shape": list(leaf.shape), "shard": list(leaf.addressable_shards[0].data.shape)}
  return out


def abstract_on(abstract, mesh):
  """ShapeDtypeStructs of the unboxed state with the mesh's shardings (a restore target)."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      nn.unbox(abstract), sharding.logical_sharding(abstract, mesh))


def main(name, tmp):
  if os.environ.get("JAX_COMPILATION_CACHE_DIR"):  # the train_and_evaluate run reuses a step compile
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  if name != "tiny_encdec":
    text_path = os.path.join(tmp, "text.txt")
    with open(text_path, "w") as f:
      f.write(TEXT)
    MODELS[name].append(f"data.text_path={text_path}")
  cfg = config(name, "data8")
  # One workdir per recipe: both workers run at once, and prepared data belongs to one tokenizer.
  _, task, model, tx, schedule, init_fn, rng, abstract, _ = train.setup(cfg, os.path.join(tmp, f"setup-{name}"), QUIET)
  state0 = jax.device_get(jax.jit(lambda r: nn.unbox(init_fn(r)))(rng))
  batches = [task.train_batch(step) for step in range(STEPS)]
  out = {"devices": jax.device_count(), "runs": {}}
  for mesh_name in MESHES:
    mesh = device_mesh(mesh_name)
    state_sharding = sharding.logical_sharding(abstract, mesh)
    batch_sharding = sharding.batch_sharding(mesh)
    step_fn = train._under_mesh(mesh, jax.jit(train.make_train_step(model, task, cfg, tx, schedule),
                                              in_shardings=(state_sharding, batch_sharding),
                                              out_shardings=(state_sharding, None), donate_argnums=0))
    state, losses = jax.device_put(state0, state_sharding), []
    for batch in batches:
      state, metrics = step_fn(state, sharding.global_batch(batch, batch_sharding))
      losses.append(float(metrics["loss_sum"]) / float(metrics["tokens"]))
    out["runs"][mesh_name] = {"losses": losses, "shards": shard_info(state)}
    if mesh_name == "tensor2_data4":
      # The model's activation constraints bind only under use_mesh (tracing alone suffices).
      lower = lambda: jax.jit(train.make_eval_step(model, task)).lower(state["params"], batches[0]).as_text()
      outside = "sharding_constraint" in lower()
      with sharding.use_mesh(mesh):
        inside = "sharding_constraint" in lower()
      out["constraints"] = {"in_mesh": inside, "outside": outside}

  if name == "tiny_encdec":
    # train_and_evaluate under fsdp=4 x data=2 saves at step 3 ...
    workdir = os.path.join(tmp, "run")
    result = train.train_and_evaluate(config(name, "fsdp4_data2", "train.num_steps=3"), workdir, QUIET)
    saved = jax.device_get(result["state"])
    out["restore"] = {"first_losses": [r["loss"] for r in _metrics(workdir)]}
    # ... which restores with equal values on one device and under tensor=2 x data=4 ...
    for mesh_name in ("1dev", "tensor2_data4"):
      with checkpoint_lib.Checkpointer(workdir) as ckpt:
        restored, _ = ckpt.restore(abstract_on(abstract, device_mesh(mesh_name)))
      equal = jax.tree.map(lambda a, b: bool(np.array_equal(a, b)), saved, jax.device_get(restored))
      out["restore"][mesh_name] = {"equal": all(jax.tree.leaves(equal)), "shards": shard_info(restored)}
    # ... and training goes on there.
    result = train.train_and_evaluate(config(name, "tensor2_data4", f"train.num_steps={STEPS}"), workdir, QUIET)
    out["restore"]["resumed"] = {"step": result["step"], "losses": [r["loss"] for r in _metrics(workdir)]}
  with open(os.path.join(tmp, f"{name}.json"), "w") as f:
    json.dump(out, f)


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r for r in map(json.loads, f) if "loss" in r]


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
