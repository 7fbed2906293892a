"""The workdir lease: one training run per workdir, a lease left by a dead run is taken over.

`<workdir>/lease.json` names the run that holds the workdir (host, pid, start time); the holder
rewrites its `refreshed` time every `timeout_s / 10` seconds (at most every minute) from a daemon
thread and deletes the file when it ends. Another run may take the lease over only when it is stale:

- on the same host (same hostname, boot and pid namespace): the pid no longer exists, or now
  belongs to a process started at another time (the pid was reused); immediately, so the
  kill-and-rerun flow needs no waiting;
- on another host sharing the workdir (NFS, gcsfuse), or a process this host cannot see: not
  refreshed for `timeout_s` (`train.lease_timeout_s`), measured against this host's clock, so
  host clocks must agree to well within it.

The file is created with a hard link of a fully written temporary file (atomic create-if-absent, on
NFS too), so a reader never sees half a lease. A takeover renames the stale file aside first and
checks that what it moved is what it judged stale, so two runs racing to take over cannot both win.
Only the training loop takes a lease; eval.py and generate only read a workdir.
"""

import json
import os
import socket
import threading
import time
import uuid

from jaxformer.errors import UserError

LEASE_NAME = "lease.json"


def _read_text(path):
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:
    return ""


def _proc_start(pid):
  """Start time of `pid` in clock ticks since boot (Linux), '' if unknown: tells a reused pid apart."""
  stat = _read_text(f"/proc/{pid}/stat")
  return stat.rsplit(")", 1)[-1].split()[19] if stat else ""


def _pid_namespace():
  try:
    return os.readlink("/proc/self/ns/pid")
  except OSError:
    return ""


def _identity():
  """What tells this host and process apart: hostname, boot id, pid namespace, pid, its start time."""
  return {"host": socket.gethostname(), "boot_id": _read_text("/proc/sys/kernel/random/boot_id"),
          "pid_namespace": _pid_namespace(), "pid": os.getpid(), "proc_start": _proc_start(os.getpid())}


def _pid_exists(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    return True
  return True


def stale_reason(holder, timeout_s, now=None):
  """Why the lease `holder` (the dict in lease.json) may be taken over, or None while it is live."""
  now = time.time() if now is None else now
  me = _identity()
  same_host = holder.get("host") == me["host"] and holder.get("boot_id", "") == me["boot_id"]
  if holder.get("host") == me["host"] and me["boot_id"] and holder.get("boot_id") not in (None, me["boot_id"]):
    return "its host has rebooted since"
  if same_host and holder.get("pid_namespace", "") == me["pid_namespace"]:
    pid = int(holder.get("pid", -1))
    if pid <= 0 or not _pid_exists(pid):
      return f"pid {pid} no longer exists"
    if holder.get("proc_start") and _proc_start(pid) not in ("", holder["proc_start"]):
      return f"pid {pid} is now another process"
    return None
  age = now - float(holder.get("refreshed", 0))
  if age > timeout_s:
    return f"not refreshed for {age:.0f} s (train.lease_timeout_s={timeout_s:g})"
  return None


def describe(holder):
  """'pid 123 on host gpu-7 (started 2024-05-01 12:00:00, command: python train.py ...)'."""
  started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started", 0))))
  command = f", command: {holder['command']}" if holder.get("command") else ""
  return f"pid {holder.get('pid')} on host {holder.get('host')} (started {started}{command})"


class Lease:
  """A held lease; `release()` ends it. `lost` becomes a message if another run took it over."""

  def __init__(self, path, record, timeout_s):
    self.path, self.record, self.timeout_s = path, record, timeout_s
    self.lost = None
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._refresh_loop, name="jaxformer-lease", daemon=True)
    self._thread.start()

  def _refresh_loop(self):
    interval = min(max(self.timeout_s / 10, 0.05), 60.0)
    while not self._stop.wait(interval):
      self.refresh()

  def refresh(self):
    """Rewrites `refreshed`; notes in `lost` (and stops) if the file now names another run."""
    holder = _load(self.path)
    if holder is None or holder.get("token") != self.record["token"]:
      self.lost = (f"the workdir lease {self.path} was taken over by "
                   f"{describe(holder) if holder else 'another run (it is gone now)'}: this run stops so the "
                   f"two do not write the same workdir (was this host suspended for longer than "
                   f"train.lease_timeout_s={self.timeout_s:g}?)")
      self._stop.set()
      return
    self.record["refreshed"] = time.time()
    tmp = f"{self.path}.{self.record['token']}.tmp"
    try:
      with open(tmp, "w") as f:
        json.dump(self.record, f)
      os.replace(tmp, self.path)
    except OSError:  # a full disk, say: keep training; the lease ages, it is not lost
      pass

  def release(self):
    """Stops refreshing and deletes the lease file if it is still this run's."""
    self._stop.set()
    if self._thread is not threading.current_thread():
      self._thread.join()
    holder = _load(self.path)
    if holder is not None and holder.get("token") == self.record["token"]:
      try:
        os.remove(self.path)
      except OSError:
        pass


def _load(path):
  """The lease dict at `path`, None if absent; {} if unreadable (not JSON)."""
  try:
    with open(path) as f:
      text = f.read()
  except FileNotFoundError:
    return None
  except OSError:
    return {}
  try:
    holder = json.loads(text)
  except ValueError:
    return {}
  return holder if isinstance(holder, dict) else {}


def acquire(workdir, timeout_s, command="", log=print):
  """Takes the lease on `workdir` (taking over a stale one) or raises UserError naming the holder."""
  path = os.path.join(workdir, LEASE_NAME)
  now = time.time()
  record = {**_identity(), "started": now, "refreshed": now, "command": command, "token": uuid.uuid4().hex}
  tmp = f"{path}.{record['token']}.tmp"
  with open(tmp, "w") as f:
    json.dump(record, f)
  try:
    for _ in range(5):
      try:
        os.link(tmp, path)  # fails if a lease exists
        return Lease(path, record, timeout_s)
      except FileExistsError:
        pass
      holder = _load(path)
      if holder is None:  # released meanwhile
        continue
      reason = stale_reason(holder, timeout_s) if holder else None
      if holder == {}:  # not a lease this code wrote: judge it by its age
        age = time.time() - os.stat(path).st_mtime if os.path.exists(path) else 0.0
        reason = f"unreadable and {age:.0f} s old" if age > timeout_s else None
      if reason is None:
        who = describe(holder) if holder else "an unreadable lease file"
        raise UserError(f"workdir {workdir} is in use by {who}: wait for that run to end or stop it, or use "
                        f"another --workdir (the lease {path} is taken over by itself once that process is gone)")
      aside = f"{path}.{record['token']}.stale"
      try:
        os.rename(path, aside)
      except FileNotFoundError:  # another run took it over first
        continue
      if _load(aside) != holder:  # a live lease was created between our read and the rename: put it back
        try:
          os.link(aside, path)
        except FileExistsError:
          pass
        os.remove(aside)
        continue
      os.remove(aside)
      log(f"took over the workdir lease of {describe(holder)}: {reason}")
    raise UserError(f"could not take the workdir lease {path}: other runs keep taking it; is another "
                    f"train.py starting on --workdir {workdir}?")
  finally:
    os.remove(tmp)
