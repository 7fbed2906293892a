"""Several processes through `train.py --multihost` on this machine (tests/multihost_harness.py):
the losses of one process with 4 devices, stops agreed by all processes, a dead process, and
resuming with another process count.

One chain of runs on gpt2_tiny shares its checkpoints and compiled programs to stay within the
suite's budget (each launch costs ~10 s of start-up):
  reference   1 process x 4 devices, 12 steps, uninterrupted; the rows of every batch recorded;
  A           2 processes x 2 devices; SIGTERM to process 1 only at step ~3 -> all save one step, exit 0;
              every process records the files it writes and the rows it reads;
  B           the same command resumes; kill -9 of process 1 at step ~9 -> process 0 stops within
              train.host_timeout_s with our line, exit 3;
  E           (a copy of B's workdir) 2 processes resume B's last complete checkpoint; kill -9 of
              process 0, the coordinator, 2 steps later -> process 1 exits 3 with our line;
  C           1 process x 4 devices resumes B's last complete checkpoint (written by 2 processes)
              and stops at step 10 (train.num_steps=10; a constant learning rate, so the same steps);
  D           4 processes x 1 device resume C's checkpoint; train.max_minutes passes on process 3
              only -> all stop at step 11, save it, exit 0;
  N           2 processes x 2 devices resume D's checkpoint (of 4 processes) with a learning rate of 1e30:
              step 12 is the reference's, steps 13 and 14 are non-finite -> train.max_skipped_steps=2
              stops all, exit 2;
  S           (a copy after N) 2 processes resume; SIGINT to process 1 -> all save one step, exit 0;
  L           the same command resumes; another run takes the lease over -> all stop, exit 2.
Every loss of steps 1-12 in A-S equals the reference's (float32 rounding).
"""

import json
import os
import re
import shutil
import signal
import time

import numpy as np
import pytest

import multihost_harness as harness

STEPS = 12
TEXT = "the quick brown fox jumps over the lazy dog.\nsphinx of black quartz, judge my vow.\n" * 40
HOST_TIMEOUT_S = 3
LONG = "train.num_steps=100000"  # runs stopped by a test, never by their end (however fast the machine)


def _args(workdir, text):
  return ["--config", "gpt2_tiny", "--workdir", workdir, f"data.text_path={text}", f"train.num_steps={STEPS}",
          "train.log_every=1", "train.eval_every=1000", "train.checkpoint_every=4", "train.keep_checkpoints=10",
          "train.sample_every_eval=false", f"train.host_timeout_s={HOST_TIMEOUT_S}",
          "optim.schedule=constant"]  # the schedule does not depend on train.num_steps (runs C, S stop early)


def _saved_steps(workdir):
  ckpts = os.path.join(workdir, "checkpoints")
  return sorted(int(d) for d in os.listdir(ckpts) if d.isdigit())


def _errors(log):
  return [line for line in log.splitlines() if line.startswith("error: ")]


def _run(job):
  """The usual record of an ended job: exit codes, process 0's log (or every log), each error line."""
  rc = job.wait()
  return {"rc": rc, "log": job.log(0), "logs": [job.log(i) for i in range(len(job.procs))],
          "errors": [_errors(job.log(i)) for i in range(len(job.procs))]}


def _kill(job, i, at):
  """kill -9 of process i once process 0 logged `at`; the record has the seconds to the last exit."""
  job.wait_for(at)
  job.procs[i].kill()
  t0 = time.time()
  job.wait(timeout=60)
  out = _run(job)
  out["stop_s"] = time.time() - t0
  return out


@pytest.fixture(scope="module")
def chain(tmp_path_factory, compilation_cache):
  tmp = str(tmp_path_factory.mktemp("multihost"))
  text = os.path.join(tmp, "text.txt")
  with open(text, "w") as f:
    f.write(TEXT)
  env = {"JAX_COMPILATION_CACHE_DIR": compilation_cache}
  launch = lambda name, n, args, **kw: harness.launch(n, args, os.path.join(tmp, f"logs-{name}"), env=env, **kw)
  out = {}

  ref = launch("ref", 1, [*_args(os.path.join(tmp, "ref"), text), "train.checkpoint_every=1000"], devices=4,
               multihost=False, audit=True)  # (its only save: the last step's)
  assert ref.wait() == [0], ref.logs()
  out["reference"], _ = harness.metrics_losses(os.path.join(tmp, "ref"))
  out["reference_rows"] = ref.rows(0)

  workdir = os.path.join(tmp, "run")
  args = _args(workdir, text)
  a = launch("a", 2, args, devices=2, audit=True)
  a.wait_for(r"^step 3/")
  a.signal(1, signal.SIGTERM)
  out["a"] = {**_run(a), "steps": _saved_steps(workdir), "writes": [a.writes(i) for i in range(2)],
              "rows": [a.rows(i) for i in range(2)], "workdir": workdir}
  out["a"]["losses"], lines = harness.metrics_losses(workdir)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    out["a"]["metrics_steps"] = [json.loads(line)["step"] for line in f if '"loss"' in line]

  out["b"] = _kill(launch("b", 2, args, devices=2), 1, r"^step 9/")
  out["b"]["steps"] = _saved_steps(workdir)
  out["b"]["losses"], lines = harness.metrics_losses(workdir, lines)

  # E: a copy, so that its steps past B's checkpoint do not change what C resumes.
  copy = os.path.join(tmp, "run-e")
  shutil.copytree(workdir, copy)
  e = launch("e", 2, [*_args(copy, text), LONG], devices=2)
  start = _resumed_from(e.wait_for(r"^resumed from .*$")[0])
  out["e"] = _kill(e, 0, rf"^step {start + 2}/")
  out["e"]["steps"] = _saved_steps(copy)
  out["e"]["losses"], _ = harness.metrics_losses(copy, lines)

  c = launch("c", 1, [*args, "train.num_steps=10"], devices=4, multihost=False)
  out["c"] = _run(c)
  out["c"]["losses"], lines = harness.metrics_losses(workdir, lines)

  d = launch("d", 4, args, devices=1, process_args={3: ["train.max_minutes=0.0001"]})  # 6 ms: its first step
  out["d"] = {**_run(d), "steps": _saved_steps(workdir)}
  out["d"]["losses"], lines = harness.metrics_losses(workdir, lines)

  n = launch("n", 2, [*args, "optim.learning_rate=1e30", "train.max_skipped_steps=2", "train.num_steps=20",
                      "train.checkpoint_every=5"], devices=2)  # no save before the limit fires
  out["n"] = {**_run(n), "steps": _saved_steps(workdir), "workdir": workdir}
  out["n"]["losses"], lines = harness.metrics_losses(workdir, lines)

  copy = os.path.join(tmp, "run-s")
  shutil.copytree(workdir, copy)
  s = launch("s", 2, [*_args(copy, text), LONG], devices=2)
  s.wait_for(r"^step 13/")
  s.signal(1, signal.SIGINT)
  out["s"] = {**_run(s), "steps": _saved_steps(copy)}
  out["s"]["losses"], lines = harness.metrics_losses(copy, lines)

  l = launch("l", 2, [*_args(copy, text), LONG, "train.lease_timeout_s=2"], devices=2)  # refreshed every 0.2 s
  start = _resumed_from(l.wait_for(r"^resumed from .*$")[0])
  l.wait_for(rf"^step {start + 2}/")
  with open(os.path.join(copy, "lease.json")) as f:
    record = json.load(f)
  record.update(host="elsewhere", pid=7, token="other", refreshed=time.time())
  with open(os.path.join(copy, "lease.json.new"), "w") as f:
    json.dump(record, f)
  os.replace(os.path.join(copy, "lease.json.new"), os.path.join(copy, "lease.json"))  # another run took it over
  out["l"] = {**_run(l), "workdir": copy}
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
def test_a_every_process_reads_only_its_rows_and_together_the_whole_batch(chain):
  ref, (p0, p1) = chain["reference_rows"], chain["a"]["rows"]
  batch = len(ref[0])
  assert batch == 4 and all(sorted(ref[s]) == list(range(batch)) for s in ref)  # one process reads every row
  assert sorted(p0) == sorted(p1) and len(p0) >= 4  # the init example (step 0) and each step run
  for step in p0:
    assert sorted(p0[step]) == [0, 1] and sorted(p1[step]) == [2, 3], (step, p0[step], p1[step])  # disjoint halves
    assert {**p0[step], **p1[step]} == ref[step], step  # together: the 1-process batch of that step, row by row


@pytest.mark.slow
def test_e_a_dead_coordinator_stops_the_others_with_one_line(chain):
  """kill -9 of process 0: JAX's client on process 1 aborts at once (its own C++ message and stack
  trace come first); the abort handler of `jaxformer.hosts` turns it into our line and exit 3."""
  e = chain["e"]
  assert e["rc"] == [-signal.SIGKILL, 3], (e["rc"], e["logs"][1][-3000:])
  assert e["stop_s"] < HOST_TIMEOUT_S + 10, e["stop_s"]
  assert len(e["errors"][1]) == 1, e["logs"][1][-3000:]
  assert re.fullmatch(r"error: process 1: process 0 of 2 \(the coordinator\) is gone: its coordination service at "
                      r"localhost:\d+ (refuses connections|has not answered for \d+ s \(train.host_timeout_s\)); it "
                      rf"died or its host was lost; the last complete checkpoint is step {max(e['steps'])} in "
                      r"\S+/checkpoints\. Resume with the same command on every host\.", e["errors"][1][0]), e["errors"][1]
  assert e["logs"][1].rstrip().endswith(e["errors"][1][0])  # the last word


@pytest.mark.slow
def test_b_e_after_kill_9_two_processes_resume_the_last_complete_checkpoint(chain):
  b, e, ref = chain["b"], chain["e"], chain["reference"]
  assert _resumed_from(e["log"]) == max(b["steps"])  # the step B's line named
  assert len(e["losses"]) >= 2
  steps = sorted(s for s in e["losses"] if s <= STEPS)
  assert steps[0] == max(b["steps"]) + 1
  np.testing.assert_allclose([e["losses"][s] for s in steps], [ref[s] for s in steps], rtol=1e-5)


@pytest.mark.slow
def test_c_d_resume_with_another_process_count_and_every_loss_matches_one_process(chain):
  ref, b, c, d = chain["reference"], chain["b"], chain["c"], chain["d"]
  assert sorted(ref) == list(range(1, STEPS + 1)) and ref[STEPS] < ref[1]
  assert _resumed_from(c["log"]) == max(b["steps"])  # a checkpoint of 2 processes in 1 process
  assert c["rc"] == [0]
  assert _resumed_from(d["log"]) == 10  # ... and one of 1 process in 4
  seen = {}
  for run in ("a", "b", "c", "d", "n"):
    seen.update(chain[run]["losses"])  # a resumed run repeats steps after its checkpoint: later runs win
  assert sorted(s for s in seen if s <= STEPS) == list(range(1, STEPS + 1))
  for run in ("a", "b", "c", "d", "n", "s"):
    got = {s: v for s, v in chain[run]["losses"].items() if s <= STEPS}
    np.testing.assert_allclose([got[s] for s in sorted(got)], [ref[s] for s in sorted(got)], rtol=1e-5, err_msg=run)


@pytest.mark.slow
def test_d_max_minutes_on_one_process_stops_all_at_one_saved_step(chain):
  d = chain["d"]
  assert d["rc"] == [0, 0, 0, 0], d["log"][-3000:]
  assert re.search(r"^train.max_minutes=0.0 reached at step 11 \(first on process 3\)$", d["log"], re.M), d["log"][-2000:]
  assert max(d["steps"]) == 11 and sorted(d["losses"]) == [11]  # its first step: agreed at its first log step
  assert not any(d["errors"])


@pytest.mark.slow
def test_n_the_non_finite_limit_stops_every_process_with_one_line(chain):
  n = chain["n"]
  assert n["rc"] == [2, 2], n["log"][-3000:]
  assert _resumed_from(n["log"]) == 11  # a checkpoint of 4 processes in 2
  want = (f"error: 2 non-finite steps in a row (steps 13-14 skipped, train.max_skipped_steps=2): the state or the "
          f"data is poisoned; the last good checkpoint is {n['workdir']}/checkpoints/11")
  assert n["errors"] == [[want]] * 2, n["errors"]
  assert max(n["steps"]) == 11 and sorted(n["losses"]) == [12, 13, 14]  # 12 finite (its update is the poison)


@pytest.mark.slow
def test_s_sigint_on_one_process_stops_all_at_one_saved_step(chain):
  s = chain["s"]
  assert s["rc"] == [0, 0], s["log"][-2000:]
  m = re.search(r"^SIGINT \(on process 1\) received: saved a checkpoint at step (\d+)", s["log"], re.M)
  assert m, s["log"][-2000:]
  saved = int(m[1])
  assert saved == max(s["steps"]) == max(s["losses"]) >= 13
  assert not any(s["errors"])


@pytest.mark.slow
def test_l_a_lost_lease_stops_every_process_with_one_line(chain):
  l = chain["l"]
  assert l["rc"] == [2, 2], l["logs"]
  lease = os.path.join(l["workdir"], "lease.json")
  assert len(l["errors"][0]) == 1 and l["errors"][0][0].startswith(
      f"error: the workdir lease {lease} was taken over by pid 7 on host elsewhere"), l["errors"][0]
  assert l["errors"][1] == ["error: process 0 lost the workdir lease to another run"], l["errors"][1]
  with open(lease) as f:
    assert json.load(f)["host"] == "elsewhere"  # not ours to delete


@pytest.mark.slow
@pytest.mark.parametrize("failing", ["data", "init_from"])
def test_a_user_error_on_process_0_during_setup_stops_every_process(tmp_path, compilation_cache, failing):
  """Process 0 copies train.init_from's tokenizer and prepares the data first; its error reaches the
  others instead of leaving them at a barrier (data: a missing text file; init_from: a workdir whose
  config.json is not JSON, read while copying its tokenizer)."""
  missing = str(tmp_path / "no-such-text.txt")
  args = ["--config", "gpt2_tiny", "--workdir", str(tmp_path / "run"), f"data.text_path={missing}"]
  if failing == "init_from":
    source = tmp_path / "source"
    source.mkdir()
    (source / "config.json").write_text("{not json")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    args[-1], missing = f"data.text_path={text}", str(source / "config.json")
    args.append(f"train.init_from={source}")
  job = harness.launch(2, args, str(tmp_path / "logs"), env={"JAX_COMPILATION_CACHE_DIR": compilation_cache},
                       timeout=120)
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
def test_translation_on_2_processes_gives_the_1_process_losses_step_for_step(tmp_path, compilation_cache):
  """The reference is the same command in the test process (1 process, 1 device: tests/test_sharding.py
  shows 1 device = 8-device meshes), which reuses conftest's `tiny_run` compiles; every step logged."""
  from conftest import TINY_OVERRIDES, tiny_config
  from jaxformer import train
  extra = ["train.log_every=1", "train.checkpoint_every=1000"]  # (checkpoints change no loss)
  train.train_and_evaluate(tiny_config(*extra), str(tmp_path / "ref"), log=lambda *a, **k: None)
  job = harness.launch(2, ["--config", "tiny_encdec", "--workdir", str(tmp_path / "run"), *TINY_OVERRIDES, *extra],
                       str(tmp_path / "logs"), devices=2, env={"JAX_COMPILATION_CACHE_DIR": compilation_cache})
  assert job.wait() == [0, 0], job.logs()
  (want, _), (got, _) = harness.metrics_losses(tmp_path / "ref"), harness.metrics_losses(tmp_path / "run")
  assert sorted(want) == list(range(1, 9)) and sorted(got) == sorted(want), job.logs()
  assert want[8] < want[1]
  np.testing.assert_allclose([got[s] for s in sorted(got)], [want[s] for s in sorted(want)], rtol=1e-5)


def test_coordinator_gone_tells_a_listening_port_from_a_closed_one():
  import socket  # pylint: disable=g-import-not-at-top
  from jaxformer import hosts
  with socket.socket() as server:
    server.bind(("localhost", 0))
    server.listen()
    address = f"localhost:{server.getsockname()[1]}"
    assert hosts._coordinator_gone(address, 2.0) is None  # pylint: disable=protected-access
  assert hosts._coordinator_gone(address, 2.0) == "refuses connections"  # pylint: disable=protected-access


@pytest.mark.parametrize("gone, code", [("'refuses connections'", 3), ("None", -signal.SIGABRT)])
def test_the_abort_handler_ends_with_our_line_only_when_the_coordinator_is_gone(gone, code):
  """abort() (as JAX's client calls it from its own thread): our line and exit 3 when `gone()` names
  a reason, else the abort goes on (SIGABRT, a core dump where enabled)."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code_text = ("import os, threading\nfrom jaxformer import hosts\n"
               f"hosts._catch_abort(lambda: {gone}, lambda why: hosts._stop(1, 'lost: ' + why))\n"
               "t = threading.Thread(target=os.abort); t.start(); t.join()\nprint('not reached')\n")
  proc = subprocess.run([sys.executable, "-c", code_text], capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == code, proc.stderr
  if code == 3:
    assert proc.stderr.splitlines() == ["error: process 1: lost: refuses connections; no checkpoint is known yet. "
                                        "Resume with the same command on every host."], proc.stderr
  assert "not reached" not in proc.stdout
