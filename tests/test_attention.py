"""Tests for jaxformer.attention (the tiled kernel): forward and q/k/v gradients against numpy.

The reference is dense attention written out in float64 numpy, with its gradient from the
softmax's formulas (dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K / sqrt(d),
dK = dS^T Q / sqrt(d)), summed over the query heads that share a kv head. Small blocks
(4 to 8 rows) make every case cross several ragged blocks, so the online softmax, the
padding of the lengths and the skipped blocks are all exercised.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import attention, layers

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def np_attention_and_grads(q, k, v, mask, bias, d_out):
  """float64 numpy: out [b, t, h, d] and (dq, dk, dv) of sum(out * d_out). mask [b, t, s] bool,
  bias [b, h, t, s] or None. Rows with no visible key give 0 (as the kernel does)."""
  q, k, v, d_out = (np.asarray(a, np.float64) for a in (q, k, v, d_out))
  b, t, h, d = q.shape
  g = h // k.shape[2]
  kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  scale = 1 / math.sqrt(d)
  s = np.einsum("bthd,bshd->bhts", q, kr) * scale + (0.0 if bias is None else bias)
  s = np.where(mask[:, None], s, -np.inf)
  m = np.max(s, -1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.where(mask[:, None], np.exp(s - m), 0.0)
  z = e.sum(-1, keepdims=True)
  p = e / np.where(z == 0, 1.0, z)
  out = np.einsum("bhts,bshd->bthd", p, vr)
  dv = np.einsum("bhts,bthd->bshd", p, d_out)
  dp = np.einsum("bthd,bshd->bhts", d_out, vr)
  ds = p * (dp - np.sum(dp * p, -1, keepdims=True))
  dq = np.einsum("bhts,bshd->bthd", ds, kr) * scale
  dk = np.einsum("bhts,bthd->bshd", ds, q) * scale

  def fold(x):  # the gradient of a repeated kv head is the sum over its query heads
    return x.reshape(x.shape[0], x.shape[1], -1, g, d).sum(3)
  return out, (dq, fold(dk), fold(dv))


def check(q, k, v, q_seg, kv_seg, q_slot=None, kv_slot=None, slopes=None, q_pos=None, kv_pos=None,
          block_q=4, block_k=8, atol=1e-5):
  """The kernel's output and gradients equal numpy's (for queries that see a key)."""
  mask = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
  if q_slot is not None:
    mask &= np.asarray(kv_slot)[None, None, :] <= np.asarray(q_slot)[None, :, None]
  bias = None
  if slopes is not None:
    bias = -slopes[None, :, None, None] * np.abs(q_pos[:, :, None] - kv_pos[:, None, :])[:, None]
  d_out = np.random.default_rng(11).normal(size=q.shape).astype(np.float32)
  sees = mask.any(-1)  # [b, t]: queries with at least one visible key
  d_out = d_out * sees[:, :, None, None]
  ref, ref_grads = np_attention_and_grads(q, k, v, mask, bias, d_out)

  def f(q_, k_, v_):
    return attention.flash_attention(
        q_, k_, v_, jnp.asarray(q_seg), jnp.asarray(kv_seg), None if q_slot is None else jnp.asarray(q_slot),
        None if kv_slot is None else jnp.asarray(kv_slot), alibi_slopes=slopes,
        q_position=None if q_pos is None else jnp.asarray(q_pos),
        kv_position=None if kv_pos is None else jnp.asarray(kv_pos), block_q=block_q, block_k=block_k)

  out, vjp = jax.jit(lambda *a: jax.vjp(f, *a), compiler_options=FAST_COMPILE)(q, k, v)
  np.testing.assert_allclose(np.asarray(out)[sees], ref[sees], atol=atol, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(out)[~sees], 0.0)
  grads = jax.jit(vjp, compiler_options=FAST_COMPILE)(jnp.asarray(d_out))
  for name, got, want in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(np.asarray(got), want, atol=atol, rtol=1e-5, err_msg=f"d{name}")


def qkv(seed, b, t, h, kvh, d, s=None):
  rng = np.random.default_rng(seed)
  s = t if s is None else s
  return (rng.normal(size=(b, t, h, d)).astype(np.float32), rng.normal(size=(b, s, kvh, d)).astype(np.float32),
          rng.normal(size=(b, s, kvh, d)).astype(np.float32))


def packed_segments(b, t):
  """Row 0: one document; row 1: two packed documents then padding (segment 0)."""
  seg = np.ones((b, t), np.int32)
  seg[1, t // 3:] = 2
  seg[1, t - 3:] = 0
  return seg


@pytest.mark.parametrize("kvh,causal", [(4, False), (2, True), (1, True)])  # MHA, GQA, MQA
def test_self_attention_packed_and_padded(kvh, causal):
  b, t = 2, 19  # ragged: 19 = 4 * 4 + 3 query rows, 2 * 8 + 3 key rows
  q, k, v = qkv(0, b, t, 4, kvh, 8)
  seg = packed_segments(b, t)
  slots = np.arange(t) if causal else None
  check(q, k, v, seg, seg, slots, slots)


@pytest.mark.parametrize("kvh", [4, 1])
def test_alibi_from_positions(kvh):
  """ALiBi per tile from positions that restart in each packed document."""
  b, t = 2, 21
  q, k, v = qkv(1, b, t, 4, kvh, 8)
  seg = packed_segments(b, t)
  pos = np.where(seg == 2, np.arange(t) - t // 3, np.arange(t)).astype(np.int32)
  slots = np.arange(t)
  check(q, k, v, seg, seg, slots, slots, layers.alibi_slopes(4), pos, pos)


def test_cross_attention():
  """q_len != kv_len, no causal mask: decoder segments see their own source segment."""
  q, k, v = qkv(2, 2, 7, 4, 2, 8, s=13)
  q_seg = np.array([[1] * 6 + [0], [1, 1, 1, 2, 2, 2, 2]], np.int32)
  kv_seg = np.array([[1] * 10 + [0] * 3, [1] * 5 + [2] * 8], np.int32)
  check(q, k, v, q_seg, kv_seg, block_q=4, block_k=4)


def test_decode_over_a_partly_filled_cache():
  """One query at slot 9 of a 24-slot cache: keys in slots 0..9 (a left-padded prompt: slots 0-1
  are segment 0), the rest unwritten (segment 0, slots above the query: blocks never visited)."""
  q, k, v = qkv(3, 2, 1, 4, 2, 8, s=24)
  kv_seg = np.zeros((2, 24), np.int32)
  kv_seg[0, :10] = 1
  kv_seg[1, 2:10] = 1
  q_seg = np.ones((2, 1), np.int32)
  pos = np.array([np.arange(24), np.maximum(np.arange(24) - 2, 0)], np.int32)
  check(q, k, v, q_seg, kv_seg, np.array([9]), np.arange(24), layers.alibi_slopes(4), pos[:, 9:10], pos,
        block_q=1, block_k=4)


def test_prefill_after_a_prefix_cache():
  """Three queries at slots 5-7 of a 12-slot cache holding a 5-token prefix: causal over slots."""
  q, k, v = qkv(4, 1, 3, 4, 1, 8, s=12)
  kv_seg = np.array([[1] * 8 + [0] * 4], np.int32)
  check(q, k, v, np.ones((1, 3), np.int32), kv_seg, np.arange(5, 8), np.arange(12), block_q=8, block_k=4)


def test_default_blocks_and_a_long_causal_row():
  """The block sizes the kernel picks itself (two 304-row blocks at 600 tokens), causal with packing."""
  assert attention.block_size(600) == 304 and attention.block_size(512) == 512 and attention.block_size(1) == 8
  q, k, v = qkv(5, 2, 600, 2, 1, 4)
  seg = packed_segments(2, 600)
  check(q, k, v, seg, seg, np.arange(600), np.arange(600), block_q=None, block_k=None)


def test_causal_tiles_above_the_diagonal_are_skipped():
  """The loop bound per query block: key blocks wholly after its last slot are never computed
  (so a NaN there cannot leak in), those with a visible slot are."""
  t = 16
  q, k, v = qkv(6, 1, t, 2, 2, 4)
  k[:, 8:] = np.nan  # query block 0 (slots 0-3) and 1 (4-7) must not touch key block 1 (8-15)
  v[:, 8:] = np.nan
  seg = np.ones((1, t), np.int32)
  out = attention.flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(seg), jnp.asarray(seg),
                                  jnp.arange(t), jnp.arange(t), block_q=4, block_k=8)
  assert np.isfinite(np.asarray(out)[:, :8]).all() and np.isnan(np.asarray(out)[:, 8:]).all()


def test_bfloat16_inputs_stay_close_to_float32():
  """bf16 q, k, v: bf16 products with float32 accumulation and softmax, output in bf16."""
  q, k, v = qkv(7, 1, 40, 4, 2, 16)
  seg = np.ones((1, 40), np.int32)
  args = (jnp.asarray(seg), jnp.asarray(seg), jnp.arange(40), jnp.arange(40))
  f32 = attention.flash_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), *args, block_q=16, block_k=16)
  bf16 = attention.flash_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), *args, block_q=16, block_k=16)
  assert bf16.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(bf16, np.float32), np.asarray(f32), atol=0.05)
