"""Runs `train.py --multihost` as N processes on this machine, as a pod or SLURM job runs it.

Each process gets JAX's environment for a job without a cluster manager (gloo CPU collectives,
the coordinator on a free localhost port, JAX_NUM_PROCESSES, JAX_PROCESS_ID) and
`devices` simulated CPU devices. Every process's output goes to `<logdir>/p<i>.log` (kept);
`Job.wait` kills the whole job past its hard timeout, so a hang fails the caller instead
of hanging it. With `audit=True` every process records the files it opens for writing
(`fixtures/audit_writes/sitecustomize.py`) in `<logdir>/p<i>.writes`, and the rows of each
training batch it read in `<logdir>/p<i>.rows`.

Used by tests/test_multihost.py and benchmarks/multihost.py.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Cheaper LLVM codegen: the test programs are tiny, compiling them is most of the time.
FAST_XLA = os.environ.get("JAXFORMER_TEST_FAST_XLA",  # conftest.FAST_XLA when run by the tests
                          "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")


def free_port():
  """A TCP port nobody listens on now (the coordinator binds it a moment later)."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


class Job:
  """N running processes of one command, their logs, and a hard deadline."""

  def __init__(self, procs, logdir, timeout):
    self.procs, self.logdir = procs, logdir
    self.deadline = time.time() + timeout

  def log(self, i):
    with open(os.path.join(self.logdir, f"p{i}.log"), errors="replace") as f:
      return f.read()

  def writes(self, i):
    """Paths process i opened for writing (audit=True), in order, without repeats."""
    path = os.path.join(self.logdir, f"p{i}.writes")
    if not os.path.exists(path):
      return []
    with open(path) as f:
      return list(dict.fromkeys(line.rstrip("\n") for line in f))

  def rows(self, i):
    """{step: {global row index: sha1 of its tokens}} of the training batches process i read
    (audit=True); the rows it left zero (another process's) are absent."""
    import json  # pylint: disable=g-import-not-at-top
    with open(os.path.join(self.logdir, f"p{i}.rows")) as f:
      return {r["step"]: {int(k): v for k, v in r["rows"].items()} for r in map(json.loads, f)}

  def logs(self, tail=3000):
    return "\n".join(f"--- process {i} (rc {p.poll()}) ---\n{self.log(i)[-tail:]}"
                     for i, p in enumerate(self.procs))

  def wait_for(self, pattern, i=0, poll=0.1):
    """Waits until process i's log matches `pattern` (a regex); returns the match."""
    while True:
      m = re.search(pattern, self.log(i), re.M)
      if m:
        return m
      if all(p.poll() is not None for p in self.procs):
        raise AssertionError(f"the job ended before process {i} logged {pattern!r}\n{self.logs()}")
      self._check_deadline(f"waiting for {pattern!r}")
      time.sleep(poll)

  def signal(self, i, sig):
    self.procs[i].send_signal(sig)

  def wait(self, timeout=None):
    """Waits for every process (at most until the hard deadline, or `timeout` s from now);
    returns their exit codes. Past it, kills them all and raises with their logs."""
    if timeout is not None:
      self.deadline = min(self.deadline, time.time() + timeout)
    while any(p.poll() is None for p in self.procs):
      self._check_deadline("waiting for the job to end")
      time.sleep(0.1)
    return [p.returncode for p in self.procs]

  def kill(self):
    for p in self.procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)  # each process leads its own group (start_new_session)
    for p in self.procs:
      p.wait()

  def _check_deadline(self, what):
    if time.time() > self.deadline:
      self.kill()
      raise AssertionError(f"hard timeout {what}: killed the job\n{self.logs()}")


def launch(n, args, logdir, devices=2, timeout=300, env=None, audit=False, multihost=True, process_args=None):
  """Starts `python train.py [--multihost] *args` as `n` processes with `devices` CPU devices each.

  n=1 with multihost=False is the plain single-process command (the reference run).
  `env` adds or overrides environment variables (a test passes its compilation cache).
  `process_args` {i: [override, ...]}: more arguments for process i alone (one host's clock ahead).
  """
  os.makedirs(logdir, exist_ok=True)
  port = free_port()
  base = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1",
          "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_XLA}", **(env or {})}
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    base.pop(k, None)
  if audit:
    base["PYTHONPATH"] = os.pathsep.join([os.path.join(HERE, "fixtures", "audit_writes"),
                                          *filter(None, [base.get("PYTHONPATH")])])
  procs = []
  for i in range(n):
    penv = dict(base)
    if multihost:
      penv.update(JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
                  JAX_NUM_PROCESSES=str(n), JAX_PROCESS_ID=str(i))
    if audit:
      penv["JAXFORMER_AUDIT_WRITES"] = os.path.join(logdir, f"p{i}.writes")
      penv["JAXFORMER_AUDIT_ROWS"] = os.path.join(logdir, f"p{i}.rows")
    with open(os.path.join(logdir, f"p{i}.log"), "w") as out:
      procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"),
                                     *(["--multihost"] if multihost else []), *args,
                                     *(process_args or {}).get(i, [])],
                                    env=penv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                    start_new_session=True))
  return Job(procs, logdir, timeout)


def losses(log):
  """{step: loss} from the progress lines of a log."""
  return {int(m[1]): float(m[2]) for m in re.finditer(r"^step (\d+)/\d+ \| loss ([-+.\deE]+|nan|inf)", log, re.M)}


def metrics_losses(workdir, skip=0):
  """({step: loss} at full precision, line count) from `<workdir>/metrics.jsonl` past its first
  `skip` lines (the file is appended to by each run of a workdir)."""
  import json  # pylint: disable=g-import-not-at-top
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    lines = f.readlines()
  records = [json.loads(line) for line in lines[skip:]]
  return {r["step"]: r["loss"] for r in records if "loss" in r}, len(lines)
