"""The CPU kernels (jaxformer/csrc: the quantized products, qmatmul.cc; paged attention, paged_attention.cc),
compiled into one library and registered with jax.ffi.

Compiled with the system C++ compiler (`$CXX`, else g++/c++) at `-O3 -march=native` against
jaxlib's XLA FFI headers (`jaxformer.qbuild`), in one of two places, tried in this order:
- "installed": `jaxformer/_qmatmul.so`, built by `pip install` (setup.py), used when its stamp
  (`_qmatmul.json`) says it was built from this source, for this CPU's flags (-march=native), with
  the same flags, against an XLA FFI API this jaxlib accepts;
- "cache": built on first use into a cache directory ($JAXFORMER_CACHE, else ~/.cache/jaxformer),
  keyed by the source, compiler, jaxlib and CPU flags.
Where neither can be had (no compiler, a failed build, or JAXFORMER_QKERNEL=off) `unavailable()` says
why and `jaxformer.qmatmul` runs the XLA path; `source()` says which library runs.
"""

import ctypes
import json
import logging
import os
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import qbuild

SOURCE = qbuild.SOURCE
FLAGS = qbuild.FLAGS
INSTALLED = qbuild.INSTALLED
TARGETS = {8: "jaxformer_qmatmul_int8", 4: "jaxformer_qmatmul_int4", 32: "jaxformer_matmul_f32"}
A8_TARGETS = {8: "jaxformer_qmatmul_int8_a8", 4: "jaxformer_qmatmul_int4_a8"}  # integer activations (VNNI builds)
ACT_BITS = {"int8": 8, "int16": 16}  # `model.quant_activations` -> the kernel's act_bits
PAGED_TARGET = "jaxformer_paged_attention"  # the same library's paged attention (`jaxformer.paged`)

_STATE = {}  # "reason": why the kernel cannot run (None: registered), "source": "installed"/"cache"; set once
_LOCK = threading.Lock()
_LOG = logging.getLogger(__name__)


def library_path(cxx):
  """Where the cache's build for this source, compiler, jaxlib and CPU goes."""
  _, version, api = qbuild.headers()
  cache = os.environ.get("JAXFORMER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxformer")
  return pathlib.Path(cache) / qbuild.cache_name(qbuild.key(cxx, version, api))


def build():
  """Compiles the kernel into the cache if needed -> the shared library's path (RuntimeError with the reason)."""
  cxx = qbuild.compiler()
  if not cxx:
    raise RuntimeError("no C++ compiler found ($CXX, g++ or c++)")
  out = library_path(cxx)
  if not out.exists():
    qbuild.compile_library(cxx, jax.ffi.include_dir(), out)
  return out


def installed(library=None):
  """(path, None) if the library `pip install` built runs here (its stamp matches), else (None, why not)."""
  library = pathlib.Path(library or INSTALLED)
  if not library.exists():
    return None, f"no {library.name} (not built at install)"
  try:
    stamp = json.loads(qbuild.stamp_path(library).read_text())
    _, version, api = qbuild.headers()
  except (OSError, ValueError, RuntimeError) as e:
    return None, f"{library.name} has no readable stamp ({e})"
  why = qbuild.mismatch(stamp, qbuild.key(None, version, api))
  return (None, f"{library.name} {why}") if why else (library, None)


def unavailable():
  """None when the kernel is built and registered with XLA:CPU, else the reason (a short phrase)."""
  with _LOCK:
    if "reason" not in _STATE:
      _STATE["reason"] = _load()
    return _STATE["reason"]


def source():
  """Which library the kernel runs from: "installed" (built by `pip install`), "cache" (built on first
  use), or None (the XLA path: `unavailable()` says why)."""
  unavailable()
  return _STATE.get("source")


def _register(path):
  lib = ctypes.cdll.LoadLibrary(str(path))
  handlers = {8: lib.JfQmatmulInt8, 4: lib.JfQmatmulInt4, 32: lib.JfMatmulF32}
  for bits, name in TARGETS.items():
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handlers[bits]), platform="cpu")
  jax.ffi.register_ffi_target(PAGED_TARGET, jax.ffi.pycapsule(lib.JfPagedAttention), platform="cpu")
  _STATE["gemm_rows"] = int(lib.JfQmatmulGemmRows())
  _STATE["vnni"] = bool(lib.JfQmatmulHasVnni())
  if _STATE["vnni"]:
    for bits, handler in ((8, lib.JfQmatmulInt8A8), (4, lib.JfQmatmulInt4A8)):
      jax.ffi.register_ffi_target(A8_TARGETS[bits], jax.ffi.pycapsule(handler), platform="cpu")


def _load():
  if os.environ.get("JAXFORMER_QKERNEL", "").lower() in ("off", "0", "false"):
    return "JAXFORMER_QKERNEL=off"
  path, why = installed()
  if path is not None:
    try:
      _register(path)
      _STATE["source"] = "installed"
      _LOG.debug("quantized matmul: the C++ kernel installed with the package (%s)", path)
      return None
    except (OSError, AttributeError) as e:
      why = f"{path.name} does not load ({e})"
  _LOG.debug("quantized matmul: not the installed kernel: %s", why)
  try:
    path = build()
    _register(path)
  except (RuntimeError, OSError, AttributeError) as e:
    return f"the C++ kernel is unavailable: {e}; {why}"
  _STATE["source"] = "cache"
  _LOG.debug("quantized matmul: the C++ kernel built on first use (%s)", path)
  return None


def gemm_rows():
  """Rows from which the kernel runs its blocked product (prefill: each weight converted once, then multiplied
  from cache against every row; AVX-512 builds), or None (no kernel, or a build without it)."""
  return None if unavailable() else (_STATE.get("gemm_rows") or None)


def vnni():
  """True where the kernel has its integer-activation products (AVX-512 VNNI builds: `qmatmul.matmul`'s
  activations="int8" / "int16")."""
  return not unavailable() and _STATE.get("vnni", False)


def bits_of(q):
  """8, 4 or 32: the scheme of a `qkernel` (int8, packed uint8, float32 output-major; `jaxformer.qmatmul`)."""
  return {jnp.dtype(jnp.int8): 8, jnp.dtype(jnp.uint8): 4, jnp.dtype(jnp.float32): 32}[jnp.dtype(q.dtype)]


def call(x, q, scale, activations="float"):
  """x [M, K] float32 . the quantized kernel (q, scale as in `jaxformer.qmatmul`) -> [M, N] float32 (the C++ kernel);
  activations="int8" / "int16": x quantized to int8 / int16 in blocks of 32 inputs first (`vnni()` builds)."""
  reason = unavailable()  # builds and registers the kernel on first use
  if reason:
    raise RuntimeError(reason)
  out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32)
  if activations == "float":
    return jax.ffi.ffi_call(TARGETS[bits_of(q)], out, vmap_method="sequential")(x, q, scale)
  return jax.ffi.ffi_call(A8_TARGETS[bits_of(q)], out, vmap_method="sequential")(
      x, q, scale, act_bits=np.int32(ACT_BITS[activations]))
