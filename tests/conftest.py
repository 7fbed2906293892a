"""Shared fixtures: a JAX compilation cache and one short tiny_encdec training run."""

import os

import jax
import pytest

from jaxformer import config as config_lib
from jaxformer import train

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
