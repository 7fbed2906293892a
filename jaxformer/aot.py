"""Ahead-of-time compilation of the real train step from abstract inputs: XLA's own memory figures.

`compile_train_step(cfg, devices, rows, lengths)` lowers and compiles the trainer's
`make_train_step` (same model, optimizer, shardings and donation as `train.py`) for any
devices JAX can describe: this host's (8 simulated CPU devices with
XLA_FLAGS=--xla_force_host_platform_device_count=8), or a TPU topology from
`jax.experimental.topologies` that is not attached (benchmarks/aot_compile.py). Nothing
is allocated: state and batch are ShapeDtypeStructs carrying their shardings.
"""

import functools
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import lora
from jaxformer import model as model_lib
from jaxformer import optim
from jaxformer import sharding
from jaxformer import tasks
from jaxformer import train

TRANSLATION_KEYS = ("inputs", "decoder_inputs", "targets", "inputs_segmentation", "targets_segmentation",
                    "inputs_position", "targets_position")


def abstract_batch(cfg, rows, lengths, batch_sharding=None):
  """ShapeDtypeStructs of a train batch: lengths (src, tgt) for translation, (length,) for an LM;
  DPO (train.objective=dpo): `rows` pairs, [rows, 2, length] (chosen, rejected) with segments,
  positions and the loss weights."""
  if cfg.train.objective == "dpo":
    return {k: jax.ShapeDtypeStruct((rows, 2, lengths[-1]), jnp.int32, sharding=batch_sharding)
            for k in ("inputs", "targets", "weights", "segment_ids", "positions")}
  if cfg.data.task == "lm":
    return {k: jax.ShapeDtypeStruct((rows, lengths[-1]), jnp.int32, sharding=batch_sharding)
            for k in ("inputs", "targets")}
  src, tgt = lengths if len(lengths) == 2 else (lengths[0], lengths[0])
  return {k: jax.ShapeDtypeStruct((rows, src if k.startswith("inputs") else tgt), jnp.int32, sharding=batch_sharding)
          for k in TRANSLATION_KEYS}


def compile_train_step(cfg, devices, rows, lengths, task=None):
  """(compiled train step, seconds to lower, seconds to compile) for `rows` x `lengths` batches
  on a mesh of `devices` shaped by cfg.mesh. A LoRA config (train.lora_rank) compiles the LoRA
  step: the adapters' state, donated, and the frozen base as a third argument; a DPO config the
  preference step (its state holds the reference, except with LoRA: the base is the reference)."""
  mesh = sharding.make_mesh(cfg.mesh, list(devices), cfg.model.moe_experts)
  model = model_lib.build_model(cfg.model)
  tx, schedule = optim.build_optimizer(cfg)
  dpo = cfg.train.objective == "dpo"
  task = task or (tasks.PreferenceTask if dpo else tasks.LMTask if cfg.data.task == "lm" else tasks.TranslationTask)
  ids = jnp.ones((1, 4), jnp.int32)
  init = functools.partial(train.init_state, model, tx, (ids,) if cfg.data.task == "lm" else (ids, ids),
                           reference=dpo and not lora.enabled(cfg), **({"cfg": cfg} if lora.enabled(cfg) else {}))
  abstract = jax.eval_shape(init, jax.random.key(0))
  state_sharding = sharding.logical_sharding(abstract, mesh)
  state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(abstract),
                       state_sharding)
  batch_sharding = sharding.batch_sharding(mesh)
  shardings, extra = (state_sharding, batch_sharding), ()
  if lora.enabled(cfg):
    boxed_base, _ = lora.abstract(cfg)
    base_sharding = sharding.logical_sharding(boxed_base, mesh)
    shardings += (base_sharding,)
    extra = (jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed_base),
                          base_sharding),)
  step = jax.jit(train.make_train_step(model, task, cfg, tx, schedule), in_shardings=shardings,
                 out_shardings=(state_sharding, None), donate_argnums=0)
  t = time.perf_counter()
  with sharding.use_mesh(mesh):
    lowered = step.lower(state, abstract_batch(cfg, rows, lengths, batch_sharding), *extra)
  lower_s = time.perf_counter() - t
  t = time.perf_counter()
  compiled = lowered.compile()
  return compiled, lower_s, time.perf_counter() - t


def memory(compiled):
  """XLA's per-device bytes of a compiled step: arguments, outputs, aliased (donated), temporaries and
  the total live at once (arguments + outputs - aliased + temporaries)."""
  m = compiled.memory_analysis()
  out = dict(argument=m.argument_size_in_bytes, output=m.output_size_in_bytes, alias=m.alias_size_in_bytes,
             temp=m.temp_size_in_bytes)
  out["total"] = out["argument"] + out["output"] - out["alias"] + out["temp"]
  return out


def plan_vs_xla(cfg, devices, rows, lengths):
  """(`inspect.memory_plan`, `memory` of the compiled step, compile seconds) for one config and batch."""
  from jaxformer import inspect  # pylint: disable=g-import-not-at-top
  compiled, _, compile_s = compile_train_step(cfg, devices, rows, lengths)
  mesh = sharding.make_mesh(cfg.mesh, list(devices)).shape
  return inspect.memory_plan(cfg, dict(mesh), rows, lengths), memory(compiled), compile_s
