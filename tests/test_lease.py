"""Tests for jaxformer.lease: one holder per workdir, stale leases taken over, live ones never."""

import json
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from jaxformer import lease as lease_lib
from jaxformer.errors import UserError


def write_lease(workdir, **fields):
  """A lease file as another run would have left it: this host and process, with `fields` replaced."""
  record = {**lease_lib._identity(), "started": time.time(), "refreshed": time.time(), "command": "python train.py",
            "token": "other", **fields}  # pylint: disable=protected-access
  (workdir / lease_lib.LEASE_NAME).write_text(json.dumps(record))
  return record


def dead_pid():
  proc = subprocess.Popen([sys.executable, "-c", "pass"])
  proc.wait()
  return proc.pid


def test_acquire_release_and_a_live_holder(tmp_path):
  lease = lease_lib.acquire(str(tmp_path), 60, command="python train.py --workdir x", log=print)
  holder = json.loads((tmp_path / "lease.json").read_text())
  assert (holder["pid"], holder["host"], holder["command"]) == (os.getpid(), socket.gethostname(),
                                                                "python train.py --workdir x")
  with pytest.raises(UserError, match=rf"workdir {tmp_path} is in use by pid {os.getpid()} on host "
                                      rf"{socket.gethostname()} \(started .*, command: python train.py --workdir x\)"):
    lease_lib.acquire(str(tmp_path), 60)
  lease.release()
  assert os.listdir(tmp_path) == []  # no lease, no temporary file
  lease_lib.acquire(str(tmp_path), 60).release()


@pytest.mark.parametrize("fields,reason", [
    (lambda: {"pid": dead_pid()}, r"pid \d+ no longer exists"),
    (lambda: {"proc_start": "1"}, rf"pid {os.getpid()} is now another process"),
    (lambda: {"boot_id": "an-earlier-boot"}, "its host has rebooted since"),
    (lambda: {"host": "elsewhere", "refreshed": time.time() - 100},
     r"not refreshed for 10\d s \(train.lease_timeout_s=60\)"),
], ids=["dead-pid", "reused-pid", "rebooted", "other-host-silent"])
def test_stale_lease_is_taken_over(tmp_path, fields, reason):
  if not lease_lib._identity()["boot_id"]:  # pylint: disable=protected-access
    pytest.skip("not Linux: no boot id or /proc")
  old = write_lease(tmp_path, **fields())
  said = []
  lease = lease_lib.acquire(str(tmp_path), 60, log=said.append)
  assert len(said) == 1 and said[0].startswith(f"took over the workdir lease of pid {old['pid']} on host {old['host']}")
  assert re.search(reason, said[0]), said
  assert json.loads((tmp_path / "lease.json").read_text())["token"] == lease.record["token"]
  lease.release()
  assert os.listdir(tmp_path) == []


def test_other_host_lease_is_live_until_it_times_out(tmp_path):
  write_lease(tmp_path, host="elsewhere", pid=1, refreshed=time.time() - 30)
  with pytest.raises(UserError, match="is in use by pid 1 on host elsewhere"):
    lease_lib.acquire(str(tmp_path), 60)
  (tmp_path / "lease.json").write_text("{not json")  # unreadable: judged by its age
  with pytest.raises(UserError, match="in use by an unreadable lease file"):
    lease_lib.acquire(str(tmp_path), 60)
  os.utime(tmp_path / "lease.json", (time.time() - 100, time.time() - 100))
  lease_lib.acquire(str(tmp_path), 60, log=lambda *a: None).release()


def test_refresh_and_lost_lease(tmp_path):
  lease = lease_lib.acquire(str(tmp_path), 1.0)  # refreshed every 0.1 s
  first = json.loads((tmp_path / "lease.json").read_text())["refreshed"]
  deadline = time.time() + 10
  while json.loads((tmp_path / "lease.json").read_text())["refreshed"] == first and time.time() < deadline:
    time.sleep(0.05)
  assert json.loads((tmp_path / "lease.json").read_text())["refreshed"] > first
  assert lease.lost is None
  write_lease(tmp_path, host="elsewhere", pid=7)  # another run took it over (this one looked dead)
  while lease.lost is None and time.time() < deadline:
    time.sleep(0.05)
  assert lease.lost.startswith(f"the workdir lease {tmp_path}/lease.json was taken over by pid 7 on host elsewhere")
  lease.release()
  assert json.loads((tmp_path / "lease.json").read_text())["pid"] == 7  # not ours to delete
