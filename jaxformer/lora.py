"""LoRA adapters as a parameter transformation: a frozen base plus trained low-rank factors on chosen projections.

Hu et al. 2021: a targeted projection W [*in, *out] computes x W + (alpha / r) (x A) B with
A [*in, r] and B [r, *out] trained (B starts at zero, so training starts from the base model)
and W frozen. The adapters live next to the kernel they adapt, in the same params tree
(`.../query/lora_a`, `.../query/lora_b`), so they follow `model.scan_layers` (stacked on the
`layers` axis), `model.remat` and the sharding rules (A carries the kernel's input names, B its
output names, the rank axis is `lora`, replicated) without any change to the model.

The product is applied in the forward pass, by intercepting `layers.TokenDense.__call__`
(`flax.linen.intercept_methods`) while `adapters_active(cfg)` is entered, rather than by
merging W + (alpha / r) A B inside the loss: merging materialises a full-size copy of every
targeted kernel and its full-size gradient as temporaries (BENCHMARKS.md, "LoRA").

MoE experts (`moe.MoEFeedForward`'s wi_gate/wi_up/wi/wo, stacked W [experts, in, out], their
paths `.../moe/wi_gate` with no `/kernel`) get per-expert adapters A [experts, in, r] and
B [experts, r, out] in one param beside W, `.../moe/wi_gate_lora/{lora_a, lora_b}`: the interceptor
catches `MoEFeedForward.expert_weight`, and every dispatch path multiplies each row by its expert's
W + s A_e B_e as h W + (h A) (s B). The router is not adapted (it picks experts; it projects nothing).

The training loop keeps only the adapters in its state (`params`, the optimizer state, the
checkpoints); the base is read from `train.init_from` and passed to the step beside it.
"""

import contextlib
import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxformer import layers
from jaxformer import model as model_lib
from jaxformer import moe
from jaxformer.errors import UserError

A, B = "lora_a", "lora_b"
EXPERT_SUFFIX = "_lora"  # an expert weight `moe/wi_gate`'s adapters: `moe/wi_gate_lora/{lora_a, lora_b}`


def enabled(cfg):
  """Whether the config trains LoRA adapters (train.lora_rank > 0)."""
  return cfg.train.lora_rank > 0


def scale(cfg):
  """alpha / r, the factor on the adapters' product."""
  return cfg.train.lora_alpha / cfg.train.lora_rank


def kernel_path(module_path):
  """The parameter path a dense module's kernel has: ('decoder', 'layer_0', ..., 'query') -> 'decoder/layer_0/.../query/kernel'."""
  return "/".join(module_path) + "/kernel"


def expert_path(module_path, name):
  """The parameter path of an MoE expert weight: (..., 'moe'), 'wi_gate' -> '.../moe/wi_gate'."""
  return "/".join(module_path) + "/" + name


def _is_expert_weight(context):
  return isinstance(context.module, moe.MoEFeedForward) and context.method_name == "expert_weight"


def _is_dense_call(context):
  # TokenDense.__call__ (not compact: it reshapes) calls the compact DenseGeneral.__call__ on the same
  # module with x [tokens, *in]: act there, once, where the module may create parameters.
  fn = getattr(context.orig_method, "func", context.orig_method)
  return isinstance(context.module, layers.TokenDense) and getattr(fn, "__qualname__", "") == "DenseGeneral.__call__"


def _a_init(key, shape, dtype=jnp.float32, n_lead=0):
  """PEFT's default for A (kaiming_uniform, a=sqrt(5), on its [r, fan_in] weight): U(-1/sqrt(fan_in), 1/sqrt(fan_in)).

  shape [*lead, *in, r]; the first n_lead axes (the experts) are not fan-in.
  """
  bound = 1.0 / math.sqrt(math.prod(shape[n_lead:-1]))
  return jax.random.uniform(key, shape, dtype, -bound, bound)


def _expert_adapters(module, name, w, rank, factor):
  """(w, A, factor B) for expert weight `name` of an MoE module, w [experts, in, out];
  A [experts, in, r] and B [experts, r, out] are one param `name + EXPERT_SUFFIX`, created at init."""
  experts, n_in, n_out = w.shape
  boxed = module.scope.get_variable("params", name)  # boxed at init: the weight's logical names
  names = tuple(getattr(boxed, "names", None) or (None,) * 3)

  def init(key):
    ka, kb = jax.random.split(key)
    del kb  # B starts at zero
    return {A: layers._Partitioned(_a_init(ka, (experts, n_in, rank), n_lead=1), names[:2] + ("lora",)),
            B: layers._Partitioned(jnp.zeros((experts, rank, n_out), jnp.float32), (names[0], "lora", names[2]))}

  adapters = module.param(name + EXPERT_SUFFIX, init)
  return w, adapters[A], adapters[B] * jnp.asarray(factor, adapters[B].dtype)


def _delta(module, x, rank, factor):
  """(alpha / r) (x A) B for one dense module; x [..., *in] -> [..., *out]. Creates A, B at init."""
  n_in = len(module.axis) if isinstance(module.axis, tuple) else 1
  features = module.features if isinstance(module.features, tuple) else (module.features,)
  in_shape = x.shape[x.ndim - n_in:]
  kernel = module.scope.get_variable("params", "kernel")  # boxed at init: the kernel's logical names
  names = tuple(getattr(kernel, "names", None) or (None,) * (n_in + len(features)))
  a = module.param(A, layers._param(_a_init, names[:n_in] + ("lora",)), in_shape + (rank,), jnp.float32)
  b = module.param(B, layers._param(nn.initializers.zeros, ("lora",) + names[n_in:]), (rank,) + features,
                   jnp.float32)
  dtype = module.dtype or x.dtype
  lead = x.shape[:x.ndim - n_in]
  h = x.reshape(-1, math.prod(in_shape)).astype(dtype) @ a.reshape(-1, rank).astype(dtype)  # [tokens, r]
  out = (h @ b.reshape(rank, -1).astype(dtype)) * jnp.asarray(factor, dtype)
  return out.reshape(*lead, *features)


@contextlib.contextmanager
def adapters_active(cfg):
  """While entered (and LoRA is on), every dense projection whose kernel path matches
  `train.lora_targets` adds (alpha / r) (x A) B to its output; at init it creates A and B.
  A no-op when train.lora_rank is 0."""
  if not enabled(cfg):
    yield
    return
  pattern, rank, factor = re.compile(cfg.train.lora_targets), cfg.train.lora_rank, scale(cfg)

  def interceptor(next_fun, args, kwargs, context):
    y = next_fun(*args, **kwargs)
    if _is_dense_call(context) and pattern.search(kernel_path(context.module.path)):
      y = y + _delta(context.module, args[0], rank, factor).astype(y.dtype)
    elif _is_expert_weight(context) and pattern.search(expert_path(context.module.path, args[0])):
      y = _expert_adapters(context.module, args[0], y, rank, factor)
    return y

  with nn.intercept_methods(interceptor):
    yield


def _dummy_inputs(m):
  dummy = jnp.ones((1, 8), jnp.int32)
  return (dummy, dummy) if m.arch == "encoder_decoder" else (dummy,)


@functools.lru_cache(maxsize=16)
def dense_kernel_paths(model_cfg):
  """Every path train.lora_targets can match, in call order: each dense projection's kernel
  ('.../query/kernel') and each MoE expert weight ('.../moe/wi_gate', stacked over the experts)."""
  model = model_lib.build_model(model_cfg)
  seen = []

  def record(next_fun, args, kwargs, context):
    if _is_dense_call(context):
      seen.append(kernel_path(context.module.path))
    elif _is_expert_weight(context):
      seen.append(expert_path(context.module.path, args[0]))
    return next_fun(*args, **kwargs)

  with nn.intercept_methods(record):
    jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *_dummy_inputs(model_cfg)))
  return tuple(dict.fromkeys(seen))


def target_paths(cfg):
  """The kernel paths train.lora_targets matches; a UserError naming the candidates if none."""
  try:
    pattern = re.compile(cfg.train.lora_targets)
  except re.error as e:
    raise UserError(f"train.lora_targets={cfg.train.lora_targets!r} is not a regular expression ({e})") from e
  paths = dense_kernel_paths(cfg.model)
  matched = [p for p in paths if pattern.search(p)]
  if not matched:
    kinds = sorted({re.sub(r"layer_\d+", "layer_<i>", p) for p in paths})
    raise UserError(f"train.lora_targets={cfg.train.lora_targets!r} matches no parameter path; it is searched "
                    f"(re.search) in these kernel paths: {', '.join(kinds)}")
  return matched


def split(params):
  """(base, adapters): the params tree without and with only the `lora_a`/`lora_b` leaves."""
  base, adapters = {}, {}
  for key, value in params.items():
    if key in (A, B):
      adapters[key] = value
    elif isinstance(value, dict):
      b, a = split(value)
      if b:
        base[key] = b
      if a:
        adapters[key] = a
    else:
      base[key] = value
  return base, adapters


def combine(base, adapters):
  """The one params tree the model reads under `adapters_active`: base with the adapter leaves added (no copy)."""
  out = dict(base)
  for key, value in adapters.items():
    out[key] = combine(base[key], value) if isinstance(value, dict) and key in base else value
  return out


def merge(base, adapters, cfg):
  """Plain model params: each adapted kernel W [*lead, *in, *out] becomes W + (alpha / r) A B.

  `lead` is the stacked `layers` axis under model.scan_layers and, for an MoE expert weight
  (`.../moe/wi_gate` from `.../moe/wi_gate_lora`), the experts axis: W [*lead, experts, in, out]
  with A [*lead, experts, in, r], B [*lead, experts, r, out] gives W_e + (alpha / r) A_e B_e per expert.
  """
  factor = scale(cfg)

  def merged(w, la, lb):
    n_lead = la.ndim + lb.ndim - 2 - w.ndim
    lead = la.shape[:n_lead]
    r = la.shape[-1]
    prod = jnp.matmul(la.reshape(*lead, -1, r), lb.reshape(*lead, r, -1))  # [*lead, in, out]
    return (w + factor * prod.reshape(w.shape)).astype(w.dtype)

  def walk(b, a):
    out = dict(b)
    for key, value in a.items():
      if key in (A, B):
        continue
      weight = key[:-len(EXPERT_SUFFIX)]
      if key.endswith(EXPERT_SUFFIX) and key not in b and not isinstance(b.get(weight), (dict, type(None))):
        out[weight] = merged(b[weight], value[A], value[B])  # an expert weight's adapters, beside it
      else:
        out[key] = walk(b[key], value)
    if A in a:
      out["kernel"] = merged(b["kernel"], a[A], a[B])
    return out

  return walk(base, adapters)


def base_dtype(cfg):
  """The frozen base's storage dtype, train.lora_base_dtype (float32 or bfloat16)."""
  return jnp.dtype(cfg.train.lora_base_dtype)


def cast_base(base, cfg):
  """The base params (arrays or ShapeDtypeStructs, boxed or not) with floating leaves in
  train.lora_base_dtype. The model reads a bfloat16 kernel as it reads a float32 one: flax promotes
  it to model.dtype for the product (so a float32-compute model multiplies the rounded weights
  in float32), and the adapters, their gradients and Adam's moments stay float32."""
  dtype = base_dtype(cfg)

  def cast(x):
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == dtype:
      return x
    return jax.ShapeDtypeStruct(x.shape, dtype, sharding=getattr(x, "sharding", None)) \
        if isinstance(x, jax.ShapeDtypeStruct) else x.astype(dtype)

  return jax.tree.map(cast, base)


@functools.lru_cache(maxsize=16)  # inspect's batch search asks for it many times
def abstract(cfg):
  """(base, adapters) boxed ShapeDtypeStruct trees (logical names kept) of the LoRA model, the base in
  train.lora_base_dtype; nothing allocated."""
  model = model_lib.build_model(cfg.model)
  with adapters_active(cfg):
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *_dummy_inputs(cfg.model)))["params"]
  base, adapters = split(params)
  return cast_base(base, cfg), adapters


def num_adapted(cfg, experts_only=False):
  """How many kernels carry adapters, counting each layer of a model.scan_layers stack and an MoE
  layer's stacked expert weight (e.g. wi_gate [experts, d, f]) as one; `experts_only`: those alone."""
  _, adapters = abstract(cfg)
  return sum(a.shape[0] if any(getattr(k, "key", None) == "layers" for k in path) else 1
             for path, a in jax.tree_util.tree_leaves_with_path(nn.unbox(adapters)) if path[-1].key == A
             and (not experts_only or path[-2].key.endswith(EXPERT_SUFFIX)))


def count(tree):
  """Number of elements in a tree of arrays or ShapeDtypeStructs (boxed or not)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(tree)))
