"""The CPU kernel of the quantized products (jaxformer/csrc/qmatmul.cc): built on first use, called via jax.ffi.

Built with the system C++ compiler (`$CXX`, else g++/c++) at `-O3 -march=native` into a cache
directory ($JAXFORMER_CACHE, else ~/.cache/jaxformer), keyed by the source, the compiler, the
JAX version and the CPU's flags: -march=native needs the machine that runs it, which a wheel
built at `pip install` time may not be. Where it cannot be built (no compiler, a failed build, or
JAXFORMER_QKERNEL=off) `unavailable()` says why and `jaxformer.qmatmul` runs the XLA path.
"""

import ctypes
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import jax
import jax.numpy as jnp

SOURCE = pathlib.Path(__file__).parent / "csrc" / "qmatmul.cc"
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-Wno-attributes", "-Wno-return-type")
TARGETS = {8: "jaxformer_qmatmul_int8", 4: "jaxformer_qmatmul_int4"}

_STATE = {}  # "reason": why the kernel cannot run (None: registered); set once
_LOCK = threading.Lock()


def _cpu_flags():
  try:
    with open("/proc/cpuinfo") as f:
      return next((line for line in f if line.startswith("flags")), "")
  except OSError:
    return platform.processor()


def library_path(cxx):
  """Where the build for this source, compiler, JAX and CPU goes."""
  key = hashlib.sha256("\0".join([SOURCE.read_text(), cxx, jax.__version__, _cpu_flags(), *FLAGS]).encode())
  cache = os.environ.get("JAXFORMER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "jaxformer")
  return pathlib.Path(cache) / f"qmatmul-{key.hexdigest()[:16]}.so"


def build():
  """Compiles the kernel if needed -> the shared library's path (raises RuntimeError with the reason)."""
  cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if not cxx:
    raise RuntimeError("no C++ compiler found ($CXX, g++ or c++)")
  out = library_path(cxx)
  if out.exists():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=out.parent) as tmp:  # build aside, then rename: concurrent builds are safe
    part = pathlib.Path(tmp) / out.name
    cmd = [cxx, *FLAGS, f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(part)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
      last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
      raise RuntimeError(f"building {SOURCE.name} failed: {last}")
    os.replace(part, out)
  return out


def unavailable():
  """None when the kernel is built and registered with XLA:CPU, else the reason (a short phrase)."""
  with _LOCK:
    if "reason" not in _STATE:
      _STATE["reason"] = _load()
    return _STATE["reason"]


def _load():
  if os.environ.get("JAXFORMER_QKERNEL", "").lower() in ("off", "0", "false"):
    return "JAXFORMER_QKERNEL=off"
  try:
    lib = ctypes.cdll.LoadLibrary(str(build()))
  except (RuntimeError, OSError) as e:
    return f"the C++ kernel is unavailable: {e}"
  for bits, name in TARGETS.items():
    fn = getattr(lib, "JfQmatmulInt8" if bits == 8 else "JfQmatmulInt4")
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(fn), platform="cpu")
  return None


def call(x, q, scale):
  """x [M, K] float32 . the quantized kernel (q, scale as in `jaxformer.qmatmul`) -> [M, N] float32 (the C++ kernel)."""
  reason = unavailable()  # builds and registers the kernel on first use
  if reason:
    raise RuntimeError(reason)
  bits = 8 if q.dtype == jnp.int8 else 4
  out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32)
  return jax.ffi.ffi_call(TARGETS[bits], out, vmap_method="sequential")(x, q, scale)
