"""The process around a command: compilation counting and caching, host memory,
multi-host start-up, and the peak FLOP/s that MFU divides by.

`train.py`, `eval.py`, `python -m jaxformer.generate` and the benchmarks call these first;
nothing here knows about the training loop.
"""

import ctypes
import os
import signal

import jax

from jaxformer import hosts
from jaxformer import inspect as inspect_lib

# Every XLA compilation in this process (seconds each), so a run can report how many
# programs it compiled and how long that took (a new batch shape = a new compilation).
COMPILES = []
jax.monitoring.register_event_duration_secs_listener(
    lambda event, seconds, **_: COMPILES.append(seconds)
    if event == "/jax/core/compile/backend_compile_duration" else None)


def is_off(setting):
  """Whether an environment setting turns its feature off ("", off, none, 0)."""
  return setting.lower() in ("", "off", "none", "0")


def use_compilation_cache():
  """Keeps compiled XLA programs on disk, so re-running a command skips compilation
  (train.py, eval.py and `python -m jaxformer.generate` call it first).

  Directory: $JAXFORMER_COMPILATION_CACHE, default ~/.cache/jaxformer/xla; `off` turns
  it off. Left alone when JAX already has a cache directory (JAX_COMPILATION_CACHE_DIR,
  tests). The key covers the program, shapes, flags, jax version and device, so a stale
  entry is never used. Saves ~10 s per `shakespeare_char` run on a 2-core CPU.
  """
  path = os.environ.get("JAXFORMER_COMPILATION_CACHE", os.path.expanduser("~/.cache/jaxformer/xla"))
  if is_off(path) or jax.config.jax_compilation_cache_dir:
    return None
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.25)  # the eval step too
  return path


def keep_freed_memory():
  """Keeps freed host memory in the process for reuse (glibc), so XLA:CPU's per-call
  temporaries stop costing page faults (train.py, eval.py and `jaxformer.generate` call
  it first).

  By default glibc serves an allocation over 32 MiB with a fresh mmap, unmaps it on
  free and trims its heaps, so every jitted call faults its scratch buffers in again:
  13k faults per step for the baby GPT (`shakespeare_char`) at one step per call.
  No mmap and no trimming keep them, as tcmalloc does (that call: 13-35% less time on
  2 CPU cores); the process keeps its peak footprint, as a GPU allocator does.
  Temporaries over 64 MiB made on XLA's threads are still mapped per call (glibc's
  per-thread heaps stop there, and one arena for all threads made compiling 30-40%
  slower): GLIBC_TUNABLES=glibc.malloc.hugetlb=1 or tcmalloc, set when the process
  starts, remove those too (README, BENCHMARKS.md).
  JAXFORMER_KEEP_MEMORY=off turns it off. Returns whether it applied.
  """
  if is_off(os.environ.get("JAXFORMER_KEEP_MEMORY", "on")):
    return False
  try:
    mallopt = ctypes.CDLL("libc.so.6").mallopt
  except (OSError, AttributeError):  # not glibc (macOS, musl)
    return False
  m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
  return mallopt(m_mmap_max, 0) == 1 and mallopt(m_trim_threshold, 2 ** 31 - 1) == 1


def maybe_initialize_distributed(multihost=False, host_timeout_s=30):
  """Joins a multi-process job (one process per host): with --multihost, or when
  JAX_COORDINATOR_ADDRESS is set. Returns whether it did.

  `jax.distributed.initialize()` finds its peers by itself on Cloud TPU pods, SLURM
  (srun), Open MPI and Kubernetes; elsewhere give every process JAX_COORDINATOR_ADDRESS
  (host:port of process 0), JAX_NUM_PROCESSES and JAX_PROCESS_ID. Must run before JAX
  touches a device.

  `host_timeout_s` (`train.host_timeout_s`): a process not heard from for that long is dead,
  and the others stop with one line (`hosts.watch_peers`); JAX's default heartbeat timeout, 100 s,
  let a job whose host died run on for minutes and then abort with a C++ stack trace.
  """
  if not (multihost or os.environ.get("JAX_COORDINATOR_ADDRESS")):
    return False
  env = lambda k: int(os.environ[k]) if os.environ.get(k) else None
  # JAX's own heartbeat timeout, longer than ours: when it fires first, its client aborts the
  # process with a C++ check failure (JAX 0.10.2 cannot call Python then: its
  # missed_heartbeat_callback fails to convert the status, std::bad_cast); `hosts` catches that
  # abort only when the coordinator is gone.
  jax_timeout = 2 * int(host_timeout_s) + 10
  jax.distributed.initialize(num_processes=env("JAX_NUM_PROCESSES"), process_id=env("JAX_PROCESS_ID"),
                             heartbeat_timeout_seconds=jax_timeout, shutdown_timeout_seconds=jax_timeout)
  if jax.process_count() > 1:
    hosts.LOST_PROCESS["timeout_s"] = host_timeout_s
    hosts.watch_peers(host_timeout_s)
  return True


def c_signal_handler(signum):
  """The C function a library (not Python) installed for `signum`, callable from Python, or None.

  JAX's preemption notifier catches SIGTERM with a plain C handler; the training loop's own
  Python handler replaces it and calls it on, so both learn of the signal (Linux/glibc: the
  handler is the first field of `struct sigaction`)."""
  if callable(signal.getsignal(signum)):  # Python's own (getsignal does not see a C library's)
    return None
  try:
    libc = ctypes.CDLL(None, use_errno=True)
  except OSError:
    return None
  action = ctypes.create_string_buffer(512)  # more than any struct sigaction
  if libc.sigaction(signum, None, action) != 0:
    return None
  pointer = ctypes.c_void_p.from_buffer(action).value
  return ctypes.CFUNCTYPE(None, ctypes.c_int)(pointer) if pointer and pointer > 1 else None


def peak_flops(cfg, log):
  """The job's peak FLOP/s for the MFU in the progress line: the datasheet's dense bf16
  peak x devices on a known GPU/TPU; on a CPU, its own matmul speed in the config's
  matmul dtype, measured now (~0.1 s; x processes); None otherwise (no MFU shown)."""
  device = jax.devices()[0]
  datasheet = inspect_lib.peak_flops(device.device_kind)
  if datasheet:
    return datasheet * jax.device_count()
  if device.platform != "cpu":
    return None
  dtype = inspect_lib.matmul_dtype(cfg)
  compiled = len(COMPILES)
  peak = inspect_lib.matmul_peak(dtype=dtype) * jax.process_count()
  del COMPILES[compiled:]  # the probe is not one of the run's programs
  log(f"mfu against this CPU's {dtype} matmul speed, measured now: {peak / 1e12:.3f} TFLOP/s "
      f"(it varies by ~10% from run to run)")
  return peak
