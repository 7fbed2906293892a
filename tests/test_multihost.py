"""Several processes through `train.py --multihost` on this machine (tests/multihost_harness.py):
the losses of one process with 4 devices, stops agreed by all processes, a dead process, and
resuming with another process count.

One chain of runs on gpt2_tiny shares its checkpoints to stay within the suite's budget:
  reference   1 process x 4 devices, 12 steps, uninterrupted;
  A           2 processes x 2 devices; SIGTERM to process 1 only at step ~3 -> all save one step, exit 0;
  B           the same command resumes; kill -9 of process 1 at step ~8 -> process 0 stops within
              train.host_timeout_s with our line, exit 3;
  C           1 process x 4 devices resumes B's last complete checkpoint (written by 2 processes)
              and stops at step 10 (train.num_steps=10; a constant learning rate, so the same steps);
  D           4 processes x 1 device resume C's checkpoint to step 12.
Every step's loss of A-D equals the reference's (float32 rounding).
"""

import json
import os
import re
import signal
import time

import numpy as np
import pytest

import multihost_harness as harness

STEPS = 12
TEXT = "the quick brown fox jumps over the lazy dog.\nsphinx of black quartz, judge my vow.\n" * 40
HOST_TIMEOUT_S = 5


def _args(workdir, text):
  return ["--config", "gpt2_tiny", "--workdir", workdir, f"data.text_path={text}", f"train.num_steps={STEPS}",
          "train.log_every=1", "train.eval_every=1000", "train.checkpoint_every=4", "train.keep_checkpoints=10",
          "train.sample_every_eval=false", f"train.host_timeout_s={HOST_TIMEOUT_S}",
          "optim.schedule=constant"]  # the schedule does not depend on train.num_steps (run C stops early)


def _saved_steps(workdir):
  ckpts = os.path.join(workdir, "checkpoints")
  return sorted(int(d) for d in os.listdir(ckpts) if d.isdigit())


@pytest.fixture(scope="module")
def chain(tmp_path_factory, compilation_cache):
  tmp = str(tmp_path_factory.mktemp("multihost"))
  text = os.path.join(tmp, "text.txt")
  with open(text, "w") as f:
    f.write(TEXT)
  env = {"JAX_COMPILATION_CACHE_DIR": compilation_cache}
  out = {}

  ref = harness.launch(1, _args(os.path.join(tmp, "ref"), text), os.path.join(tmp, "logs-ref"), devices=4,
                       env=env, multihost=False)
  assert ref.wait() == [0], ref.logs()
  out["reference"], _ = harness.metrics_losses(os.path.join(tmp, "ref"))

  workdir = os.path.join(tmp, "run")
  args = _args(workdir, text)
  a = harness.launch(2, args, os.path.join(tmp, "logs-a"), devices=2, env=env, audit=True)
  a.wait_for(r"^step 3/")
  a.signal(1, signal.SIGTERM)
  out["a"] = {"rc": a.wait(), "log": a.log(0), "steps": _saved_steps(workdir),
              "writes": [a.writes(i) for i in range(2)], "workdir": workdir}
  out["a"]["losses"], lines = harness.metrics_losses(workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    out["a"]["metrics_steps"] = [json.loads(line)["step"] for line in f if '"loss"' in line]

  b = harness.launch(2, args, os.path.join(tmp, "logs-b"), devices=2, env=env)
  b.wait_for(r"^step 9/")
  b.procs[1].kill()
  t0 = time.time()
  rc = b.wait(timeout=60)
  out["b"] = {"rc": rc, "stop_s": time.time() - t0, "log": b.log(0), "steps": _saved_steps(workdir)}
  out["b"]["losses"], lines = harness.metrics_losses(workdir, lines)

  c = harness.launch(1, [*args, "train.num_steps=10"], os.path.join(tmp, "logs-c"), devices=4, env=env,
                     multihost=False)
  out["c"] = {"rc": c.wait(), "log": c.log(0)}
  out["c"]["losses"], lines = harness.metrics_losses(workdir, lines)

  d = harness.launch(4, args, os.path.join(tmp, "logs-d"), devices=1, env=env)
  out["d"] = {"rc": d.wait(), "log": d.log(0)}
  out["d"]["losses"], lines = harness.metrics_losses(workdir, lines)
  return out


def _resumed_from(log):
  m = re.search(r"^resumed from \S+/(\d+) ", log, re.M)
  return int(m[1]) if m else None


@pytest.mark.slow
def test_a_sigterm_on_one_process_stops_all_at_one_saved_step(chain):
  a = chain["a"]
  assert a["rc"] == [0, 0], a["log"][-2000:]
  m = re.search(r"^SIGTERM \((?:a preemption notice|on process 1)\) received: saved a checkpoint at step (\d+)", a["log"], re.M)
  assert m, a["log"][-2000:]
  saved = int(m[1])
  assert saved == max(a["steps"]) and saved == max(harness.losses(a["log"]))  # the last step run is saved
  assert saved < STEPS


@pytest.mark.slow
def test_a_process_0_alone_writes_metrics_tensorboard_lease_and_tokenizer(chain):
  a = chain["a"]
  workdir = a["workdir"]
  mine = lambda writes: {os.path.relpath(p, workdir).split(os.sep)[0] for p in writes if p.startswith(workdir + os.sep)}
  p0, p1 = mine(a["writes"][0]), mine(a["writes"][1])
  for name in ("metrics.jsonl", "tb", "lease.json", "tokenizer.json", "config.json", "data"):
    assert name in p0, (name, sorted(p0))
    assert name not in p1, (name, sorted(p1))
  assert p1 <= {"checkpoints", ".write-test-1"}, sorted(p1)  # its shards of the checkpoints, the write probe
  assert a["metrics_steps"] == sorted(a["losses"]) == list(range(1, max(a["steps"]) + 1))  # each step once


@pytest.mark.slow
def test_b_a_dead_process_stops_the_others_in_bounded_time_with_one_line(chain):
  b = chain["b"]
  assert _resumed_from(b["log"]) == max(chain["a"]["steps"])
  assert b["rc"][0] == 3 and b["rc"][1] == -signal.SIGKILL, (b["rc"], b["log"][-3000:])
  assert b["stop_s"] < HOST_TIMEOUT_S + 20, b["stop_s"]  # heartbeat timeout + polling, not JAX's 100 s
  lines = [line for line in b["log"].splitlines() if line.startswith("error: ")]
  assert len(lines) == 1, b["log"][-3000:]
  complete = max(b["steps"])
  assert re.fullmatch(rf"error: process 0: process 1 of 2 has not been heard from for {HOST_TIMEOUT_S} s "
                      rf"\(train.host_timeout_s\): it died or its host was lost; the last complete checkpoint is "
                      rf"step {complete} in \S+/checkpoints\. Resume with the same command on every host\.",
                      lines[0]), lines[0]
  assert "Check failure stack trace" not in b["log"]


@pytest.mark.slow
def test_c_d_resume_with_another_process_count_and_every_loss_matches_one_process(chain):
  ref, b, c, d = chain["reference"], chain["b"], chain["c"], chain["d"]
  assert sorted(ref) == list(range(1, STEPS + 1)) and ref[STEPS] < ref[1]
  assert _resumed_from(c["log"]) == max(b["steps"])  # a checkpoint of 2 processes in 1 process
  assert c["rc"] == [0]
  assert d["rc"] == [0, 0, 0, 0], d["log"][-3000:]
  assert _resumed_from(d["log"]) == 10  # ... and one of 1 process in 4
  seen = {}
  for run in ("a", "b", "c", "d"):
    seen.update(chain[run]["losses"])  # a resumed run repeats steps after its checkpoint: later runs win
  assert sorted(seen) == list(range(1, STEPS + 1))
  for run in ("a", "b", "c", "d"):
    got = chain[run]["losses"]
    np.testing.assert_allclose([got[s] for s in sorted(got)], [ref[s] for s in sorted(got)], rtol=1e-5, err_msg=run)


@pytest.mark.slow
def test_a_user_error_on_process_0_during_setup_stops_every_process(tmp_path, compilation_cache):
  """Process 0 prepares the data first; its error reaches the others instead of leaving them at a barrier."""
  missing = str(tmp_path / "no-such-text.txt")
  job = harness.launch(2, ["--config", "gpt2_tiny", "--workdir", str(tmp_path / "run"), f"data.text_path={missing}"],
                       str(tmp_path / "logs"), env={"JAX_COMPILATION_CACHE_DIR": compilation_cache}, timeout=120)
  assert job.wait() == [2, 2], job.logs()
  first = [line for line in job.log(0).splitlines() if line.startswith("error: ")]
  other = [line for line in job.log(1).splitlines() if line.startswith("error: ")]
  assert len(first) == 1 and missing in first[0], job.logs()
  assert other == [f"error: process 0 failed while preparing the data: {first[0][len('error: '):]}"], job.logs()


def test_url_workdirs_are_refused_in_one_line(tmp_path, monkeypatch):
  from jaxformer import config as config_lib
  from jaxformer import train
  from jaxformer.errors import UserError
  monkeypatch.chdir(tmp_path)
  cfg = config_lib.load_config("gpt2_tiny")
  for name, workdir, overrides in (("--workdir", "gs://bucket/run", ()),
                                   ("train.init_from", "run", ("train.init_from=file:///tmp/x",))):
    with pytest.raises(UserError, match=rf"^{re.escape(name)}=\S+ is a URL: .*shared filesystem .*GCS FUSE"):
      train.train_and_evaluate(config_lib.replace(cfg, **dict(o.split("=", 1) for o in overrides)), workdir)
  assert os.listdir(tmp_path) == []  # no local folder named gs: (or anything else)


@pytest.mark.slow
def test_translation_on_2_processes_gives_the_1_process_4_device_losses(tmp_path, compilation_cache):
  from conftest import TINY_OVERRIDES
  env = {"JAX_COMPILATION_CACHE_DIR": compilation_cache}
  args = lambda name: ["--config", "tiny_encdec", "--workdir", str(tmp_path / name), *TINY_OVERRIDES,
                       "train.log_every=1", "train.checkpoint_every=1000"]
  ref = harness.launch(1, args("ref"), str(tmp_path / "logs-ref"), devices=4, env=env, multihost=False)
  assert ref.wait() == [0], ref.logs()
  job = harness.launch(2, args("run"), str(tmp_path / "logs-run"), devices=2, env=env)
  assert job.wait() == [0, 0], job.logs()
  (want, _), (got, _) = harness.metrics_losses(tmp_path / "ref"), harness.metrics_losses(tmp_path / "run")
  assert sorted(want) == list(range(1, 9)) and sorted(got) == sorted(want), job.logs()
  assert want[8] < want[1]
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-5)
