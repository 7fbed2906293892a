"""Performance options must not change results: `train.steps_per_call` K > 1 trains bitwise as K = 1."""

import json
import os
import types

import jax
import numpy as np
import pytest

from conftest import tiny_config, with_default_codegen
from jaxformer import inspect as inspect_lib
from jaxformer import runtime
from jaxformer import train
from jaxformer.config import load_config, replace


def _run(cfg, workdir):
  result = train.train_and_evaluate(cfg, str(workdir), log=lambda *a: None)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  logged = [(r["step"], r.get("loss"), r.get("val_nll")) for r in records]
  return jax.device_get(result["state"]), logged, records


def _assert_identical(a, b):
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_steps_this_call_keeps_boundaries_exact():
  t = load_config("gpt2_tiny", ["train.steps_per_call=4", "train.log_every=6", "train.eval_every=12",
                                "train.checkpoint_every=12", "train.num_steps=14"]).train
  lm, translation = types.SimpleNamespace(name="lm"), types.SimpleNamespace(name="translation")
  steps, step = [], 0
  while step < t.num_steps:
    steps.append(train._steps_this_call(step, t, lm))
    step += steps[-1]
  # 0-4 (a chunk), 4, 5 -> 6 (log), 6-10, 10, 11 -> 12 (log, eval, checkpoint), 12, 13 -> 14 (end).
  assert steps == [4, 1, 1, 4, 1, 1, 1, 1]
  assert train._steps_this_call(0, t, translation) == 1


@with_default_codegen
def test_lm_steps_per_call_is_bitwise_identical(tmp_path, monkeypatch):
  """gpt2_tiny with dropout (so the per-step rng goes through the scan too): K=1 vs K=4."""
  monkeypatch.setattr(runtime.inspect_lib, "peak_flops", lambda kind: 1e12)  # as if on a known device
  rng = np.random.default_rng(0)
  words = "the cat dog sat on a mat and ran to big red house".split()
  (tmp_path / "text.txt").write_text("\n".join(" ".join(rng.choice(words, 8)) + "." for _ in range(200)))
  cfg = load_config("gpt2_tiny", [f"data.text_path={tmp_path / 'text.txt'}", "model.num_layers=1",
                                  "model.dropout_rate=0.1", "train.num_steps=10", "train.log_every=4",
                                  "train.eval_every=8", "train.checkpoint_every=8", "train.eval_batches=1",
                                  "train.sample_every_eval=false"])
  state_1, logged_1, _ = _run(cfg, tmp_path / "k1")
  state_4, logged_4, records = _run(replace(cfg, **{"train.steps_per_call": 4}), tmp_path / "k4")
  assert int(state_4["step"]) == 10
  _assert_identical(state_1, state_4)
  # Same steps logged and evaluated, same values; the logged training loss only to float32
  # rounding: XLA may order the float32 sum over tokens differently inside the scan (the
  # gradients, and so the state above, stay bitwise equal).
  assert [(s, v) for s, _, v in logged_1] == [(s, v) for s, _, v in logged_4]
  assert [loss is None for _, loss, _ in logged_1] == [loss is None for _, loss, _ in logged_4]
  np.testing.assert_allclose([loss for _, loss, _ in logged_1 if loss is not None],
                             [loss for _, loss, _ in logged_4 if loss is not None], rtol=1e-6)
  # MFU = achieved model FLOP/s over the (patched) peak: tokens/s x the 6N + attention FLOPs per token / 1e12.
  per_token = inspect_lib.flops_per_token(cfg, cfg.data.block_size)["train"]
  logged = [r for r in records if "loss" in r]
  assert len(logged) == 3
  for r in logged:
    assert r["mfu"] == pytest.approx(r["tokens_per_sec"] * per_token / 1e12, rel=1e-4)


@pytest.mark.slow
@with_default_codegen
def test_translation_steps_per_call_is_bitwise_identical(tmp_path):
  """Translation ignores steps_per_call (bucket shapes vary; see `train._steps_this_call`)."""
  cfg = tiny_config("model.num_layers=1", "train.num_steps=8", "train.log_every=8", "train.checkpoint_every=8")
  state_1, logged_1, _ = _run(cfg, tmp_path / "k1")
  state_4, logged_4, _ = _run(replace(cfg, **{"train.steps_per_call": 4}), tmp_path / "k4")
  _assert_identical(state_1, state_4)
  assert logged_1 == logged_4


def test_cpu_mfu_divides_by_the_measured_matmul_peak(tmp_path, monkeypatch):
  """On a CPU (no datasheet peak) the progress line's MFU is the model FLOP/s over the
  matmul speed measured once at the start, in the config's matmul dtype."""
  assert jax.devices()[0].platform == "cpu"
  measured = []
  monkeypatch.setattr(runtime.inspect_lib, "matmul_peak",
                      lambda n=1024, repeats=5, dtype="float32": measured.append(dtype) or 5e9)
  (tmp_path / "text.txt").write_text("the cat sat on the mat and ran to the big red house.\n" * 200)
  cfg = load_config("gpt2_tiny", [f"data.text_path={tmp_path / 'text.txt'}", "model.num_layers=1",
                                  "model.matmul_dtype=bfloat16", "train.num_steps=8", "train.log_every=4",
                                  "train.eval_every=8", "train.checkpoint_every=8", "train.eval_batches=1",
                                  "train.sample_every_eval=false"])
  _, _, records = _run(cfg, tmp_path / "run")
  assert measured == ["bfloat16"]
  per_token = inspect_lib.flops_per_token(cfg, cfg.data.block_size)["train"]
  logged = [r for r in records if "loss" in r]
  assert len(logged) == 2
  for r in logged:
    assert r["mfu"] == pytest.approx(r["tokens_per_sec"] * per_token / 5e9, rel=1e-4)


def test_matmul_peak_is_flops_per_second():
  """`inspect.matmul_peak` = 2 n^3 FLOPs over the best of its timed products (a fake
  clock that advances 0.25 s per reading), for float32 and bf16 operands."""
  ticks = iter(range(1000))
  clock = lambda: 0.25 * next(ticks)
  for dtype in ("float32", "bfloat16"):
    assert inspect_lib.matmul_peak(n=64, repeats=3, dtype=dtype, clock=clock) == pytest.approx(2 * 64 ** 3 / 0.25)


def test_mfu_bookkeeping_compiles_nothing():
  """The FLOP count and the CPU peak probe add no program to a run's `compiled N XLA
  programs` (the FLOP count traces the model under eval_shape only)."""
  cfg = load_config("shakespeare_char", ["model.d_model=24", "model.d_ff=40"])  # shapes not seen before
  before = len(runtime.COMPILES)
  inspect_lib.flops_per_token(cfg, 64)
  runtime.peak_flops(cfg, log=lambda *a: None)  # pylint: disable=protected-access
  assert len(runtime.COMPILES) == before
