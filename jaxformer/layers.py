"""Building blocks shared by every model: embeddings, positions, attention, FFN, norms.

Every parameter carries logical axis names (`vocab`, `embed`, `heads`, `kv_heads`,
`kv`, `mlp`, `norm`, `length`); `jaxformer.sharding` maps them to mesh axes, so
nothing here mentions devices. Parameters are float32; compute runs in `cfg.dtype`, the
products on `cfg.matmul_dtype` operands (see `einsum`).
"""

import dataclasses
import functools
import logging
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import attention
from jaxformer import kernels
from jaxformer import paged
from jaxformer import qmatmul
from jaxformer.config import ModelConfig

# Masked logits get a large finite negative value, not -inf: a fully masked row
# (a padding query) then gives a harmless uniform average instead of NaN.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


class _Partitioned(nn.LogicallyPartitioned):
  """LogicallyPartitioned that skips its sharding constraint at the wrong rank.

  DenseGeneral unboxes a kernel at its flattened [fan_in, fan_out] shape before the
  reshape (also when flax re-checks param shapes inside a jitted step): the final
  rank's names cannot constrain that, and under a mesh flax would raise.
  """

  def unbox(self, apply_constraint=True):
    return super().unbox(apply_constraint and jnp.ndim(self.value) == len(self.names))


def _param(init, names):
  return lambda *args, **kwargs: _Partitioned(init(*args, **kwargs), names)


def kernel_init(cfg: ModelConfig):
  """The config's kernel initializer (Xavier-uniform for the paper, N(0, std) for GPT/Llama).

  DenseGeneral calls it on the kernel flattened to [fan_in, fan_out].
  """
  if cfg.kernel_init == "normal":
    return nn.initializers.normal(cfg.init_std)
  return nn.initializers.xavier_uniform()


def _transposed_specs(spec):
  """"ab,bc->ac" -> the einsums giving each operand's gradient: ("ac,bc->ab", "ab,ac->bc").

  Valid when every index of an operand is in the other operand or in the output.
  """
  inputs, out = spec.split("->")
  a, b = inputs.split(",")
  return f"{out},{b}->{a}", f"{a},{out}->{b}"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def _lowp_einsum(spec, a, b, dtype):
  return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def _lowp_einsum_fwd(spec, a, b, dtype):
  a_low, b_low = a.astype(dtype), b.astype(dtype)
  return jnp.einsum(spec, a_low, b_low, preferred_element_type=jnp.float32), (a_low, b_low)


def _lowp_einsum_bwd(spec, dtype, saved, g):
  a_low, b_low = saved
  g_low = g.astype(dtype)
  spec_a, spec_b = _transposed_specs(spec)
  return (jnp.einsum(spec_a, g_low, b_low, preferred_element_type=jnp.float32),
          jnp.einsum(spec_b, a_low, g_low, preferred_element_type=jnp.float32))


_lowp_einsum.defvjp(_lowp_einsum_fwd, _lowp_einsum_bwd)


def einsum(spec, a, b, matmul_dtype="float32"):
  """jnp.einsum of two operands; with matmul_dtype "bfloat16" and float32 operands the
  product runs on bf16 copies of them with float32 accumulation, and so do both gradient
  products (float32 results): a TPU's default matmul precision, and AMX on recent x86 CPUs.
  Everything around the products stays float32."""
  if matmul_dtype == "float32" or a.dtype != jnp.float32 or b.dtype != jnp.float32:
    return jnp.einsum(spec, a, b)
  return _lowp_einsum(spec, a, b, jnp.dtype(matmul_dtype))


class TokenDense(nn.DenseGeneral):
  """DenseGeneral over trailing `axis` that runs as one 2-D matmul on [tokens, features].

  Same parameters and result; the leading [batch, length] dims are merged first
  because XLA:CPU computes the kernel gradient of a 3-D dot through transposed
  copies of the activations (the reshapes themselves are free).
  A quantized workdir's kernel (`qkernel`, `qscale`: `jaxformer.qmatmul`) replaces `kernel`;
  the product then dequantizes it inside the matmul (float params trace what they did before);
  `quant_activations` ("float" | "int8" | "int16") is the quantized product's `activations` (`qmatmul.matmul`).
  """
  quant_activations: str = "float"

  def __call__(self, x):
    n_in = len(self.axis) if isinstance(self.axis, tuple) else 1
    if self.has_variable("params", "qkernel"):
      y = qmatmul.dense_apply(self, x.reshape(-1, *x.shape[x.ndim - n_in:]), n_in, self.features, self.use_bias,
                              self.quant_activations)
    else:
      y = super().__call__(x.reshape(-1, *x.shape[x.ndim - n_in:]))
    return y.reshape(*x.shape[:x.ndim - n_in], *y.shape[1:])


def _dot_general(matmul_dtype):
  """DenseGeneral's product through `einsum`: lhs [tokens, *in] . kernel [*in, *out]."""
  def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    del precision, preferred_element_type
    (contract, rhs_contract), _ = dimension_numbers
    if tuple(contract) != tuple(range(lhs.ndim - len(contract), lhs.ndim)) or \
        tuple(rhs_contract) != tuple(range(len(contract))):
      raise ValueError(f"matmul_dtype path expects trailing lhs / leading kernel axes, got {dimension_numbers}")
    k = math.prod(lhs.shape[i] for i in contract)
    out = einsum("nk,kf->nf", lhs.reshape(lhs.shape[0], k), rhs.reshape(k, -1), matmul_dtype)
    return out.reshape(lhs.shape[0], *rhs.shape[len(contract):])
  return dot_general


def dense(cfg, features, names, axis=-1, name=None, use_bias=None):
  """TokenDense with logical names on kernel (`names`) and bias (the output names)."""
  n_out = len(features) if isinstance(features, tuple) else 1
  low = {} if cfg.matmul_dtype == "float32" else {"dot_general": _dot_general(cfg.matmul_dtype)}
  return TokenDense(
      features, axis=axis, **low, use_bias=cfg.use_bias if use_bias is None else use_bias,
      quant_activations=cfg.quant_activations,
      dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.float32, name=name,
      kernel_init=_param(kernel_init(cfg), names),
      bias_init=_param(nn.initializers.zeros, names[-n_out:]))


class Embed(nn.Module):
  """Token embedding table [vocab, d_model]; `attend` reuses it as the output layer.

  A quantized workdir may hold the table in `jaxformer.qmatmul`'s int8 or int4 format, vocab as the outputs
  (`qkernel` int8 [vocab, d_model] + `qscale` [vocab], or uint8 [vocab, d_model / 2] + [vocab, d_model / group])."""
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    if self.has_variable("params", "qkernel"):
      self.quantized = (self.get_variable("params", "qkernel"), self.get_variable("params", "qscale"))
      return
    self.quantized = None
    # With sqrt(d) scaling the table starts at std d^-0.5 so the scaled input has unit scale.
    std = cfg.d_model ** -0.5 if cfg.scale_embeddings else cfg.init_std
    self.embedding = self.param("embedding", _param(nn.initializers.normal(std), ("vocab", "embed")),
                                (cfg.vocab_size, cfg.d_model), jnp.float32)

  def __call__(self, ids):
    """ids [batch, length] int -> [batch, length, d_model]."""
    # FSDP: gather from the table all-gathered over `embed`, so the rows come out sharded
    # like `ids` (over the batch); else XLA gathers embed-sharded rows and reshards them.
    if self.quantized is not None:
      q, scale = self.quantized
      x = qmatmul.lookup(q, scale, ids.reshape(-1)).reshape(*ids.shape, -1).astype(self.cfg.dtype)
    else:
      table = nn.with_logical_constraint(self.embedding, ("vocab", None))
      x = jnp.take(table, ids, axis=0).astype(self.cfg.dtype)
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    return x * math.sqrt(self.cfg.d_model) if self.cfg.scale_embeddings else x

  def attend(self, x):
    """x [batch, length, d_model] -> logits [batch, length, vocab] (float32)."""
    if self.quantized is not None:
      logits = qmatmul.matmul(x.reshape(-1, x.shape[-1]).astype(self.cfg.dtype), *self.quantized,
                              activations=self.cfg.quant_activations)
      return logits.reshape(*x.shape[:-1], -1)
    logits = _project(x.reshape(-1, x.shape[-1]), self.embedding, "nd,vd->nv", self.cfg)  # 2-D, as in TokenDense
    return logits.reshape(*x.shape[:-1], -1)

  def table(self):
    """The table [vocab, d_model] as float (a quantized one dequantized: the chunked loss's output weight)."""
    return self.embedding if self.quantized is None else qmatmul.dequantize(*self.quantized)


def project_logits(x, weight, spec, cfg: ModelConfig, bias=None):
  """x [tokens, d_model] -> logits [tokens, vocab] (float32) through the output layer's weight.

  weight: the tied embedding table [vocab, d_model] (spec "nd,vd->nv") or the untied
  kernel [d_model, vocab] ("nd,dv->nv"); the product in cfg.dtype on cfg.matmul_dtype
  operands, as `Embed.attend` and the `logits` layer compute it; plus `bias` [vocab]
  (model.logits_bias) when given, then model.final_softcap (`finish_logits`).
  """
  return finish_logits(_project(x, weight, spec, cfg), bias, cfg)


def _project(x, weight, spec, cfg):
  dtype = jnp.dtype(cfg.dtype)
  return einsum(spec, x.astype(dtype), weight.astype(dtype), cfg.matmul_dtype).astype(jnp.float32)


def finish_logits(logits, bias, cfg: ModelConfig):
  """logits [..., vocab] (float32) + the logits bias [vocab] (None: none), soft-capped as
  model.final_softcap asks (Gemma 2: 30 * tanh(logits / 30))."""
  if bias is not None:
    logits = logits + bias
  if cfg.final_softcap:
    logits = cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap)
  return logits


def sinusoidal(positions, d_model, layout="interleaved", max_timescale=10000.0):
  """The paper's encoding: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...).

  positions [batch, length] -> [batch, length, d_model]. `layout="concat"` gives
  tensor2tensor's variant (all sines, then all cosines, timescales 1..10000 spread
  over d/2 - 1 steps), kept as an option for checkpoints trained that way.
  `layout="marian"` (Marian, OPUS-MT) has the paper's frequencies 10000^(-2i/d) with
  the sines in the first half and the cosines in the second.
  """
  half = d_model // 2
  if layout == "concat":
    inv_freq = np.exp(-np.arange(half) * math.log(max_timescale) / max(half - 1, 1))
  else:
    inv_freq = max_timescale ** (-np.arange(0, d_model, 2, dtype=np.float64) / d_model)
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
  sin, cos = jnp.sin(angles), jnp.cos(angles)
  if layout == "interleaved":
    return jnp.stack([sin, cos], axis=-1).reshape(*positions.shape, 2 * half)
  return jnp.concatenate([sin, cos], axis=-1)


def rope_frequencies(cfg: ModelConfig):
  """Inverse frequencies [head_dim/2] and the attention-scale factor for RoPE and its scalings.

  - linear: position interpolation (Chen et al. 2023): every frequency divided by s (Gemma 3's global layers).
  - ntk:    NTK-aware: base theta * s^(d / (d - 2)), stretching low frequencies most.
  - yarn:   YaRN (Peng et al. 2023): interpolate low frequencies by s, keep high ones,
            linear ramp between (dims turning rope_beta_fast = 32 and rope_beta_slow = 1
            times over the original length), and scale cos/sin by the attention factor
            (default 0.1 ln s + 1, so the logits by its square), as in HF's rope utils.
  - llama3: Llama 3.1's piecewise rule (rope_low_freq_factor 1, rope_high_freq_factor 4).
  """
  d = cfg.dim_per_head
  s = cfg.rope_scaling_factor
  theta = cfg.rope_theta
  if cfg.rope_scaling == "ntk":
    theta = theta * s ** (d / (d - 2))
  inv_freq = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
  mscale = 1.0
  if cfg.rope_scaling == "linear":
    inv_freq = inv_freq / s
  if cfg.rope_scaling == "yarn":
    def dim_for(rotations):  # the dimension whose wavelength fits `rotations` times in the context
      return d * math.log(cfg.rope_original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
    low, high = dim_for(cfg.rope_beta_fast), dim_for(cfg.rope_beta_slow)
    if cfg.rope_truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = np.clip((np.arange(d // 2) - low) / (high - low if high != low else 1e-3), 0, 1)  # 0: keep, 1: interpolate
    inv_freq = inv_freq * (1 - ramp) + inv_freq / s * ramp
    mscale = cfg.rope_attention_factor
    if mscale is None:
      def m(scale, k=1.0):
        return 0.1 * k * math.log(scale) + 1.0 if scale > 1 else 1.0
      if cfg.rope_mscale and cfg.rope_mscale_all_dim:  # DeepSeek's rule
        mscale = m(s, cfg.rope_mscale) / m(s, cfg.rope_mscale_all_dim)
      else:
        mscale = m(s)
  elif cfg.rope_scaling == "llama3":
    low_factor, high_factor = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = cfg.rope_original_max_len / low_factor, cfg.rope_original_max_len / high_factor
    smooth = (cfg.rope_original_max_len / wavelen - low_factor) / (high_factor - low_factor)
    mid = (1 - smooth) * inv_freq / s + smooth * inv_freq
    inv_freq = np.where(wavelen > low_wavelen, inv_freq / s, np.where(wavelen < high_wavelen, inv_freq, mid))
  return inv_freq, mscale


def apply_rope(x, positions, cfg: ModelConfig):
  """Rotates x [batch, length, heads, head_dim] by positions [batch, length].

  Half-split layout (dims i and i + d/2 form a pair), as in Llama's HF/MaxText code.
  """
  inv_freq, mscale = rope_frequencies(cfg)
  angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)
  sin, cos = jnp.sin(angles)[:, :, None, :] * mscale, jnp.cos(angles)[:, :, None, :] * mscale
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def alibi_slopes(num_heads):
  """ALiBi head slopes (Press et al. 2022): geometric from 2^(-8/n), with the paper's rule for non-powers of 2."""
  def power_of_2(n):
    start = 2 ** (-8 / n)
    return [start ** (i + 1) for i in range(n)]
  if math.log2(num_heads).is_integer():
    return np.array(power_of_2(num_heads), np.float32)
  closest = 2 ** math.floor(math.log2(num_heads))
  extra = power_of_2(2 * closest)[0::2][: num_heads - closest]
  return np.array(power_of_2(closest) + extra, np.float32)


def make_attention_mask(q_segment, kv_segment, q_slot=None, kv_slot=None, window=0):
  """Boolean mask [batch, 1, q_len, kv_len]: True where a query may attend to a key.

  Segment ids do the padding and the packing at once: a key is visible when it is
  in the query's segment and is not padding (segment 0). With slot indices (the
  position of each token in its row/cache, [q_len] and [kv_len]) the mask is causal;
  with a `window` > 0 a query sees only keys fewer than `window` slots back (itself
  included: transformers' sliding_window). Only the dense paths build it; the tiled
  kernel builds each block's part itself.
  """
  mask = (q_segment[:, :, None] == kv_segment[:, None, :]) & (kv_segment[:, None, :] != 0)
  if q_slot is not None:  # [len], or [batch, len] per row (the serving engine's positions)
    q_slot = q_slot[None, :, None] if q_slot.ndim == 1 else q_slot[:, :, None]
    kv_slot = kv_slot[None, None, :] if kv_slot.ndim == 1 else kv_slot[:, None, :]
    mask = mask & (kv_slot <= q_slot)
    if window:
      mask = mask & (q_slot - kv_slot < window)
  return mask[:, None]


def alibi_bias(slopes, q_position, kv_position):
  """ALiBi's bias [batch, heads, q_len, kv_len]: -slope * |i - j| from positions [batch, len] (dense paths)."""
  distance = (q_position[:, :, None] - kv_position[:, None, :]).astype(jnp.float32)
  return -jnp.asarray(slopes, jnp.float32)[None, :, None, None] * jnp.abs(distance)[:, None]


# Query rows per block when causal attention skips masked key blocks (the dense path).
_CAUSAL_BLOCK = 128

# `auto` picks the tiled kernel when q_len * kv_len reaches this squared (and no dropout):
# below it the dense path is as fast on CPU and its [q, kv] temporaries are small (BENCHMARKS.md,
# "Tiled attention"). Decode steps (one query) stay dense.
TILED_MIN_LENGTH = 2048

IMPLEMENTATIONS = ("auto", "einsum", "tiled", "xla", "cudnn", "splash")

_REPORTED = set()   # (requested, choice, shapes, dtype) already logged: one line per distinct program
_LOG = [None]       # where the choices go: train.setup points it at the run's log; else `logging`


def log_attention_choices(log):
  """Sends each attention choice (one line per distinct program) to `log` (e.g. the run's log)."""
  _LOG[0] = log


def choose_attention(implementation, q_shape, kv_shape, dtype, dropout, backend=None, *, causal=False,
                     slotted=False, alibi=False, window=0, softcap=0.0):
  """The kernel `dot_product_attention` runs -> (kernel, reason).

  implementation: `model.attention_impl`; q_shape [batch, q_len, heads, head_dim], kv_shape
  [batch, kv_len, kv_heads, head_dim]; dropout: whether attention dropout is on in this call;
  backend: jax.default_backend() unless given. An explicit choice is honoured whatever the
  default backend (compiling for a TPU topology from this CPU, `jax.default_backend()` is "cpu").
  causal: the training causal mask (slots = arange); slotted: a mask from KV-cache slots
  (decode); alibi: an ALiBi bias; window, softcap: a sliding window and logit soft-capping. These decide whether the backend kernels of
  `jaxformer.kernels` can run: splash (Pallas, TPU) and cuDNN (GPU) each say why not, and the
  tiled kernel runs instead. `auto` picks them on their backend for long rows (q_len x kv_len >=
  TILED_MIN_LENGTH^2), where the dense path's memory is measured to lose; below that it keeps the
  dense path, because neither has been timed on its device in this project yet (BENCHMARKS.md,
  "device_check"; the rule is: auto changes only where the new kernel is measured not slower).
  """
  backend = backend or jax.default_backend()
  q_len, kv_len = q_shape[1], kv_shape[1]
  if dropout:
    # Only the dense path implements attention dropout (off in every recipe).
    why = "attention dropout is on: only the dense path implements it"
    return "einsum", why if implementation in ("auto", "einsum") else f"{why} ({implementation} requested)"
  shape_args = dict(causal=causal, has_bias=alibi, decode=slotted and not causal)
  shape_args.update({k: v for k, v in (("window", window), ("softcap", softcap)) if v})
  long = q_len * kv_len >= TILED_MIN_LENGTH ** 2
  # `auto` takes a backend kernel only where the dense path is measured to be the worse one (long
  # rows: its [q, kv] temporaries, BENCHMARKS.md "Tiled attention"); below that it keeps the dense
  # path each backend ran before, until benchmarks/device_check.py has timed splash/cuDNN there.
  if implementation == "splash" or (implementation == "auto" and backend == "tpu" and long):
    # Requested by name, splash is checked as for a TPU whatever the default backend.
    reason = kernels.splash_supported(q_shape, kv_shape, dtype, backend="tpu", **shape_args)
    why = "requested" if implementation == "splash" else f"auto on tpu, q_len x kv_len >= {TILED_MIN_LENGTH}^2"
    if reason is None:
      return "splash", why
    return "tiled", f"splash {why} but {reason}"
  if implementation == "cudnn" or (implementation == "auto" and backend == "gpu" and long):
    # Segment ids are checked per batch (packed rows take the tiled kernel: `_cudnn_or_tiled`).
    reason = kernels.cudnn_supported(q_shape, kv_shape, dtype, segments="padding", backend="gpu", **shape_args)
    why = "requested" if implementation == "cudnn" else f"auto on gpu, q_len x kv_len >= {TILED_MIN_LENGTH}^2"
    if reason is None:
      return "cudnn", f"{why}; a batch with packed rows (several segments) runs the tiled kernel"
    return "tiled", f"cudnn {why} but {reason}"
  if implementation != "auto":
    return implementation, "requested"
  if long:
    return "tiled", f"q_len x kv_len {q_len}x{kv_len} >= {TILED_MIN_LENGTH}^2: memory linear in the length"
  unmeasured = {"tpu": " (splash not timed on a TPU yet)", "gpu": " (cuDNN not timed on a GPU yet)"}.get(backend, "")
  if backend == "gpu":
    return "xla", f"gpu, below {TILED_MIN_LENGTH}^2: jax.nn.dot_product_attention's XLA path{unmeasured}"
  return "einsum", f"{backend}, below {TILED_MIN_LENGTH}^2: dense head-major matmuls{unmeasured}"


def _report(implementation, choice, reason, q_shape, kv_shape, dtype):
  """Logs the choice once per distinct program; a replaced request is a warning."""
  key_ = (implementation, choice, tuple(q_shape), tuple(kv_shape), str(dtype))
  if key_ in _REPORTED:
    return
  _REPORTED.add(key_)
  line = (f"attention: {choice} for q {tuple(q_shape)} kv {tuple(kv_shape)} {dtype} "
          f"(model.attention_impl={implementation}: {reason})")
  if _LOG[0] is not None:
    _LOG[0](line)
  elif choice != implementation and implementation != "auto":
    logging.getLogger(__name__).warning(line)
  else:
    logging.getLogger(__name__).info(line)


def dot_product_attention(q, k, v, q_segment, kv_segment, q_slot=None, kv_slot=None, *, alibi_slopes=None,
                          q_position=None, kv_position=None, dropout_rate=0.0, dropout_rng=None,
                          deterministic=True, implementation="auto", causal=False, matmul_dtype="float32",
                          window=0, softcap=0.0, scale=None):
  """softmax(q k^T / sqrt(d_k) + ALiBi) v over the visible keys: the one attention used everywhere.

  q [batch, q_len, heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim] with heads a
  multiple of kv_heads (GQA/MQA). Which keys a query sees comes from ids, never a dense mask:
  q_segment [batch, q_len], kv_segment [batch, kv_len] (same segment, key not 0 = padding),
  and for causal attention q_slot [q_len], kv_slot [kv_len] (each token's slot in its row or
  KV cache: a key is visible when kv_slot <= q_slot). ALiBi: alibi_slopes [heads] with
  q_position [batch, q_len], kv_position [batch, kv_len] (bias -slope * |i - j|).
  Returns [batch, q_len, heads, head_dim]; a query that sees no key gets an unspecified
  (finite) output. `causal=True` promises slots are arange(q_len) == arange(kv_len) (training);
  the dense path then skips the key blocks above the diagonal. `matmul_dtype` as in `einsum`
  (dense and tiled paths). window > 0 (needs slots): a query sees keys fewer than `window`
  slots back only (Mistral, Gemma's local layers); softcap > 0: logits become
  softcap * tanh(logits / softcap) before the mask (Gemma 2); scale: the logits' scale
  (None: head_dim^-0.5; Gemma's query_pre_attn_scalar^-0.5).

  Kernels (`choose_attention` picks one and logs it once per program): `einsum`, dense
  head-major matmuls (the CPU default at short lengths); `tiled`, FlashAttention-2 in JAX
  (`jaxformer.attention`, memory linear in the length); `xla`/`cudnn`,
  `jax.nn.dot_product_attention` with that implementation (JAX 0.10.2's `implementation=None`
  is its XLA path, a dense score matrix, not cuDNN); `cudnn`, cuDNN flash attention with
  `is_causal` and per-row lengths (`jaxformer.kernels`; untested on a GPU here); `splash`,
  Pallas splash attention in `shard_map` over the mesh (`jaxformer.kernels`; TPU).
  """
  use_dropout = dropout_rate > 0.0 and not deterministic
  if window and q_slot is None:
    raise ValueError("a sliding window needs slots (causal attention)")
  # The new variants are passed only when set: a model without them traces the program it did before.
  variant = {k: v for k, v in (("window", window), ("softcap", softcap), ("scale", scale)) if v}
  choice, reason = choose_attention(implementation, q.shape, k.shape, q.dtype, use_dropout, causal=causal,
                                    slotted=q_slot is not None, alibi=alibi_slopes is not None,
                                    window=window, softcap=softcap)
  _report(implementation, choice, reason, q.shape, k.shape, q.dtype)
  tiled = functools.partial(attention.flash_attention, q, k, v, q_segment, kv_segment, q_slot, kv_slot,
                            alibi_slopes=alibi_slopes, q_position=q_position, kv_position=kv_position,
                            causal=causal, matmul_dtype=matmul_dtype, **variant)
  if choice == "tiled":
    return tiled()
  if choice == "splash":
    return kernels.splash_attention(q, k, v, q_segment, kv_segment, causal=causal, **variant)
  if choice == "cudnn":
    # cuDNN sees padding as one length per row; a packed batch is decided at run time.
    no_cap = {k: v for k, v in variant.items() if k != "softcap"}  # (cudnn_supported refuses soft-capping)
    return jax.lax.cond(kernels.cudnn_rows_ok(q_segment, kv_segment),
                        lambda: kernels.cudnn_attention(q, k, v, q_segment, kv_segment, causal=causal,
                                                        **no_cap).astype(q.dtype),
                        lambda: tiled().astype(q.dtype))
  mask = make_attention_mask(q_segment, kv_segment, q_slot, kv_slot, window)
  bias = None if alibi_slopes is None else alibi_bias(alibi_slopes, q_position, kv_position)
  if choice == "xla" and not softcap:
    return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=scale, implementation=choice)
  return _dense_attention(q, k, v, mask, bias, dropout_rate if use_dropout else 0.0, dropout_rng, causal,
                          matmul_dtype, window, softcap, scale)


def paged_attention(q, k, v, pool_k, pool_v, src, kv_segment, kv_position, q_segment, q_position, *,
                    alibi_slopes=None, window=0, softcap=0.0, scale=None, matmul_dtype="float32", scanned=False):
  """New tokens' attention over their history in the serving engine's KV pool and over themselves.

  q [batch, T, heads, head_dim]; k, v [batch, T, kv_heads, head_dim] (the new tokens'); pool_k, pool_v
  [kv_heads * slots, head_dim]; src, kv_segment, kv_position [batch, L]: each history key's pool slot,
  segment id (0: empty) and position; q_segment, q_position [batch, T]. A query sees the keys of its
  segment at positions up to its own (within `window`). -> [batch, T, heads, head_dim]. The C++ kernel
  (`jaxformer.paged`) where it runs, else one gather and `dot_product_attention`, the positions serving
  as the causal slots (within a segment they order keys as slots do).
  """
  reason = paged.why_not(jnp.promote_types(q.dtype, pool_k.dtype), alibi=alibi_slopes is not None,
                         matmul_dtype=matmul_dtype, scanned=scanned)
  paged.say_once(reason)
  if reason is None:
    return paged.kernel_attention(q, k, v, pool_k, pool_v, src, kv_segment, kv_position, q_segment, q_position,
                                  window=window, softcap=softcap, scale=scale).astype(q.dtype)
  kv_heads = k.shape[2]
  keys = jnp.concatenate([paged.gather(pool_k, src, kv_heads).astype(k.dtype), k], 1)
  values = jnp.concatenate([paged.gather(pool_v, src, kv_heads).astype(v.dtype), v], 1)
  kv_segment = jnp.concatenate([kv_segment, q_segment], 1)
  kv_position = jnp.concatenate([kv_position, q_position], 1)
  return dot_product_attention(q, keys, values, q_segment, kv_segment, q_position, kv_position,
                               alibi_slopes=alibi_slopes, q_position=q_position, kv_position=kv_position,
                               implementation="einsum", matmul_dtype=matmul_dtype, window=window, softcap=softcap,
                               scale=scale)


def _dense_attention(q, k, v, mask, bias, dropout_rate, dropout_rng, causal, matmul_dtype, window=0, softcap=0.0,
                     scale=None):
  """The dense path: mask [batch, 1|heads, q_len, kv_len] bool, bias [batch|1, heads, q_len, kv_len] or None."""
  use_dropout = dropout_rate > 0.0
  b, t, h, d = q.shape
  s, kv_heads = k.shape[1], k.shape[2]
  g = h // kv_heads
  # Head-major operands [b, kv_heads, rows, d], so both products are batched matmuls
  # over (b, kv_heads) with no transposes left for XLA to insert around them (with the
  # causal blocks: an 11% faster step for a 256-token LM on CPU; BENCHMARKS.md). The g
  # query heads that share a kv head (GQA/MQA) are stacked as rows: kv is never repeated.
  q = (q * jnp.asarray(d ** -0.5 if scale is None else scale, q.dtype)).reshape(b, t, kv_heads, g, d)
  q = q.transpose(0, 2, 3, 1, 4)
  k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [b, kv_heads, s, d]
  mask = jnp.broadcast_to(mask, (b, h, t, s))
  if bias is not None:
    bias = jnp.broadcast_to(bias, (b, h, t, s))

  def attend(rows, keys, first=0):
    """Queries `rows` against keys [first, keys): -> [b, kvh, g, len(rows), d]."""
    qb = q[:, :, :, rows].reshape(b, kv_heads, -1, d)
    ks = slice(first, keys)
    logits = einsum("bkrd,bksd->bkrs", qb, k[:, :, ks], matmul_dtype).astype(jnp.float32)
    logits = logits.reshape(b, h, -1, keys - first)
    if softcap:
      logits = softcap * jnp.tanh(logits / softcap)
    if bias is not None:
      logits = logits + bias[:, :, rows, ks]
    weights = jax.nn.softmax(jnp.where(mask[:, :, rows, ks], logits, _MASK_VALUE), axis=-1)
    if use_dropout:
      keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
      weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    weights = weights.astype(v.dtype).reshape(b, kv_heads, -1, keys - first)
    return einsum("bkrs,bksd->bkrd", weights, v[:, :, ks], matmul_dtype).reshape(b, kv_heads, g, -1, d)

  if causal and t == s and t >= 2 * _CAUSAL_BLOCK and not use_dropout:
    # Query block i only sees keys up to its last row: ~half the square for long rows; with a
    # window, only keys from (its first row - window + 1): linear in the window.
    out = jnp.concatenate([attend(slice(i, min(i + _CAUSAL_BLOCK, t)), min(i + _CAUSAL_BLOCK, t),
                                  max(0, i - window + 1) if window else 0)
                           for i in range(0, t, _CAUSAL_BLOCK)], axis=3)
  else:
    out = attend(slice(None), s)
  return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


class Attention(nn.Module):
  """Multi-head self- or cross-attention with GQA/MQA and a static-size KV cache.

  In decode mode, self-attention keeps `cached_key`/`cached_value` [batch, kv_heads,
  max_len, head_dim] (one row: [1, max_len, kv_heads, head_dim]) plus the keys' segment ids and positions; each call writes its
  tokens at `cache_index` (prefill many positions, then one per step). The cache size
  is the length of the input the cache was initialised with. Cross-attention (cross=True)
  keeps the source's keys and values, `cross_key`/`cross_value` [batch, kv_heads, src_len,
  head_dim]: computed when a call passes kv_x (a sentence's first step) and read back
  when kv_x is None (every later step), so the source is projected once per sentence.

  A local layer (`local`, model.sliding_window > 0) attends within the window, and its cache is
  a ring buffer of min(window, size) slots: slot s is stored at s % slots, so decoding past the
  window stays exact with a bounded cache.
  """
  cfg: ModelConfig
  causal: bool = False
  cross: bool = False
  local: bool = False

  @nn.compact
  def __call__(self, x, q_segment, q_position, kv_x=None, kv_segment=None, kv_position=None,
               deterministic=True, decode=False):
    """x [batch, q_len, d_model] -> [batch, q_len, d_model]; cross-attention attends to kv_x [batch, src_len, d_model]."""
    cfg = self.cfg
    h, kvh, d = cfg.num_heads, cfg.kv_heads, cfg.dim_per_head
    cross = self.cross
    if not cross:
      kv_x, kv_segment, kv_position = x, q_segment, q_position
    qkv_bias = cfg.use_bias or cfg.qkv_bias
    q = dense(cfg, (h, d), ("embed", "heads", "kv"), name="query", use_bias=qkv_bias)(x)
    if cross and decode and kv_x is None:  # a later step: the source's keys and values are cached
      k, v = (_from_head_major(self.get_variable("cache", n)) for n in ("cross_key", "cross_value"))
    else:
      k = dense(cfg, (kvh, d), ("embed", "kv_heads", "kv"), name="key", use_bias=qkv_bias)(kv_x)
      v = dense(cfg, (kvh, d), ("embed", "kv_heads", "kv"), name="value", use_bias=qkv_bias)(kv_x)
      if cross and decode:
        self.put_variable("cache", "cross_key", _head_major(k))
        self.put_variable("cache", "cross_value", _head_major(v))
    if cfg.qk_norm and not cross:  # Qwen3, Gemma 3: each head's q and k normalised over head_dim, before RoPE
      q, k = norm(cfg, "query_norm")(q), norm(cfg, "key_norm")(k)
    if cfg.position == "rope" and not cross:
      rope_cfg = cfg
      if self.local and cfg.rope_local_theta is not None:  # Gemma 3: local layers rotate with their own, unscaled base
        rope_cfg = dataclasses.replace(cfg, rope_theta=cfg.rope_local_theta, rope_scaling="none")
      q, k = apply_rope(q, q_position, rope_cfg), apply_rope(k, kv_position, rope_cfg)

    q_len = x.shape[1]
    window = cfg.sliding_window if self.local else 0
    slopes = alibi_slopes(h) if cfg.position == "alibi" and not cross else None
    scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
    if decode and not cross and self.has_variable("cache", "pool_key"):  # the serving engine's block pool
      out = self._paged(q, k, v, q_segment, q_position, window, slopes, scale)
    else:
      q_slot = kv_slot = jnp.arange(q_len) if self.causal else None
      if decode and not cross:
        update = self._update_ring if window else self._update_cache
        k, v, kv_segment, kv_position, q_slot, kv_slot = update(k, v, q_segment, q_position)

      dropout_rng = None
      if cfg.attention_dropout_rate > 0 and not deterministic:
        dropout_rng = self.make_rng("dropout")
      out = dot_product_attention(q, k, v, q_segment, kv_segment, q_slot, kv_slot, alibi_slopes=slopes,
                                  q_position=q_position, kv_position=kv_position,
                                  dropout_rate=cfg.attention_dropout_rate, dropout_rng=dropout_rng,
                                  deterministic=deterministic, implementation=cfg.attention_impl,
                                  causal=self.causal and not decode, matmul_dtype=cfg.matmul_dtype, window=window,
                                  softcap=cfg.attn_softcap if not cross else 0.0, scale=scale)
    out = nn.with_logical_constraint(out, ("batch", "length", "heads", "kv"))
    return dense(cfg, cfg.d_model, ("heads", "kv", "embed"), axis=(-2, -1), name="out")(out)

  def _paged(self, q, k, v, segment, position, window, slopes, scale):
    """The serving engine's cache (`jaxformer.engine`): the history lies in a block pool (`pool_key`,
    `pool_value` [kv_heads * slots, head_dim]; `history_slots`, `history_segment`, `history_position`
    [batch, L]); the new keys and values go back as `new_key`, `new_value` for the engine to write. With
    `history_pages` [batch, L / block_size], `history_length` [batch] and `new_slots` [batch, 1] (TPU decode
    steps), the layer writes them and hands back the pool."""
    cfg = self.cfg
    cache = lambda name: self.get_variable("cache", name)
    if self.has_variable("cache", "history_pages"):
      # A decode step on TPU (`paged.pallas_why_not`): the kernel reads only the pool, so the new token's key
      # and value are written into it here, and the written pool goes back in their place.
      pool_k = paged.write(cache("pool_key"), k, cache("new_slots"))
      pool_v = paged.write(cache("pool_value"), v, cache("new_slots"))
      self.put_variable("cache", "pool_key", pool_k)
      self.put_variable("cache", "pool_value", pool_v)
      pages = cache("history_pages")
      return paged.pallas_attention(q, pool_k, pool_v, pages, cache("history_length"), k.shape[2],
                                    cache("history_slots").shape[1] // pages.shape[1], softcap=cfg.attn_softcap,
                                    scale=scale).astype(q.dtype)
    self.put_variable("cache", "new_key", k)
    self.put_variable("cache", "new_value", v)
    return paged_attention(q, k, v, cache("pool_key"), cache("pool_value"), cache("history_slots"),
                           cache("history_segment"), cache("history_position"), segment, position,
                           alibi_slopes=slopes, window=window, softcap=cfg.attn_softcap, scale=scale,
                           matmul_dtype=cfg.matmul_dtype, scanned=cfg.scan_layers)

  def _update_cache(self, k, v, segment, position):
    """Writes k, v [batch, len, kv_heads, head_dim] at cache_index; returns the whole cache."""
    b, t = k.shape[:2]
    initialized = self.has_variable("cache", "cached_key")
    ck = self.variable("cache", "cached_key", jnp.zeros, _head_major(k).shape, k.dtype)
    cv = self.variable("cache", "cached_value", jnp.zeros, _head_major(v).shape, v.dtype)
    cseg = self.variable("cache", "cached_segment", jnp.zeros, segment.shape, jnp.int32)
    cpos = self.variable("cache", "cached_position", jnp.zeros, position.shape, jnp.int32)
    index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
    if not initialized:  # init call: the input's length fixes the cache size
      return k, v, segment, position, jnp.arange(t), jnp.arange(t)
    i = index.value
    at = tuple(i if axis == kv_slots_axis(b) else 0 for axis in range(4))
    ck.value = jax.lax.dynamic_update_slice(ck.value, _head_major(k).astype(ck.value.dtype), at)
    cv.value = jax.lax.dynamic_update_slice(cv.value, _head_major(v).astype(cv.value.dtype), at)
    cseg.value = jax.lax.dynamic_update_slice(cseg.value, segment.astype(jnp.int32), (0, i))
    cpos.value = jax.lax.dynamic_update_slice(cpos.value, position.astype(jnp.int32), (0, i))
    index.value = i + t
    max_len = ck.value.shape[kv_slots_axis(b)]
    return (_from_head_major(ck.value), _from_head_major(cv.value), cseg.value, cpos.value, i + jnp.arange(t),
            jnp.arange(max_len))

  def _update_ring(self, k, v, segment, position):
    """A local layer's cache: a ring of n = min(window, size) slots, slot s kept at s % n.

    One token (a decode step) is written first, then attends to the ring, which then holds
    exactly the window ending at it. A longer call (a prompt) attends to the ring as it was
    plus its own tokens, then keeps its last n tokens: its early queries need keys that the
    write would overwrite. Returns what `_update_cache` does (slots of each key to mask with).
    """
    b, t = k.shape[:2]
    initialized = self.has_variable("cache", "cached_key")
    n = min(self.cfg.sliding_window, t) if not initialized else None
    shape = lambda x: x.shape[:kv_slots_axis(b)] + (n,) + x.shape[kv_slots_axis(b) + 1:]
    ck = self.variable("cache", "cached_key", lambda: jnp.zeros(shape(_head_major(k)), k.dtype))
    cv = self.variable("cache", "cached_value", lambda: jnp.zeros(shape(_head_major(v)), v.dtype))
    cseg = self.variable("cache", "cached_segment", lambda: jnp.zeros((b, n), jnp.int32))
    cpos = self.variable("cache", "cached_position", lambda: jnp.zeros((b, n), jnp.int32))
    index = self.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
    if not initialized:
      return k, v, segment, position, jnp.arange(t), jnp.arange(t)
    i, axis = index.value, kv_slots_axis(b)
    n = ck.value.shape[axis]

    def ring_slots(written):  # the slot each ring entry holds once `written` slots are written (< 0: none yet)
      r = jnp.arange(n)
      return written - 1 - jnp.mod(written - 1 - r, n)

    def write(k, v, segment, position, first):
      """Stores the tokens of slots first, first + 1, ... (at most n of them) in the ring."""
      at = jnp.mod(first + jnp.arange(k.shape[1]), n)
      put = lambda cache, x: cache.at[(slice(None),) * axis + (at,)].set(x.astype(cache.dtype))
      ck.value, cv.value = put(ck.value, _head_major(k)), put(cv.value, _head_major(v))
      cseg.value = cseg.value.at[:, at].set(segment.astype(jnp.int32))
      cpos.value = cpos.value.at[:, at].set(position.astype(jnp.int32))

    index.value = i + t
    if t == 1:
      write(k, v, segment, position, i)
      return (_from_head_major(ck.value), _from_head_major(cv.value), cseg.value, cpos.value, i + jnp.arange(1),
              ring_slots(i + 1))
    keys = jnp.concatenate([_from_head_major(ck.value), k.astype(ck.value.dtype)], 1)
    values = jnp.concatenate([_from_head_major(cv.value), v.astype(cv.value.dtype)], 1)
    kv_segment = jnp.concatenate([cseg.value, segment.astype(jnp.int32)], 1)
    kv_position = jnp.concatenate([cpos.value, position.astype(jnp.int32)], 1)
    kv_slot = jnp.concatenate([ring_slots(i), i + jnp.arange(t)])
    keep = min(t, n)
    write(k[:, t - keep:], v[:, t - keep:], segment[:, t - keep:], position[:, t - keep:], i + t - keep)
    return keys, values, kv_segment, kv_position, i + jnp.arange(t), kv_slot


# The KV cache is stored head-major, [batch, kv_heads, slots, head_dim]: the layout the attention
# matmuls read, so the transposes around them cancel and a decode step does not copy the whole
# cache into that layout per layer (a third of a beam-search step's time on CPU; BENCHMARKS.md).
# A single row keeps [1, slots, kv_heads, head_dim]: there the matmul reads the head-major cache
# through a bitcast that drops the batch axis, into which XLA duplicates the in-place update, and
# that copies the whole cache per layer per step (GPT-2 at batch 1: 10% slower).
def kv_slots_axis(rows):
  """The slots axis of a cache of `rows` rows: 2 head-major, 1 for a single row (the one layout rule)."""
  return 2 if rows > 1 else 1


def _head_major(x):
  return x.transpose(0, 2, 1, 3) if kv_slots_axis(x.shape[0]) == 2 else x


_from_head_major = _head_major  # [batch, kv_heads, slots, head_dim] -> [batch, slots, kv_heads, head_dim]


class FeedForward(nn.Module):
  """Position-wise FFN: ReLU (paper), GELU (tanh: GPT-2; erf: nanoGPT, BERT), SiLU (OPUS-MT), SwiGLU (Llama)
  or GeGLU (Gemma).

  [batch, length, d_model] -> [batch, length, d_model].
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, deterministic=True):
    cfg = self.cfg
    names = ("wi_gate", "wi_up") if cfg.gated else ("wi",)
    hidden = ffn_activation(cfg, [dense(cfg, cfg.d_ff, ("embed", "mlp"), name=n)(x) for n in names])
    hidden = nn.with_logical_constraint(hidden, ("batch", "length", "mlp"))
    return dense(cfg, cfg.d_model, ("mlp", "embed"), name="wo")(hidden)


def ffn_activation(cfg: ModelConfig, hidden):
  """The FFN nonlinearity on the input projections' outputs: [wi] or, gated, [wi_gate, wi_up] (also MoE experts)."""
  if cfg.activation == "swiglu":
    return nn.silu(hidden[0]) * hidden[1]
  if cfg.activation == "geglu":  # Gemma: gelu_pytorch_tanh on the gate
    return nn.gelu(hidden[0], approximate=True) * hidden[1]
  h = hidden[0]
  if cfg.activation == "relu":
    return nn.relu(h)
  if cfg.activation == "silu":  # x * sigmoid(x), "swish" in HF configs (OPUS-MT)
    return nn.silu(h)
  # gelu: the tanh approximation (GPT-2); gelu_exact: the erf form (nanoGPT, BERT).
  return nn.gelu(h, approximate=cfg.activation == "gelu")


class UnitOffsetRMSNorm(nn.Module):
  """Gemma's RMSNorm: x / rms(x) * (1 + w), w [features] starting at 0, computed in float32.

  [..., features] -> same shape in `dtype`.
  """
  epsilon: float = 1e-6
  dtype: str = "float32"

  @nn.compact
  def __call__(self, x):
    w = self.param("scale", _param(nn.initializers.zeros, ("norm",)), (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.epsilon)
    return (y * (1.0 + w)).astype(self.dtype)


def norm(cfg: ModelConfig, name=None):
  """LayerNorm (paper, GPT-2), RMSNorm (Llama) or its (1 + w) form (Gemma), parameters named on the `norm` axis."""
  if cfg.norm_unit_offset:
    return UnitOffsetRMSNorm(epsilon=cfg.norm_eps, dtype=cfg.dtype, name=name)
  if cfg.norm == "rmsnorm":
    return nn.RMSNorm(epsilon=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype), name=name,
                      scale_init=_param(nn.initializers.ones, ("norm",)))
  return nn.LayerNorm(epsilon=cfg.norm_eps, dtype=jnp.dtype(cfg.dtype), name=name,
                      scale_init=_param(nn.initializers.ones, ("norm",)),
                      bias_init=_param(nn.initializers.zeros, ("norm",)))
