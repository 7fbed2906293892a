"""Ahead-of-time compilation of the real train step (and of one decode step) from abstract inputs: XLA's own memory figures.

`compile_train_step(cfg, devices, rows, lengths)` lowers and compiles the trainer's
`make_train_step` (same model, optimizer, shardings and donation as `train.py`) for any
devices JAX can describe: this host's (8 simulated CPU devices with
XLA_FLAGS=--xla_force_host_platform_device_count=8), or a TPU topology from
`jax.experimental.topologies` that is not attached (benchmarks/aot_compile.py). Nothing
is allocated: state and batch are ShapeDtypeStructs carrying their shardings.

`compile_decode_step(cfg, devices, batch, context, bits=...)` does the same for one decode step
of a decoder-only model on one chip (float params, or the int8/int4 ones `jaxformer.quantize` writes).
"""

import dataclasses
import functools
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import decode
from jaxformer import inspect
from jaxformer import lora
from jaxformer import model as model_lib
from jaxformer import optim
from jaxformer import qmatmul
from jaxformer import sharding
from jaxformer import tasks
from jaxformer import train
from jaxformer.errors import UserError

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


def abstract_decode_params(cfg, bits=None, group_size=128, embedding="int8", param_dtype=None):
  """(params, manifest): ShapeDtypeStructs of the params a decode step reads (unrolled layers) and
  the quantization manifest (None for float). Float: every leaf float32 as the model holds it, or
  `param_dtype` ("bfloat16": floating leaves cast, as train.lora_base_dtype does for a LoRA base;
  the model promotes them to model.dtype in its products). bits=8|4: the leaves
  `python -m jaxformer.quantize --bits {bits} --group-size {group_size} --embedding {embedding}`
  writes (`inspect.quantized_manifest` + `qmatmul.quantized_abstract`: int8 [N, K] / uint8 [N, K/2]
  kernels and float32 scales), the other float leaves in `param_dtype`. Nothing is allocated."""
  m = dataclasses.replace(cfg.model, scan_layers=False)
  model = model_lib.build_model(m)
  ids = jnp.ones((1, 1), jnp.int32)
  params = nn.unbox(jax.eval_shape(lambda: model.init(jax.random.key(0), ids))["params"])
  if param_dtype not in (None, "float32", "bfloat16"):
    raise UserError(f"--param-dtype {param_dtype}: float32 or bfloat16")
  if param_dtype is not None:
    dtype = jnp.dtype(param_dtype)
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype)
                          if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
  if bits is None:
    return params, None
  manifest = inspect.quantized_manifest(m, bits, group_size, embedding)
  return qmatmul.quantized_abstract(params, manifest), manifest


def compile_decode_step(cfg, devices, batch, context, bits=None, group_size=128, embedding="int8", param_dtype=None):
  """(compiled decode step, seconds to lower, seconds to compile) on the first of `devices` (one chip:
  nothing sharded).

  The step is `decode._lm_step`, as `decode.generate` runs it (the serving engine's `_step` makes the same
  model call, then projects the positions it samples): tokens
  [batch, 1] (with their segment and position [batch, 1]) through a KV cache of `context` slots per
  sequence (`decode.init_cache`: cached keys/values [batch, kv_heads, context, head_dim] per layer,
  donated) -> next-token logits [batch, 1, vocab] and the cache. The params are
  `abstract_decode_params(cfg, bits, group_size, embedding, param_dtype)`: float, or int8/int4."""
  if cfg.model.arch != "decoder_only":
    raise UserError(f"--decode: a decoder-only config (this one is {cfg.model.arch})")
  if batch < 1 or context < 1:
    raise UserError(f"--decode {context} --batch {batch}: both positive")
  m = dataclasses.replace(cfg.model, scan_layers=False)
  model = model_lib.build_model(m)
  params, _ = abstract_decode_params(cfg, bits, group_size, embedding, param_dtype)
  mesh = jax.sharding.Mesh([list(devices)[0]], ("one",))
  chip = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  place = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=chip), tree)
  cache = jax.eval_shape(lambda: decode.init_cache(model, batch, context))
  token = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=chip)
  step = jax.jit(functools.partial(decode._lm_step, model), donate_argnums=1,  # pylint: disable=protected-access
                 in_shardings=chip, out_shardings=chip)
  t = time.perf_counter()
  lowered = step.lower(place(params), place(cache), token, token, token)
  lower_s = time.perf_counter() - t
  t = time.perf_counter()
  compiled = lowered.compile()
  return compiled, lower_s, time.perf_counter() - t


def lower_engine_decode(cfg, device=None, slots=16, context=2048, block_size=16, kv_blocks=None, param_dtype=None):
  """(lowered decode step of the serving engine, seconds): `engine._step` as `Engine._decode` calls it on a TPU,
  `slots` rows of one token each over a block pool through JAX's Pallas paged-attention kernel (block tables of
  context / block_size blocks; `kv_blocks` blocks in the pool, default slots x context / block_size). device: a
  TPU device (a deviceless topology's) to lower for, everything placed on it; None lowers for platform "tpu"
  from this host (no libtpu needed to lower, only to compile)."""
  from jaxformer import engine  # pylint: disable=g-import-not-at-top
  if cfg.model.arch != "decoder_only":
    raise UserError(f"--serve-decode: a decoder-only config (this one is {cfg.model.arch})")
  m = dataclasses.replace(cfg.model, scan_layers=False)
  if reason := engine.paged.pallas_why_not(m, engine.Engine.kv_dtype(model_lib.build_model(m)), platform="tpu"):
    raise UserError(f"--serve-decode: {cfg.name} cannot take the Pallas kernel: {reason}")
  model = model_lib.build_model(m)
  params, _ = abstract_decode_params(cfg, param_dtype=param_dtype)
  width = -(-context // block_size)
  kv_blocks = kv_blocks or slots * width
  kv = engine.pool_shapes(model, kv_blocks + 1, block_size)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  flag = jax.ShapeDtypeStruct((), jnp.bool_)
  args = [params, kv, *[i32(slots, 1)] * 4, *[i32(slots, width * block_size)] * 3, i32(slots, 1), i32(slots, 1),
          f32(slots), i32(slots), f32(slots), i32(slots), i32(slots), flag, flag]
  extra = dict(pages=i32(slots, width), lengths=i32(slots))
  step = jax.jit(functools.partial(engine._step, model), donate_argnums=(1,))  # pylint: disable=protected-access
  t = time.perf_counter()
  if device is None:
    lowered = step.trace(*args, **extra).lower(lowering_platforms=("tpu",))
  else:
    chip = jax.sharding.NamedSharding(jax.sharding.Mesh([device], ("one",)), jax.sharding.PartitionSpec())
    place = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=chip), tree)
    lowered = step.lower(*place(args), **place(extra))
  return lowered, time.perf_counter() - t


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
  compiled, _, compile_s = compile_train_step(cfg, devices, rows, lengths)
  mesh = sharding.make_mesh(cfg.mesh, list(devices)).shape
  return inspect.memory_plan(cfg, dict(mesh), rows, lengths), memory(compiled), compile_s
