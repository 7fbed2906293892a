"""Faults below preemption: a second run on the same workdir, damaged checkpoints, a poisoned state, a full disk.

Each test fails on the code before the workdir lease and checkpoint checksums (see the README's Reliability).
"""

import errno
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from orbax.checkpoint._src.serialization import serialization as orbax_serialization

from jaxformer import checkpoint as checkpoint_lib
from jaxformer import evaluate
from jaxformer import tasks
from jaxformer import train
from test_reliability import ARGS, launch, losses_by_step, snapshot, steps_on_disk


@pytest.fixture(scope="module")
def run12(tmp_path_factory):
  """An undamaged 12-step tiny_encdec run, in process: checkpoints 8, 10, 12, a loss logged at every step."""
  workdir = tmp_path_factory.mktemp("run12")
  train.train_and_evaluate(train.config_lib.load_config("tiny_encdec", ARGS), str(workdir), log=lambda *a: None)
  return workdir


def copy_run(src, dst):
  shutil.copytree(src, dst, ignore=shutil.ignore_patterns("tb"))
  return dst


def damage(workdir, step, how):
  """Truncates `state/_sharding` to half (the issue's `Invalid JSON`), or flips 64 bytes in the middle
  of the largest array data file (the issue's silent garbage), of checkpoint `step`."""
  state = os.path.join(workdir, "checkpoints", str(step), "state")
  if how == "truncated":
    path = os.path.join(state, "_sharding")
    os.truncate(path, os.path.getsize(path) // 2)
  else:
    path = max(glob.glob(f"{state}/ocdbt.process_*/d/*"), key=os.path.getsize)
    with open(path, "r+b") as f:
      f.seek(os.path.getsize(path) // 2)
      data = f.read(64)
      f.seek(os.path.getsize(path) // 2)
      f.write(bytes(b ^ 0xFF for b in data))


def params_at(workdir, step):
  return jax.device_get(evaluate.load_run(str(workdir), step=step, log=lambda *a: None)[2])


def assert_bitwise(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(x, y)


def all_files(workdir):
  """{relative path: (size, sha256)} of every file under `workdir`."""
  out = {}
  for path in sorted(glob.glob(f"{workdir}/**", recursive=True)):
    if os.path.isfile(path):
      with open(path, "rb") as f:
        out[os.path.relpath(path, workdir)] = (os.path.getsize(path), hashlib.sha256(f.read()).hexdigest())
  return out


def wait_stopped(pid, timeout=30):
  """Until `pid` is stopped (a signal is delivered asynchronously): from then on it writes nothing."""
  deadline = time.time() + timeout
  while time.time() < deadline:
    with open(f"/proc/{pid}/stat") as f:
      if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
        return
    time.sleep(0.01)
  raise TimeoutError(f"pid {pid} did not stop")


def main_error(capfd, argv):
  """`train.py argv` in process, expected to fail: its stderr (everything written to fd 2)."""
  capfd.readouterr()
  with pytest.raises(SystemExit) as exit_info:
    train.main(argv)
  err = capfd.readouterr().err
  assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
  return err


def test_second_run_on_a_busy_workdir_stops_at_once(run12, tmp_path, capfd):
  """While run A holds the workdir (stopped with SIGSTOP mid-run, so nothing moves): eval reads it,
  run B exits 2 with one line naming A and writes nothing; A then finishes as if B had never started."""
  workdir = tmp_path / "run"
  tokenizer = f"data.tokenizer_path={run12}/tokenizer.model"
  a = launch(workdir, tokenizer, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  out = []
  try:
    for line in a.stdout:
      out.append(line)
      m = re.match(r"step (\d+)/", line)
      if m and int(m.group(1)) >= 3 and 2 in steps_on_disk(workdir):
        break
    a.send_signal(signal.SIGSTOP)
    wait_stopped(a.pid)
    holder = json.loads((workdir / "lease.json").read_text())
    assert (holder["pid"], holder["host"]) == (a.pid, socket.gethostname()), holder
    before = all_files(workdir)
    assert evaluate.load_run(str(workdir), step=2, log=lambda *a: None)[4]["step"] == 2  # eval takes no lease
    err = main_error(capfd, ["--config", "tiny_encdec", "--workdir", str(workdir), *ARGS, tokenizer])
    assert err.startswith(f"error: workdir {workdir} is in use by pid {a.pid} on host {socket.gethostname()} "), err
    assert all_files(workdir) == before  # nothing of B (or of eval): not a line of metrics, not a checkpoint
  finally:
    a.send_signal(signal.SIGCONT)
  out.append(a.communicate(timeout=300)[0])
  assert a.returncode == 0 and "resumed" not in "".join(out), "".join(out)
  steps = [r["step"] for r in map(json.loads, open(workdir / "metrics.jsonl")) if "loss" in r]
  assert steps == list(range(1, 13))  # A's records only, each once
  assert losses_by_step(workdir) == losses_by_step(run12) and not (workdir / "lease.json").exists()


@pytest.mark.parametrize("how", ["truncated", "bitflipped"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(run12, tmp_path, how):
  """Checkpoint 12 damaged: one warning naming it, moved aside; the run resumes from 10 and logs
  the losses of the undamaged run at steps 11 and 12, ending with bitwise its parameters."""
  workdir = copy_run(run12, tmp_path / "run")
  damage(workdir, 12, how)
  lines = []
  result = train.train_and_evaluate(train.config_lib.load_config("tiny_encdec", ARGS), str(workdir),
                                    log=lines.append)
  warnings = [line for line in lines if line.startswith("warning")]
  assert len(warnings) == 1, lines
  assert warnings[0].startswith(f"warning: checkpoint {workdir}/checkpoints/12 is damaged: "), warnings
  assert warnings[0].endswith(f"moved it to {workdir}/checkpoints/12.corrupt and resumed from step 10"), warnings
  assert f"resumed from {workdir}/checkpoints/10 (step 10)" in lines and result["step"] == 12
  assert losses_by_step(workdir) == losses_by_step(run12)  # steps 11 and 12 logged again, the same
  assert steps_on_disk(workdir) == [8, 10, 12] and (workdir / "checkpoints" / "12.corrupt").is_dir()
  assert_bitwise(params_at(workdir, 12), params_at(run12, 12))


def test_no_intact_checkpoint_is_one_line_and_moves_nothing(run12, tmp_path, capfd):
  workdir = copy_run(run12, tmp_path / "run")
  damage(workdir, 8, "truncated")
  damage(workdir, 10, "bitflipped")
  os.truncate(workdir / "checkpoints" / "12" / "meta" / "metadata", 100)
  before = snapshot(workdir)
  err = main_error(capfd, ["--config", "tiny_encdec", "--workdir", str(workdir), *ARGS])
  assert err.startswith(f"error: no intact checkpoint in {workdir}/checkpoints: steps 8, 10, 12 damaged (newest: "), err
  assert snapshot(workdir) == before and sorted(os.listdir(workdir / "checkpoints")) == ["10", "12", "8"]
  assert not (workdir / "lease.json").exists()


def test_nonfinite_steps_in_a_row_stop_the_run(run12, tmp_path, monkeypatch, capfd):
  """NaN loss from step 6 on: the default `train.max_skipped_steps=10` stops the run at step 15, naming
  checkpoint 4 (old: all 16 steps, 11 of them skipped, exit 0)."""
  loss, batch_at = tasks.TranslationTask.loss, tasks.TranslationTask.train_batch

  def poisoned_loss(model, params, batch, *args):
    out = loss(model, params, batch, *args)
    return (out[0] * batch["scale"][0], *out[1:]) if "scale" in batch else out

  def poisoned_batch(self, step):
    batch = batch_at(self, step)
    return {**batch, "scale": np.full(len(batch["inputs"]), np.nan if step >= 5 else 1.0, np.float32)}

  monkeypatch.setattr(tasks.TranslationTask, "loss", staticmethod(poisoned_loss))
  monkeypatch.setattr(tasks.TranslationTask, "train_batch", poisoned_batch)
  workdir = tmp_path / "run"
  err = main_error(capfd, ["--config", "tiny_encdec", "--workdir", str(workdir), *ARGS, "train.num_steps=16",
                           "train.keep_checkpoints=20", f"data.tokenizer_path={run12}/tokenizer.model"])
  assert err == (f"error: 10 non-finite steps in a row (steps 6-15 skipped, train.max_skipped_steps=10): the state "
                 f"or the data is poisoned; the last good checkpoint is {workdir}/checkpoints/4\n")
  assert steps_on_disk(workdir) == [2, 4, 6, 8, 10, 12, 14] and max(losses_by_step(workdir)) == 15


def test_a_state_with_nan_is_never_saved(run12, tmp_path, monkeypatch, capfd):
  """An update that makes the parameters infinite (finite loss and gradient, so not skipped): the
  save at step 2 refuses the state and stops the run (old: saved it, every later step skipped, exit 0)."""
  apply_updates = optax.apply_updates
  monkeypatch.setattr(optax, "apply_updates", lambda params, updates: jax.tree.map(
      lambda p: p * np.inf, apply_updates(params, updates)))
  workdir = tmp_path / "run"
  err = main_error(capfd, ["--config", "tiny_encdec", "--workdir", str(workdir), *ARGS,
                           f"data.tokenizer_path={run12}/tokenizer.model"])
  assert err.startswith("error: the train state at step 2 holds NaN or inf (params/") and err.endswith(
      "so it was not saved; no checkpoint was completed before it\n"), err
  assert steps_on_disk(workdir) == []


@pytest.fixture
def tmpfs(tmp_path):
  """A 4 MiB tmpfs (needs root; skipped elsewhere, where the injected variant still runs)."""
  mount = tmp_path / "tmpfs"
  mount.mkdir()
  if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode:
    pytest.skip("cannot mount a tmpfs here (not root)")
  yield mount
  subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.parametrize("disk", ["injected", "tmpfs"])
def test_full_disk_during_a_save_is_one_line_and_keeps_the_earlier_checkpoints(run12, tmp_path, monkeypatch,
                                                                              capfd, request, disk):
  """The save of step 10 runs out of space: one line, exit 2; checkpoints 4, 6, 8 as they were
  (none deleted to make room), 8 bitwise the undamaged run's, nothing of 10 left behind.
  `injected`: orbax's array writer raises ENOSPC in its background thread. `tmpfs`: `checkpoints/`
  is a real 4 MiB filesystem, filled up just before that save."""
  workdir = tmp_path / "run"
  where = "mounted on"
  if disk == "tmpfs":
    mount = request.getfixturevalue("tmpfs")
    workdir.mkdir()
    os.symlink(mount, workdir / "checkpoints")
    where = f"tmpfs (mounted on {mount})"
  else:
    write = orbax_serialization.async_serialize_from_host

    async def no_space_for_step_10(rslices, tensorstore_spec, **kwargs):
      if "/10.orbax-checkpoint-tmp" in json.dumps(tensorstore_spec, default=str):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
      return await write(rslices, tensorstore_spec, **kwargs)

    monkeypatch.setattr(orbax_serialization, "async_serialize_from_host", no_space_for_step_10)
  save, before = checkpoint_lib.Checkpointer.save, {}

  def save_and_watch(self, step, *args, **kwargs):
    if step == 10:
      self.wait()
      before.update(snapshot(workdir))
      if disk == "tmpfs":  # leave 64 KiB: the 10 KiB of metadata files fit, the arrays do not
        stat = os.statvfs(mount)
        with open(mount / "filler", "wb") as f:
          f.write(b"\0" * (stat.f_bavail * stat.f_frsize - 64 * 1024))
    return save(self, step, *args, **kwargs)

  monkeypatch.setattr(checkpoint_lib.Checkpointer, "save", save_and_watch)
  err = main_error(capfd, ["--config", "tiny_encdec", "--workdir", str(workdir), *ARGS,
                           f"data.tokenizer_path={run12}/tokenizer.model"])
  assert err.startswith("error: no space left on ") and where in err and err.endswith(
      " while saving step 10; the last complete checkpoint is step 8\n"), err
  if disk == "tmpfs":
    os.remove(mount / "filler")
  assert steps_on_disk(workdir) == [4, 6, 8] and snapshot(workdir) == before
  assert not glob.glob(f"{workdir}/checkpoints/10*")
  assert_bitwise(params_at(workdir, 8), params_at(run12, 8))


def test_poisoned_message_when_the_checkpoint_before_was_pruned():
  class Ckpt:
    directory = "/w/checkpoints"
    all_steps = staticmethod(lambda: [10, 12, 14])
  assert train._poisoned_message(10, 15, 10, Ckpt()) == (  # pylint: disable=protected-access
      "10 non-finite steps in a row (steps 6-15 skipped, train.max_skipped_steps=10): the state or the data is "
      "poisoned; checkpoints [10, 12, 14] were saved during the skipped steps and hold the weights of step 5")
  Ckpt.all_steps = staticmethod(lambda: [])
  assert train._poisoned_message(3, 3, 3, Ckpt()).endswith("no checkpoint was saved before step 1")  # pylint: disable=protected-access
