"""Multi-host liveness: the peer watch that stops every process with one line when another dies.

`runtime.maybe_initialize_distributed` starts it after `jax.distributed.initialize()`; the
training loop tells it where its last complete checkpoint is (`LOST_PROCESS["where"]`). Nothing
here runs in the training loop. Three ways a dead process is noticed, each ending this one with
one line (`error: process I: ...; the last complete checkpoint is step N in DIR. Resume with the
same command on every host.`) and exit code 3:

- a peer's beat in the coordination service's key-value store has not changed for
  `train.host_timeout_s` (a dead process other than the coordinator, or a hung one);
- the coordination service (it lives in process 0) does not answer for that long, or refuses;
- JAX's client aborts the process (SIGABRT) because it lost the service: process 0 died. JAX
  0.10.2 aborts at once, from its own thread, with a C++ check failure (its
  `missed_heartbeat_callback` cannot reach Python: converting the status throws std::bad_cast),
  so a SIGABRT handler turns that abort into our line when the coordinator is unreachable; JAX's
  own message and stack trace are printed before it (they are written before abort()).
"""

import atexit
import ctypes
import os
import signal
import socket
import threading
import time

# What the dead-peer line says about the run: the training loop sets "where" to a function
# returning where its last complete checkpoint is, read from the disk at that moment; "exit" is
# what this process tells the others when it ends ("done" after a clean run).
LOST_PROCESS = {"where": lambda: "no checkpoint is known yet", "exit": "failed"}
_ONE_LINE = threading.Lock()  # the first thread to decide prints; any other waits for its exit
_ENDING = threading.Event()  # set at exit: JAX's shutdown then closes the service, which is no death
_KEEP = []  # the SIGABRT handler's ctypes callback, alive as long as the process


def await_lost_process():
  """Waits (at most two peer timeouts) for the peer watch to stop this process with its line: a
  collective that failed because a process died (gloo: "Connection closed by peer") fails before
  the watch has decided. Returns if it never does (the caller re-raises the collective's error)."""
  if LOST_PROCESS.get("timeout_s"):
    time.sleep(2 * LOST_PROCESS["timeout_s"] + 2)


def _stop(me, who):
  """Prints `error: process <me>: <who>; <where the last complete checkpoint is>. ...` and exits 3."""
  if not _ONE_LINE.acquire(blocking=False):
    time.sleep(3600)  # another thread is printing the line and will end the process
  try:
    where = LOST_PROCESS["where"]()
  except Exception as e:  # pylint: disable=broad-except
    where = f"(could not list the checkpoints: {e})"
  # os.write, not print: the main thread may hold sys.stderr's lock (this can run in a signal handler).
  os.write(2, f"error: process {me}: {who}; {where}. Resume with the same command on every host.\n".encode())
  os._exit(3)  # pylint: disable=protected-access


def _coordinator_gone(address, timeout_s):
  """Why the coordination service at "host:port" is unreachable ("refuses connections", "does
  not answer"), or None when it accepts a connection."""
  host, _, port = address.rpartition(":")
  try:
    socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
  except socket.timeout:
    return f"does not answer within {timeout_s:g} s"
  except OSError as e:
    return "refuses connections" if isinstance(e, ConnectionRefusedError) else f"is unreachable ({e.strerror or e})"
  return None


def _coordinator_line(n, address, why, last_beat):
  if last_beat == "failed":
    return f"process 0 of {n} (the coordinator) stopped with an error (its log says which)"
  return (f"process 0 of {n} (the coordinator) is gone: its coordination service at {address} {why}; "
          "it died or its host was lost")


def watch_peers(timeout_s, period_s=1.0):
  """Starts a daemon thread that beats for this process in the coordination service's key-value
  store every `period_s` and watches the others' beats: a process whose beat has not changed
  for `timeout_s` (train.host_timeout_s, measured on this host's clock) is dead, and so is the
  service if it stops answering for that long or refuses. Then it prints one line naming the lost
  process and the last complete checkpoint and exits at once (code 3): the job cannot go on, and
  the main thread may be blocked in a collective that will never complete. A process that ends
  normally says so first (atexit: "done", or "failed" unless the command set
  LOST_PROCESS["exit"] = "done"), so its silence is not a death. Processes other than 0 also turn
  JAX's abort on a lost coordinator into that line (`_catch_abort`)."""
  import jax  # pylint: disable=g-import-not-at-top  (here: the abort handler's tests start no JAX)
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  client, me, n = distributed.global_state.client, jax.process_index(), jax.process_count()
  address = distributed.global_state.coordinator_address
  key = lambda i: f"jaxformer/alive/{i}"
  seen = {i: (None, time.monotonic()) for i in range(n) if i != me}  # last beat, when it changed
  answered = [time.monotonic()]  # when the service last answered a whole round

  def beat_and_watch():
    beat = 0
    while not _ENDING.is_set():
      beat += 1
      try:
        client.key_value_set(key(me), str(beat), allow_overwrite=True)
        for i, (value, since) in list(seen.items()):
          try:
            now = client.key_value_try_get(key(i))
          except Exception as e:  # pylint: disable=broad-except
            if "NOT_FOUND" not in str(e) and "not found" not in str(e).lower():
              raise
            now = None  # not started beating yet
          if now == "done":
            del seen[i]
          elif now != value:
            seen[i] = (now, time.monotonic())
          elif time.monotonic() - since > timeout_s and now == "failed":  # and this one did not follow
            _stop(me, f"process {i} of {n} stopped with an error {timeout_s:g} s ago (its log says which)")
          elif time.monotonic() - since > timeout_s:
            _stop(me, f"process {i} of {n} has not been heard from for {timeout_s:g} s (train.host_timeout_s): "
                  "it died or its host was lost")
        answered[0] = time.monotonic()
      except Exception as e:  # pylint: disable=broad-except
        if _ENDING.is_set():
          return
        if me == 0:
          _stop(me, f"lost the job's coordination service ({str(e).strip().splitlines()[0][:160]})")
        _stop(me, _coordinator_line(n, address, _coordinator_gone(address, 2.0) or "failed a request",
                                    seen.get(0, (None,))[0]))
      _ENDING.wait(period_s)

  def service_watch():
    # A stopped or cut-off process 0 keeps its socket open: the beat thread's requests then hang
    # (they have no deadline) and only this thread notices, after timeout_s of silence.
    while not _ENDING.wait(period_s):
      if time.monotonic() - answered[0] > timeout_s:
        _stop(me, _coordinator_line(n, address, f"has not answered for {timeout_s:g} s (train.host_timeout_s)",
                                    seen.get(0, (None,))[0]))

  def done():
    # The watch threads end first: a daemon thread still inside a JAX call when the interpreter
    # finalizes is unwound through C++ (pthread_exit), and the process aborts ("FATAL: exception
    # not rethrown"). Then JAX's shutdown closing the service is no death.
    _ENDING.set()
    for thread in threads:
      thread.join(timeout=5)
    _catch_abort(None, None)
    try:
      client.key_value_set(key(me), LOST_PROCESS["exit"], allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except
      pass

  atexit.register(done)  # after JAX's own atexit shutdown was registered, so it runs before it
  if me != 0:
    _catch_abort(lambda: _coordinator_gone(address, 2.0),
                 lambda why: _stop(me, _coordinator_line(n, address, why, seen.get(0, (None,))[0])))
  threads = [threading.Thread(target=beat_and_watch, name="jaxformer-peers", daemon=True),
             threading.Thread(target=service_watch, name="jaxformer-service", daemon=True)]
  for thread in threads:
    thread.start()


def _catch_abort(gone, stop):
  """Installs a SIGABRT handler: when the coordinator is unreachable (`gone()` says why), `stop(why)`
  prints our line and exits 3 instead of the abort; otherwise the abort goes on as before (a crash
  that is not a lost coordinator keeps its core dump and exit code 134).

  JAX's client aborts from its own C++ thread, which holds no Python lock; a ctypes callback takes
  the GIL there (the main thread releases it within a few ms, in Python or in a blocking JAX call).
  A Python `signal.signal` handler would never run: it is deferred to the main thread, and abort()
  does not return to it. `gone` None: back to the default action (at exit)."""
  try:
    libc = ctypes.CDLL(None)
  except OSError:
    return
  libc.signal.restype = ctypes.c_void_p
  libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
  if gone is None:
    if _KEEP:
      libc.signal(signal.SIGABRT, None)
    return

  @ctypes.CFUNCTYPE(None, ctypes.c_int)
  def handler(signum):
    why = gone()
    if why is not None:
      stop(why)
    libc.signal(signum, None)  # SIG_DFL: abort() raises again when a handler returns

  _KEEP.append(handler)
  libc.signal(signal.SIGABRT, ctypes.cast(handler, ctypes.c_void_p))
