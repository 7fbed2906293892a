"""The quantized-matmul kernel built at `pip install` (setup.py -> jaxformer.qbuild.build_installed): the
library it writes runs the XLA path's products, a missing compiler is a warning line and not a failed
install, and jaxformer.qkernel uses an installed library only where its stamp fits the machine."""

import ctypes
import json
import logging

import jax
import numpy as np
import pytest

from jaxformer import qbuild
from jaxformer import qkernel
from jaxformer import qmatmul


@pytest.mark.slow  # a pip build of the kernels (every install builds them too)
def test_install_build_loads_and_matches_the_xla_path(tmp_path):
  lib = tmp_path / "_qmatmul.so"
  lines = []
  if not qbuild.build_installed(lib, log=lines.append):
    pytest.skip(lines[0])
  assert lines[0].startswith("jaxformer: built the CPU kernels (quantized matmul, paged attention) _qmatmul.so") and len(lines) == 1
  _, version, api = qbuild.headers()
  stamp = json.loads(qbuild.stamp_path(lib).read_text())
  assert stamp == qbuild.key(qbuild.compiler(), version, api)
  assert qkernel.installed(lib) == (lib, None)  # its stamp fits this machine
  so = ctypes.cdll.LoadLibrary(str(lib))  # under names of its own: the session may hold qkernel's build
  for fn in ("JfQmatmulInt8", "JfQmatmulInt4"):
    jax.ffi.register_ffi_target(f"jaxformer_test_install_{fn}", jax.ffi.pycapsule(getattr(so, fn)), platform="cpu")
  rng = np.random.default_rng(7)
  w = rng.standard_normal((96, 37)).astype(np.float32)
  x = rng.standard_normal((3, 96)).astype(np.float32)
  for fn, (q, s) in (("JfQmatmulInt8", qmatmul.quantize_int8(w)), ("JfQmatmulInt4", qmatmul.quantize_int4(w, 32))):
    out = jax.ShapeDtypeStruct((3, 37), np.float32)
    got = jax.jit(jax.ffi.ffi_call(f"jaxformer_test_install_{fn}", out, vmap_method="sequential"))(x, q, s)
    want = jax.jit(qmatmul.xla_matmul)(x, q, s)
    dense = np.asarray(qmatmul.dequantize(q, s), np.float64)
    bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(dense).T)  # float32 accumulation error
    assert np.all(np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)) <= bound)


def _broken_compiler(tmp_path):
  cxx = tmp_path / "broken-cxx"
  cxx.write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
  cxx.chmod(0o755)
  return cxx


@pytest.mark.parametrize("setup", ["nonexistent", "no-compiler-on-path", "broken", "off"])
def test_install_build_without_a_compiler_warns_and_goes_on(monkeypatch, tmp_path, capsys, setup):
  lib = tmp_path / "pkg" / "_qmatmul.so"
  lib.parent.mkdir()
  lib.write_bytes(b"stale")  # a previous install's library: not left behind
  monkeypatch.delenv("CXX", raising=False)
  monkeypatch.delenv("JAXFORMER_QKERNEL", raising=False)
  if setup == "nonexistent":
    monkeypatch.setenv("CXX", "/nonexistent/g++")
  elif setup == "no-compiler-on-path":
    monkeypatch.setenv("PATH", str(tmp_path))
  elif setup == "broken":
    monkeypatch.setenv("CXX", str(_broken_compiler(tmp_path)))
  else:
    monkeypatch.setenv("JAXFORMER_QKERNEL", "off")
  assert qbuild.build_installed(lib) is False  # the default log: one line on stderr
  err = capsys.readouterr().err.strip().splitlines()
  why = {"nonexistent": "cannot run the compiler /nonexistent/g++: No such file or directory",
         "no-compiler-on-path": "no C++ compiler found ($CXX, g++ or c++)",
         "broken": "building qmatmul.cc, paged_attention.cc failed: broken compiler", "off": "JAXFORMER_QKERNEL=off"}[setup]
  assert err == [f"WARNING: jaxformer: the CPU kernels (quantized matmul, paged attention) were not built at install ({why}); "
                 "jaxformer.qkernel builds them on first use or runs the XLA path"]
  assert list(lib.parent.iterdir()) == []


def _installed_library(tmp_path, **changes):
  """A stand-in for jaxformer/_qmatmul.so (never loaded here) with a stamp of this machine, changed."""
  _, version, api = qbuild.headers()
  lib = tmp_path / "_qmatmul.so"
  lib.write_bytes(b"")
  qbuild.stamp_path(lib).write_text(json.dumps({**qbuild.key("g++", version, api), **changes}))
  return lib


@pytest.mark.parametrize("changes,why", [
    ({}, None),
    ({"compiler": "clang++", "jaxlib": "0.0.1"}, None),  # neither matters at run time
    ({"cpu_flags_sha256": "0" * 64}, "_qmatmul.so built for another CPU (-march=native)"),
    ({"source_sha256": "0" * 64}, "_qmatmul.so built from other kernel sources (csrc/)"),
    ({"flags": ["-O0"]}, "_qmatmul.so built with other flags"),
    ({"ffi_api": [99, 0]}, "_qmatmul.so built against XLA FFI API 99.0"),
])
def test_installed_library_is_used_only_where_its_stamp_fits(monkeypatch, tmp_path, caplog, changes, why):
  lib = _installed_library(tmp_path, **changes)
  path, reason = qkernel.installed(lib)
  assert (path, reason and reason.split(" (jaxlib")[0]) == ((None, why) if why else (lib, None))
  # the choice in qkernel's load: the installed library, or else a build into the cache (stubbed here)
  registered = []
  monkeypatch.setattr(qkernel, "_STATE", {})
  monkeypatch.setattr(qkernel, "INSTALLED", lib)
  monkeypatch.setattr(qkernel, "_register", registered.append)
  monkeypatch.setattr(qkernel, "build", lambda: tmp_path / "cache.so")
  monkeypatch.delenv("JAXFORMER_QKERNEL", raising=False)
  with caplog.at_level(logging.DEBUG, logger="jaxformer.qkernel"):
    assert qkernel.unavailable() is None
  assert registered == [tmp_path / "cache.so" if why else lib]
  assert qkernel.source() == ("cache" if why else "installed")
  lines = [r.getMessage() for r in caplog.records if r.name == "jaxformer.qkernel"]
  if why:
    assert lines[0].startswith(f"quantized matmul: not the installed kernel: {why}")
    assert lines[1] == f"quantized matmul: the C++ kernel built on first use ({tmp_path / 'cache.so'})"
  else:
    assert lines == [f"quantized matmul: the C++ kernel installed with the package ({lib})"]


def test_no_stamp_and_the_off_switch(monkeypatch, tmp_path):
  lib = tmp_path / "_qmatmul.so"
  lib.write_bytes(b"")
  assert qkernel.installed(lib)[1].startswith("_qmatmul.so has no readable stamp")
  monkeypatch.setattr(qkernel, "_STATE", {})
  monkeypatch.setenv("JAXFORMER_QKERNEL", "off")
  assert qkernel.unavailable() == "JAXFORMER_QKERNEL=off" and qkernel.source() is None
