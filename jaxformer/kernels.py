"""The backend kernels behind layers.dot_product_attention: Pallas splash attention on TPU, cuDNN on GPU.

Each kernel has a `*_supported(...)` check that returns None when the kernel can run the
call, else a one-line reason (the dispatcher logs it and runs the tiled JAX kernel instead),
and the call itself. Shapes follow `layers.dot_product_attention`: q [batch, q_len, heads,
head_dim]; k, v [batch, kv_len, kv_heads, head_dim] with heads a multiple of kv_heads.
Segment ids [batch, len] int: a query sees a key of its own segment; 0 is padding.

Neither kernel has run on its device in this project yet (no TPU or GPU here): splash is
checked on CPU in Pallas' interpret mode, cuDNN only by the arguments it is given
(tests/test_kernels.py).

Variants (as `jaxformer.attention`): `scale` replaces head_dim^-0.5 (folded into q for
splash, jax.nn's `scale` for cuDNN); a sliding window w (causal only: a query sees keys
with q - w < k <= q); logit soft-capping c * tanh(logits / c) of the scaled logits.
What the installed JAX (0.10.2) was read to say:
- splash (jax/experimental/pallas/ops/tpu/splash_attention/splash_attention_mask.py):
  `LocalMask(shape, window_size=(left, right), offset)` keeps q + offset - left <= k and
  k <= q + offset + right, so window_size=(w - 1, 0), offset 0 is exactly q - k < w and
  k <= q (causal with the window; no CausalMask needed on top). splash_attention_kernel.py:
  `make_splash_mha/mqa(..., attn_logits_soft_cap=c)` applies c * tanh(qk / c) to the raw
  q.k (the kernel has no scale of its own, we fold it into q) before the mask, and the dq
  and dkv kernels multiply by 1 - tanh^2: the order transformers' Gemma2 uses.
- cuDNN (jax/_src/nn/functions.py, `dot_product_attention`): `local_window_size=(left,
  right)` on implementation="cudnn" becomes `sliding_window_length = left + 1` when right
  is 0 or the mask is causal, and jax/_src/cudnn/fused_attention_stablehlo.py documents
  that as the window (pos - sliding_window_length, pos]; the XLA path masks q - k <= left
  and k - q <= right. So (w - 1, 0) with is_causal is q - k < w on both. `scale` is passed
  through to cuDNN's fmha scale. Neither file has any logit soft-capping.
"""

import concurrent.futures
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxformer import sharding

# Splash's tiles: a block must be a multiple of the TPU's 128 lanes and divide the length.
# Bigger blocks mean fewer grid steps (each has a fixed cost); 512 is the largest its
# tests exercise in the forward pass.
SPLASH_BLOCKS = (512, 256, 128)
_LANES = 128


def _block(n):
  """The largest of SPLASH_BLOCKS that divides n (None if none does)."""
  return next((b for b in SPLASH_BLOCKS if n % b == 0), None)


def _mesh_axes(mesh, logical):
  """The mesh axes that sharding.RULES maps `logical` to, restricted to those `mesh` has."""
  axes = dict(sharding.RULES)[logical]
  axes = axes if isinstance(axes, tuple) else (axes,) if axes else ()
  return tuple(a for a in axes if a in mesh.axis_names)


def _mesh_size(mesh, axes):
  return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def _current_mesh():
  """The mesh `sharding.use_mesh` made current (an empty AbstractMesh when there is none)."""
  return jax.sharding.get_abstract_mesh()


# ----------------------------------------------------------------------------- TPU: splash

def splash_supported(q_shape, kv_shape, dtype, *, causal, has_bias=False, dropout=False, decode=False,
                     backend=None, mesh=None, window=0, softcap=0.0):
  """None if splash attention can run this call, else the reason it cannot.

  q_shape [batch, q_len, heads, head_dim], kv_shape [batch, kv_len, kv_heads, head_dim];
  `backend` defaults to jax.default_backend() ("tpu" for the compile-only TPU targets is
  the caller's to pass); `mesh` defaults to the current one (its data x fsdp axes must
  divide the batch and its tensor axis the heads, as sharding.RULES splits them).
  window > 0: a sliding window (LocalMask; causal only); softcap > 0: logit soft-capping
  (splash's attn_logits_soft_cap), supported as such.
  """
  b, t, h, d = q_shape
  s, kvh = kv_shape[1], kv_shape[2]
  backend = backend or jax.default_backend()
  mesh = _current_mesh() if mesh is None else mesh
  if backend != "tpu":
    return f"splash attention is a TPU kernel (backend is {backend})"
  if dropout:
    return "attention dropout (splash has none)"
  if has_bias:
    return "an additive bias such as ALiBi (splash takes masks only)"
  if decode:
    return "decoding through the KV cache (its slots are filled at run time; splash masks are static)"
  if t == 1:
    return "one query (decode): splash tiles queries in blocks of 128"
  if d % _LANES:
    return f"head_dim {d} is not a multiple of {_LANES}"
  if t % _LANES or s % _LANES:
    return f"lengths q {t}, kv {s} are not multiples of {_LANES}"
  if causal and t != s:
    return f"causal attention with q_len {t} != kv_len {s}"
  if window and not causal:
    return f"a sliding window ({window}) without the causal mask (splash's LocalMask counts rows, not slots)"
  if window < 0 or softcap < 0:
    return f"window {window}, softcap {softcap}: expected >= 0"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
    return f"dtype {jnp.dtype(dtype).name} (splash takes float32 or bfloat16)"
  if h % kvh:
    return f"{h} heads are not a multiple of {kvh} kv heads"
  if mesh is not None and mesh.axis_names:
    batch_shards = _mesh_size(mesh, _mesh_axes(mesh, "batch"))
    head_shards = _mesh_size(mesh, _mesh_axes(mesh, "heads"))
    if b % batch_shards:
      return f"batch {b} does not split over {batch_shards} data x fsdp devices"
    if h % head_shards or (kvh > 1 and kvh % head_shards):
      return f"{h} heads / {kvh} kv heads do not split over {head_shards} tensor devices"
  return None


def splash_block_sizes(q_len, kv_len):
  """BlockSizes for the forward and both backward kernels, from the lengths (multiples of 128)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # pylint: disable=g-import-not-at-top
  bq, bkv = _block(q_len), _block(kv_len)
  return sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                       block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                       block_q_dq=bq, block_kv_dq=bkv)


def splash_mask(q_len, kv_len, causal, window=0):
  """One head's splash mask [q_len, kv_len] (lazy; index it for numpy): full, causal, or with window > 0
  the causal window q - window < k <= q (LocalMask(window_size=(window - 1, 0)) keeps
  q - (window - 1) <= k <= q, causal by itself; splash_supported wants causal with a window)."""
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # pylint: disable=g-import-not-at-top
  if window:
    return sa.LocalMask((q_len, kv_len), window_size=(window - 1, 0), offset=0)
  return sa.CausalMask((q_len, kv_len)) if causal else sa.FullMask((q_len, kv_len))


@functools.lru_cache(maxsize=64)
def _splash_kernel(heads, q_len, kv_len, causal, mqa, interpret, window=0, softcap=0.0):
  """The splash kernel for one example: q [heads, q_len, d] against k, v [kv_heads|-, kv_len, d].

  Built once per shape and variant: the mask's block structure (which tiles are empty,
  full or partial, so causal attention skips the upper triangle and a window the tiles
  before it) is worked out in numpy here.
  """
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # pylint: disable=g-import-not-at-top
  mask = sa.MultiHeadMask([splash_mask(q_len, kv_len, causal, window)] * heads)
  make = sa.make_splash_mqa if mqa else sa.make_splash_mha
  cap = {"attn_logits_soft_cap": float(softcap)} if softcap else {}
  # Its block tables become arrays: concrete ones, so the cached kernel holds no tracer of the trace
  # that first built it. Built in a thread of its own: JAX's trace state and the mesh context are
  # per thread, so the tables land on the host's default device even while a step is traced for a
  # TPU that is only a compile target (benchmarks/aot_compile.py), where staging them under the
  # step's mesh would need to run a program on that TPU.
  def build():
    return make(mask, block_sizes=splash_block_sizes(q_len, kv_len), head_shards=1, q_seq_shards=1,
                interpret=interpret, **cap)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(build).result()


def splash_attention(q, k, v, q_segment=None, kv_segment=None, *, causal, interpret=False, window=0, softcap=0.0,
                     scale=None):
  """softmax(cap(scale * q k^T)) v by Pallas splash attention: -> [batch, q_len, heads, head_dim].

  q [batch, q_len, heads, head_dim]; k, v [batch, kv_len, kv_heads, head_dim]; q_segment
  [batch, q_len], kv_segment [batch, kv_len] int or None (one segment). Check
  `splash_supported` first. scale: None is head_dim^-0.5; window > 0 (causal only): a query
  at row i sees keys i - window < j <= i; softcap > 0: the scaled logits x become
  softcap * tanh(x / softcap) before the mask. Under a mesh (`sharding.use_mesh`) it runs inside `shard_map`
  with the batch over data x fsdp and the heads over tensor, the layout sharding.RULES
  gives these activations, so no array is regathered. GQA runs the multi-head kernel,
  which maps query head i to kv head i // (heads // kv_heads) (layers' grouping); MQA
  (one kv head) the MQA kernel; k and v are never repeated.

  Padding: splash masks by segment equality only, so a padding query (segment 0) sees
  the padding keys where the dense mask shows it nothing; those rows' outputs are unused
  (the loss weights them 0) and every other row is the same.
  """
  b, t, h, d = q.shape
  s, kvh = k.shape[1], k.shape[2]
  mqa = kvh == 1
  if window and not causal:
    raise ValueError(f"window={window} needs causal=True (splash_supported says so)")
  # Splash's operands are head-major per example, [heads, len, head_dim]; the softmax
  # scale is not applied by the kernel, so it is folded into q (as layers does): its soft
  # cap then applies to the scaled logits.
  q = (q * jnp.asarray(d ** -0.5 if scale is None else scale, q.dtype)).transpose(0, 2, 1, 3)
  k, v = (x[:, :, 0] if mqa else x.transpose(0, 2, 1, 3) for x in (k, v))
  segmented = q_segment is not None or kv_segment is not None
  if segmented:
    q_segment = jnp.ones((b, t), jnp.int32) if q_segment is None else q_segment.astype(jnp.int32)
    kv_segment = jnp.ones((b, s), jnp.int32) if kv_segment is None else kv_segment.astype(jnp.int32)

  def local(q, k, v, q_segment, kv_segment):
    """One device's share: q [b', h', t, d] -> out [b', h', t, d]."""
    kernel = _splash_kernel(q.shape[1], t, s, causal, mqa, interpret, int(window), float(softcap))
    if not segmented:
      return jax.vmap(kernel)(q, k, v)
    return jax.vmap(lambda *a: kernel(*a[:3], a[3]))(q, k, v, _segment_ids(q_segment, kv_segment))

  mesh = _current_mesh()
  if mesh.axis_names and mesh.size > 1:
    batch, heads = _mesh_axes(mesh, "batch") or None, _mesh_axes(mesh, "heads") or None
    qspec = P(batch, heads, None, None)
    kvspec = P(batch, None, None) if mqa else qspec  # one kv head: every tensor shard needs it
    segspec = P(batch, None)
    args = (q, k, v) + ((q_segment, kv_segment) if segmented else ())
    specs = (qspec, kvspec, kvspec) + ((segspec, segspec) if segmented else ())
    # check_vma off: pallas_call's outputs carry no varying-axes annotation to check.
    fn = jax.shard_map(lambda *a: local(*a, *([None] * (5 - len(a)))), mesh=mesh, in_specs=specs,
                       out_specs=qspec, check_vma=False)
    out = fn(*args)
  else:
    out = local(q, k, v, q_segment, kv_segment)
  return out.transpose(0, 2, 1, 3)


def _segment_ids(q_segment, kv_segment):
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # pylint: disable=g-import-not-at-top
  return sa.SegmentIds(q_segment, kv_segment)


# ----------------------------------------------------------------------------- GPU: cuDNN

def cudnn_supported(q_shape, kv_shape, dtype, *, causal, segments="none", has_bias=False, dropout=False,
                    decode=False, backend=None, compute_capability=None, window=0, softcap=0.0):
  """None if cuDNN flash attention (through jax.nn.dot_product_attention) can run this call, else why not.

  The constraints are those of the installed JAX (0.10.2): jax/_src/nn/functions.py takes
  per-row query/key lengths but no segment ids, and jax/_src/cudnn/fused_attention_stablehlo.py
  (`check_layout`, `check_is_flash_attention`) wants fp16/bf16 and head_dim a multiple of 8
  and at most 128 (256 from compute capability 9.0, Hopper). `segments`: "none" (every
  token valid), "padding" (each row one sequence, then padding: segment ids 1...1 0...0)
  or "packed" (several documents per row). `compute_capability` ("9.0") defaults to the
  first GPU's; 128 is the head_dim limit when it is unknown. window > 0: a causal sliding
  window (local_window_size); softcap > 0 is refused (jax.nn.dot_product_attention has none).
  """
  t, h, d = q_shape[1], q_shape[2], q_shape[3]
  s, kvh = kv_shape[1], kv_shape[2]
  backend = backend or jax.default_backend()
  if backend != "gpu":
    return f"cuDNN is a GPU kernel (backend is {backend})"
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
    return f"dtype {jnp.dtype(dtype).name}: cuDNN flash attention takes float16/bfloat16 (model.dtype=bfloat16)"
  if dropout:
    return "attention dropout (jax.nn.dot_product_attention has none)"
  if has_bias:
    return "an additive bias such as ALiBi (cuDNN would read it as a dense [batch, heads, q, kv] array)"
  if softcap:
    return f"logit soft-capping ({softcap}): jax.nn.dot_product_attention's cuDNN call has none"
  if window and not causal:
    return f"a sliding window ({window}) without the causal mask (cuDNN's window is left of each row)"
  if window < 0:
    return f"window {window}: expected >= 0"
  if segments == "packed":
    return "packed documents: jax.nn.dot_product_attention's cuDNN call takes only one length per row"
  if segments not in ("none", "padding"):
    raise ValueError(f"segments={segments!r}: expected none, padding or packed")
  if decode:
    return "decoding through the KV cache (its valid slots are not a prefix length per row)"
  if causal and t != s:
    return f"causal attention with q_len {t} != kv_len {s}"
  if compute_capability is None and backend == "gpu":
    compute_capability = getattr(jax.devices()[0], "compute_capability", None)
  hopper = compute_capability is not None and tuple(int(x) for x in str(compute_capability).split(".")) >= (9, 0)
  limit = 256 if hopper else 128
  if d % 8 or d > limit:
    return f"head_dim {d}: cuDNN wants a multiple of 8, at most {limit}"
  if h % kvh:
    return f"{h} heads are not a multiple of {kvh} kv heads"
  return None


def cudnn_arguments(q_segment=None, kv_segment=None, *, causal, window=0, scale=None):
  """The keyword arguments for jax.nn.dot_product_attention(q, k, v, implementation="cudnn", ...).

  Padding becomes per-row lengths (the count of non-zero segment ids, int32 [batch], which
  assumes the valid tokens come first: segments="padding") and causality `is_causal`, so
  cuDNN builds its masks itself and no dense [q, kv] mask or bias exists. window > 0:
  local_window_size (window - 1, 0), i.e. q - window < k <= q (cuDNN's sliding_window_length
  = window); scale: the logits' scale (None: jax's default, head_dim^-0.5).
  """
  args = dict(is_causal=causal)
  if window:
    args["local_window_size"] = (int(window) - 1, 0)
  if scale is not None:
    args["scale"] = float(scale)
  if q_segment is not None:
    args["query_seq_lengths"] = jnp.sum(q_segment != 0, axis=-1).astype(jnp.int32)
  if kv_segment is not None:
    args["key_value_seq_lengths"] = jnp.sum(kv_segment != 0, axis=-1).astype(jnp.int32)
  return args


def cudnn_rows_ok(q_segment, kv_segment):
  """Whether cuDNN's per-row lengths describe these segment ids -> bool scalar (traced).

  True when every row is one sequence (the same non-zero id in q and kv) followed only by
  padding (0), and no row is all padding; packed rows (several documents) are not.
  """
  def prefix(seg, first):
    length = jnp.sum(seg != 0, axis=-1, keepdims=True)
    inside = jnp.arange(seg.shape[-1])[None] < length
    return jnp.all(seg == jnp.where(inside, first, 0)) & jnp.all(length > 0)
  first = q_segment[:, :1]
  return prefix(q_segment, first) & prefix(kv_segment, first)


def cudnn_attention(q, k, v, q_segment=None, kv_segment=None, *, causal, window=0, scale=None):
  """cuDNN flash attention: q [batch, q_len, heads, head_dim], k, v [batch, kv_len, kv_heads, head_dim]
  in fp16/bf16 -> [batch, q_len, heads, head_dim]. Check `cudnn_supported` first; window and
  scale as `cudnn_arguments`.

  Untested on a GPU in this project (none here): the arguments are checked by running
  the same call with implementation="xla" (tests/test_kernels.py).
  """
  return jax.nn.dot_product_attention(q, k, v, implementation="cudnn",
                                      **cudnn_arguments(q_segment, kv_segment, causal=causal, window=window,
                                                        scale=scale))
