"""Attention over the serving engine's KV block pool without gathering it: the C++ kernel and when it runs.

The engine (`jaxformer.engine`) keeps each layer's keys and values in a pool [kv_heads * slots, head_dim]
(head h's slot i at row h * slots + i) and tells each row which slots hold its history (`src`). The kernel
(`csrc/paged_attention.cc`, built with the quantized matmul into one library by `jaxformer.qkernel`) reads
each visible key where it lies, and only the keys a row holds; `layers.paged_attention` falls back to
`gather` (one `jnp.take` into the cache layout) plus the model's `dot_product_attention` where it cannot run
(`why_not` says why), so both give the same attention (tests/test_paged.py).

On TPU, decode steps (one new token per row) take JAX's Pallas paged-attention kernel instead
(`jax.experimental.pallas.ops.tpu.paged_attention`, `pallas_why_not`): the pool viewed as its
[kv_heads, blocks, block_size, head_dim] pages, a block table and a length per row; the new token's key
and value are written into the pool first, since the kernel reads only the pool. Compiled here by the TPU
compiler without a TPU (`benchmarks/aot_compile.py --serve-decode`) and run on CPU by Pallas' TPU
interpreter (`JAXFORMER_PAGED=pallas-interpret`, tests); never run on a TPU.
"""

import functools
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import qkernel

TARGET = qkernel.PAGED_TARGET
_LOG = logging.getLogger(__name__)
_SAID = set()


def why_not(dtype, *, alibi, matmul_dtype, scanned, devices=None):
  """None when the kernel runs for queries and pools of `dtype`, else the reason (a short phrase). devices: how
  many the call is sharded over (None: the current mesh's, inside `sharding.use_mesh`)."""
  forced = os.environ.get("JAXFORMER_PAGED", "").lower()
  if forced in ("gather", "pallas", "pallas-interpret"):
    return f"JAXFORMER_PAGED={forced}"
  if jax.default_backend() != "cpu":
    return f"no paged kernel on {jax.default_backend()} here (untested: Pallas paged attention is not wired)"
  if jnp.dtype(dtype) != jnp.float32 or matmul_dtype != "float32":
    return "the kernel takes float32 queries and pools"
  if alibi:
    return "ALiBi biases are not in the kernel"
  if scanned:  # inside nn.scan each layer's pool is a slice, which XLA would copy to hand it to a custom call
    return "scanned layers (model.scan_layers)"
  if devices is None:
    mesh = jax.sharding.get_abstract_mesh()
    devices = 1 if mesh.empty else mesh.size
  if devices > 1:  # a custom call is not partitioned: XLA would all-gather the pool
    return f"sharded over {devices} devices"
  return qkernel.unavailable()


def say_once(reason):
  """Logs (once per reason) which path paged attention takes."""
  if reason not in _SAID:
    _SAID.add(reason)
    _LOG.info("paged attention: %s", "the C++ kernel" if reason is None else f"gather + dense attention ({reason})")


def kernel_attention(q, k, v, pool_k, pool_v, src, kv_segment, kv_position, q_segment, q_position, *, window=0,
                     softcap=0.0, scale=None):
  """The C++ kernel (see csrc/paged_attention.cc). q [rows, T, heads, d]; k, v [rows, T, kv_heads, d] (the new
  tokens'); pool_k, pool_v [kv_heads * slots, d]; src, kv_segment, kv_position [rows, L] (each history key's
  pool slot, segment id, 0: empty, and position); q_segment, q_position [rows, T] -> [rows, T, heads, d]."""
  reason = qkernel.unavailable()
  if reason:
    raise RuntimeError(reason)
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  return jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")(
      q, k, v, pool_k, pool_v, i32(src), i32(kv_segment), i32(kv_position), i32(q_segment), i32(q_position),
      window=np.int64(window), scale=np.float32(scale), softcap=np.float32(softcap))


def pool_rows(slots, kv_heads, pool_len):
  """The pool rows holding slots [...] for every kv head -> [..., kv_heads] (head h's slot i at h * slots + i)."""
  return slots[..., None] + jnp.arange(kv_heads, dtype=jnp.int32) * (pool_len // kv_heads)


def gather(pool, src, kv_heads):
  """The history keys (or values) of each row: pool [kv_heads * slots, d], src [rows, L] -> [rows, L, kv_heads, d]."""
  return jnp.take(pool, pool_rows(src, kv_heads, pool.shape[0]), axis=0)


def write(pool, x, slots):
  """The pool [(layers,) kv_heads * slots, d] with x [(layers,) rows, T, kv_heads, d] written at the pool slots
  `slots` [rows, T] (every kv head's row)."""
  return pool.at[..., pool_rows(slots, x.shape[-2], pool.shape[-2]), :].set(x.astype(pool.dtype))


def pallas_why_not(cfg, kv_dtype, devices=1, platform=None):
  """None when the engine's decode steps take JAX's Pallas TPU paged-attention kernel for model config `cfg` with
  a pool of `kv_dtype` on `platform` (None: this process's backend), else why not (a short phrase).
  JAXFORMER_PAGED=pallas forces it on any backend; =pallas-interpret runs it in Pallas' TPU interpreter (CPU
  tests)."""
  platform = platform or jax.default_backend()
  if os.environ.get("JAXFORMER_PAGED", "").lower() not in ("pallas", "pallas-interpret") and platform != "tpu":
    return f"no Pallas TPU kernel on {platform}"
  if jnp.dtype(kv_dtype) != jnp.bfloat16:   # it would round them: tokens would differ from generate's
    return f"the Pallas kernel reads keys and values as bfloat16; this pool is {jnp.dtype(kv_dtype).name}"
  if cfg.position == "alibi":
    return "ALiBi biases are not in the Pallas kernel"
  if cfg.sliding_window:
    return "sliding windows are not in the Pallas kernel"
  if cfg.scan_layers:
    return "scanned layers (model.scan_layers)"
  if cfg.dim_per_head % 128:   # its per-row max and sum blocks are [..., head_dim] over arrays [..., 1]
    return f"head_dim {cfg.dim_per_head} is not a multiple of 128 (the Pallas kernel's TPU blocks)"
  if devices > 1:  # a pallas_call is not partitioned by XLA
    return f"sharded over {devices} devices"
  return None


def pallas_attention(q, pool_k, pool_v, pages, lengths, kv_heads, block_size, *, softcap=0.0, scale=None):
  """JAX's Pallas TPU paged-attention kernel over the pool. q [rows, 1, heads, d] (one token per row, its key and
  value already in the pool); pool_k, pool_v [kv_heads * blocks * block_size, d]; pages [rows, P]: each row's
  block table; lengths [rows]: its keys (history + the new token) -> [rows, 1, heads, d] float32. The kernel
  reads keys and values as bfloat16 (`MultiPageAsyncCopyDescriptor._maybe_dequantize` in the installed jax: a
  float32 pool would be rounded, so `pallas_why_not` takes bfloat16 pools only) and does not scale the queries,
  so they are scaled here."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention  # pylint: disable=g-import-not-at-top
  rows, _, heads, d = q.shape
  scale = d ** -0.5 if scale is None else scale
  view = lambda pool: pool.reshape(kv_heads, -1, block_size, d)   # head h's slot i at row h * slots + i
  per_block = next(n for n in (8, 4, 2, 1) if pages.shape[1] % n == 0)   # pages per compute block (<= 128 keys at 16)
  call = functools.partial(paged_attention, (q[:, 0].astype(jnp.float32) * scale), view(pool_k), view(pool_v),
                           jnp.asarray(lengths, jnp.int32), jnp.asarray(pages, jnp.int32),
                           attn_logits_soft_cap=softcap or None, pages_per_compute_block=per_block)
  if os.environ.get("JAXFORMER_PAGED", "").lower() == "pallas-interpret":
    with pltpu.force_tpu_interpret_mode():
      out = call()
  else:
    out = call()
  return out.astype(jnp.float32)[:, None]
