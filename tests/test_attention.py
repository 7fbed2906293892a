"""Tests for jaxformer.attention (the tiled kernel): forward and q/k/v gradients against numpy.

The reference is dense attention written out in float64 numpy, with its gradient from the
softmax's formulas (dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = dS K / sqrt(d),
dK = dS^T Q / sqrt(d)), summed over the query heads that share a kv head. With the variants
(a custom scale, soft-capping c * tanh(x / c) whose dS is multiplied by 1 - tanh^2, a
sliding window in the mask) its gradients are also checked against jax.grad of a dense
jnp implementation. Small blocks
(4 to 8 rows) make every case cross several ragged blocks, so the online softmax, the
padding of the lengths and the skipped blocks are all exercised.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import attention, layers

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def np_attention_and_grads(q, k, v, mask, bias, d_out, scale=None, softcap=0.0):
  """float64 numpy: out [b, t, h, d] and (dq, dk, dv) of sum(out * d_out). mask [b, t, s] bool,
  bias [b, h, t, s] or None; logits softcap * tanh(scale * q.k / softcap) + bias (scale None:
  1 / sqrt(d); softcap 0: no cap). Rows with no visible key give 0 (as the kernel does)."""
  q, k, v, d_out = (np.asarray(a, np.float64) for a in (q, k, v, d_out))
  b, t, h, d = q.shape
  g = h // k.shape[2]
  kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
  scale = 1 / math.sqrt(d) if scale is None else scale
  s = np.einsum("bthd,bshd->bhts", q, kr) * scale
  if softcap:
    cap = np.tanh(s / softcap)
    s = softcap * cap
  s = s + (0.0 if bias is None else bias)
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
  if softcap:
    ds = ds * (1 - cap ** 2)  # d/dx c tanh(x / c)
  dq = np.einsum("bhts,bshd->bthd", ds, kr) * scale
  dk = np.einsum("bhts,bthd->bshd", ds, q) * scale

  def fold(x):  # the gradient of a repeated kv head is the sum over its query heads
    return x.reshape(x.shape[0], x.shape[1], -1, g, d).sum(3)
  return out, (dq, fold(dk), fold(dv))


def np_mask(q_seg, kv_seg, q_slot=None, kv_slot=None, window=0):
  """[b, t, s] bool: same segment, key not padding, kv_slot <= q_slot, q_slot - kv_slot < window."""
  mask = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
  if q_slot is not None:
    diff = np.asarray(q_slot)[None, :, None] - np.asarray(kv_slot)[None, None, :]
    mask &= diff >= 0
    if window:
      mask &= diff < window
  return mask


def check(q, k, v, q_seg, kv_seg, q_slot=None, kv_slot=None, slopes=None, q_pos=None, kv_pos=None,
          block_q=4, block_k=8, atol=1e-5, **variant):
  """The kernel's output and gradients equal numpy's (for queries that see a key) -> (out, grads, reference).

  variant: window, softcap, scale as flash_attention takes them."""
  mask = np_mask(q_seg, kv_seg, q_slot, kv_slot, variant.get("window", 0))
  bias = None
  if slopes is not None:
    bias = -slopes[None, :, None, None] * np.abs(q_pos[:, :, None] - kv_pos[:, None, :])[:, None]
  d_out = np.random.default_rng(11).normal(size=q.shape).astype(np.float32)
  sees = mask.any(-1)  # [b, t]: queries with at least one visible key
  d_out = d_out * sees[:, :, None, None]
  ref, ref_grads = np_attention_and_grads(q, k, v, mask, bias, d_out, variant.get("scale"), variant.get("softcap", 0.0))

  def f(q_, k_, v_):
    return attention.flash_attention(
        q_, k_, v_, jnp.asarray(q_seg), jnp.asarray(kv_seg), None if q_slot is None else jnp.asarray(q_slot),
        None if kv_slot is None else jnp.asarray(kv_slot), alibi_slopes=slopes,
        q_position=None if q_pos is None else jnp.asarray(q_pos),
        kv_position=None if kv_pos is None else jnp.asarray(kv_pos), block_q=block_q, block_k=block_k, **variant)

  out, vjp = jax.jit(lambda *a: jax.vjp(f, *a), compiler_options=FAST_COMPILE)(q, k, v)
  np.testing.assert_allclose(np.asarray(out)[sees], ref[sees], atol=atol, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(out)[~sees], 0.0)
  grads = jax.jit(vjp, compiler_options=FAST_COMPILE)(jnp.asarray(d_out))
  for name, got, want in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(np.asarray(got), want, atol=atol, rtol=1e-5, err_msg=f"d{name}")
  return np.asarray(out), [np.asarray(x) for x in grads], (mask, bias, d_out, sees)


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


# ----------------------------------------------------------------------------- window, soft-capping, scale

VARIANTS = {
    "window": dict(window=5),
    "softcap": dict(softcap=1.5),
    "scale": dict(scale=0.2),
    "all": dict(window=6, softcap=2.0, scale=0.25),
}


def np_reference(q, k, v, q_seg, kv_seg, q_slot, kv_slot, d_out, window=0, softcap=0.0, scale=None):
  """numpy's output [b, t, h, d] for one set of variants (the mask rebuilt with the window)."""
  mask = np_mask(q_seg, kv_seg, q_slot, kv_slot, window)
  return np_attention_and_grads(q, k, v, mask, None, d_out, scale, softcap)[0]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variants_against_numpy_causal_gqa_packed(name):
  """Each variant alone and all together: GQA, 37 ragged tokens in 4-row query / 8-row key blocks,
  packed + padded rows. Without any one of them numpy's numbers are far off (the check can fail)."""
  variant = VARIANTS[name]
  b, t = 2, 37
  q, k, v = qkv(8, b, t, 4, 2, 8)
  q = 2 * q  # logits of a few units, where the cap bends them
  seg = packed_segments(b, t)
  slots = np.arange(t)
  out, _, (_, _, d_out, sees) = check(q, k, v, seg, seg, slots, slots, **variant)
  for dropped in variant:
    rest = {key: value for key, value in variant.items() if key != dropped}
    ref = np_reference(q, k, v, seg, seg, slots, slots, d_out, **rest)
    assert np.abs(out[sees] - ref[sees]).max() > 1e-2, dropped


def test_all_variants_with_alibi_mqa_and_skipped_blocks():
  """Window, cap and scale with ALiBi (positions restarting per document) and one kv head; 4-row
  blocks, so the later query blocks start several key blocks in."""
  b, t, window = 2, 45, 7
  q, k, v = qkv(9, b, t, 4, 1, 8)
  seg = packed_segments(b, t)
  pos = np.where(seg == 2, np.arange(t) - t // 3, np.arange(t)).astype(np.int32)
  slots = np.arange(t)
  check(q, k, v, seg, seg, slots, slots, layers.alibi_slopes(4), pos, pos, block_q=4, block_k=4,
        window=window, softcap=3.0, scale=0.3)
  start, stop = (np.asarray(x) for x in attention.key_block_range(slots, slots, block_q=4, block_k=4, window=window))
  # The last query block holds slot 44 only (45 tokens; its padding must not widen the range): keys 38-44.
  assert start[-1] == (44 - window + 1) // 4 == 9 and stop[-1] == 12 and (stop - start <= 3).all(), (start, stop)


def test_softcap_and_scale_without_slots():
  """Cross attention (no slots, every key block visited) with soft-capping and a scale."""
  q, k, v = qkv(10, 2, 7, 4, 2, 8, s=13)
  q_seg = np.array([[1] * 6 + [0], [1, 1, 1, 2, 2, 2, 2]], np.int32)
  kv_seg = np.array([[1] * 10 + [0] * 3, [1] * 5 + [2] * 8], np.int32)
  check(3 * q, k, v, q_seg, kv_seg, block_q=4, block_k=4, softcap=1.0, scale=0.5)


def test_a_window_needs_slots():
  q, k, v = qkv(11, 1, 8, 2, 2, 8)
  seg = jnp.ones((1, 8), jnp.int32)
  with pytest.raises(ValueError, match="needs slots"):
    attention.flash_attention(q, k, v, seg, seg, window=4)


def test_numpy_reference_gradients_equal_jax_grad_of_a_dense_jnp_attention():
  """The hand-written numpy backward (softmax, soft-cap and scale terms) against jax.grad of dense
  jnp attention, itself checked against numpy's forward; without the 1 - tanh^2 term it is off."""
  b, t = 2, 13
  q, k, v = qkv(12, b, t, 4, 2, 8)
  q = 2 * q
  seg = np.ones((b, t), np.int32)
  seg[1, 9:] = 2
  slots = np.arange(t)
  mask = np_mask(seg, seg, slots, slots, window=4)
  d_out = np.random.default_rng(13).normal(size=q.shape).astype(np.float32)
  scale, softcap = 0.3, 1.5

  def dense(q, k, v):
    g = q.shape[2] // k.shape[2]
    kr, vr = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    logits = jnp.einsum("bthd,bshd->bhts", q, kr) * scale
    logits = softcap * jnp.tanh(logits / softcap)
    p = jax.nn.softmax(jnp.where(jnp.asarray(mask)[:, None], logits, -1e30), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, vr)

  out, vjp = jax.vjp(dense, q, k, v)
  ref, ref_grads = np_attention_and_grads(q, k, v, mask, None, d_out, scale, softcap)
  np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)
  grads = vjp(jnp.asarray(d_out))
  for name, got, want in zip("qkv", grads, ref_grads):
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")
  # The cap's derivative matters here: numpy's dq without it (the forward kept) is far off.
  cap = np.tanh(np.einsum("bthd,bshd->bhts", q, np.repeat(k, 2, axis=2)) * scale / softcap)
  assert np.abs(cap ** 2 * mask[:, None]).max() > 0.3


@pytest.mark.parametrize("window, blocks", [(6, (0, 2)), (12, (0, 6))])
def test_unsorted_ring_buffer_slots_equal_the_sorted_layout(window, blocks):
  """A 24-slot ring buffer after 32 tokens (positions 0-7 hold slots 24-31, 8-23 hold slots 8-23)
  and four queries at slots 32-35: the numbers of the keys sorted by slot, and numpy's. The range
  from per-block min/max covers the window's keys: (0, 2) for window 6, all six blocks for 12."""
  q, k, v = qkv(14, 2, 4, 4, 2, 8, s=24)
  kv_slot = np.r_[np.arange(24, 32), np.arange(8, 24)]
  q_slot = np.arange(32, 36)
  q_seg, kv_seg = np.ones((2, 4), np.int32), np.ones((2, 24), np.int32)
  kv_seg[1, 4:6] = 0  # padding (unwritten) inside the window of row 1
  out, grads, _ = check(q, k, v, q_seg, kv_seg, q_slot, kv_slot, block_q=4, block_k=4, window=window)
  order = np.argsort(kv_slot)
  out_sorted, grads_sorted, _ = check(q, k[:, order], v[:, order], q_seg, kv_seg[:, order], q_slot, kv_slot[order],
                                      block_q=4, block_k=4, window=window)
  np.testing.assert_allclose(out, out_sorted, atol=1e-6)
  np.testing.assert_allclose(grads[0], grads_sorted[0], atol=1e-6)
  for got, want in zip(grads[1:], grads_sorted[1:]):
    np.testing.assert_allclose(got[:, order], want, atol=1e-6)
  start, stop = attention.key_block_range(q_slot, kv_slot, block_q=4, block_k=4, window=window)
  assert (int(start[0]), int(stop[0])) == blocks
  start, stop = attention.key_block_range(q_slot, kv_slot[order], block_q=4, block_k=4, window=window)
  assert (int(start[0]), int(stop[0])) == ((4, 6) if window == 6 else (3, 6))  # sorted: the last blocks


def np_visible_blocks(q_slot, kv_slot, bq, bk, window):
  """[nq, nk] bool: whether key block j holds a key visible to some query of block i (from the dense mask)."""
  diff = np.asarray(q_slot)[:, None] - np.asarray(kv_slot)[None, :]
  seen = (diff >= 0) & ((diff < window) if window else True)
  nq, nk = -(-len(q_slot) // bq), -(-len(kv_slot) // bk)
  return np.array([[seen[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].any() for j in range(nk)] for i in range(nq)])


@pytest.mark.parametrize("q_slot, kv_slot, bq, bk, window, exact", [
    (np.arange(4000), np.arange(4000), 128, 128, 512, True),         # ragged: the last blocks are padded
    (np.arange(100, 150), np.arange(200), 8, 16, 20, True),          # prefill after a 100-token prefix
    (np.arange(37), np.arange(37), 4, 8, 5, True),
    (np.arange(600), np.arange(600), 128, 64, 0, True),              # no window: today's stop, start 0
    (np.arange(40, 48), np.r_[np.arange(32, 48), np.arange(16, 32)], 4, 8, 10, False),  # ring buffer
])
def test_key_block_range_covers_exactly_the_visible_blocks(q_slot, kv_slot, bq, bk, window, exact):
  """Every key block with a visible key lies in [start, stop); with sorted slots the range is exactly
  first..last visible block, padding included (its slots -1 and int32 max must not widen it)."""
  start, stop = (np.asarray(x) for x in attention.key_block_range(q_slot, kv_slot, block_q=bq, block_k=bk,
                                                                   window=window))
  seen = np_visible_blocks(q_slot, kv_slot, bq, bk, window)
  j = np.arange(seen.shape[1])[None, :]
  assert not (seen & ((j < start[:, None]) | (j >= stop[:, None]))).any()
  if exact:
    np.testing.assert_array_equal(start, seen.argmax(1))
    np.testing.assert_array_equal(stop, seen.shape[1] - seen[:, ::-1].argmax(1))


def test_a_window_visits_a_number_of_key_blocks_linear_in_the_window():
  """4096 causal tokens, 128-row blocks, window 512: each query block visits at most ceil(512/128) + 1
  key blocks (the ones the window overlaps), not up to 32 as without the window."""
  slots = np.arange(4096)
  start, stop = (np.asarray(x) for x in attention.key_block_range(slots, slots, block_q=128, block_k=128, window=512))
  i = np.arange(32)
  np.testing.assert_array_equal(stop - start, np.minimum(i, 4) + 1)
  assert (stop - start).max() <= -(-512 // 128) + 1 and (stop == i + 1).all()
  start, stop = (np.asarray(x) for x in attention.key_block_range(slots, slots, block_q=128, block_k=128))
  assert (start == 0).all() and (stop == i + 1).all()


def test_a_window_skips_the_key_blocks_before_it():
  """NaN keys and values in key block 0 (slots 0-7), window 8, 8-row blocks: query blocks 2 and 3
  (slots 16-31) never touch it, forward or backward; query blocks 0-1 and every block without the
  window do (so the NaN shows wherever a block is visited)."""
  t = 32
  q, k, v = qkv(15, 1, t, 2, 1, 4)
  k[:, :8] = np.nan
  v[:, :8] = np.nan
  seg = jnp.ones((1, t), jnp.int32)

  @functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
  def run(window, q):
    f = lambda q: attention.flash_attention(q, k, v, seg, seg, jnp.arange(t), jnp.arange(t), block_q=8, block_k=8,
                                            window=window)
    out, vjp = jax.vjp(f, q)
    return out, vjp(jnp.ones_like(out))[0]

  out, dq = (np.asarray(x) for x in run(8, q))
  assert np.isfinite(out[:, 16:]).all() and np.isfinite(dq[:, 16:]).all()
  assert np.isnan(out[:, :16]).all()
  out, dq = (np.asarray(x) for x in run(0, q))
  assert np.isnan(out[:, 16:]).all() and np.isnan(dq[:, 16:]).all()


def test_the_default_variants_trace_the_program_they_did_before():
  """window=0, softcap=0, scale=None (or the default scale given) add no op, forward and backward."""
  q, k, v = qkv(16, 1, 12, 2, 1, 8)
  seg, slots = jnp.ones((1, 12), jnp.int32), jnp.arange(12)

  def program(**variant):
    loss = lambda q, k, v: attention.flash_attention(q, k, v, seg, seg, slots, slots, block_q=4, block_k=4,
                                                     **variant).sum()
    return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v))

  base = program()
  assert program(window=0, softcap=0.0, scale=None) == base == program(scale=8 ** -0.5)
  assert "tanh" not in base and "tanh" in program(softcap=2.0)
  assert program(window=4) != base and program(scale=0.5) != base
