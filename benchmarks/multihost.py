"""Runs `train.py --multihost` as N local processes (tests/multihost_harness.py), by hand, for runs
bigger than CI's, and reports how they ended.

    python benchmarks/multihost.py --processes 4 --devices 2 --logdir /tmp/mh -- \
        --config gpt2_tiny --workdir /tmp/mh/run train.num_steps=200
    python benchmarks/multihost.py --processes 2 --kill 1 --at-step 100 --logdir /tmp/mh -- ...   # kill -9
    python benchmarks/multihost.py --processes 2 --sigterm 1 --at-step 100 --logdir /tmp/mh -- ...
    python benchmarks/multihost.py --processes 2 --stop 0 --at-step 100 --logdir /tmp/mh -- ...     # SIGSTOP: a hung host

Prints each process's exit code, the seconds from the kill or signal to the last exit (a stopped
process is killed once the others have ended), process 0's last progress line and every
process's `error:` lines. Every log stays in --logdir (p<i>.log).
"""

import argparse
import os
import re
import signal
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import multihost_harness as harness  # noqa: E402


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=2)
  parser.add_argument("--devices", type=int, default=2, help="simulated CPU devices per process")
  parser.add_argument("--logdir", required=True)
  parser.add_argument("--timeout", type=float, default=1800, help="hard limit for the whole job (s)")
  parser.add_argument("--kill", type=int, default=None, help="kill -9 this process at --at-step")
  parser.add_argument("--sigterm", type=int, default=None, help="SIGTERM this process at --at-step")
  parser.add_argument("--stop", type=int, default=None, help="SIGSTOP this process at --at-step (it hangs, "
                      "its sockets stay open, as a host cut off from the network)")
  parser.add_argument("--at-step", type=int, default=None, help="when process 0 has logged this step")
  parser.add_argument("--at-line", default=None, help="or when process 0 has logged a line matching this regex "
                      "(e.g. '^resumed from': during set-up)")
  parser.add_argument("train_args", nargs="+", help="train.py's arguments (after --)")
  args = parser.parse_args(argv)
  job = harness.launch(args.processes, args.train_args, args.logdir, devices=args.devices, timeout=args.timeout)
  t0 = time.time()
  at = args.at_line or (rf"^step {args.at_step}/" if args.at_step is not None else None)
  actions = [(args.kill, signal.SIGKILL), (args.sigterm, signal.SIGTERM), (args.stop, signal.SIGSTOP)]
  target, sig = next(((i, sig) for i, sig in actions if i is not None), (None, None))
  if at is not None and target is not None:
    job.wait_for(at)
    t0 = time.time()
    job.signal(target, sig)
  if sig == signal.SIGSTOP:  # the others end by themselves; then the stopped one is killed
    while any(p.poll() is None for i, p in enumerate(job.procs) if i != target):
      job._check_deadline("waiting for the others to end")  # pylint: disable=protected-access
      time.sleep(0.05)
    elapsed = time.time() - t0
    job.procs[target].kill()
  codes = job.wait()
  elapsed = elapsed if sig == signal.SIGSTOP else time.time() - t0
  log = job.log(0)
  progress = re.findall(r"^step \d+/\d+ \|.*$", log, re.M)
  print(f"exit codes {codes}; {elapsed:.1f} s from start/kill/signal to the last exit"
        + (" of the others" if sig == signal.SIGSTOP else ""))
  print("\n".join(re.findall(r"^.* received: saved a checkpoint at step \d+", log, re.M)))
  print("last progress: " + (progress[-1] if progress else "(none)"))
  for i in range(len(job.procs)):
    for line in job.log(i).splitlines():
      if line.startswith("error:"):
        print(f"process {i}: {line}")
  print(f"logs: {args.logdir}/p<i>.log")


if __name__ == "__main__":
  main()
