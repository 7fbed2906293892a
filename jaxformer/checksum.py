"""Checksums of array pytrees, computed where the arrays live: what a checkpoint records and restore verifies.

Each array gets two 32-bit sums over its elements of `fmix32(mix_k(word, position))` (murmur3's
finalizer; the word is the element's bits as an unsigned integer, the position its row-major
index). Both mixes are bijective in the word, so any single changed element changes both sums,
and any other damage (bytes flipped, swapped, zeroed) goes unnoticed with odds ~2^-64.
Integer sums modulo 2^32 do not depend on the order of addition, so the checksum of an array
is the same on any device, mesh or sharding: on GPU/TPU the global array of a multi-host job is
summed inside one `jax.jit`, each device over its own shard, with nothing gathered on a host;
for arrays on one CPU device the same sums are accumulated chunk by chunk (XLA:CPU runs that
form ~2x faster).
It is a check against accidental damage (storage, transfer, truncation), not against tampering.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

ALGORITHM = "fmix32-sum-x2-v1"  # recorded with the checksums; a checkpoint with another is not verified

_M1, _M2, _M3 = np.uint32(0x9E3779B1), np.uint32(0x27D4EB2F), np.uint32(0x165667B1)


def path_str(path):
  """`(DictKey('params'), GetAttrKey('mu'), SequenceKey(0))` -> 'params/mu/0'."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _fmix32(h):
  """murmur3's 32-bit finalizer: a bijection on uint32 that spreads every input bit."""
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x):
  """The bits of `x` as uint32 words: [*shape] (or [*shape, 2] for 64-bit dtypes)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[size])
  if size == 8:  # only with jax_enable_x64
    return jnp.stack([bits.astype(jnp.uint32), (bits >> 32).astype(jnp.uint32)], -1)
  return bits.astype(jnp.uint32)


def _mix(w, position):
  """The two per-element terms: bijective in the word `w` for each position (uint32, any shape)."""
  return _fmix32(w + position * _M1), _fmix32(w * _M2 + position * _M3)


def _sums_fused(w):
  """Both sums as reductions over the array's own shape (no reshape: a sharded array stays sharded)."""
  position = jnp.zeros(w.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(w.ndim)):  # row-major index + 1, modulo 2^32
    position = position + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * np.uint32(stride % 2 ** 32)
    stride *= w.shape[axis]
  a, b = _mix(w, position + np.uint32(1))
  return jnp.stack([jnp.sum(a, dtype=jnp.uint32), jnp.sum(b, dtype=jnp.uint32)])


def _sums_looped(w, chunk=8192):
  """The same sums, accumulated chunk by chunk into two vectors. XLA:CPU emits a reduction fused
  with integer arithmetic as a scalar loop; this form is elementwise, vectorized: ~2x faster there."""
  w = w.reshape(-1)
  if w.size == 0:
    return jnp.zeros(2, jnp.uint32)
  chunk = min(chunk, w.size)
  rows = w.size // chunk
  lane = jax.lax.iota(jnp.uint32, chunk) + np.uint32(1)

  def body(i, acc):
    start = i * chunk
    a, b = _mix(jax.lax.dynamic_slice(w, (start,), (chunk,)), lane + start.astype(jnp.uint32))
    return acc[0] + a, acc[1] + b

  zeros = jnp.zeros(chunk, jnp.uint32)
  a, b = jax.lax.fori_loop(0, rows, body, (zeros, zeros))
  tail_a, tail_b = _mix(w[rows * chunk:], jax.lax.iota(jnp.uint32, w.size - rows * chunk)
                        + np.uint32((rows * chunk + 1) % 2 ** 32))
  return jnp.stack([jnp.sum(a, dtype=jnp.uint32) + jnp.sum(tail_a, dtype=jnp.uint32),
                    jnp.sum(b, dtype=jnp.uint32) + jnp.sum(tail_b, dtype=jnp.uint32)])


def _leaf_fingerprint(x, looped):
  """(uint32[2] checksum, bool finite) of one array."""
  w = _words(x)
  sums = _sums_looped(w) if looped else _sums_fused(w)
  finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
  return sums, finite


@functools.partial(jax.jit, static_argnums=1)
def _fingerprints(leaves, looped):
  """uint32[n, 2] checksums and bool[n] finiteness of a list of arrays: one program per tree."""
  out = [_leaf_fingerprint(x, looped) for x in leaves]
  return jnp.stack([s for s, _ in out]), jnp.stack([f for _, f in out])


def fingerprint(tree):
  """({path: 16-hex-digit checksum}, [paths of arrays holding NaN or inf]) of a pytree of arrays.

  One jitted pass over every array where it lives (one small device-to-host copy); paths are
  `path_str` of the tree paths ('params/decoder/layer_0/ffn/wi/kernel', 'opt_state/0/mu/...').
  """
  with_path = jax.tree_util.tree_leaves_with_path(tree)
  if not with_path:
    return {}, []
  leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in with_path]
  # The chunked form reshapes each array to one dimension: only for unsharded arrays on a CPU.
  one_cpu = all(len(x.devices()) == 1 and next(iter(x.devices())).platform == "cpu" for x in leaves)
  sums, finite = _fingerprints(leaves, one_cpu)
  sums, finite = np.asarray(sums), np.asarray(finite)
  paths = [path_str(p) for p, _ in with_path]
  return ({p: f"{int(a):08x}{int(b):08x}" for p, (a, b) in zip(paths, sums)},
          [p for p, ok in zip(paths, finite) if not ok])
