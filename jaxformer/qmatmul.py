"""Weight-only quantized matmul kernels (int8 per output channel, int4 in groups): formats, products.

A quantized kernel is stored output-major, as llama.cpp and most CPU kernels do: the float
kernel flattened to w [K, N] (K = fan-in, N = fan-out) becomes

- int8: `qkernel` int8 [N, K], round(w^T / s) with one scale per output, `qscale` float32 [N]
  (s = max |w[:, n]| / 127: symmetric, no zero point).
- int4: `qkernel` uint8 [N, K / 2], two signed 4-bit values per byte (the even k in the low
  nibble, the odd k in the high one), `qscale` float32 [N, K / group]: one scale per
  group of `group` consecutive inputs of an output (s = max |w| over the group / 7, values -7..7).
- float32 ("bits 32", not a quantization): `qkernel` float32 [N, K] = w^T, `qscale` ones [N]. The
  serving engine lays a float model's weights out so (`output_major`) on CPU, where the kernel
  streams each output's weights once for all of a decode step's rows (up to KERNEL_MAX_ROWS[32]).

`matmul` is the product the Dense layers and MoE experts run on them: on CPU a C++ kernel
(jaxformer/csrc, `jax.ffi`) when it could be built: for any number of rows where it has its blocked product for
prefill (AVX-512 builds, `qkernel.gemm_rows`; `GEMM_MAX_ROWS`), else up to `KERNEL_MAX_ROWS`; above that, or without
the kernel (logged once with the reason), the XLA path: the int8/int4 weights converted
for `dot_general`, which TPU/GPU compilers fuse into the product and which XLA:CPU writes out in float32
right before its product (`_after`). Float models reach it only through the serving engine's output-major
layout (`output_major`); their training, eval and generate programs are unchanged.
"""

import json
import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import qkernel
from jaxformer import qpallas
from jaxformer.errors import UserError

QUANT_PARAMS = ("qkernel", "qscale")
# Rows up to which the C++ kernel runs, by bits; above, the XLA path, which converts the weights for XLA's GEMM
# (GPT-2 124M: ~9 ms per call whatever the rows; int4's unpacking more). GPT-2 124M prefill against float32's time,
# each path forced (`python benchmarks/prefill_rows.py`, BENCHMARKS.md "Quantized weights, part 4"; an AVX-512 AMD
# EPYC, 32 MB of L3). Without the blocked product (AVX2 or scalar builds) the kernel's streaming loop: int8 0.86x at
# 32 rows (XLA path 1.02x), 1.22x at 48 (1.06x); int4 1.25x at 32 (1.35x), 1.65x at 128 (1.12x).
# float32 (`benchmarks/dense_layout.py kernel`, GPT-2's decode products + head): the kernel 0.5x XLA's time at 16
# rows, 0.57x at 32; at 144 rows ~1.6x, where XLA's blocked GEMM reuses the activations better.
KERNEL_MAX_ROWS = {8: 32, 4: 32, 32: 32}
# With the blocked product (AVX-512 builds, `qkernel.gemm_rows`; on XLA's thread pool) the kernel takes every row
# count: the same table (BENCHMARKS.md "Quantized weights", parts 6 and 7, 15-21 rounds) gives int8 0.82x / 0.89x /
# 0.97x at 64 / 128 / 256 rows (XLA path 1.04-1.06x), int4 0.85x / 0.90x / 1.00x (1.09-1.16x), and at 256-2048 rows
# (part 7) the kernel 0.94-1.07x against the XLA path's 0.96-1.10x: there both are bound by float32's multiply-adds
# (the products alone are at float32's time: `benchmarks/qmatmul_rows.py --rows 512,1024`), and the XLA path also
# writes every weight out in float32 first.
# float32 (the serving engine's prompt chunks): XLA's dot from 33 rows (a 128-token prefill call 93 ms against
# 101-106 through it).
GEMM_MAX_ROWS = {8: math.inf, 4: math.inf, 32: 32}


def quantize_int8(w):
  """w [K, N] float -> (q int8 [N, K], scale float32 [N]): per-output-channel symmetric int8."""
  w = np.asarray(w, np.float32).T
  amax = np.max(np.abs(w), axis=1)
  scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
  q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
  return q, scale


def quantize_int4(w, group):
  """w [K, N] float -> (packed uint8 [N, K / 2], scale float32 [N, K / group]): grouped symmetric int4.

  `group` must divide K and be even (K itself for a kernel smaller than the group)."""
  w = np.asarray(w, np.float32).T
  n, k = w.shape
  if k % group or group % 2:
    raise ValueError(f"int4 group {group} must be even and divide the fan-in {k}")
  g = w.reshape(n, k // group, group)
  amax = np.max(np.abs(g), axis=2)
  scale = np.where(amax > 0, amax / np.float32(7), np.float32(1)).astype(np.float32)
  q = np.clip(np.rint(g / scale[:, :, None]), -7, 7).astype(np.int8).reshape(n, k)
  packed = (q[:, 0::2] & 0x0F) | (q[:, 1::2] << 4)
  return packed.astype(np.uint8), scale


def group_for(k, group):
  """The int4 group a kernel of fan-in k gets: `group`, or k itself when k is smaller."""
  return k if k < group else group


def unpack_int4(packed):
  """packed uint8 [N, K / 2] -> int8 [N, K] in -8..7 (jnp; the even k from the low nibble)."""
  b = packed.astype(jnp.int8)
  lo = jnp.right_shift(jnp.left_shift(b, 4), 4)  # arithmetic shifts sign-extend the nibbles
  hi = jnp.right_shift(b, 4)
  return jnp.stack([lo, hi], axis=-1).reshape(packed.shape[0], -1)


def dequantize(q, scale, dtype=jnp.float32):
  """(qkernel, qscale) -> the float kernel w^T [N, K] in `dtype`: what the quantized product multiplies by."""
  if q.dtype != jnp.uint8:  # int8, or float32 output-major
    return q.astype(dtype) * scale[:, None].astype(dtype)
  w = unpack_int4(q).astype(dtype)
  n, k = w.shape
  groups = scale.shape[1]
  return (w.reshape(n, groups, k // groups) * scale[:, :, None].astype(dtype)).reshape(n, k)


def lookup(q, scale, ids):
  """Rows `ids` [T] (int) of a quantized table (int8 [V, D] + scale [V], or int4 uint8 [V, D / 2] + scale
  [V, D / group]) -> float32 [T, D]: the token embeddings' lookup, reading only those rows.

  One id is looked up twice: the TPU compiler makes a one-row gather a dynamic slice, for which it re-tiles
  the whole int8/uint8 table from its (32, 128) tiles to (8, 128) each call (Llama 3.1 8B's batch-1 decode
  step: a 525 MB copy to read one 4 KB row); two rows stay a gather of the table as it lies
  (`benchmarks/tpu_lookup.py`, `benchmarks/aot_compile.py --decode`; BENCHMARKS.md "Quantized weights, part 5")."""
  rows = jnp.concatenate([ids, ids]) if ids.shape[0] == 1 else ids
  return dequantize(jnp.take(q, rows, axis=0), jnp.take(scale, rows, axis=0))[:ids.shape[0]]


bits_of = qkernel.bits_of  # 8, 4 or 32: the scheme of a `qkernel`


def xla_matmul(x, q, scale):
  """x [M, K] . dequantize(q, scale)^T -> [M, N] float32, through XLA's dot_general.

  int8: the int8 operand converted in the dot and the per-output scale applied to its result
  (exact algebra); int4: the unpacked weight times its group scales, then the dot."""
  dtype = x.dtype
  if q.dtype != jnp.uint8:  # int8 (or float32 output-major, scale 1)
    out = jnp.einsum("mk,nk->mn", x, q.astype(dtype), preferred_element_type=jnp.float32)
    return out * scale
  return jnp.einsum("mk,nk->mn", x, dequantize(q, scale, dtype), preferred_element_type=jnp.float32)


def _after(q, x):
  """q, made to depend on x: for XLA:CPU, so that it converts the weights right before their product.

  The conversion reads only parameters, and XLA:CPU's scheduler (which runs what it can concurrently) put every
  product's conversion at the program's start: GPT-2's 512-token prefill then held all its weights in float32 at
  once (344.6 MiB of temporaries against float32's 27.4: `benchmarks/prefill_rows.py --memory`), page-faulted in on every call, and took 1.19x float32's time
  (an optimization barrier does not hold: XLA:CPU removes it). min(x's bits as uint32, 0) is 0 for every x, which
  XLA does not fold away (tests/test_quantize.py checks the temporaries)."""
  if x.size == 0 or q.dtype == jnp.float32:  # a float32 kernel is not converted
    return q
  bits = jax.lax.bitcast_convert_type(x[0, 0].astype(jnp.float32), jnp.uint32)
  return q + jnp.minimum(bits, jnp.uint32(0)).astype(q.dtype)


def _xla_matmul_cpu(x, q, scale):
  """`xla_matmul` with the weights converted after x is computed (`_after`): the XLA path on CPU."""
  return xla_matmul(x, _after(q, x), scale)


_LOGGED = set()


def _log_once(key, line):
  if key not in _LOGGED:
    _LOGGED.add(key)
    logging.getLogger(__name__).warning(line)


def kernel_max_rows(bits):
  """The most rows a product of this scheme takes the C++ kernel for: GEMM_MAX_ROWS[bits] where the kernel has its
  blocked product for prefill (`qkernel.gemm_rows`), else KERNEL_MAX_ROWS[bits] (the streaming loop's range)."""
  return GEMM_MAX_ROWS[bits] if qkernel.gemm_rows() else KERNEL_MAX_ROWS[bits]


def a8_unavailable(x, q, scale):
  """None where `matmul(x, q, scale, activations="int8" / "int16")` runs on integer activations on CPU (the kernel's
  VNNI product), else why not (a short phrase; calls of fewer than ACT_MIN_ROWS rows are not asked)."""
  if bits_of(q) == 32:
    return "float32 weights"
  if x.dtype != jnp.float32:
    return f"activations are {x.dtype}, the CPU kernel takes float32"
  if not qkernel.vnni():
    return qkernel.unavailable() or "the CPU kernel was built without AVX-512 VNNI"
  if bits_of(q) == 4 and (q.shape[1] * 2 // scale.shape[1]) % 32:
    return f"int4 groups of {q.shape[1] * 2 // scale.shape[1]} inputs (integer activations take multiples of 32)"
  return None


# Rows from which activations="int8" / "int16" quantizes them (see `matmul`): prefill and eval, and decode steps of
# as many sequences. GPT-2 124M prefill against the weight-only kernel (x float32's time, `benchmarks/prefill_rows.py`
# with these set to 4): int8 activations (BENCHMARKS.md "Quantized weights, part 8") 4 rows 0.65x / 0.43x, 8 rows
# 0.70x / 0.56x, 16 rows 0.59x / 0.73x, 24 rows 0.65x / 0.87x; int16 (part 9, int8 weights) 8 rows 0.81x / 0.62x,
# 16 rows 0.77-0.85x / 0.73-0.75x, 20 rows 0.81x / 0.91x, 24 rows 0.65-0.74x / 0.78-1.10x (int4 alike): below these
# the integer product's per-call packing of the weights costs more than it saves.
ACT_MIN_ROWS = {"int8": 16, "int16": 20}


def matmul(x, q, scale, activations="float"):
  """x [M, K] (float) times the quantized kernel -> [M, N] float32: the one quantized product.

  On CPU with at most `kernel_max_rows(bits)` rows, float32 activations and the kernel built, the C++
  kernel; otherwise the XLA path (`xla_matmul`; on CPU its conversion ordered after x, `_after`), except int4
  on TPU where `qpallas.blocks` fits: its Pallas kernel. Why the XLA path runs on CPU at few rows is logged
  once per reason.

  activations="int8" / "int16" (`model.quant_activations`; `jaxformer.quantize` writes int16 unless told): a
  call of at least ACT_MIN_ROWS rows on CPU quantizes x to int8 / int16 in blocks of 32 inputs (a float32 scale
  each, max |x| / 127 or / 32767) and multiplies integers (the kernel's AVX-512 VNNI product; `a8_unavailable` says
  where it runs, and why not is logged once). That changes the result (int8: by about 1% of the largest output on
  random data; int16: levels 258x finer; a model's NLL: BENCHMARKS.md); calls of fewer rows (most decode steps),
  other devices and calls it cannot take run the weight-only product above."""
  rows = x.shape[0]
  default = xla_matmul
  if bits_of(q) == 4 and qpallas.blocks(rows, q.shape, scale.shape):  # on TPU, the Pallas int4 kernel
    default = lambda x, q, scale: jax.lax.platform_dependent(x, q, scale, tpu=qpallas.int4_matmul, default=xla_matmul)
  if activations != "float" and rows >= ACT_MIN_ROWS[activations]:
    why = a8_unavailable(x, q, scale)
    if why is None:
      a8 = lambda x, q, scale: qkernel.call(x, q, scale, activations=activations)
      return jax.lax.platform_dependent(x, q, scale, cpu=a8, default=default)
    if jax.default_backend() == "cpu":
      _log_once(f"a8 {why}", f"quantized matmul: float activations ({why})")
  if rows <= kernel_max_rows(bits_of(q)):  # the C++ kernel where it runs
    why = f"activations are {x.dtype}, the CPU kernel takes float32" if x.dtype != jnp.float32 else qkernel.unavailable()
    if why is None:
      return jax.lax.platform_dependent(x, q, scale, cpu=qkernel.call, default=default)
    if jax.default_backend() == "cpu":
      _log_once(why, f"quantized matmul: XLA path on CPU ({why})")
  return jax.lax.platform_dependent(x, q, scale, cpu=_xla_matmul_cpu, default=default)


def quantized_shapes(k, n, bits, group):
  """{qkernel, qscale} ShapeDtypeStructs of a [K, N] kernel in a scheme (for restoring checkpoints)."""
  if bits == 8:
    return {"qkernel": jax.ShapeDtypeStruct((n, k), jnp.int8), "qscale": jax.ShapeDtypeStruct((n,), jnp.float32)}
  g = group_for(k, group)
  return {"qkernel": jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
          "qscale": jax.ShapeDtypeStruct((n, k // g), jnp.float32)}


# How `plan_manifest` stores the token embeddings and an untied output layer (`--embedding`): int8 with a scale per
# vocabulary row, int4 in groups along d_model (the kernels' int4 format, vocabulary rows as the outputs), or float.
EMBEDDINGS = ("int8", "int4", "float")


def plan_manifest(shapes, quantizable, bits, group_size=128, embedding="int8", flag="--bits"):
  """The manifest `quantize.quantize_params` writes for float params of these shapes, from the shapes
  alone (no weights): {"bits", "group_size", "embedding", "kernels": {path: {"k", "n"[, "bits"][, "experts"]}}}.

  shapes: {param path 'a/b/kernel': shape} of the float params (unrolled layers); quantizable:
  `model.quantizable`'s {path: (n_in, kind)}. A dense kernel [*in (n_in axes), *out] is K = prod(in)
  by N = prod(out); an embedding table [vocab, d_model] is K = d_model, N = vocab; the output
  layer [d_model, vocab] K = d_model, N = vocab (both int8, or int4 with embedding="int4", in groups
  along d_model); an MoE expert weight [experts, K, N].
  With embedding="float" the tables and the output layer are left out (stay float). `flag` names
  the bits in the errors (UserError, one line) for a scheme the shapes do not allow."""
  if embedding not in EMBEDDINGS:
    raise UserError(f"--embedding {embedding}: int8, int4 or float")
  if bits not in (8, 4):
    raise UserError(f"{flag} {bits}: 8 or 4")
  if (bits == 4 or embedding == "int4") and (group_size < 2 or group_size % 2):
    raise UserError(f"--group-size {group_size}: a positive even number (e.g. 128)")
  kernels = {}
  for path, (n_in, kind) in quantizable.items():
    shape = tuple(int(d) for d in shapes[path])
    if kind in ("embedding", "output"):
      if embedding == "float":
        continue
      k, n = (shape[1], shape[0]) if kind == "embedding" else (shape[0], shape[1])
      table_bits = 8 if embedding == "int8" else 4
      if table_bits == 4 and (k % group_for(k, group_size) or group_for(k, group_size) % 2):
        raise UserError(f"--embedding int4: d_model {k} is not a multiple of --group-size {group_size} (or is odd): "
                        f"choose a group size that divides it, or use --embedding int8")
      kernels[path] = {"k": k, "n": n, "bits": table_bits}
      continue
    if kind == "dense":
      k = math.prod(shape[:n_in])
      entry = {"k": k, "n": math.prod(shape) // k}
    else:  # [experts, in, out]
      entry = {"k": shape[1], "n": shape[2], "experts": shape[0]}
    g = group_for(entry["k"], group_size)
    if bits == 4 and (entry["k"] % g or g % 2):
      raise UserError(f"int4: fan-in {entry['k']} is not a multiple of --group-size {group_size} (or is odd): "
                      f"choose a group size that divides every fan-in, or use {flag} 8")
    kernels[path] = entry
  return {"bits": bits, "group_size": group_size, "embedding": embedding, "kernels": kernels}


def param_bytes(shapes, manifest=None, dtype="float32"):
  """Bytes of a model's params stored as `manifest` (None: all float) says, from shapes alone:
  dict(kernels, tables, float, total).

  shapes: {param path: shape} of the float params (unrolled layers); each manifest path counts as
  its quantized leaves (`quantized_shapes`: int8 [N, K] + float32 [N], or uint8 [N, K / 2] + float32
  [N, K / group], per expert for an MoE weight): `tables` the embedding tables and output
  layer, `kernels` the other quantized weights; every other leaf is `float`, at `dtype`."""
  itemsize = jnp.dtype(dtype).itemsize
  entries = (manifest or {}).get("kernels", {})
  out = dict(kernels=0, tables=0, float=0)
  for path, shape in shapes.items():
    entry = entries.get(path)
    if entry is None:
      out["float"] += math.prod(shape) * itemsize
      continue
    leaves = quantized_shapes(entry["k"], entry["n"], entry.get("bits", manifest["bits"]), manifest["group_size"])
    n = entry.get("experts", 1) * sum(math.prod(s.shape) * s.dtype.itemsize for s in leaves.values())
    out["tables" if "bits" in entry else "kernels"] += n
  out["total"] = sum(out.values())
  return out


def dense_apply(module, x, n_in, features, use_bias, activations="float"):
  """TokenDense's product on quantized params: x [tokens, *in] -> [tokens, *features] in the module's dtype.

  module: the TokenDense (its `qkernel`, `qscale` and optional `bias` params); activations as `matmul` takes it."""
  q, scale = module.get_variable("params", "qkernel"), module.get_variable("params", "qscale")
  k = math.prod(x.shape[x.ndim - n_in:])
  dtype = module.dtype or jnp.float32
  y = matmul(x.reshape(x.shape[0], k).astype(dtype), q, scale, activations)
  features = features if isinstance(features, tuple) else (features,)
  y = y.reshape(x.shape[0], *features).astype(dtype)
  if use_bias:
    y = y + module.get_variable("params", "bias").astype(dtype)
  return y


# A quantized workdir's manifest (quantization.json): {"bits", "group_size", "kernels": {path: {"k", "n"}}}.
MANIFEST = "quantization.json"


def read_manifest(workdir):
  """The workdir's quantization manifest (dict), or None for a float run."""
  path = os.path.join(workdir, MANIFEST)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def quantized_abstract(shapes, manifest):
  """The abstract params of a quantized workdir: `shapes` (the float model's, unrolled) with each
  manifest path's `kernel` (a dense module's), `embedding` (a table) or expert weight (`.../moe/wi`)
  replaced by its quantized leaves."""
  shapes = jax.tree.map(lambda x: x, shapes)  # a copy we may edit
  for path, entry in manifest["kernels"].items():
    *parents, leaf = path.split("/")
    node = shapes
    for p in parents:
      node = node[p]
    bits, group = manifest["bits"], manifest["group_size"]
    q = quantized_shapes(entry["k"], entry["n"], entry.get("bits", bits), group)
    del node[leaf]
    if leaf in ("kernel", "embedding"):  # a dense kernel, or an embedding table (int8, rows = outputs)
      node.update(q)
    else:  # an MoE expert weight [experts, in, out]: one quantized kernel per expert
      e = entry["experts"]
      for name, s in q.items():
        node[f"{leaf}_{name}"] = jax.ShapeDtypeStruct((e, *s.shape), s.dtype)
  return shapes


def expert_weight(module, name, dtype):
  """An MoE expert weight [experts, in, out] in `dtype` from its quantized leaves (`{name}_qkernel`,
  `{name}_qscale`), or None when the module holds it in float. Dequantized into the dot (XLA path)."""
  if not module.has_variable("params", f"{name}_qkernel"):
    return None
  q, scale = module.get_variable("params", f"{name}_qkernel"), module.get_variable("params", f"{name}_qscale")
  return jax.vmap(lambda q, s: dequantize(q, s, dtype).T)(q, scale)


def output_major(params, found):
  """Float params with each dense kernel of `found` ({path: (n_in, kind)}, `model.quantizable`) in the float32
  output-major layout above (`qkernel` w^T [N, K], `qscale` ones [N]; MoE expert weights left as they are),
  which the Dense layers and the tied table then multiply through `matmul`. A table [vocab, d_model] is
  already output-major (its rows are the logits' outputs): it is kept, not copied."""
  params = jax.tree.map(lambda x: x, params)  # new containers: the caller's tree is not edited
  for path, (n_in, kind) in found.items():
    if kind == "experts":
      continue
    *parents, leaf = path.split("/")
    node = params
    for p in parents:
      node = node[p]
    w = jnp.asarray(node.pop(leaf), jnp.float32)
    q = w if kind == "embedding" else w.reshape(math.prod(w.shape[:n_in]), -1).T
    node["qkernel"], node["qscale"] = q, jnp.ones((q.shape[0],), jnp.float32)
  return params
