"""Builds the quantized-matmul CPU kernel at `pip install` (the metadata is in pyproject.toml).

jaxformer/csrc/qmatmul.cc -> jaxformer/_qmatmul.so plus its stamp, _qmatmul.json, with the system
C++ compiler and the command `jaxformer.qkernel` would run on first use (`jaxformer/qbuild.py`).
Not a Python extension module: a shared library that qkernel registers with jax.ffi. Without a
compiler or if the build fails, one warning line and the install goes on (see jaxformer/csrc/README.md).
"""

import importlib.util
import os
import pathlib

from setuptools import Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

# By path: importing the package would need its dependencies, absent from pip's build environment.
_spec = importlib.util.spec_from_file_location(
    "_jaxformer_qbuild", pathlib.Path(__file__).resolve().parent / "jaxformer" / "qbuild.py")
qbuild = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(qbuild)


class BuildKernel(build_ext):
  """build_ext for the kernel: `qbuild.build_installed` instead of a Python extension's compile and link."""

  def get_ext_filename(self, fullname):
    return os.path.join(*fullname.split(".")) + ".so"  # jaxformer/_qmatmul.so, no Python ABI suffix

  def build_extension(self, ext):
    qbuild.build_installed(self.get_ext_fullpath(ext.name))  # never raises

  def copy_extensions_to_source(self):  # editable installs (and --inplace): the stamp goes along
    super().copy_extensions_to_source()
    build_py = self.get_finalized_command("build_py")
    for ext in self.extensions:
      inplace, regular = (pathlib.Path(p) for p in self._get_inplace_equivalent(build_py, ext))
      if regular.exists():
        self.copy_file(str(qbuild.stamp_path(regular)), str(qbuild.stamp_path(inplace)), level=self.verbose)
      else:  # not built this time: no stale library left in the tree
        for stale in (inplace, qbuild.stamp_path(inplace)):
          stale.unlink(missing_ok=True)

  def get_output_mapping(self):
    mapping = super().get_output_mapping()
    stamps = {qbuild.stamp_path(k): qbuild.stamp_path(v) for k, v in mapping.items() if k.endswith(".so")}
    return {**mapping, **{str(k): str(v) for k, v in stamps.items() if k.exists()}}

  def get_outputs(self):
    outputs = super().get_outputs()
    if self.inplace:  # the keys of get_output_mapping: the stamp is there
      return outputs
    return outputs + [str(qbuild.stamp_path(p)) for p in outputs if p.endswith(".so") and os.path.exists(p)]


setup(
    ext_modules=[Extension("jaxformer._qmatmul", sources=["jaxformer/csrc/qmatmul.cc", "jaxformer/csrc/paged_attention.cc"], optional=True)],
    cmdclass={"build_ext": BuildKernel},
)
