"""Model arithmetic without weights: parameters, FLOPs, KV cache, decode roofline, training memory.

  python -m jaxformer.inspect --config llama3_8b [model.num_layers=2] [--dtype bfloat16]
      [--batch 1] [--context 4096,32768] [--seq-len 8192]
  python -m jaxformer.inspect --config llama3_8b --mesh fsdp=64 [--batch 64] [model.remat=full ...]
  python -m jaxformer.inspect --config llama3_8b train.lora_rank=16 --batch 1 --seq-len 2048 model.remat=full
  python -m jaxformer.inspect --config llama3_8b --quantize 8|4 [--group-size 128] [--embedding int8|int4|float]

Shapes come from `jax.eval_shape(model.init)`: nothing is allocated, and the counts are
the model's own rather than a formula that could drift from it. `DEVICES`, `peak_flops`
and `matmul_peak` are shared by the trainer's MFU and the benchmarks.
"""

import argparse
import dataclasses
import functools
import math
import re
import time
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxformer import layers
from jaxformer import lora
from jaxformer import losses
from jaxformer import moe
from jaxformer import qmatmul
from jaxformer import sharding
from jaxformer.config import ModelConfig, load_config
from jaxformer.errors import UserError, cli
from jaxformer.model import block_class, build_model, quantizable


class Device(NamedTuple):
  """An accelerator for the roofline: HBM bandwidth (bytes/s) and dense bf16 peak (FLOP/s)."""
  memory_bandwidth: float
  peak_flops: float


# Datasheet numbers; peaks are dense (no structured sparsity) bf16.
DEVICES = {
    "A100": Device(2.039e12, 312e12),  # 80GB SXM
    "H100": Device(3.35e12, 989e12),   # SXM
    "H200": Device(4.8e12, 989e12),
    "TPU v4": Device(1.2e12, 275e12),
    "TPU v5e": Device(0.819e12, 197e12),
    "TPU v5p": Device(2.765e12, 459e12),
    "TPU v6e": Device(1.64e12, 918e12),
}

# `jax.devices()[0].device_kind` (lower-cased) -> DEVICES key. H100 PCIe/NVL have lower
# peaks than SXM, so they are left unknown rather than overstated.
_DEVICE_KINDS = (
    (r"a100", "A100"),
    (r"h100(?!.*(pcie|nvl))", "H100"),
    (r"h200", "H200"),
    (r"tpu v4$", "TPU v4"),
    (r"tpu v5 ?(lite|e)", "TPU v5e"),
    (r"tpu v5p?$", "TPU v5p"),
    (r"tpu v6 ?(lite|e)", "TPU v6e"),
)

COMPONENTS = ("embeddings", "attention", "ffn", "norms", "output")


def device_name(device_kind):
  """The `DEVICES` key for a `device_kind` string ("NVIDIA H100 80GB HBM3", "TPU v5 lite"), or None."""
  kind = device_kind.lower().strip()
  return next((name for pattern, name in _DEVICE_KINDS if re.search(pattern, kind)), None)


def peak_flops(device_kind):
  """Dense bf16 peak FLOP/s for a `jax.devices()[0].device_kind` string, or None if unknown."""
  name = device_name(device_kind)
  return DEVICES[name].peak_flops if name else None


def matmul_dtype(cfg):
  """The operand dtype of a config's matmuls: "bfloat16" when model.dtype or model.matmul_dtype is."""
  return "bfloat16" if "bfloat16" in (cfg.model.dtype, cfg.model.matmul_dtype) else "float32"


def matmul_peak(n=1024, repeats=5, dtype="float32", clock=time.perf_counter):
  """FLOP/s of the best of `repeats` jitted [n, n] x [n, n] products (operands in `dtype`,
  float32 accumulation) on the default device: the practical peak that MFU divides by
  where no datasheet applies (CPUs). On a 2-core CPU n=1024 gives the rate of n=2048 in
  ~0.1 s. `clock` is the timer (a test passes a fake one)."""
  rng = np.random.default_rng(0)
  a, b = (jnp.asarray(rng.standard_normal((n, n), np.float32), dtype) for _ in range(2))
  f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
  f(a, b).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t = clock()
    f(a, b).block_until_ready()
    best = min(best, clock() - t)
  return 2 * n ** 3 / best


def _model_cfg(cfg):
  return getattr(cfg, "model", cfg)  # a Config or a ModelConfig


@functools.lru_cache(maxsize=32)
def _shapes(m: ModelConfig):
  """{param path: shape}, traced with eval_shape so no weight is allocated."""
  model = build_model(m)

  def init():  # all inside eval_shape: nothing is compiled or run
    ids = jnp.ones((1, 1), jnp.int32)
    return model.init(jax.random.key(0), *((ids, ids) if m.arch == "encoder_decoder" else (ids,)))

  variables = jax.eval_shape(init)
  params = traverse_util.flatten_dict(nn.unbox(variables["params"]))
  return {path: tuple(x.shape) for path, x in params.items()}


def _component(path):
  """Which component a parameter path belongs to (norms first: `self_attention_norm` is a norm)."""
  if path[-1] in ("embedding", "position_embedding"):
    return "embeddings"
  if any(p.endswith("_norm") for p in path):
    return "norms"
  if "logits" in path:
    return "output"
  if "ffn" in path or "moe" in path:  # an MoE layer's router, experts and shared experts count as its FFN
    return "ffn"
  if "self_attention" in path or "cross_attention" in path:
    return "attention"
  return "other"  # a new kind of module: still counted, shown separately


def count_parameters(cfg):
  """Parameters per component (embeddings incl. position tables, attention, ffn, norms, output) and "total"."""
  counts = dict.fromkeys(COMPONENTS, 0)
  for path, shape in _shapes(_model_cfg(cfg)).items():
    key = _component(path)
    counts[key] = counts.get(key, 0) + math.prod(shape)
  counts["total"] = sum(counts.values())
  return counts


def _expert_share(m: ModelConfig, path):
  """The fraction of a parameter one token uses: top_k / experts for MoE expert weights, else 1."""
  if "moe" in path and path[-1] in moe.EXPERT_PARAMS:
    return m.moe_top_k / m.moe_experts
  return 1.0


def active_parameters(cfg):
  """Parameters one token passes through: all but the (experts - top_k) unchosen experts of
  each MoE layer (Mixtral 8x7B: 12.9B of 46.7B). Equals the total for a dense model."""
  m = _model_cfg(cfg)
  return int(round(sum(math.prod(shape) * _expert_share(m, path) for path, shape in _shapes(m).items())))


def matmul_parameters(cfg):
  """Kernel weights used per token: dict(encoder, decoder, decoder_step, output).

  `decoder_step` leaves out cross-attention key/value kernels: they read only the
  source, so a decoder that caches them runs them once per sentence, not per token.
  `output` is the vocabulary projection, counted even when tied to the embedding.
  """
  m = _model_cfg(cfg)
  counts = dict(encoder=0, decoder=0, decoder_step=0, output=0 if not m.tie_output else m.vocab_size * m.d_model)
  for path, shape in _shapes(m).items():
    if path[-1] != "kernel" and _expert_share(m, path) == 1.0:
      continue
    n = int(round(math.prod(shape) * _expert_share(m, path)))  # MoE experts: the active ones only
    if path[0] == "logits":
      counts["output"] += n
    elif path[0] == "encoder":
      counts["encoder"] += n
    else:
      counts["decoder"] += n
      if not ("cross_attention" in path and path[-2] in ("key", "value")):
        counts["decoder_step"] += n
  return counts


def attention_kernel(cfg, seq_len, backend=None):
  """(kernel, reason) `layers.dot_product_attention` picks for a training step at seq_len on
  `backend` (default: this process's), no dropout unless the config has it."""
  m = _model_cfg(cfg)
  shape = (1, seq_len, m.num_heads, m.dim_per_head)
  kv = (1, seq_len, m.kv_heads, m.dim_per_head)
  return layers.choose_attention(m.attention_impl, shape, kv, m.dtype, m.attention_dropout_rate > 0, backend)


def flops_per_token(cfg, seq_len, context=None, backend=None):
  """FLOPs per (target) token: dict(train, forward, decode, train_executed).

  forward = 2 x matmul weights (see `matmul_parameters`; embedding lookups and position
  tables are not matmuls) + 4 x heads x head_dim per layer per key attended (q.k scores
  and the weighted sum of v). Causal self-attention at length L attends to (L+1)/2 keys
  on average; the encoder and cross-attention attend to all L (source length = target
  length). train = 3 x forward (backward ~ 2 x forward): the model FLOPs MFU counts.
  train_executed adds what the attention kernel picked for `backend` at seq_len
  (`attention_kernel`) recomputes: the tiled kernel's backward redoes q.k per tile, so
  its attention costs 3.5 x forward, not 3 x. decode = one new token of the decoder at
  `context` cached keys (default seq_len; cross-attention over a source of the same
  length); the encoder runs once per sentence and is not counted.
  """
  m = _model_cfg(cfg)
  context = seq_len if context is None else context
  p = matmul_parameters(m)
  per_key = 4 * m.num_heads * m.dim_per_head
  cross = m.arch == "encoder_decoder"
  keys = _causal_keys(m, seq_len) + m.encoder_layers * seq_len + (m.num_layers * seq_len if cross else 0)
  forward = 2 * (p["encoder"] + p["decoder"] + p["output"]) + per_key * keys
  decode = 2 * (p["decoder_step"] + p["output"]) + per_key * (_cached_slots(m, context) + (
      m.num_layers * context if cross else 0))
  recompute = per_key * keys / 2 if attention_kernel(m, seq_len, backend)[0] == "tiled" else 0.0
  return dict(train=3 * forward, forward=forward, decode=decode, train_executed=3 * forward + recompute)


def _causal_keys(m, seq_len):
  """Keys a query attends to on average, summed over the decoder's layers: (L + 1) / 2 in a global layer,
  in a local one (model.sliding_window = w) the same for L <= w, else w - w (w - 1) / (2 L)."""
  total = 0.0
  for i in range(m.num_layers):
    w = m.sliding_window if m.layer_is_local(i) else 0
    total += (seq_len + 1) / 2 if not w or seq_len <= w else w - w * (w - 1) / (2 * seq_len)
  return total


def _cached_slots(m, context):
  """KV-cache slots per sequence at `context` tokens, summed over the layers: a local layer's ring
  holds min(window, context) (layers.Attention), a global one all `context`."""
  return sum(min(m.sliding_window, context) if m.layer_is_local(i) else context for i in range(m.num_layers))


def _itemsize(dtype):
  try:
    return jnp.dtype(dtype).itemsize
  except TypeError:
    raise UserError(f"unknown dtype {dtype!r} (e.g. bfloat16, float16, float32, int8)") from None


def kv_cache_bytes_per_token(cfg, dtype="bfloat16"):
  """Bytes of KV cache per token per sequence while every layer still grows: 2 x layers x kv_heads x
  head_dim x bytes(dtype) (local layers stop at their window: `kv_cache_bytes`).

  For an encoder-decoder this is the decoder's self-attention cache.
  """
  m = _model_cfg(cfg)
  return 2 * m.num_layers * m.kv_heads * m.dim_per_head * _itemsize(dtype)


def kv_cache_bytes(cfg, context, dtype="bfloat16"):
  """Bytes of KV cache of one sequence at `context` tokens: what `kv_cache_bytes_per_token` gives per
  slot, with a local layer's ring of min(model.sliding_window, context) slots."""
  m = _model_cfg(cfg)
  return 2 * _cached_slots(m, context) * m.kv_heads * m.dim_per_head * _itemsize(dtype)


def quantized_manifest(cfg, bits, group_size=128, embedding="int8", flag="--quantize"):
  """The `quantization.json` manifest `python -m jaxformer.quantize --bits {bits}` would write for this
  config (unrolled layers), from the abstract shapes: no weights. UserError for a scheme the shapes
  do not allow (bits not 8/4, an int4 group that does not divide a fan-in)."""
  m = dataclasses.replace(_model_cfg(cfg), scan_layers=False)
  shapes = {"/".join(path): shape for path, shape in _shapes(m).items()}
  return qmatmul.plan_manifest(shapes, quantizable(m), bits, group_size, embedding, flag=flag)


def weight_bytes(cfg, dtype="bfloat16", manifest=None):
  """Bytes of the model's weights: dict(kernels, tables, float, total) (`qmatmul.param_bytes`).

  Without a manifest every parameter is `float`, at `dtype`; with one (`quantized_manifest`, or a
  quantized workdir's quantization.json) its kernels are int8 [N, K] + a float32 scale per output
  or packed int4 [N, K / 2] + a float32 scale per group, its tables (token embeddings, untied output
  layer) int8 + a float32 scale per row, and the rest (norms, biases, position tables, routers) `dtype`."""
  m = dataclasses.replace(_model_cfg(cfg), scan_layers=False)
  shapes = {"/".join(path): shape for path, shape in _shapes(m).items()}
  _itemsize(dtype)  # (an unknown dtype: a one-line error)
  return qmatmul.param_bytes(shapes, manifest, dtype)


def decode_roofline(cfg, dtype="bfloat16", batch=1, context=2048, weights=None):
  """Lower bound on one decode step (a token for each of `batch` sequences) per device.

  A step reads every weight once (shared by the batch) plus each sequence's KV cache at
  `context`, and does batch x decode FLOPs: time = max(bytes / bandwidth, FLOPs / peak).
  `weights`: the weights' bytes (default: every parameter in `dtype`; a quantized model's
  from `weight_bytes(cfg, dtype, manifest)["total"]`); the KV cache is in `dtype` either way.
  Returns {device: dict(seconds, bound="memory"|"compute")}.
  """
  weights = count_parameters(cfg)["total"] * _itemsize(dtype) if weights is None else weights
  nbytes = weights + kv_cache_bytes(cfg, context, dtype) * batch
  flops = batch * flops_per_token(cfg, context, context)["decode"]
  result = {}
  for name, device in DEVICES.items():
    memory, compute = nbytes / device.memory_bandwidth, flops / device.peak_flops
    result[name] = dict(seconds=max(memory, compute), bound="memory" if memory >= compute else "compute")
  return result


# Memory per device for training (model.remat, model.scan_layers, model.logits_chunk, the mesh).

# Accelerators for the fit table: memory per device in GB (10^9 bytes, as datasheets count).
DEVICE_MEMORY_GB = {"A100 40GB": 40, "A100 80GB": 80, "H100": 80, "H200": 141, "TPU v4": 32, "TPU v5e": 16,
                    "TPU v5p": 95}


@functools.lru_cache(maxsize=32)
def _boxed_params(m: ModelConfig):
  """The abstract params with their logical axis names (nothing allocated)."""
  model = build_model(m)
  ids = jnp.ones((1, 1), jnp.int32)
  return jax.eval_shape(lambda: model.init(jax.random.key(0), *((ids, ids) if m.arch == "encoder_decoder" else (ids,))))

def _mesh_sizes(mesh):
  """{"data", "fsdp", "tensor"} sizes from a MeshConfig, a dict or a string like "fsdp=64,tensor=2"."""
  if isinstance(mesh, str):
    sizes = {}
    for part in filter(None, (p.strip() for p in mesh.split(","))):
      axis, _, n = part.partition("=")
      if axis not in sharding.MESH_AXES or not n.strip().isdigit() or int(n) < 1:
        raise UserError(f"--mesh {mesh!r}: expected comma-separated AXIS=N with AXIS one of "
                        f"{', '.join(sharding.MESH_AXES)} (e.g. fsdp=64 or data=4,fsdp=16)")
      sizes[axis] = int(n)
    mesh = sizes
  elif not isinstance(mesh, dict):
    mesh = {a: getattr(mesh, a) for a in sharding.MESH_AXES}
  sizes = {a: max(int(mesh.get(a, 1)), 1) for a in sharding.MESH_AXES}  # -1 (fill) counts as 1 here
  return sizes


def parameter_bytes_per_device(cfg, mesh, tree=None):
  """Parameter bytes (at each leaf's dtype) one device holds under the sharding rules (a dimension that
  its mesh axes do not divide is replicated, as `sharding.logical_sharding` does); `tree`: other
  boxed params (a LoRA run's adapters) instead of the model's."""
  m, sizes = _model_cfg(cfg), _mesh_sizes(mesh)
  tree = _boxed_params(m)["params"] if tree is None else tree
  boxed = nn.unbox(tree)
  specs = nn.get_partition_spec(tree)
  total = 0
  for spec, leaf in zip(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
                        jax.tree.leaves(boxed)):
    shape = list(leaf.shape)
    for i, axes in enumerate(nn.logical_to_mesh_axes(tuple(spec), sharding.RULES) if spec else ()):
      names = axes if isinstance(axes, tuple) else (axes,) if axes else ()
      n = math.prod(sizes[a] for a in names)
      if shape[i] % n == 0:
        shape[i] //= n
    total += math.prod(shape) * leaf.dtype.itemsize
  return total


@functools.lru_cache(maxsize=256)
def block_residual_bytes(m: ModelConfig, rows, length, causal=True, cross=False, src_len=None):
  """Bytes one block keeps for its backward pass (under m.remat) for `rows` x `length` tokens,
  counted from the block's own residuals (`jax.vjp` traced under eval_shape): its parameters
  and the inputs every layer shares (segments, positions, the encoder output) are left out."""
  block = block_class(m)(m, causal, cross, moe=m.moe_experts > 0)  # (MoE: as if every layer were)
  x = jnp.zeros((rows, length, m.d_model), m.dtype)
  ints = jnp.zeros((rows, length), jnp.int32)
  enc = jnp.zeros((rows, src_len, m.d_model), m.dtype) if cross else None
  enc_seg = jnp.zeros((rows, src_len), jnp.int32) if cross else None
  result = {}

  def count():
    params = nn.unbox(block.init(jax.random.key(0), x, ints, ints, enc, enc_seg, True, False))["params"]
    apply = lambda p, y: block.apply({"params": p}, y, ints, ints, enc, enc_seg, False, False,
                                     rngs={"dropout": jax.random.key(0)})
    _, backward = jax.vjp(apply, params, x)
    shared = {id(t) for t in jax.tree.leaves((params, ints, enc, enc_seg))}
    saved = {id(r): r for r in jax.tree.leaves(backward) if id(r) not in shared and hasattr(r, "dtype")}
    result["bytes"] = sum(r.size * r.dtype.itemsize for r in saved.values())

  jax.eval_shape(count)
  return result["bytes"]


def memory_plan(cfg, mesh, rows, lengths):
  """Per-device bytes of one training step (Adam/AdamW, float32 params; a LoRA base in train.lora_base_dtype) and their sum.

  rows: the global batch (sequences; train.objective=dpo: pairs, two sequences each); lengths: (length,)
  for an LM, (src, tgt) for translation.
  - params, grads: the sharded parameters, and a gradient for each (float32);
  - optimizer: Adam's two moments (2 x params);
  - activations: each layer's residuals under model.remat (`block_residual_bytes`) times the
    layers, plus, with remat, what one layer recomputes while its backward pass runs;
  - logits: the float32 logits and their gradient for the tokens processed at once (all of
    them, or one chunk of model.logits_chunk), plus a bf16 copy when model.dtype is bf16.
  - reference (DPO, full fine-tuning): `ref_params`, a float32 copy of the params. DPO with LoRA
    has none: its reference is the frozen base with the adapters off. DPO's logits are whole
    (its log-probs are not chunked); the reference's forward pass keeps no activations.
  Rows are split over data x fsdp x expert; tensor parallelism divides parameters only here,
  expert parallelism the MoE experts (and the rows).
  """
  m, sizes = cfg.model, _mesh_sizes(mesh)
  shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  dpo = cfg.train.objective == "dpo"
  rows = 2 * rows if dpo else rows  # DPO: chosen and rejected
  rows_dev = -(-rows // shards)
  src, tgt = (lengths[0], lengths[-1])
  params = parameter_bytes_per_device(cfg, sizes)
  plan = {"params": params, "grads": params, "optimizer": 2 * params}
  lora_tokens = 0  # LoRA: each adapted projection also keeps x A [tokens, r] for the backward pass
  if cfg.train.lora_rank > 0:  # the frozen base (train.lora_base_dtype); gradients and Adam's moments of the adapters only
    base, adapter_tree = lora.abstract(cfg)
    params = parameter_bytes_per_device(cfg, sizes, base)
    adapters = parameter_bytes_per_device(cfg, sizes, adapter_tree)
    plan = {"params": params, "adapters": adapters, "grads": adapters, "optimizer": 2 * adapters}
    # (an MoE expert weight's x A is per token copy: top_k rows a token)
    experts = lora.num_adapted(cfg, experts_only=True)
    lora_tokens = ((lora.num_adapted(cfg) - experts + experts * m.moe_top_k) * cfg.train.lora_rank
                   * jnp.dtype(m.dtype).itemsize)
  elif dpo:
    plan["reference"] = params
  if m.arch == "encoder_decoder":
    kinds = [(m.encoder_layers, dict(length=src, causal=False)),
             (m.num_layers, dict(length=tgt, cross=True, src_len=src))]
  else:
    kinds = [(m.num_layers, dict(length=tgt))]
  activations = sum(n * block_residual_bytes(m, rows_dev, **kind) for n, kind in kinds)
  if m.remat != "none":  # the backward pass of a layer recomputes what its policy did not keep
    plain = dataclasses.replace(m, remat="none")
    activations += max(block_residual_bytes(plain, rows_dev, **kind) - block_residual_bytes(m, rows_dev, **kind)
                       for _, kind in kinds)
  plan["activations"] = activations + rows_dev * max(src, tgt) * lora_tokens
  chunk = 0 if dpo else losses.logits_chunk(m.logits_chunk, rows * tgt, m.vocab_size, shards)
  tokens = rows_dev * (max(1, min(chunk // rows, tgt)) if chunk else tgt)
  plan["logits"] = tokens * m.vocab_size * (8 + (2 if m.dtype == "bfloat16" else 0))
  plan["total"] = sum(plan.values())
  return plan


def largest_batch(cfg, mesh, lengths, device_bytes):
  """The largest per-device batch (sequences) whose `memory_plan` total fits in device_bytes, or 0.

  The plan grows linearly with the batch (a chunked loss's logits aside), so two plans give
  the estimate, and exact plans step it down until it fits.
  """
  shards = _mesh_sizes(mesh)["data"] * _mesh_sizes(mesh)["fsdp"] * _mesh_sizes(mesh)["expert"]
  total = lambda b: memory_plan(cfg, mesh, b * shards, lengths)["total"]
  one, two = total(1), total(2)
  if one > device_bytes:
    return 0
  b = 1 + int((device_bytes - one) // max(two - one, 1))
  while b > 1 and total(b) > device_bytes:
    b = max(1, int(b * 0.95))
  return b


def memory_report(cfg, mesh, rows, lengths):
  """The CLI's training-memory section: the plan, and the fit against DEVICE_MEMORY_GB."""
  m, sizes = cfg.model, _mesh_sizes(mesh)
  shards = sizes["data"] * sizes["fsdp"] * sizes["expert"]
  plan = memory_plan(cfg, sizes, rows, lengths)
  dpo = cfg.train.objective == "dpo"
  chunk = 0 if dpo else losses.logits_chunk(m.logits_chunk, rows * lengths[-1], m.vocab_size, shards)
  shape = " + ".join(str(n) for n in lengths)
  lines = [f"Training memory per device: mesh {' x '.join(f'{a}={n}' for a, n in sizes.items() if a != 'expert' or n > 1)}, batch {rows:,}"
           f"{' DPO pairs' if dpo else ''} x {shape} tokens ({-(-(2 if dpo else 1) * rows // shards):,} sequences per "
           f"device), remat {m.remat}, "
           f"scan_layers {str(m.scan_layers).lower()}, logits {f'in chunks of {chunk:,} tokens' if chunk else 'whole'}"]
  notes = {"params": "float32, sharded by the rules", "grads": "float32, one per parameter",
           "optimizer": "Adam: 2 moments x params", "activations": "kept for the backward pass, all layers",
           "logits": "float32 logits + their gradient", "reference": "DPO's frozen reference: a float32 copy of the params"}
  if cfg.train.lora_rank > 0:
    notes.update(params=f"the frozen base, {cfg.train.lora_base_dtype} (train.lora_base_dtype), sharded by the rules",
                 adapters=f"LoRA rank {cfg.train.lora_rank} on {lora.num_adapted(cfg)} kernels, float32",
                 grads="float32, the adapters' only", optimizer="Adam: 2 moments x adapters",
                 activations="kept for the backward pass, all layers, + x A per adapter")
  for key, n in plan.items():
    lines.append(f"  {key:<12}{n / 2**30:10.2f} GiB  {notes.get(key, '')}".rstrip())
  if dpo and cfg.train.lora_rank > 0:
    lines.append("  (DPO with LoRA: the reference is the frozen base with the adapters off, no copy of the weights)")
  if m.remat != "none" and not m.scan_layers:
    lines.append("  (remat without model.scan_layers: XLA:CPU recomputes early and keeps nearly everything anyway; "
                 "BENCHMARKS.md)")
  if sizes["tensor"] > 1:
    lines.append("  (tensor > 1: activations counted as if not split over `tensor`: an upper bound)")
  lines.append(f"  {'device':<10}{'GB':>5}  fits  largest batch per device{' (pairs)' if dpo else ''}")
  devices = dict(DEVICE_MEMORY_GB)
  if cfg.train.lora_rank > 0:  # the single-GPU question LoRA is for
    devices = {"24 GB GPU": 24, "80 GB GPU": 80, **devices}
  for name, gb in devices.items():
    fits = "yes" if plan["total"] <= gb * 1e9 else "no"
    lines.append(f"  {name:<10}{gb:>5}  {fits:<4}  {largest_batch(cfg, sizes, lengths, gb * 1e9):,}")
  return "\n".join(lines)


def _si(x, unit):
  """12345678 -> '12.35 M<unit>'."""
  for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= scale:
      return f"{x / scale:.2f} {prefix}{unit}"
  return f"{x:.0f} {unit}"


def _weights_section(cfg, dtype, manifest):
  """The report's lines on a quantized model's weight bytes (`weight_bytes`) against all-`dtype` weights."""
  q, plain = weight_bytes(cfg, dtype, manifest), weight_bytes(cfg, dtype)["total"]
  bits, group = manifest["bits"], manifest["group_size"]
  n = sum(1 for e in manifest["kernels"].values() if "bits" not in e)
  tables = sum(1 for e in manifest["kernels"].values() if "bits" in e)
  kernel = ("int8 [N, K] + a float32 scale per output" if bits == 8 else
            f"int4, two a byte [N, K/2] + a float32 scale per {group} inputs")
  gib = lambda b: f"{b / 2**30:9.2f} GiB"
  lines = [f"Weights, int{bits} weight-only (python -m jaxformer.quantize --bits {bits}"
           f"{f' --group-size {group}' if bits == 4 else ''} --embedding {manifest['embedding']}): "
           f"{q['total'] / 2**30:.2f} GiB, {q['total'] / plain:.3f}x of {plain / 2**30:.2f} GiB in {dtype}",
           f"  kernels {gib(q['kernels'])}  {n} weights: {kernel}"]
  if tables:
    table = ("int8 + a float32 scale per row" if manifest["embedding"] == "int8" else
             f"int4 + a float32 scale per {group} of d_model")
    lines.append(f"  tables  {gib(q['tables'])}  {tables} (token embeddings, untied output layer): {table}")
  lines.append(f"  float   {gib(q['float'])}  the rest in {dtype}"
               f"{' (embeddings and output layer included: --embedding float)' if not tables else ''}")
  return lines


def report(cfg, dtype="bfloat16", batch=1, contexts=(4096, 32768), seq_len=None, manifest=None):
  """The human-readable report printed by the CLI; `manifest` (`quantized_manifest`): a quantized
  model's weights (their bytes, and the decode roofline on them; the KV cache stays in `dtype`)."""
  m = cfg.model
  if seq_len is None:  # the length the recipe trains at
    seq_len = cfg.data.block_size if cfg.data.task == "lm" else cfg.data.max_len
  layers = f"{m.encoder_layers}+{m.num_layers}" if m.arch == "encoder_decoder" else str(m.num_layers)
  lines = [f"{cfg.name}: {m.arch}, {layers} layers, d_model {m.d_model}, {m.num_heads} heads "
           f"({m.kv_heads} kv) x {m.dim_per_head}, d_ff {m.d_ff} ({m.activation}), vocab {m.vocab_size:,}, "
           f"position {m.position}, {'tied' if m.tie_output else 'untied'} output", ""]

  counts = count_parameters(cfg)
  total = counts["total"]
  lines.append("Parameters")
  for key, n in counts.items():
    if key != "total" and (n or key in COMPONENTS):
      lines.append(f"  {key:<12}{n:>16,}  {100 * n / total:5.1f}%")
  lines.append(f"  {'total':<12}{total:>16,}  ({_si(total * _itemsize(dtype), 'B')} in {dtype})")
  lines.append(f"  FFN share: {100 * counts['ffn'] / total:.1f}%")
  if m.moe_experts:
    active = active_parameters(cfg)
    lines.append(f"  active per token: {active:,} ({m.moe_top_k} of {m.moe_experts} experts"
                 f"{f' + {m.moe_shared_experts} shared' if m.moe_shared_experts else ''}; FLOPs below count these)")

  flops = flops_per_token(cfg, seq_len)
  kernel, why = attention_kernel(cfg, seq_len)
  p = matmul_parameters(cfg)
  lines += ["", f"FLOPs per token at sequence length {seq_len:,}"
            f" ({2 * sum(v for k, v in p.items() if k != 'decoder_step'):,} from matmul weights)",
            f"  forward       {_si(flops['forward'], 'FLOP')}",
            f"  train (3x)    {_si(flops['train'], 'FLOP')}",
            f"  train run     {_si(flops['train_executed'], 'FLOP')} with the {kernel} attention kernel ({why})",
            f"  decode        {_si(flops['decode'], 'FLOP')} at context {seq_len:,}",
            f"  (causal self-attention counted honestly: {(seq_len + 1) / 2:,} keys per query on average,"
            f" (L+1)/2{'; source length = target length' if m.arch == 'encoder_decoder' else ''}"
            f"{f'; local layers: at most their {m.sliding_window:,}-token window' if m.sliding_window else ''})"]

  per_token = kv_cache_bytes_per_token(cfg, dtype)
  what = "decoder self-attention, " if m.arch == "encoder_decoder" else ""
  local = sum(m.layer_is_local(i) for i in range(m.num_layers))
  ring = (f"; {local} local layer(s) keep a ring of their {m.sliding_window:,}-token window, so past it"
          f" {per_token * (m.num_layers - local) // m.num_layers:,} bytes/token") if local else ""
  lines += ["", f"KV cache ({what}{dtype}): {per_token:,} bytes/token{ring}"]
  for c in contexts:
    lines.append(f"  context {c:>7,} x batch {batch}: {kv_cache_bytes(cfg, c, dtype) * batch / 2**30:8.2f} GiB")

  weights = None
  if manifest is None:
    what = f"weights and KV cache in {dtype}"
  else:
    lines += [""] + _weights_section(cfg, dtype, manifest)
    weights = weight_bytes(cfg, dtype, manifest)["total"]
    what = f"int{manifest['bits']} weights ({weights / 2**30:.2f} GiB), KV cache in {dtype}"
  lines += ["", f"Decode roofline: batch {batch}, context {seq_len:,}, {what}"
            f" (one token per sequence per step; peak = dense bf16)",
            f"  {'device':<9}{'TB/s':>7}{'TFLOP/s':>9}{'ms/token':>10}  bound"]
  for name, r in decode_roofline(cfg, dtype, batch, seq_len, weights).items():
    d = DEVICES[name]
    lines.append(f"  {name:<9}{d.memory_bandwidth / 1e12:>7.3g}{d.peak_flops / 1e12:>9.0f}"
                 f"{r['seconds'] * 1e3:>10.2f}  {r['bound']}")
  return "\n".join(lines)


@cli
def main(argv):
  """CLI entry point: `python -m jaxformer.inspect --config NAME [overrides...]`."""
  parser = argparse.ArgumentParser(prog="python -m jaxformer.inspect", description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True, help="recipe name (configs/<name>.py) or path")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=2")
  parser.add_argument("--dtype", default="bfloat16", help="bytes per weight and KV entry (default bfloat16)")
  parser.add_argument("--batch", type=int, default=None,
                      help="sequences decoded together (default 1); with --mesh, the global training batch "
                           "(default: the recipe's)")
  parser.add_argument("--mesh", default=None,
                      help="print the training memory per device on this mesh, e.g. fsdp=64 or data=2,fsdp=32")
  parser.add_argument("--context", default="4096,32768", help="comma-separated context lengths for the KV cache")
  parser.add_argument("--seq-len", type=int, default=None,
                      help="training length for FLOPs and decode context for the roofline (default: the recipe's)")
  parser.add_argument("--quantize", type=int, default=None, metavar="8|4",
                      help="weights as `python -m jaxformer.quantize --bits` stores them: int8/int4 weight bytes "
                           "and the decode roofline on them")
  parser.add_argument("--group-size", type=int, default=128, help="with --quantize 4: inputs per scale (default 128)")
  parser.add_argument("--embedding", default="int8",
                      help="with --quantize: token embeddings and an untied output layer int8 per row (default), "
                           "int4 in groups along d_model, or float")
  args = parser.parse_intermixed_args(argv)  # overrides before, between or after flags
  try:
    contexts = [int(c.replace("_", "")) for c in args.context.split(",") if c.strip()]
  except ValueError:
    raise UserError(f"--context {args.context!r}: expected comma-separated integers, e.g. 4096,32768") from None
  cfg = load_config(args.config, args.overrides)
  _itemsize(args.dtype)
  manifest = None
  if args.quantize is not None:
    manifest = quantized_manifest(cfg, args.quantize, args.group_size, args.embedding)
  elif args.group_size != 128 or args.embedding != "int8":
    raise UserError("--group-size and --embedding describe quantized weights: add --quantize 8 or 4")
  print(report(cfg, args.dtype, args.batch or 1, contexts, args.seq_len, manifest))
  if args.mesh:
    seq_len = args.seq_len or (cfg.data.block_size if cfg.data.task == "lm" else cfg.data.max_len)
    lengths = (seq_len,) if cfg.data.task == "lm" else (seq_len, seq_len)
    recipe_rows = cfg.data.batch_size if cfg.data.task == "lm" else max(cfg.data.tokens_per_batch // seq_len, 1)
    rows = args.batch or recipe_rows
    print("\n" + memory_report(cfg, args.mesh, rows, lengths))
  elif cfg.train.lora_rank > 0:  # a LoRA run is usually one device: its memory without --mesh
    seq_len = args.seq_len or (cfg.data.block_size if cfg.data.task == "lm" else cfg.data.max_len)
    lengths = (seq_len,) if cfg.data.task == "lm" else (seq_len, seq_len)
    print("\n" + memory_report(cfg, "data=1", args.batch or cfg.data.batch_size, lengths))


if __name__ == "__main__":
  main()
