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
from jaxformer.errors import UserError

A, B = "lora_a", "lora_b"


def enabled(cfg):
  """Whether the config trains LoRA adapters (train.lora_rank > 0)."""
  return cfg.train.lora_rank > 0


def scale(cfg):
  """alpha / r, the factor on the adapters' product."""
  return cfg.train.lora_alpha / cfg.train.lora_rank


def kernel_path(module_path):
  """The parameter path a dense module's kernel has: ('decoder', 'layer_0', ..., 'query') -> 'decoder/layer_0/.../query/kernel'."""
  return "/".join(module_path) + "/kernel"


def _is_dense_call(context):
  # TokenDense.__call__ (not compact: it reshapes) calls the compact DenseGeneral.__call__ on the same
  # module with x [tokens, *in]: act there, once, where the module may create parameters.
  fn = getattr(context.orig_method, "func", context.orig_method)
  return isinstance(context.module, layers.TokenDense) and getattr(fn, "__qualname__", "") == "DenseGeneral.__call__"


def _a_init(key, shape, dtype=jnp.float32):
  """PEFT's default for A (kaiming_uniform, a=sqrt(5), on its [r, fan_in] weight): U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
  bound = 1.0 / math.sqrt(math.prod(shape[:-1]))
  return jax.random.uniform(key, shape, dtype, -bound, bound)


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
    return y

  with nn.intercept_methods(interceptor):
    yield


def _dummy_inputs(m):
  dummy = jnp.ones((1, 8), jnp.int32)
  return (dummy, dummy) if m.arch == "encoder_decoder" else (dummy,)


@functools.lru_cache(maxsize=16)
def dense_kernel_paths(model_cfg):
  """Every dense projection's kernel path in the model (what train.lora_targets can match), in call order."""
  model = model_lib.build_model(model_cfg)
  seen = []

  def record(next_fun, args, kwargs, context):
    if _is_dense_call(context):
      seen.append(kernel_path(context.module.path))
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

  `lead` is the stacked `layers` axis under model.scan_layers (A [*lead, *in, r], B [*lead, r, *out]).
  """
  factor = scale(cfg)

  def walk(b, a):
    out = dict(b)
    for key, value in a.items():
      if key in (A, B):
        continue
      out[key] = walk(b[key], value)
    if A in a:
      w, la, lb = b["kernel"], a[A], a[B]
      n_lead = la.ndim + lb.ndim - 2 - w.ndim
      lead = la.shape[:n_lead]
      r = la.shape[-1]
      prod = jnp.matmul(la.reshape(*lead, -1, r), lb.reshape(*lead, r, -1))  # [*lead, in, out]
      out["kernel"] = (w + factor * prod.reshape(w.shape)).astype(w.dtype)
    return out

  return walk(base, adapters)


@functools.lru_cache(maxsize=16)  # inspect's batch search asks for it many times
def abstract(cfg):
  """(base, adapters) boxed ShapeDtypeStruct trees (logical names kept) of the LoRA model; nothing allocated."""
  model = model_lib.build_model(cfg.model)
  with adapters_active(cfg):
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *_dummy_inputs(cfg.model)))["params"]
  return split(params)


def num_adapted(cfg):
  """How many kernels carry adapters, counting each layer of a model.scan_layers stack."""
  _, adapters = abstract(cfg)
  return sum(a.shape[0] if any(getattr(k, "key", None) == "layers" for k in path) else 1
             for path, a in jax.tree_util.tree_leaves_with_path(nn.unbox(adapters)) if path[-1].key == A)


def count(tree):
  """Number of elements in a tree of arrays or ShapeDtypeStructs (boxed or not)."""
  return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(tree)))
