"""Shared fixtures: a JAX compilation cache, one short tiny_encdec training run, the HF fixtures converted."""

import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile

# Cheap LLVM codegen for every program the tests compile, here and in the train.py / eval.py
# processes they start (they inherit it): test programs are tiny and compiling them is most of
# their time (-19% suite time on test_decode + test_scale). These flags lower LLVM's optimisation of
# the emitted code; XLA's HLO passes (fusion, layout, buffer assignment) are unchanged.
# Tests of what the default codegen does (bitwise equality of two programs) run with it through
# `with_default_codegen`.
# FAST_XLA also compiles fusions with XLA's elemental IR emitters instead of its MLIR fusion emitters
# (--xla_cpu_use_fusion_emitters=false; the same fused HLO): -40% compile time of a tiny Llama's train
# step and of the eager ops of its init, -30% or so of the suite's time. Its fusions round differently in
# the last bits; tests whose tolerances are about the MLIR emitters' rounding run with them
# (`with_fusion_emitters`).
FAST_XLA_O0 = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def _xla_knows(flag):
  """Whether this jaxlib's XLA defines `flag` (XLA aborts the process on an unknown one, and a later jaxlib
  may retire a flag): its name is among libjax_common.so's strings (~0.2 s to look)."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import mmap  # pylint: disable=g-import-not-at-top
  try:
    library = os.path.join(os.path.dirname(importlib.util.find_spec("jaxlib").origin), "libjax_common.so")
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
      return m.find(flag.encode()) >= 0
  except (OSError, ValueError, AttributeError):
    return False


FAST_XLA = FAST_XLA_O0 + (" --xla_cpu_use_fusion_emitters=false" if _xla_knows("xla_cpu_use_fusion_emitters") else "")
os.environ["JAXFORMER_TEST_FAST_XLA"] = FAST_XLA  # for the test scripts run as processes of their own
os.environ.setdefault("JAXFORMER_XLA_FLAGS_GIVEN", os.environ.get("XLA_FLAGS", ""))  # before any FAST_XLA
XLA_FLAGS_GIVEN = os.environ["JAXFORMER_XLA_FLAGS_GIVEN"]  # (xdist workers inherit the controller's env)
CODEGEN = os.environ.get("JAXFORMER_TEST_CODEGEN")
if CODEGEN != "default" and "xla_backend_optimization_level" not in XLA_FLAGS_GIVEN:
  os.environ["XLA_FLAGS"] = f"{XLA_FLAGS_GIVEN} {FAST_XLA_O0 if CODEGEN == 'fusion_emitters' else FAST_XLA}".strip()

import jax  # noqa: E402  (after XLA_FLAGS: read when the CPU backend starts)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from jaxformer import config as config_lib  # noqa: E402
from jaxformer import train  # noqa: E402

# Overrides that keep tiny_encdec fast: a small synthetic corpus, one bucket shape
# (so one train-step compile), checkpoints at steps 4 and 8.
TINY_OVERRIDES = ("data.synthetic_size=2000", "data.max_len=24", "train.num_steps=8",
                  "train.checkpoint_every=4", "train.log_every=4", "train.eval_every=1000",
                  "train.eval_batches=1", "train.keep_checkpoints=5")


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
  """Many tests build the same tiny models under fresh `jax.jit`s: compile each once.

  One directory for the whole run: both pytest-xdist workers (each builds the session fixtures)
  and the train.py/eval.py subprocesses tests start ($JAXFORMER_COMPILATION_CACHE, which also
  keeps them out of the user's ~/.cache)."""
  if os.environ.get("PYTEST_XDIST_WORKER"):  # workers' base temps are siblings: share their parent
    path = os.path.join(str(tmp_path_factory.getbasetemp().parent), "jax_cache")
    os.makedirs(path, exist_ok=True)
  else:
    path = str(tmp_path_factory.mktemp("jax_cache"))
  if os.environ.get("JAXFORMER_COMPILATION_CACHE", "").lower() != "off":
    os.environ["JAXFORMER_COMPILATION_CACHE"] = path
  old = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir",
                                              "jax_persistent_cache_min_compile_time_secs",
                                              "jax_persistent_cache_min_entry_size_bytes")}
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  yield path
  for k, v in old.items():
    jax.config.update(k, v)


def tiny_config(*overrides):
  """tiny_encdec with TINY_OVERRIDES, then `overrides`."""
  return config_lib.load_config("tiny_encdec", [*TINY_OVERRIDES, *overrides])


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
  """(workdir, cfg, result) of an 8-step tiny_encdec run with checkpoints at 4 and 8."""
  workdir = str(tmp_path_factory.mktemp("tiny_run"))
  cfg = tiny_config()
  result = train.train_and_evaluate(cfg, workdir, log=lambda *a: None)
  return workdir, cfg, result


# ----------------------------------------------------------------------------- Hugging Face fixtures

HF_FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"


def hf_expected(name):
  """(expected.npz, expected.json) of the HF fixture `name`: what transformers computed for it."""
  return np.load(HF_FIXTURES / name / "expected.npz"), json.loads((HF_FIXTURES / name / "expected.json").read_text())


def hf_tensors(directory):
  """{name: array} of every *.safetensors file in an HF folder."""
  from safetensors.numpy import load_file  # pylint: disable=g-import-not-at-top
  out = {}
  for path in sorted(pathlib.Path(directory).glob("*.safetensors")):
    out.update(load_file(str(path)))
  return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  """name -> (workdir, cfg, model, params, tokenizer): the HF fixture `name` converted once per module."""
  from jaxformer import convert, evaluate  # pylint: disable=g-import-not-at-top
  cache = {}
  quiet = lambda *a, **k: None

  def get(name):
    if name not in cache:
      workdir = str(tmp_path_factory.mktemp(name) / "w")
      convert.from_hf(str(HF_FIXTURES / name), workdir, log=quiet)
      cfg, model, params, tok, _ = evaluate.load_run(workdir, log=quiet)
      cache[name] = workdir, cfg, model, params, tok
    return cache[name]
  return get


# The decoder features of issue 36 and the value that turns each off (tests/test_model_features.py,
# tests/test_convert_families.py).
FEATURES_OFF = {"qkv_bias": False, "qk_norm": False, "norm_unit_offset": False, "post_norms": False,
                "sliding_window": 0, "attn_softcap": 0.0, "final_softcap": 0.0, "query_pre_attn_scalar": None,
                "rope_local_theta": None, "activation": "swiglu", "scale_embeddings": False, "rope_scaling": "none"}


def feature_off_changes(field):
  """The ModelConfig changes that turn one feature off (no window: no pattern, no local RoPE base either)."""
  if field == "sliding_window":
    return {"sliding_window": 0, "attention_pattern": "", "rope_local_theta": None}
  return {field: FEATURES_OFF[field]}


def feature_off(m, params, field):
  """(ModelConfig, params) of model config `m` with one feature off, the weights it no longer has dropped."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  params = jax.tree.map(lambda x: x, params)  # a new dict tree, same arrays
  for i in range(m.num_layers):
    layer = params["decoder"][f"layer_{i}"]
    if field == "qkv_bias":
      for n in ("query", "key", "value"):
        layer["self_attention"][n].pop("bias")
    elif field == "qk_norm":
      for n in ("query_norm", "key_norm"):
        layer["self_attention"].pop(n)
    elif field == "post_norms":
      for n in ("self_attention_post_norm", "ffn_post_norm"):
        layer.pop(n)
  return dataclasses.replace(m, **feature_off_changes(field)), params


def window_by_window_nll(model, params, ids, block):
  """Summed NLL of `ids` over non-overlapping windows of `block` targets, each recomputed alone (float64)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  apply = jax.jit(model.apply)
  total = 0.0
  for start in range(0, len(ids) - 1, block):
    window = ids[start:start + block + 1]
    logits = np.asarray(apply({"params": params}, jnp.asarray(window[None, :-1])), np.float64)[0]
    logits -= logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    total -= logp[np.arange(len(window) - 1), window[1:]].sum()
  return total


def forward_logp(model, params, ids):
  """log p(ids[i] | ids[:i]) for i >= 1 [len - 1] and the log-softmax rows [len - 1, vocab], from one unpadded
  forward without a cache, in float64 numpy (the reference for prompt log-probs)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  ids = np.asarray(ids)
  logits = np.asarray(jax.jit(model.apply)({"params": params}, jnp.asarray(ids[None])), np.float64)[0, :-1]
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  return logp[np.arange(len(ids) - 1), ids[1:]], logp


# Modules whose module-scoped fixture (a run, a chain of processes) is worth building once: under
# `-n 2` each of them runs on one xdist worker; every other test is scheduled alone, as in
# xdist's default "load". (xdist's own `--dist loadgroup` marks are ignored with pytest 9.2:
# pytest-dev/pytest-xdist#1386. Before this, test_multihost's 2-minute chain ran on both workers.)
ONE_WORKER = {"test_chat", "test_chat_tools", "test_cli", "test_convert", "test_convert_mixtral", "test_data",
              "test_dpo", "test_faults", "test_layout", "test_lora", "test_multihost", "test_prepare",
              "test_reliability", "test_serve", "test_sharding", "test_train"}


def pytest_xdist_make_scheduler(config, log):
  """xdist's scheduler for `-n N` (dist "load"): one work unit per ONE_WORKER module, one per other test."""
  if config.getvalue("dist") != "load":
    return None
  from xdist.scheduler import LoadScopeScheduling  # pylint: disable=g-import-not-at-top

  class ModuleOrTest(LoadScopeScheduling):
    def _split_scope(self, nodeid):
      module = nodeid.split("::", 1)[0]
      return module if os.path.basename(module)[:-3] in ONE_WORKER else nodeid

  return ModuleOrTest(config, log)


def with_default_codegen(test, codegen="default", xla_flags=XLA_FLAGS_GIVEN):
  """Runs the test in a pytest subprocess with XLA's default codegen (without FAST_XLA): for
  claims about the programs users run that the cheap codegen does not keep. steps_per_call=4
  trains bitwise as 1 with the default codegen; at LLVM -O0 they differ by 1 ulp."""
  @functools.wraps(test)
  def run(*args, **kwargs):
    if os.environ.get("JAXFORMER_TEST_CODEGEN") in ("default", codegen):
      return test(*args, **kwargs)
    node = os.environ["PYTEST_CURRENT_TEST"].rsplit(" ", 1)[0]
    env = {**os.environ, "JAXFORMER_TEST_CODEGEN": codegen, "XLA_FLAGS": xla_flags}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "",  # slow ones too
                           f"--basetemp={tempfile.mkdtemp()}", node], env=env, capture_output=True, text=True,
                          cwd=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-5000:] + proc.stderr[-2000:]
  return run


def with_fusion_emitters(test):
  """Runs the test in a pytest subprocess with FAST_XLA's LLVM settings but XLA's MLIR fusion emitters
  (the default): for tolerances set by how those fusions round (scan vs unrolled gradients at rtol 1e-5)."""
  return with_default_codegen(test, "fusion_emitters", f"{XLA_FLAGS_GIVEN} {FAST_XLA_O0}".strip())
