"""Tests for jaxformer.metrics."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import metrics


@pytest.mark.parametrize("seconds,text", [
    (0, "0s"), (45.4, "45s"), (59.6, "1m00s"), (725, "12m05s"),
    (3720, "1h02m"), (86400 + 3 * 3600 + 59, "1d03h"),
    (None, "?"), (float("nan"), "?"), (-1, "?"),
])
def test_format_eta(seconds, text):
  assert metrics.format_eta(seconds) == text


def test_format_count():
  assert metrics.format_count(12345.4) == "12,345"
  assert metrics.format_count(7) == "7"


def test_writer_jsonl_tensorboard_and_plot(tmp_path):
  writer = metrics.MetricWriter(tmp_path, total_steps=100)
  for step in range(1, 6):
    writer.write(step, {"loss": jnp.float32(4.0 / step),
                        "nll": np.float64(3.0 / step), "lr": 1e-3})
  writer.write(5, {"val_loss": 1.5, "val_bleu": 12.0, "bad": float("nan")})
  writer.close()

  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  records = [json.loads(line) for line in lines]  # Strict: no NaN tokens.
  assert len(records) == 6
  assert records[0]["step"] == 1 and records[0]["loss"] == 4.0
  assert isinstance(records[0]["time"], float)
  assert records[-1]["bad"] is None and "NaN" not in lines[-1]
  tb_files = os.listdir(tmp_path / "tb")
  assert any(f.startswith("events.out.tfevents") for f in tb_files)
  assert os.path.getsize(tmp_path / "tb" / tb_files[0]) > 100

  # A torn last line (killed mid-write) and missing keys must not matter.
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 6, "lo')
  png = tmp_path / "plots" / "metrics.png"
  metrics.plot_metrics(tmp_path / "metrics.jsonl", png)
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  empty = tmp_path / "empty.png"
  metrics.plot_metrics(tmp_path / "metrics.jsonl", empty, keys=("acc",))
  assert empty.read_bytes()[:4] == b"\x89PNG"


def test_disabled_writer_is_noop(tmp_path, capsys):
  writer = metrics.MetricWriter(tmp_path / "w", total_steps=10, enabled=False)
  writer.write(1, {"loss": 1.0})
  assert writer.progress(1, {"loss": 1.0}) is None
  writer.close()
  assert not (tmp_path / "w").exists()
  assert capsys.readouterr().out == ""


def test_progress_line(tmp_path, monkeypatch, capsys):
  clock = iter([100.0, 110.0, 120.0])
  monkeypatch.setattr(metrics, "_clock", lambda: next(clock))
  writer = metrics.MetricWriter(tmp_path, total_steps=100000)
  first = writer.progress(1000, {"loss": 3.5})
  assert first == "step 1000/100000 | loss 3.5"  # No ETA before a rate.
  writer.progress(1100, {"loss": 3.3})  # 0.1 s/step.
  line = writer.progress(1200, {
      "mfu": 0.312, "lr": 6.9e-4, "nll": 2.9, "loss": jnp.float32(3.2141),
      "tok_per_sec": 12345.4, "grad_norm": 0.51234})
  writer.close()
  # 98,800 steps left at 0.1 s/step.
  assert line == ("step 1200/100000 | loss 3.214 | nll 2.9 | lr 6.9e-04 | "
                  "12,345 tok/s | mfu 31.2% | grad_norm 0.5123 | eta 2h44m")
  assert line in capsys.readouterr().out


def test_progress_eta_respects_time_budget(tmp_path, monkeypatch):
  clock = iter([100.0, 110.0])
  monkeypatch.setattr(metrics, "_clock", lambda: next(clock))
  monkeypatch.setattr(metrics, "_wall", lambda: 5000.0)
  writer = metrics.MetricWriter(tmp_path, total_steps=100000)
  writer.deadline = 5000.0 + 1800  # train.max_minutes=30 started now
  writer.progress(1000, {"step_ms": 100.0})
  line = writer.progress(1100, {"step_ms": 100.0})  # 0.1 s/step: 2h45m of steps, 30 min of budget
  writer.close()
  assert line == "step 1100/100000 | 100 ms/step | eta 30m00s (max_minutes)"
