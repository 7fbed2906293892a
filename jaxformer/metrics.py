"""Metric logging: JSON lines + TensorBoard, a progress line, and plots."""

import errno
import json
import math
import os
import time

import numpy as np

# Step timing uses a monotonic clock: wall time can jump (NTP) mid-run.
_clock = time.monotonic
_wall = time.time  # the clock train.max_minutes deadlines are set in


def format_eta(seconds):
  """`3725` -> '1h02m'; '2d03h', '12m05s', '45s'; '?' when unknown."""
  if seconds is None or not math.isfinite(seconds) or seconds < 0:
    return "?"
  s = int(round(seconds))
  days, s = divmod(s, 86400)
  hours, s = divmod(s, 3600)
  minutes, s = divmod(s, 60)
  if days:
    return f"{days}d{hours:02d}h"
  if hours:
    return f"{hours}h{minutes:02d}m"
  if minutes:
    return f"{minutes}m{s:02d}s"
  return f"{s}s"


def format_count(n):
  """`12345.6` -> '12,346'."""
  return f"{int(round(n)):,}"


def _to_python(value):
  """Scalars (python, numpy, jax) -> int/float; non-finite -> None.

  NaN/inf would make the JSON line unreadable for strict parsers (jq).
  """
  if isinstance(value, (str, bool)) or value is None:
    return value
  value = np.asarray(value)
  if value.size != 1:
    return value.tolist()
  value = value.item()
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


# How `progress` shows some keys; others print as `name 1.234`.
_FORMATS = {
    "lr": lambda v: f"lr {v:.1e}",
    "tok_per_sec": lambda v: f"{format_count(v)} tok/s",
    "tokens_per_sec": lambda v: f"{format_count(v)} tok/s",
    "mfu": lambda v: f"mfu {100 * v:.1f}%",  # A fraction of peak FLOPs.
    "step_ms": lambda v: f"{v:,.0f} ms/step",
}
_ORDER = ("loss", "nll", "lr", "tok_per_sec", "tokens_per_sec", "step_ms", "mfu")


class MetricWriter:
  """Writes `<workdir>/metrics.jsonl` and TensorBoard scalars (`<workdir>/tb`).

  With `enabled=False` (processes other than 0 in multi-host) every method is
  a no-op, so callers need no `if process_index == 0` around it.
  """

  def __init__(self, workdir, total_steps, enabled=True, ema=0.9):
    """`ema` weighs the previous step-time average in the ETA estimate."""
    self.total_steps = int(total_steps)
    self.enabled = enabled
    self._ema = ema
    self._step_time = None  # Moving average of seconds per step.
    self._last = None  # (time, step) at the previous `progress` call.
    self.deadline = None  # time.time() at which training stops regardless of steps (max_minutes)
    self._jsonl = self._tb = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      self.jsonl_path = os.path.join(workdir, "metrics.jsonl")
      # Line-buffered append: a restarted run continues the same file and a
      # killed one loses at most the line being written.
      self._jsonl = open(self.jsonl_path, "a", buffering=1)
      # Imported here so non-zero processes never load TensorBoard.
      import tensorboardX  # pylint: disable=g-import-not-at-top
      self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, "tb"))

  def write(self, step, metrics, when=None):
    """Appends `{"step", "time", **metrics}` as a JSON line and to TensorBoard; `time` is `when`
    (default: now), e.g. the moment the logged rates were measured."""
    if not self.enabled:
      return
    record = {"step": int(step), "time": time.time() if when is None else when}
    record.update({k: _to_python(v) for k, v in metrics.items()})
    self._jsonl.write(json.dumps(record) + "\n")
    for key, value in metrics.items():
      value = _to_python(value)
      if isinstance(value, (int, float)) and not isinstance(value, bool):
        self._tb.add_scalar(key, value, int(step))

  def progress(self, step, metrics):
    """Prints and returns one line: step, known metrics, throughput, ETA."""
    if not self.enabled:
      return None
    now = _clock()
    if self._last is not None and step > self._last[1]:
      dt = (now - self._last[0]) / (step - self._last[1])
      self._step_time = dt if self._step_time is None else (
          self._ema * self._step_time + (1 - self._ema) * dt)
    self._last = (now, step)

    parts = [f"step {step}/{self.total_steps}"]
    keys = [k for k in _ORDER if k in metrics]
    keys += [k for k in metrics if k not in _ORDER]
    for key in keys:
      value = _to_python(metrics[key])
      if not isinstance(value, (int, float)) or isinstance(value, bool):
        continue
      parts.append(_FORMATS.get(key, lambda v, k=key: f"{k} {v:.4g}")(value))
    if self._step_time is not None:
      remaining = max(self.total_steps - step, 0) * self._step_time
      if self.deadline is not None and _wall() + remaining > self.deadline:
        parts.append(f"eta {format_eta(max(self.deadline - _wall(), 0))} (max_minutes)")
      else:
        parts.append(f"eta {format_eta(remaining)}")
    line = " | ".join(parts)
    print(line, flush=True)
    return line

  def close(self):
    """Flushes and closes the files."""
    if self._jsonl is not None:
      files, self._jsonl, self._tb = (self._jsonl, self._tb), None, None
      for f in files:
        try:
          f.close()
        except OSError as e:  # a full disk: the run is already stopping with one line that says so
          if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise


def read_jsonl(path):
  """The records of a metrics.jsonl; skips a torn last line from a crash."""
  records = []
  with open(path) as f:
    for line in f:
      try:
        records.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return records


def plot_metrics(jsonl_path, png_path,
                 keys=("loss", "nll", "val_loss", "val_nll", "val_bleu")):
  """Plots each present key vs step; `x` and `val_x` share a panel."""
  # No pyplot: its global state and GUI backends have no place in training.
  from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
  from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top

  series = {}  # key -> (steps, values), for keys with at least one value.
  for record in read_jsonl(jsonl_path):
    for key in keys:
      if isinstance(record.get(key), (int, float)) and "step" in record:
        steps, values = series.setdefault(key, ([], []))
        steps.append(record["step"])
        values.append(record[key])
  families = {}  # 'loss' -> ['loss', 'val_loss'], in `keys` order.
  for key in keys:
    if key in series:
      families.setdefault(key.removeprefix("val_"), []).append(key)

  n = max(len(families), 1)
  fig = Figure(figsize=(6, 3 * n))
  FigureCanvasAgg(fig)
  axes = fig.subplots(n, 1, squeeze=False)[:, 0]
  if not families:
    axes[0].text(0.5, 0.5, f"no {', '.join(keys)} in {jsonl_path}",
                 ha="center", va="center", wrap=True)
  for ax, (family, members) in zip(axes, families.items()):
    for key in members:
      steps, values = series[key]
      # Validation points are sparse: markers keep single points visible.
      ax.plot(steps, values, label=key,
              marker="o" if key.startswith("val_") else None, markersize=3)
    ax.set_ylabel(family)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(png_path)), exist_ok=True)
  fig.savefig(png_path, dpi=100)
