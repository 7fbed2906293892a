"""Attention over the serving engine's KV block pool without gathering it: the C++ kernel and when it runs.

The engine (`jaxformer.engine`) keeps each layer's keys and values in a pool [kv_heads * slots, head_dim]
(head h's slot i at row h * slots + i) and tells each row which slots hold its history (`src`). The kernel
(`csrc/paged_attention.cc`, built with the quantized matmul into one library by `jaxformer.qkernel`) reads
each visible key where it lies, and only the keys a row holds; `layers.paged_attention` falls back to
`gather` (one `jnp.take` into the cache layout) plus the model's `dot_product_attention` where it cannot run
(`why_not` says why), so both give the same attention (tests/test_paged.py).
"""

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
  if os.environ.get("JAXFORMER_PAGED", "").lower() == "gather":
    return "JAXFORMER_PAGED=gather"
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
