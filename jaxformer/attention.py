"""Tiled attention (FlashAttention-2) in plain JAX: memory linear in the length, on every backend.

softmax(cap(scale * q k^T) + ALiBi) v is computed one [query block, key block] tile at a
time with the online softmax of FlashAttention (Dao et al. 2022; FlashAttention-2, Dao
2023): per query row a running maximum `m`, a running sum `l` of exp(logit - m) and an
accumulator of the weighted values, rescaled whenever the maximum grows. No [q_len,
kv_len] array exists, not even the mask: each tile's mask comes from segment ids and
slots, its ALiBi bias from positions. A `jax.custom_vjp` saves only the output and the
log-sum-exp per row and recomputes each tile in the backward pass (FlashAttention-2's
algorithm 2), so training memory is linear in the length too.

The loops are `lax.map` over query blocks and a `lax.fori_loop` over key blocks whose
upper bound comes from the slots: key blocks entirely after a query block's last slot
(causal attention above the diagonal; a KV cache's unwritten slots) are never visited.
With a sliding window the lower bound does the same for the key blocks entirely before
the window, so the cost is linear in the window, not the length (`key_block_range`).
The program size does not depend on the length, so neither does the compile time.

Variants (Gemma 2, Mistral): `scale` replaces head_dim^-0.5; `softcap` c > 0 turns the
scaled logits x into c * tanh(x / c) before ALiBi and the mask, as transformers' Gemma2
does (the backward multiplies by its derivative 1 - tanh(x / c)^2); `window` w > 0 hides
a key unless q_slot - kv_slot < w (a query sees itself and w - 1 earlier slots:
transformers' sliding_window). Without them the program is the one traced before they existed.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

# Masked logits: a large finite negative, as in layers (a row with no visible key then has
# m = _MASK_VALUE and l = 0 instead of NaN; its output is 0).
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_MAX_BLOCK = 512  # rows per tile: [b, heads, 512, 512] float32 logits is 1 MiB per head and batch row


def block_size(n, max_block=_MAX_BLOCK):
  """Rows per block for a length n: the fewest blocks of at most max_block rows, each a multiple of 8."""
  blocks = -(-n // max_block)
  return -(-(-(-n // blocks)) // 8) * 8


_INT32_MIN, _INT32_MAX = int(np.iinfo(np.int32).min), int(np.iinfo(np.int32).max)


def _pad(x, n, axis, value=0):
  """x padded at the end of `axis` to n entries of `value`."""
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, n - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)


def _blocked_slots(q_slot, kv_slot, bq, bk, nq, nk):
  """Slots in blocks: q [nq, bq] (padding -1: sees nothing), kv [nk, bk] (padding int32 max: never visible)."""
  q_sl = _pad(jnp.asarray(q_slot, jnp.int32), nq * bq, 0, -1).reshape(nq, bq)
  kv_sl = _pad(jnp.asarray(kv_slot, jnp.int32), nk * bk, 0, _INT32_MAX).reshape(nk, bk)
  return q_sl, kv_sl


def _key_blocks(q_sl, kv_sl, t, s, window):
  """Per query block, the key blocks that may hold a visible key -> (start [nq] or None, stop [nq]).

  Key block j may be visible to query block i when min(kv slots of j) <= max(q slots of i)
  and, with a window, max(kv slots of j) > min(q slots of i) - window. Per-block min/max, so
  unsorted slots (a ring-buffer KV cache) give a conservative, still correct range.
  """
  nq, bq = q_sl.shape
  nk, bk = kv_sl.shape
  # The padding values are already neutral here: -1 never raises a query block's max, int32 max
  # never lowers a key block's min.
  visible = kv_sl.min(1)[None, :] <= q_sl.max(1)[:, None]                    # [nq, nk]
  if not window:
    # Query block i needs key blocks [0, last block with a slot <= its largest slot].
    return None, jnp.max(jnp.where(visible, jnp.arange(1, nk + 1)[None, :], 0), axis=1)
  # Here they are not (-1 would lower a query block's min, widening the range; int32 max would
  # raise a key block's max past the window): the window's bounds read real rows only.
  q_real = (jnp.arange(nq * bq) < t).reshape(nq, bq)
  kv_real = (jnp.arange(nk * bk) < s).reshape(nk, bk)
  q_min = jnp.where(q_real, q_sl, _INT32_MAX).min(1)
  kv_max = jnp.where(kv_real, kv_sl, _INT32_MIN).max(1)
  visible = visible & (kv_max[None, :] > q_min[:, None] - window)
  stop = jnp.max(jnp.where(visible, jnp.arange(1, nk + 1)[None, :], 0), axis=1)
  start = jnp.min(jnp.where(visible, jnp.arange(nk)[None, :], nk), axis=1)
  return jnp.minimum(start, stop), stop  # no visible block: an empty range


def key_block_range(q_slot, kv_slot, *, block_q=None, block_k=None, window=0):
  """The key blocks `flash_attention` visits per query block -> (start, stop), int32 [num_q_blocks].

  q_slot [q_len], kv_slot [kv_len] int; blocks as flash_attention picks them (or given).
  Query block i runs key blocks start[i] <= j < stop[i]; start is 0 without a window.
  """
  t, s = len(q_slot), len(kv_slot)
  bq, bk = block_q or block_size(t), block_k or block_size(s)
  nq, nk = -(-t // bq), -(-s // bk)
  start, stop = _key_blocks(*_blocked_slots(q_slot, kv_slot, bq, bk, nq, nk), t, s, window)
  return (jnp.zeros_like(stop) if start is None else start), stop


def flash_attention(q, k, v, q_segment, kv_segment, q_slot=None, kv_slot=None, *, alibi_slopes=None,
                    q_position=None, kv_position=None, causal=False, matmul_dtype="float32",
                    block_q=None, block_k=None, window=0, softcap=0.0, scale=None):
  """Tiled softmax(cap(scale * q k^T) + ALiBi) v; arguments as `layers.dot_product_attention`.

  q [batch, q_len, heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim] (GQA/MQA:
  the heads sharing a kv head are stacked as rows of one product, k and v never repeated);
  q_segment [batch, q_len], kv_segment [batch, kv_len]; q_slot [q_len], kv_slot [kv_len] or
  None (no causal mask); alibi_slopes [heads] with q_position / kv_position [batch, len].
  Returns [batch, q_len, heads, head_dim] in q's dtype; a query that sees no key gets 0.
  Lengths need not divide the blocks: they are padded with segment 0 (invisible) here.
  `causal` is implied by the slots (the skipping follows them), accepted for the signature.
  Static variants: scale (None: head_dim^-0.5); softcap > 0: logits c * tanh(logits / c)
  after the scale, before ALiBi and the mask; window > 0 (needs slots): a key is visible
  only when q_slot - kv_slot < window too, and key blocks before the window are skipped.
  """
  del causal
  if window and q_slot is None:
    raise ValueError(f"window={window} needs slots (q_slot, kv_slot): the window is counted in slots")
  if window < 0 or softcap < 0:
    raise ValueError(f"window={window}, softcap={softcap}: expected >= 0 (0 is off)")
  b, t, h, d = q.shape
  s, kvh = k.shape[1], k.shape[2]
  g = h // kvh
  bq, bk = block_q or block_size(t), block_k or block_size(s)
  nq, nk = -(-t // bq), -(-s // bk)
  has_slots, has_alibi = q_slot is not None, alibi_slopes is not None

  # Blocked, head-major operands: q [nq, b, kvh, g * bq, d], k and v [nk, b, kvh, bk, d]; the
  # scale is folded into q (outside the custom_vjp, so JAX differentiates it).
  scaled = q * jnp.asarray(d ** -0.5 if scale is None else scale, q.dtype)
  qs = _pad(scaled, nq * bq, 1).reshape(b, nq, bq, kvh, g, d)
  qs = qs.transpose(1, 0, 3, 4, 2, 5).reshape(nq, b, kvh, g * bq, d)
  ks, vs = (_pad(x, nk * bk, 1).reshape(b, nk, bk, kvh, d).transpose(1, 0, 3, 2, 4) for x in (k, v))
  q_seg = _pad(q_segment.astype(jnp.int32), nq * bq, 1).reshape(b, nq, bq).transpose(1, 0, 2)
  kv_seg = _pad(kv_segment.astype(jnp.int32), nk * bk, 1).reshape(b, nk, bk).transpose(1, 0, 2)
  if has_slots:  # padded queries look at nothing (slot -1), padded keys are never reached
    q_sl, kv_sl = _blocked_slots(q_slot, kv_slot, bq, bk, nq, nk)
    start, stop = _key_blocks(q_sl, kv_sl, t, s, window)   # start None without a window: loops from 0
  else:
    q_sl, kv_sl = jnp.zeros((nq, bq), jnp.int32), jnp.zeros((nk, bk), jnp.int32)
    start, stop = None, jnp.full((nq,), nk, jnp.int32)
  if has_alibi:
    q_pos = _pad(q_position.astype(jnp.int32), nq * bq, 1).reshape(b, nq, bq).transpose(1, 0, 2)
    kv_pos = _pad(kv_position.astype(jnp.int32), nk * bk, 1).reshape(b, nk, bk).transpose(1, 0, 2)
    slopes = jnp.asarray(alibi_slopes, jnp.float32).reshape(kvh, g)
  else:
    q_pos, kv_pos, slopes = q_seg, kv_seg, jnp.zeros((kvh, g), jnp.float32)
  dtype = jnp.bfloat16 if matmul_dtype == "bfloat16" or q.dtype == jnp.bfloat16 else jnp.float32
  meta = _Meta(has_slots, has_alibi, np.dtype(dtype).name, g, int(window), float(softcap))
  out = _flash(meta, qs, ks, vs, q_seg, kv_seg, q_sl, kv_sl, q_pos, kv_pos, slopes, start, stop)
  out = out.reshape(nq, b, kvh, g, bq, d).transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * bq, h, d)
  return out[:, :t].astype(q.dtype)


class _Meta(tuple):
  """Static facts of a call: (has_slots, has_alibi, matmul dtype name, query heads per kv head, window, softcap)."""

  def __new__(cls, *args):
    return super().__new__(cls, args)


def _dot(spec, a, b, dtype):
  """A tile's product on `dtype` operands, accumulated in float32."""
  return jnp.einsum(spec, a.astype(dtype), b.astype(dtype), preferred_element_type=jnp.float32)


def _tile(meta, q_i, k_j, ids_i, ids_j, slopes):
  """Logits [b, kvh, g, bq, bk] of query block q_i [b, kvh, g*bq, d] (scaled) against key block k_j
  [b, kvh, bk, d], soft-capped, with ALiBi and masked (finite _MASK_VALUE); the mask [b, 1, 1, bq, bk];
  and tanh(logits / softcap) [b, kvh, g, bq, bk] for the backward (None without soft-capping)."""
  has_slots, has_alibi, dtype, g, window, softcap = meta
  (seg_i, slot_i, pos_i), (seg_j, slot_j, pos_j) = ids_i, ids_j
  b, kvh, rows, _ = q_i.shape
  logits = _dot("bkrd,bksd->bkrs", q_i, k_j, dtype).reshape(b, kvh, g, rows // g, -1)
  capped = None
  if softcap:  # Gemma 2: scale, cap, then bias and mask
    capped = jnp.tanh(logits / softcap)
    logits = softcap * capped
  mask = (seg_i[:, :, None] == seg_j[:, None, :]) & (seg_j[:, None, :] != 0)           # [b, bq, bk]
  if has_slots:
    mask = mask & (slot_j[None, None, :] <= slot_i[None, :, None])
    if window:  # kv > q - window, i.e. q - kv < window; padding (-1, int32 max) stays invisible by the line above
      mask = mask & (slot_j[None, None, :] > (slot_i - window)[None, :, None])
  if has_alibi:  # -slope * |i - j|, per tile from positions
    distance = jnp.abs(pos_i[:, :, None] - pos_j[:, None, :]).astype(jnp.float32)
    logits = logits - slopes[None, :, :, None, None] * distance[:, None, None]
  mask = mask[:, None, None]
  return jnp.where(mask, logits, _MASK_VALUE), mask, capped


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(meta, q, k, v, q_seg, kv_seg, q_sl, kv_sl, q_pos, kv_pos, slopes, start, stop):
  return _flash_fwd(meta, q, k, v, q_seg, kv_seg, q_sl, kv_sl, q_pos, kv_pos, slopes, start, stop)[0]


def _flash_fwd(meta, q, k, v, q_seg, kv_seg, q_sl, kv_sl, q_pos, kv_pos, slopes, start, stop):
  """Forward: out [nq, b, kvh, g*bq, d] and the residuals (inputs, out, log-sum-exp per row).
  start, stop [nq]: the key blocks each query block visits (start None: from 0)."""
  dtype = meta[2]

  def one_block(args):
    q_i, seg_i, sl_i, pos_i, start_i, stop_i = args
    b, kvh, rows, d = q_i.shape
    g, bq = meta[3], rows // meta[3]

    def step(j, carry):
      m, l, acc = carry                         # [b, kvh, g, bq], same, [b, kvh, g, bq, d]
      logits, mask, _ = _tile(meta, q_i, k[j], (seg_i, sl_i, pos_i), (kv_seg[j], kv_sl[j], kv_pos[j]), slopes)
      m_new = jnp.maximum(m, logits.max(-1))
      p = jnp.where(mask, jnp.exp(logits - m_new[..., None]), 0.0)   # masked keys add exactly 0
      rescale = jnp.exp(m - m_new)              # earlier blocks were summed against a smaller maximum
      pv = _dot("bkrs,bksd->bkrd", p.reshape(b, kvh, rows, -1), v[j], dtype).reshape(b, kvh, g, bq, d)
      return m_new, l * rescale + p.sum(-1), acc * rescale[..., None] + pv

    init = (jnp.full((b, kvh, g, bq), _MASK_VALUE, jnp.float32), jnp.zeros((b, kvh, g, bq), jnp.float32),
            jnp.zeros((b, kvh, g, bq, d), jnp.float32))
    m, l, acc = jax.lax.fori_loop(0 if start_i is None else start_i, stop_i, step, init)
    l_safe = jnp.where(l == 0.0, 1.0, l)       # a row that saw no key: output 0, not NaN
    return (acc / l_safe[..., None]).reshape(b, kvh, rows, d), (m + jnp.log(l_safe)).reshape(b, kvh, rows)

  out, lse = jax.lax.map(one_block, (q, q_seg, q_sl, q_pos, start, stop))
  out = out.astype(q.dtype)
  return out, (q, k, v, q_seg, kv_seg, q_sl, kv_sl, q_pos, kv_pos, slopes, start, stop, out, lse)


def _flash_bwd(meta, res, d_out):
  """Backward: per query block, revisit its key blocks, rebuild p = exp(logits - lse) and
  accumulate dq for the block and dk, dv for every key block it saw (FlashAttention-2)."""
  q, k, v, q_seg, kv_seg, q_sl, kv_sl, q_pos, kv_pos, slopes, start, stop, out, lse = res
  dtype = meta[2]
  g = meta[3]

  def one_block(carry, args):
    dk, dv = carry                              # [nk, b, kvh, bk, d] float32, written block by block
    q_i, seg_i, sl_i, pos_i, start_i, stop_i, do_i, o_i, lse_i = args
    b, kvh, rows, d = q_i.shape
    do_i = do_i.astype(jnp.float32)
    delta = jnp.sum(do_i * o_i.astype(jnp.float32), -1)   # rowsum(dO * O) = sum_j p_ij dp_ij

    def step(j, inner):
      dq, dk, dv = inner
      logits, mask, capped = _tile(meta, q_i, k[j], (seg_i, sl_i, pos_i), (kv_seg[j], kv_sl[j], kv_pos[j]), slopes)
      p = jnp.where(mask, jnp.exp(logits - lse_i.reshape(b, kvh, g, -1)[..., None]), 0.0).reshape(b, kvh, rows, -1)
      dp = _dot("bkrd,bksd->bkrs", do_i, v[j], dtype)
      ds = p * (dp - delta[..., None])          # softmax's Jacobian applied to dp
      if capped is not None:                    # through c * tanh(x / c): times 1 - tanh^2
        ds = ds * (1.0 - jnp.square(capped)).reshape(ds.shape)
      dq = dq + _dot("bkrs,bksd->bkrd", ds, k[j], dtype)
      dk = dk.at[j].add(_dot("bkrs,bkrd->bksd", ds, q_i, dtype))
      dv = dv.at[j].add(_dot("bkrs,bkrd->bksd", p, do_i, dtype))
      return dq, dk, dv

    dq, dk, dv = jax.lax.fori_loop(0 if start_i is None else start_i, stop_i, step,
                                   (jnp.zeros((b, kvh, rows, d), jnp.float32), dk, dv))
    return (dk, dv), dq

  zeros = jnp.zeros(k.shape, jnp.float32)
  (dk, dv), dq = jax.lax.scan(one_block, (zeros, zeros), (q, q_seg, q_sl, q_pos, start, stop, d_out, out, lse))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)) + (None,) * 9


_flash.defvjp(_flash_fwd, _flash_bwd)
