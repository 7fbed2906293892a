"""Reliability: preemption and exact resume, NaN stop, one-line errors that leave checkpoints alone."""

import glob
import hashlib
import json
import os
import pathlib
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jaxformer import config as config_lib
from jaxformer import evaluate
from jaxformer import generate
from jaxformer import tasks
from jaxformer import tokenizer as tokenizer_lib
from jaxformer import train
from jaxformer.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parent.parent
ARGS = ("model.num_layers=1", "data.tokens_per_batch=256", "data.synthetic_size=2000", "data.max_len=24",
        "train.num_steps=12", "train.checkpoint_every=2", "train.log_every=1", "train.eval_every=1000",
        "train.eval_batches=1", "train.keep_checkpoints=3")

# CPU, and the compilation cache of conftest.py for every jit, however quick.
ENV = {"JAX_PLATFORMS": "cpu", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
       "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def launch(workdir, *extra, **kwargs):
  """`python train.py --config tiny_encdec --workdir WORKDIR ARGS extra` as a subprocess."""
  return subprocess.Popen([sys.executable, "train.py", "--config", "tiny_encdec", "--workdir", str(workdir),
                           *ARGS, *extra], cwd=ROOT, env={**os.environ, **ENV}, text=True, **kwargs)


def steps_on_disk(workdir):
  """Complete checkpoint steps (plain integer directories), ascending."""
  names = os.listdir(os.path.join(workdir, "checkpoints"))
  return sorted(int(n) for n in names if n.isdigit())


def params_of(workdir):
  return jax.device_get(evaluate.load_run(str(workdir), log=lambda *a: None)[2])


def losses_by_step(workdir):
  """{step: loss} from metrics.jsonl; a step logged twice (before a kill, after resuming) keeps the last."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def snapshot(workdir):
  """{relative path: (size, mtime_ns, sha256)} of the checkpoints, config and tokenizer."""
  out = {}
  for path in sorted(glob.glob(f"{workdir}/checkpoints/**", recursive=True)) + [
      f"{workdir}/config.json", f"{workdir}/tokenizer.model"]:
    if os.path.isfile(path):
      with open(path, "rb") as f:
        out[os.path.relpath(path, workdir)] = (os.path.getsize(path), os.stat(path).st_mtime_ns,
                                               hashlib.sha256(f.read()).hexdigest())
  return out


def interrupt(workdir, sig, after_step, delay=0.0, during_save=False):
  """Trains until the log shows `after_step`, then sends `sig` (`delay` s later, or while the
  next checkpoint save is unfinished). Returns (returncode, output, whether a save was in flight)."""
  proc = launch(workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  out, in_save = [], False
  try:
    for line in proc.stdout:
      out.append(line)
      m = re.match(r"step (\d+)/", line)
      if m and int(m.group(1)) >= after_step:
        deadline = time.time() + 10
        while during_save and not in_save and time.time() < deadline:
          in_save = bool(glob.glob(f"{workdir}/checkpoints/{m.group(1)}.orbax-checkpoint-tmp*"))
        time.sleep(delay)
        proc.send_signal(sig)
        break
    out.append(proc.stdout.read())
    proc.wait(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  return proc.returncode, "".join(out), in_save


def resumed_step(output):
  m = re.search(r"resumed from \S+ \(step (\d+)\)", output)
  return int(m.group(1)) if m else 0


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
  """An uninterrupted 12-step run: checkpoints 8, 10, 12 (keep_checkpoints=3)."""
  workdir = tmp_path_factory.mktemp("baseline")
  p = launch(workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  out = p.communicate(timeout=300)[0]
  assert p.returncode == 0, out
  return workdir


@pytest.mark.slow  # kill -9 of a real train.py; test_train's in-process resume stays in the quick suite
def test_killed_and_resumed_run_matches_the_uninterrupted_one(baseline, tmp_path):
  """3 SIGKILLs (one mid-save) and a SIGTERM, each followed by the same command: same final params."""
  rng = random.Random(0)
  workdir = tmp_path / "run"
  # SIGKILL while the save of an even step is unfinished: restart uses the previous complete one.
  k = rng.choice([4, 6])
  rc, out, in_save = interrupt(workdir, signal.SIGKILL, k, during_save=True)
  assert rc == -signal.SIGKILL and in_save, out
  unfinished = glob.glob(f"{workdir}/checkpoints/{k}.orbax-checkpoint-tmp*")
  assert unfinished and steps_on_disk(workdir)[-1] == k - 2, os.listdir(workdir / "checkpoints")
  killed_pid = json.loads((workdir / "lease.json").read_text())["pid"]  # the killed run's lease is left behind
  # Rename it to a step that is never saved again: it must be ignored, and cleaned up.
  os.rename(unfinished[0], workdir / "checkpoints" / f"{k - 1}.orbax-checkpoint-tmp")
  last = k - 2
  # SIGKILL at random moments: each restart resumes from the newest complete checkpoint.
  for _ in range(2):
    after = min(last + rng.randint(1, 3), 9)
    rc, out, _ = interrupt(workdir, signal.SIGKILL, after, delay=rng.uniform(0, 0.2))
    assert rc == -signal.SIGKILL and resumed_step(out) == last, out
    # ... and the next run takes it over at once: same host, and that pid no longer exists.
    assert f"took over the workdir lease of pid {killed_pid} on host " in out and "no longer exists" in out, out
    killed_pid = json.loads((workdir / "lease.json").read_text())["pid"]
    last = steps_on_disk(workdir)[-1]
  # SIGTERM: the step finishes, a checkpoint is written, exit 0 with how to resume.
  rc, out, _ = interrupt(workdir, signal.SIGTERM, min(last + rng.randint(1, 2), 10))
  assert rc == 0 and resumed_step(out) == last, out
  m = re.search(r"SIGTERM received: saved a checkpoint at step (\d+) .* Resume with the same command: python train\.py",
                out)
  assert m, out
  stopped = int(m.group(1))
  assert stopped < 12 and steps_on_disk(workdir)[-1] == stopped
  # The same command continues at the next step and finishes.
  p = launch(workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  out = p.communicate(timeout=300)[0]
  assert p.returncode == 0 and resumed_step(out) == stopped, out
  assert re.findall(r"^step (\d+)/12", out, re.M)[0] == str(stopped + 1), out
  # Bitwise the same parameters; old checkpoints and unfinished saves are cleaned up.
  for a, b in zip(jax.tree.leaves(params_of(baseline)), jax.tree.leaves(params_of(workdir))):
    np.testing.assert_array_equal(a, b)
  assert losses_by_step(workdir) == losses_by_step(baseline)  # the same batch at every step
  assert steps_on_disk(baseline) == steps_on_disk(workdir) == [8, 10, 12]
  assert sorted(os.listdir(workdir / "checkpoints")) == ["10", "12", "8"] and not (workdir / "lease.json").exists()


def test_nan_stop_keeps_the_last_good_checkpoint(baseline, tmp_path, monkeypatch, capsys):
  """A NaN loss at step 5: `skip` logs `skipped 1`; `stop` raises, checkpoint 4 is the last and intact."""
  loss = tasks.TranslationTask.loss
  batch_at = tasks.TranslationTask.train_batch

  def poisoned_loss(model, params, batch, *args):
    out = loss(model, params, batch, *args)
    return (out[0] * batch["scale"][0], *out[1:]) if "scale" in batch else out

  def poisoned_batch(self, step):
    batch = batch_at(self, step)
    return {**batch, "scale": np.full(len(batch["inputs"]), np.nan if step == 4 else 1.0, np.float32)}

  monkeypatch.setattr(tasks.TranslationTask, "loss", staticmethod(poisoned_loss))
  monkeypatch.setattr(tasks.TranslationTask, "train_batch", poisoned_batch)
  cfg = train.config_lib.load_config("tiny_encdec", [*ARGS, "train.num_steps=5",
                                                      f"data.tokenizer_path={baseline}/tokenizer.model"])
  skip = train.train_and_evaluate(cfg, str(tmp_path / "skip"))
  assert re.search(r"^step 5/5 \|.* \| skipped 1\b", capsys.readouterr().out, re.M)
  assert skip["skipped"] == 1 and steps_on_disk(tmp_path / "skip") == [2, 4, 5]
  # `stop`, resuming from 4 and logging rarely: it stops at step 5 and writes no checkpoint.
  stop_dir = tmp_path / "stop"
  shutil.copytree(tmp_path / "skip", stop_dir)
  shutil.rmtree(stop_dir / "checkpoints" / "5")
  before = snapshot(stop_dir)
  cfg = train.config_lib.replace(cfg, **{"train.nan_policy": "stop", "train.num_steps": 8, "train.log_every": 100})
  with pytest.raises(UserError, match=f"non-finite .* before step 5 .* last good checkpoint is in {stop_dir}"):
    train.train_and_evaluate(cfg, str(stop_dir))
  after = snapshot(stop_dir)
  assert {k: v for k, v in after.items() if k.startswith("checkpoints")} == {
      k: v for k, v in before.items() if k.startswith("checkpoints")} and steps_on_disk(stop_dir) == [2, 4]


def _other_tokenizer(path):
  tokenizer_lib.train_sentencepiece(["zebra quokka yak " * 20, "xylophone wombat"] * 50, 64, path)
  return path


# Cases with another source or tokenizer get a data folder of their own: the baseline's prepared
# data would refuse them first, with its own one-line error (tests/test_prepare.py).
BAD_TRAIN = [
    (["model.num_layres=2"], "unknown config key 'model.num_layres' (did you mean 'model.num_layers'?)"),
    (["train.num_steps=ten"], "override train.num_steps='ten': expected int"),
    (["data.source=local", "data.train_src={tmp}/a.en", "data.train_tgt={tmp}/a.de", "data.data_dir={tmp}/data"],
     "parallel files differ in length: {tmp}/a.en has 3 lines, {tmp}/a.de has 2"),
    (["data.source=local", "data.train_src={tmp}/empty.en", "data.train_tgt={tmp}/a.de", "data.data_dir={tmp}/data"],
     "{tmp}/empty.en: file is empty"),
    (["data.source=local", "data.train_src={tmp}/latin1.en", "data.train_tgt={tmp}/a.de",
      "data.data_dir={tmp}/data"], "{tmp}/latin1.en:2: not valid UTF-8"),
    (["model.d_model=64"], "checkpoint has params/"),
    (["data.tokenizer_path={tmp}/other.model", "data.data_dir={tmp}/data"], "tokenizer {tmp}/other.model is not the one"),
]


@pytest.mark.parametrize("overrides,message", BAD_TRAIN, ids=["key", "type", "lengths", "empty", "utf8", "shape",
                                                             "tokenizer"])
def test_bad_training_input_is_one_line_and_leaves_checkpoints_alone(baseline, tmp_path, capsys, overrides,
                                                                     message):
  (tmp_path / "a.en").write_text("one\ntwo\nthree\n")
  (tmp_path / "a.de").write_text("eins\nzwei\n")
  (tmp_path / "empty.en").write_text("\n")
  (tmp_path / "latin1.en").write_bytes("ok\nna\xefve\n".encode("latin-1"))
  if "other.model" in " ".join(overrides):
    _other_tokenizer(str(tmp_path / "other.model"))
  before = snapshot(baseline)
  argv = ["--config", "tiny_encdec", "--workdir", str(baseline), *ARGS,
          *[o.format(tmp=tmp_path) for o in overrides]]
  with pytest.raises(SystemExit) as exit_info:
    train.main(argv)
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
  assert message.format(tmp=tmp_path) in err and "Traceback" not in err
  assert snapshot(baseline) == before
  with pytest.raises(UserError):  # --debug raises, so the traceback shows
    train.main([*argv, "--debug"])


def test_unwritable_workdir(tmp_path, capsys):
  (tmp_path / "file").write_text("")
  with pytest.raises(SystemExit) as exit_info:
    train.main(["--config", "tiny_encdec", "--workdir", str(tmp_path / "file" / "run")])
  assert exit_info.value.code == 2
  assert capsys.readouterr().err == f"error: cannot write to workdir {tmp_path}/file/run: Not a directory\n"


def test_eval_and_generate_need_a_checkpoint(baseline, tmp_path, capsys):
  """No checkpoint, or a replaced tokenizer: one line, exit 2."""
  shutil.copy(baseline / "config.json", tmp_path / "config.json")
  for main in (evaluate.main, generate.main):
    with pytest.raises(SystemExit) as exit_info:
      main(["--workdir", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err == (
        f"error: no checkpoint in {tmp_path}/checkpoints: is --workdir '{tmp_path}' right, "
        "or has training not saved one yet?\n"), err
  copy = tmp_path / "copy"
  shutil.copytree(baseline, copy, ignore=shutil.ignore_patterns("tb", "cache"))
  _other_tokenizer(str(copy / "tokenizer.model"))
  with pytest.raises(SystemExit) as exit_info:
    evaluate.main(["--workdir", str(copy), "--limit", "1"])
  err = capsys.readouterr().err
  assert exit_info.value.code == 2 and err.startswith(f"error: tokenizer {copy}/tokenizer.model is not the one")


def test_cli_error_in_a_real_process(baseline):
  """Exit code 2, one line on stderr, no traceback; checkpoints untouched."""
  before = snapshot(baseline)
  p = launch(baseline, "model.d_model=64", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  err = p.communicate(timeout=300)[1]
  assert p.returncode == 2 and err.startswith("error: checkpoint has params/") and err.count("\n") == 1, err
  assert snapshot(baseline) == before


def test_ctrl_c_finishes_the_step_saves_and_exits_0(baseline, tmp_path):
  """SIGINT (Ctrl-C in a terminal) as SIGTERM: the step finishes, a checkpoint of it is saved (the
  parameters of the uninterrupted run at that step), exit 0 with how to resume; nothing is lost."""
  workdir = tmp_path / "run"
  rc, out, _ = interrupt(workdir, signal.SIGINT, 3)
  m = re.search(r"SIGINT received: saved a checkpoint at step (\d+) .* Resume with the same command: python train\.py",
                out)
  assert rc == 0 and m and "Traceback" not in out and "KeyboardInterrupt" not in out, out
  stopped = int(m.group(1))
  assert 3 <= stopped < 12 and steps_on_disk(workdir)[-1] == stopped
  assert not (workdir / "lease.json").exists()
  logged = losses_by_step(workdir)
  assert max(logged) == stopped and all(logged[s] == losses_by_step(baseline)[s] for s in logged)
  if stopped in steps_on_disk(baseline):  # the same weights as the uninterrupted run at that step
    want = jax.device_get(evaluate.load_run(str(baseline), step=stopped, log=lambda *a: None)[2])
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(params_of(workdir))):
      np.testing.assert_array_equal(a, b)


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory):
  """A 2-step gpt2_tiny run (a char LM) with its checkpoint at step 2."""
  tmp = tmp_path_factory.mktemp("lm_run")
  (tmp / "text.txt").write_text("the cat sat on the mat and ran to the big red house.\n" * 100)
  cfg = config_lib.load_config("gpt2_tiny", [f"data.text_path={tmp / 'text.txt'}", "model.num_layers=1",
                                             "train.num_steps=2", "train.checkpoint_every=2",
                                             "train.eval_every=1000", "train.sample_every_eval=false"])
  train.train_and_evaluate(cfg, str(tmp / "run"), log=lambda *a: None)
  return tmp / "run"


def test_generate_refuses_a_damaged_checkpoint(lm_run, tmp_path, capsys):
  """`python -m jaxformer.generate` on a checkpoint whose params fail their checksums, or whose files
  are cut short: one line naming it, exit 2, and no text generated from unverified numbers."""
  generate.main(["--workdir", str(lm_run), "--prompt", "the", "--max-new-tokens", "4"])
  assert capsys.readouterr().out.startswith("--- 'the'\nthe")  # the intact run generates
  copy = tmp_path / "checksum"
  shutil.copytree(lm_run, copy, ignore=shutil.ignore_patterns("tb"))
  meta_path = copy / "checkpoints" / "2" / "meta" / "metadata"
  meta = json.loads(meta_path.read_text())
  name = sorted(k for k in meta["checksums"]["arrays"] if k.startswith("params/"))[0]
  meta["checksums"]["arrays"][name] = "0" * 16  # as if that array had changed on disk
  meta_path.write_text(json.dumps(meta))
  cut = tmp_path / "truncated"
  shutil.copytree(lm_run, cut, ignore=shutil.ignore_patterns("tb"))
  # Every file of the arrays' data cut in half (which of them holds the params, that generate reads,
  # depends on how Orbax grouped the arrays).
  for data_file in (p for p in (cut / "checkpoints" / "2").rglob("*") if p.is_file() and p.parent.name == "d"):
    os.truncate(data_file, data_file.stat().st_size // 2)
  for workdir, why in ((copy, f"{name} does not match its checksum"), (cut, "")):
    with pytest.raises(SystemExit) as exit_info:
      generate.main(["--workdir", str(workdir), "--prompt", "the", "--max-new-tokens", "4"])
    captured = capsys.readouterr()
    assert exit_info.value.code == 2 and captured.out == "", captured.out
    assert re.fullmatch(rf"error: checkpoint {workdir}/checkpoints/2 is damaged: .*{re.escape(why)}.*\n", captured.err,
                        re.S) and captured.err.count("\n") == 1, captured.err
