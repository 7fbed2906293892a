"""Compiling the CPU kernels (csrc/: the quantized matmul, paged attention) into one shared library: shared by
setup.py and `jaxformer.qkernel`.

Standard library only: setup.py loads this file by its path in pip's build environment, which has
jaxlib (the XLA FFI headers) but not jax. Two places get a build:
- `pip install` (setup.py's build_ext, `build_installed`): `jaxformer/_qmatmul.so` and, next to it,
  `_qmatmul.json`, the stamp of what it was built for (`key`);
- first use (`qkernel.build`): the cache directory, the file named by a hash of the same `key`.
Both run the same command: `$CXX` (else g++/c++) with FLAGS against jaxlib's headers.
"""

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

CSRC = pathlib.Path(__file__).parent / "csrc"
SOURCES = (CSRC / "qmatmul.cc", CSRC / "paged_attention.cc")  # compiled together; both include workers.h
HEADERS = (CSRC / "workers.h",)
SOURCE = SOURCES[0]
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-Wno-attributes", "-Wno-return-type")
INSTALLED = pathlib.Path(__file__).parent / "_qmatmul.so"  # where `pip install` puts its build


def stamp_path(library):
  """The stamp beside a library: _qmatmul.so -> _qmatmul.json."""
  return pathlib.Path(library).with_suffix(".json")


def cpu_flags():
  try:
    with open("/proc/cpuinfo") as f:
      return next((line for line in f if line.startswith("flags")), "")
  except OSError:
    return platform.processor()


def _sha256(text):
  return hashlib.sha256(text.encode()).hexdigest()


def compiler():
  """The C++ compiler: $CXX, else g++ or c++ on PATH; None if there is none."""
  return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def headers():
  """(include dir, jaxlib version, (major, minor) XLA FFI API version) of the jaxlib that Python would
  import, found without importing it (raises RuntimeError)."""
  spec = importlib.util.find_spec("jaxlib")
  if spec is None or not spec.submodule_search_locations:
    raise RuntimeError("jaxlib (the XLA FFI headers) is not installed")
  include = pathlib.Path(list(spec.submodule_search_locations)[0]) / "include"
  try:
    text = (include / "xla" / "ffi" / "api" / "c_api.h").read_text()
  except OSError:
    raise RuntimeError(f"no XLA FFI headers in {include}") from None
  api = [re.search(rf"#define XLA_FFI_API_{part}\s+(\d+)", text) for part in ("MAJOR", "MINOR")]
  if not all(api):
    raise RuntimeError(f"no XLA FFI API version in {include}/xla/ffi/api/c_api.h")
  try:
    version = importlib.metadata.version("jaxlib")
  except importlib.metadata.PackageNotFoundError:
    version = "unknown"
  return include, version, (int(api[0].group(1)), int(api[1].group(1)))


def key(cxx, jaxlib_version, ffi_api):
  """What a build is for: the source, this CPU (-march=native), the flags, the compiler, the headers.

  An installed library's stamp holds it; the cache names its builds by its hash (`cache_name`)."""
  return {"source_sha256": _sha256("".join(p.read_text() for p in SOURCES + HEADERS)), "cpu_flags_sha256": _sha256(cpu_flags()),
          "flags": list(FLAGS), "compiler": cxx, "jaxlib": jaxlib_version, "ffi_api": list(ffi_api)}


def cache_name(k):
  return f"qmatmul-{_sha256(json.dumps(k, sort_keys=True))[:16]}.so"


def mismatch(stamp, here):
  """None if a library built for `stamp` (a `key`) runs here (`here`: this machine's key), else why not.

  The compiler and jaxlib version may differ: XLA:CPU accepts handlers built against the same XLA
  FFI API major version and an older or equal minor one (xla/ffi/api/c_api.h)."""
  if stamp.get("source_sha256") != here["source_sha256"]:
    return "built from other kernel sources (csrc/)"
  if stamp.get("cpu_flags_sha256") != here["cpu_flags_sha256"]:
    return "built for another CPU (-march=native)"
  if stamp.get("flags") != here["flags"]:
    return "built with other flags"
  api, runtime = list(stamp.get("ffi_api") or (-1, -1)), here["ffi_api"]
  if api[0] != runtime[0] or api[1] > runtime[1]:
    return (f"built against XLA FFI API {api[0]}.{api[1]} (jaxlib {stamp.get('jaxlib')}), "
            f"jaxlib {here['jaxlib']} has {runtime[0]}.{runtime[1]}")
  return None


def compile_library(cxx, include, out):
  """Compiles SOURCES into `out`, built aside then renamed (concurrent builds are safe); RuntimeError with
  the reason if it cannot."""
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
    part = pathlib.Path(tmp) / out.name
    cmd = [cxx, *FLAGS, f"-I{include}", *map(str, SOURCES), "-o", str(part)]
    try:
      proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as e:
      raise RuntimeError(f"cannot run the compiler {cxx}: {e.strerror}") from None
    if proc.returncode:
      last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
      raise RuntimeError(f"building {', '.join(p.name for p in SOURCES)} failed: {last}")
    os.replace(part, out)
  return out


def build_installed(out, log=None):
  """The `pip install` build (setup.py): SOURCES -> the library `out` and its stamp beside it.

  -> True if built. Never raises: without a compiler or headers, if compiling fails, or with
  JAXFORMER_QKERNEL=off it prints one warning line and leaves neither file (jaxformer.qkernel then
  builds on first use, or runs the XLA path)."""
  log = log or (lambda line: print(line, file=sys.stderr, flush=True))
  out = pathlib.Path(out)
  for stale in (out, stamp_path(out)):
    stale.unlink(missing_ok=True)
  start = time.perf_counter()
  try:
    if os.environ.get("JAXFORMER_QKERNEL", "").lower() in ("off", "0", "false"):
      raise RuntimeError("JAXFORMER_QKERNEL=off")
    cxx = compiler()
    if not cxx:
      raise RuntimeError("no C++ compiler found ($CXX, g++ or c++)")
    include, version, api = headers()
    stamp = key(cxx, version, api)
    compile_library(cxx, include, out)
    stamp_path(out).write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
  except Exception as e:  # pylint: disable=broad-except  (the install goes on without the kernel)
    out.unlink(missing_ok=True)
    log(f"WARNING: jaxformer: the CPU kernels (quantized matmul, paged attention) were not built at install ({e}); "
        "jaxformer.qkernel builds them on first use or runs the XLA path")
    return False
  log(f"jaxformer: built the CPU kernels (quantized matmul, paged attention) {out.name} ({cxx}, jaxlib {version}, XLA FFI API "
      f"{api[0]}.{api[1]}) in {time.perf_counter() - start:.1f} s")
  return True
