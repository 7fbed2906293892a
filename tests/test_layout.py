"""The package's shape: imports run one way, and a wheel installs only `jaxformer`."""

import ast
import os
import pathlib
import subprocess
import sys
import venv
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jaxformer"


def _imports(path):
  """The jaxformer modules `path` imports, at any depth (function-level imports count too)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module == "jaxformer":
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jaxformer."):
      found.add(node.module.split(".")[1])
    elif isinstance(node, ast.Import):
      found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("jaxformer."))
  return found & _NODES


# The package's modules, a subpackage (jaxformer/convert/) counting as one module of all its files.
_SUBPACKAGES = {p.parent.name: sorted(p.parent.glob("*.py")) for p in PACKAGE.glob("*/__init__.py")}
_NODES = {p.stem for p in PACKAGE.glob("*.py")} | set(_SUBPACKAGES)


def _subpackage_imports(path, package):
  """The modules of `package` that its file `path` imports (`from jaxformer.<package> import x`, `... .x import`)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.module == f"jaxformer.{package}":
      found.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"jaxformer.{package}."):
      found.add(node.module.split(".")[2])
  return found


def _check_acyclic(graph):
  def visit(module, path):
    if module in path:
      cycle = path[path.index(module):] + [module]
      pytest.fail("import cycle: " + " -> ".join(cycle))
    for dep in sorted(graph.get(module, ())):
      visit(dep, path + [module])

  for module in sorted(graph):
    visit(module, [])


def test_module_imports_have_no_cycle():
  graph = {p.stem: _imports(p) - {p.stem} for p in PACKAGE.glob("*.py")}
  inner = {}
  for package, files in _SUBPACKAGES.items():
    graph[package] = set().union(*(_imports(f) for f in files)) - {package}
    # inside it too (the package's __init__ may import its modules; they may not import it back)
    inner[package] = {f.stem: _subpackage_imports(f, package) - {f.stem} for f in files if f.stem != "__init__"}
    _check_acyclic(inner[package])
  _check_acyclic(graph)
  assert "llama" in inner["convert"]["mixtral"]  # the inner graph sees a module's imports (the check is not vacuous)
  assert {"evaluate", "checkpoint", "lora"} <= graph["convert"]  # a subpackage's files count for it
  assert "train" not in graph["evaluate"] and "train" not in graph["generate"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
  out = tmp_path_factory.mktemp("wheel")
  proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)],
                        capture_output=True, text=True, timeout=600)
  if proc.returncode:
    pytest.skip(f"cannot build a wheel here: {proc.stderr.strip().splitlines()[-1:]}")
  return next(out.glob("jaxformer-*.whl"))


@pytest.mark.slow  # builds the wheel (pip wheel, the C++ kernels included)
def test_wheel_installs_recipes_inside_the_namespace(wheel):
  names = zipfile.ZipFile(wheel).namelist()
  tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
  assert tops == {"jaxformer"}, tops  # no top-level `configs` to clash with PyPI's package of that name
  assert "jaxformer/configs/wmt_base.py" in names and "jaxformer/configs/_paths.py" in names
  assert "jaxformer/convert/llama.py" in names and "jaxformer/convert/__main__.py" in names  # the subpackage
  assert "jaxformer/csrc/qmatmul.cc" in names  # the quantized kernel's source, built on first use


@pytest.mark.slow
def test_wheel_runs_outside_the_checkout(wheel, tmp_path):
  """Install the wheel in a fresh virtualenv (its dependencies borrowed from this one, not the
  checkout: a `.pth` line adds our site-packages without running its editable-install hook) and
  use it from a directory that is not the checkout, as `pip install git+URL` users do."""
  env_dir = tmp_path / "venv"
  venv.create(env_dir, with_pip=True)
  python = env_dir / "bin" / "python"
  site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                        capture_output=True, text=True, check=True).stdout.strip()
  ours = [p for p in sys.path if p.endswith("site-packages") and os.path.isdir(os.path.join(p, "jax"))]
  pathlib.Path(site, "borrowed.pth").write_text("\n".join(ours) + "\n")
  subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                 timeout=300)
  work = tmp_path / "elsewhere"
  work.mkdir()
  env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAXFORMER_DATA")}
  env.update(JAX_PLATFORMS="cpu", JAXFORMER_COMPILATION_CACHE="off")

  def run(*args):
    return subprocess.run([str(python), *args], cwd=work, env=env, capture_output=True, text=True, timeout=600)

  where = run("-c", "import jaxformer, jaxformer.configs as c; print(jaxformer.__file__); print(c.__file__)")
  assert where.returncode == 0, where.stderr
  assert all(line.startswith(site) for line in where.stdout.split()), where.stdout  # not the checkout's
  out = run("-m", "jaxformer.inspect", "--config", "wmt_base")
  assert out.returncode == 0 and "wmt_base: encoder_decoder, 6+6 layers, d_model 512" in out.stdout, out.stderr
  out = run("-m", "jaxformer.train", "--config", "tiny_encdec", "--workdir", "run", "train.num_steps=2",
            "train.log_every=1", "train.checkpoint_every=2", "data.synthetic_size=500")
  assert out.returncode == 0, out.stderr[-2000:]
  assert "step 2/2" in out.stdout and (work / "run" / "checkpoints" / "2").is_dir()
  # A recipe whose corpus sits beside a checkout says how to point it at the data.
  out = run("-m", "jaxformer.train", "--config", "shakespeare_char", "--workdir", "run2")
  assert out.returncode == 2 and "JAXFORMER_DATA" in out.stderr and "data.text_path=" in out.stderr, out.stderr
  assert len(out.stderr.strip().splitlines()) == 1, out.stderr
