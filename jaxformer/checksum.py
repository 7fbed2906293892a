"""Checksums of array pytrees, computed where the arrays live: what a checkpoint records and restore verifies.

Each array gets two 32-bit sums over its elements of `fmix32(mix_k(word, position))` (murmur3's
finalizer; the word is the element's bits as an unsigned integer, the position its row-major
index + 1). Both mixes are bijective in the word, so any single changed element changes both
sums, and other damage (bytes flipped, swapped, zeroed) goes unnoticed only by a coincidence of
odds ~2^-64. Integer sums modulo 2^32 do not depend on the order of addition, so an array's
checksum is the same on any device, mesh or sharding, and is computed where the array is:

- on GPU/TPU (and arrays spread over several processes), by a jitted reduction per array: each
  device sums its own shard, a multi-host array is never gathered, and one small program per
  distinct shape is compiled;
- on CPU devices of this process, with numpy on the array's memory (a sharded array is read
  whole), in chunks of 128k elements, one thread per core (XLA:CPU runs an integer reduction
  fused with arithmetic as a scalar loop, ~4x slower, and would compile a program per shape).

It is a check against accidental damage (storage, transfer, truncation), not against tampering.
"""

import concurrent.futures
import os

import jax
import jax.numpy as jnp
import numpy as np

ALGORITHM = "fmix32-sum-x2-v1"  # recorded with the checksums; a checkpoint with another is not verified

_M1, _M2, _M3 = np.uint32(0x9E3779B1), np.uint32(0x27D4EB2F), np.uint32(0x165667B1)
_F1, _F2 = np.uint32(0x85EBCA6B), np.uint32(0xC2B2AE35)
_CHUNK = 1 << 17  # host path: elements per step (a few cache-sized temporaries)


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
  h = h * _F1
  h = h ^ (h >> 13)
  h = h * _F2
  return h ^ (h >> 16)


def _mix(w, position):
  """The two per-element terms, each bijective in the word `w` for a given position (uint32)."""
  return _fmix32(w + position * _M1), _fmix32(w * _M2 + position * _M3)


def _words(x):
  """The bits of a jax array `x` as uint32 words: [*shape] (or [*shape, 2] for 64-bit dtypes)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  size = jnp.dtype(x.dtype).itemsize
  bits = jax.lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[size])
  if size == 8:  # only with jax_enable_x64
    return jnp.stack([bits.astype(jnp.uint32), (bits >> 32).astype(jnp.uint32)], -1)
  return bits.astype(jnp.uint32)


@jax.jit
def _device_fingerprint(x):
  """(uint32[2] sums, bool finite) of one array, as reductions over its own shape (no reshape:
  a sharded array stays sharded)."""
  w = _words(x)
  position = jnp.ones(w.shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(w.ndim)):  # row-major index + 1, modulo 2^32
    position = position + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * np.uint32(stride % 2 ** 32)
    stride *= w.shape[axis]
  a, b = _mix(w, position)
  finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.bool_(True)
  return jnp.stack([jnp.sum(a, dtype=jnp.uint32), jnp.sum(b, dtype=jnp.uint32)]), finite


def _host_words(x):
  """The bits of a numpy array as uint32 words, flat (a view when they are 32-bit already)."""
  x = np.ascontiguousarray(x).reshape(-1)
  if x.dtype == np.bool_:
    return x.view(np.uint8)
  size = x.dtype.itemsize
  bits = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size])
  if size == 8:
    return np.stack([(bits & 0xFFFFFFFF).astype(np.uint32), (bits >> 32).astype(np.uint32)], -1).reshape(-1)
  return bits


def _host_fingerprint(x):
  """`_device_fingerprint` of one array in host memory, with numpy, chunk by chunk."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  x = np.asarray(x)  # no copy for an array on a CPU device
  words, flat = _host_words(x), x.reshape(-1)
  base = np.arange(1, _CHUNK + 1, dtype=np.uint32)
  s1 = s2 = 0
  with np.errstate(over="ignore"):
    for start in range(0, words.size, _CHUNK):
      w = words[start:start + _CHUNK].astype(np.uint32, copy=False)
      a, b = _mix(w, base[:w.size] + np.uint32(start % 2 ** 32))
      s1 += int(a.sum(dtype=np.uint32))
      s2 += int(b.sum(dtype=np.uint32))
  inexact = np.issubdtype(x.dtype, np.inexact) or "float" in x.dtype.name  # ml_dtypes' bfloat16, float8_*
  finite = not inexact or all(np.isfinite(flat[i:i + _CHUNK]).all() for i in range(0, flat.size, _CHUNK))
  return np.array([s1 % 2 ** 32, s2 % 2 ** 32], np.uint32), finite


_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="jaxformer-checksum")


def fingerprint(tree):
  """({path: 16-hex-digit checksum}, [paths of arrays holding NaN or inf]) of a pytree of arrays.

  Paths are `path_str` of the tree paths ('params/decoder/layer_0/ffn/wi/kernel', 'opt_state/0/mu/...').
  Arrays on CPU devices (one, or several of this process) are summed in host memory (numpy, a
  thread per core), all others by a jitted reduction on their devices (one small device-to-host
  copy of the results).
  """
  with_path = jax.tree_util.tree_leaves_with_path(tree)
  leaves = [x if isinstance(x, jax.Array) else jnp.asarray(x) for _, x in with_path]
  # CPU arrays (sharded over simulated devices too) are in host memory already: numpy reads them, and
  # no collective program runs (many tiny all-reduces stalled XLA:CPU's rendezvous on 2 busy cores).
  on_host = [x.is_fully_addressable and all(d.platform == "cpu" for d in x.devices()) for x in leaves]
  device = {i: _device_fingerprint(x) for i, (x, host) in enumerate(zip(leaves, on_host)) if not host}
  host = dict(zip([i for i, h in enumerate(on_host) if h],
                  _POOL.map(_host_fingerprint, [x for x, h in zip(leaves, on_host) if h])))
  results = {**host, **jax.device_get(device)}
  sums, nonfinite = {}, []
  for i, (path, _) in enumerate(with_path):
    (a, b), finite = results[i]
    sums[path_str(path)] = f"{int(a):08x}{int(b):08x}"
    if not finite:
      nonfinite.append(path_str(path))
  return sums, nonfinite
