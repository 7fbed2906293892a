"""Checkpointing: a thin wrapper over `orbax.checkpoint.CheckpointManager`.

Layout: `<workdir>/checkpoints/<step>/{state,meta}`; `state` is the train-state
pytree (orbax StandardSave), `meta` a JSON dict (data position, config name...).

Unfinished saves: on local disks orbax writes `<step>.orbax-checkpoint-tmp` and
renames it to `<step>` only once complete (on GCS it writes
`commit_success.txt` last instead), and its step listing skips both kinds of
unfinished step, so a save killed midway is never restored.

Integrity: `meta` also records a checksum of every array of the state
(`jaxformer.checksum`, computed before the asynchronous write), and
every restore recomputes them on what it read: a checkpoint that cannot be read
or does not match is `DamagedCheckpoint`, never loaded numbers. Checkpoints
written before checksums existed restore unverified, with a note. A state with
NaN or inf is not saved (`NonFiniteState`). A failed write (a full disk), also
one surfacing from orbax's background thread, is `CheckpointWriteError`, one
line naming the last complete step; earlier checkpoints are left as they were.
`restore_newest_intact` (the training job's resume) renames damaged newer
checkpoints `<step>.corrupt`, out of orbax's listing, and restores the one before.
`DamagedCheckpoint` names the file to blame (`damaged_file`). Files a restore never
reads (the per-process OCDBT manifests and b-tree nodes that orbax's merged index
supersedes, `commit_success.txt`) are not checked: damage to them changes nothing.
"""

import errno
import json
import logging
import math
import os
import re
import shutil
import sys
import traceback
import warnings

from etils import epath
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from jax.experimental import multihost_utils

from jaxformer import checksum
from jaxformer.errors import UserError


class DamagedCheckpoint(UserError):
  """A checkpoint that cannot be read or whose arrays do not match their checksums."""

  def __init__(self, directory, step, reason):
    super().__init__(f"checkpoint {directory}/{step} is damaged: {reason}")
    self.step, self.reason = step, reason


class NonFiniteCheckpoint(UserError):
  """An intact checkpoint whose state holds NaN or inf (saved before saves refused them)."""

  def __init__(self, directory, step, paths):
    super().__init__(f"checkpoint {directory}/{step} holds NaN or inf ({_some(paths)})")
    self.step = step


class NonFiniteState(UserError):
  """A state with NaN or inf that `save` refused to write."""


class CheckpointWriteError(UserError):
  """A save that failed (full disk, I/O error); the earlier checkpoints are untouched."""


def _some(paths, n=2):
  """'a, b and 3 more'."""
  more = f" and {len(paths) - n} more" if len(paths) > n else ""
  return ", ".join(paths[:n]) + more


def _one_line(error, limit=160):
  """`ValueError: first line of the message` (cut to `limit` characters)."""
  text = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
  return text if len(text) <= limit else text[:limit - 3] + "..."


def is_no_space(error):
  """Whether `error` (or what caused it) is a full disk or quota: OSError ENOSPC/EDQUOT, or
  tensorstore's `... No space left on device [os_error_code='28']`."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
      return True
    text = str(error)
    if "No space left on device" in text or "Disk quota exceeded" in text or f"os_error_code='{errno.ENOSPC}'" in text:
      return True
    error = error.__cause__ or error.__context__
  return False


def filesystem_of(path):
  """'/dev/sdb1 (mounted on /data)' for the filesystem holding `path`; its mount point if unknown."""
  path = os.path.realpath(path)
  while not os.path.exists(path):
    path = os.path.dirname(path)
  mount = path
  while not os.path.ismount(mount):
    mount = os.path.dirname(mount)
  try:
    with open("/proc/mounts") as f:
      devices = [line.split()[0] for line in f if len(line.split()) > 1 and line.split()[1] == mount]
  except OSError:
    devices = []
  return f"{devices[-1]} (mounted on {mount})" if devices else mount


class _QuietOrbaxTracebacks(logging.Filter):
  """Drops orbax's logged tracebacks of a failed background save: `Checkpointer` re-raises the
  same error as one line (`--debug` shows its traceback)."""

  def filter(self, record):
    return not (record.levelno >= logging.ERROR and record.exc_info and "orbax" in record.pathname)


def _is_orbax_read_noise(unraisable):
  """When one array of a damaged checkpoint fails to read, orbax closes its event loop under the
  other reads: tensorstore's callbacks then hit `Event loop is closed` and the abandoned read
  coroutines raise as they are collected, each printed as an unraisable traceback. The one
  `DamagedCheckpoint` says it all."""
  code = getattr(unraisable.object, "cr_code", None)
  return ((isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed")
          or (code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename))


def _is_orbax_asyncio_noise(record):
  """The writes abandoned when one of them fails (a full disk): asyncio logs each one's error, with
  a traceback, when its task or future is collected."""
  if "exception was never retrieved" not in record.getMessage():  # Task, Future, _GatheringFuture
    return False
  frames = traceback.extract_tb(record.exc_info[2]) if record.exc_info and record.exc_info[2] else []
  # orbax in a frame, or in the message (tensorstore's errors name the `.orbax-checkpoint-tmp` path)
  return any("orbax" in text for text in [record.getMessage(), *(f.filename for f in frames)])


def _quiet_orbax_noise():
  """Installs the filters above once per process (not with JAXFORMER_DEBUG=1)."""
  if os.environ.get("JAXFORMER_DEBUG") == "1" or getattr(sys.unraisablehook, "jaxformer", False):
    return
  logging.getLogger("absl").addFilter(_QuietOrbaxTracebacks())
  logging.getLogger("asyncio").addFilter(lambda record: not _is_orbax_asyncio_noise(record))
  # The same abandoned reads, when one was never started: a two-line RuntimeWarning under the warning line.
  warnings.filterwarnings("ignore", r"coroutine '_read_array_index_and_device_put' was never awaited", RuntimeWarning)
  previous = sys.unraisablehook

  def hook(unraisable):
    if not _is_orbax_read_noise(unraisable):
      previous(unraisable)

  hook.jaxformer = True
  sys.unraisablehook = hook


class _Unusable(Exception):
  """A file a restore needs and cannot use; the message is its path relative to the checkpoint."""


def _ocdbt_file(location):
  """(path relative to the database directory, offset, length) of an OCDBT node or value location,
  'btreenode::d/ab12:0:180' or 'value:ocdbt.process_0/:d/cd34:15391:3862' (`ts.ocdbt.dump`'s form)."""
  head, offset, length = location.split(":", 1)[1].rsplit(":", 2)
  base, name = head.split(":", 1)
  return base + name, int(offset), int(length)


def _ocdbt_values(step_dir):
  """[(key, file)] of every value of the latest version of `<step_dir>/state`'s OCDBT database (the
  one a restore reads: orbax's merged index), `file` relative to `step_dir` (the b-tree node for a
  value stored inline); [] if the arrays are not in an OCDBT database.

  Raises `_Unusable` naming the manifest, a node or a data file that tensorstore cannot decode, or
  that is missing or shorter than a reference into it. The per-process manifests and the nodes
  of their earlier versions are not read: a restore never does.
  """
  state = os.path.join(step_dir, "state")
  if not os.path.exists(os.path.join(state, "manifest.ocdbt")) and not any(
      n.startswith("ocdbt.process_") for n in (os.listdir(state) if os.path.isdir(state) else [])):
    return []  # plain zarr directories (orbax's use_ocdbt=False)

  def whole(rel, end):
    path = os.path.join(state, rel)
    if not os.path.isfile(path) or os.path.getsize(path) < end:
      raise _Unusable(os.path.join("state", rel))

  kv = ts.KvStore.open({"driver": "file", "path": state + os.sep}).result()
  whole("manifest.ocdbt", 1)
  try:
    versions = ts.ocdbt.dump(kv).result()["versions"]
  except Exception as e:  # pylint: disable=broad-exception-caught  (tensorstore's DATA_LOSS, ...)
    raise _Unusable("state/manifest.ocdbt") from e
  root = versions[-1]["root"].get("location") if versions else None
  values, nodes = [], [(root, b"")] if root else []
  while nodes:
    location, prefix = nodes.pop()
    rel, offset, length = _ocdbt_file(location)
    whole(rel, offset + length)
    try:
      node = ts.ocdbt.dump(kv, location).result()
    except Exception as e:  # pylint: disable=broad-exception-caught
      raise _Unusable(os.path.join("state", rel)) from e
    for entry in node["entries"]:
      key = prefix + entry["key"]
      if "indirect_value" in entry:
        value_rel, offset, length = _ocdbt_file(entry["indirect_value"])
        whole(value_rel, offset + length)
        values.append((key, os.path.join("state", value_rel)))
      elif "location" in entry:  # an interior node: its children's keys follow the common prefix
        nodes.append((entry["location"], prefix + entry.get("subtree_common_prefix", b"")))
      else:
        values.append((key, os.path.join("state", rel)))
  return values


def _json_files(step_dir):
  """[(path relative to `step_dir`, required)] of the JSON files a restore reads."""
  listing = os.path.join(step_dir, "state", "array_metadatas")
  per_process = sorted(os.listdir(listing)) if os.path.isdir(listing) else []
  return ([("state/_METADATA", True), ("state/_sharding", False), ("meta/metadata", True)]
          + [(f"state/array_metadatas/{name}", False) for name in per_process])


def damaged_file(step_dir, error=None, array=None):
  """The file of checkpoint directory `step_dir` to blame for a failed restore (relative to it), or None.

  `array`, a path whose data failed its checksum ('params/embed/embedding'): the file(s) its data
  was read from. Otherwise the first file a restore reads and cannot use: a JSON file missing or
  not JSON, an OCDBT manifest or node that tensorstore cannot decode, a data file missing or shorter
  than what refers to it; when those are all whole, the data file of the array that tensorstore's
  message in `error` names (bytes changed in place: undecodable). Best effort, on the error path:
  any failure of the diagnosis itself is None.
  """
  try:
    if array is None:
      for rel, required in _json_files(step_dir):
        path = os.path.join(step_dir, rel)
        if os.path.exists(path) or required:
          try:
            with open(path, encoding="utf-8") as f:
              json.load(f)
          except (OSError, ValueError):  # missing, not UTF-8 or not JSON
            return rel
    values = _ocdbt_values(step_dir)
    if array is not None:
      key = array.replace("/", ".") + "/"  # orbax's key of the array's chunks: 'params.embed.embedding/0.0'
    else:
      text = []
      while error is not None and len(text) < 10:
        text.append(str(error))
        error = error.__cause__ or error.__context__
      named = re.search(r'Error reading "([^"]+)" in OCDBT database', " ".join(text))
      key = named.group(1) if named else None
    if key is None:
      return None
    files = sorted({f for k, f in values
                    if k.startswith(key.encode()) and not k.endswith((b"/.zarray", b"/zarr.json"))})
    return _some(files) if files else None
  except _Unusable as e:
    return str(e)
  except Exception:  # pylint: disable=broad-exception-caught  (never hide the damage behind a failed diagnosis)
    return None


def _all_processes(ok):
  """`ok` on every process (a multi-host job decides together whether a checkpoint is intact)."""
  if jax.process_count() == 1:
    return ok
  return bool(np.all(multihost_utils.process_allgather(np.int32(ok))))


def _stored_shape(leaf):
  """Shape as orbax stores it: typed PRNG keys are saved as their key data."""
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    return tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
  return tuple(leaf.shape)


# train.lora_base_dtype=bfloat16 reads a float32 base in groups of about this many (stored) bytes.
NARROW_GROUP_BYTES = 1 << 30


def _cast(x, dtype, sharding):
  """x cast to `dtype`, laid out by `sharding` (one small program per shape)."""
  return jax.jit(lambda y: y.astype(dtype), out_shardings=sharding)(x)


def _with_default_shardings(abstract):
  """Gives leaves without a sharding (plain `jax.eval_shape`) one device.

  Without a sharding orbax would restore a numpy array, or reuse the sharding
  saved in the checkpoint, which may name devices this job does not have.
  Multi-device runs should pass the shardings they train with.
  """
  device = jax.local_devices()[0]

  def fix(x):
    if getattr(x, "sharding", None) is not None:
      return x
    return jax.ShapeDtypeStruct(
        x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device))

  return jax.tree.map(fix, abstract)


def _params_of(tree):
  """The `params` subtree of a dict-like or TrainState-like state."""
  if isinstance(tree, dict) and "params" in tree:
    return tree["params"]
  if hasattr(tree, "params"):
    return tree.params
  raise UserError("the state has no 'params' entry to average or restore")


class Checkpointer:
  """Saves and restores (train state, JSON meta) pairs under a workdir, with checksums."""

  def __init__(self, workdir, max_to_keep=5, async_save=True, cleanup_tmp=False, log=None):
    """Opens `<workdir>/checkpoints`; `max_to_keep=None` keeps everything.

    `cleanup_tmp` deletes unfinished saves left by a killed job: only for the job
    that writes (eval would delete the save a running training job has in flight).
    `log` receives notes (a checkpoint restored without checksums to verify).
    """
    self.workdir = os.fspath(workdir)
    self.directory = os.path.join(os.path.abspath(self.workdir), "checkpoints")
    self._log = log or (lambda *args: None)
    self._writing = None  # the step whose asynchronous save may still be running
    self._failed = False
    _quiet_orbax_noise()
    options = ocp.CheckpointManagerOptions(
        # `max_to_keep` is deprecated in this orbax in favour of policies.
        preservation_policy=ocp.checkpoint_managers.LatestN(max_to_keep),
        enable_async_checkpointing=async_save,
        cleanup_tmp_directories=cleanup_tmp,
    )
    self._mgr = ocp.CheckpointManager(self.directory, options=options)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def save(self, step, state, meta, force=False, allow_nonfinite=False):
    """Saves `state` and the JSON-able `meta` dict with the state's checksums; returns whether it saved.

    Asynchronous by default: device arrays are copied to host before this
    returns, so the caller may donate or overwrite them. Steps at or below the
    latest one are skipped unless `force`; an existing step is never rewritten.
    A state holding NaN or inf raises `NonFiniteState` unless `allow_nonfinite`;
    a failed write (now, or of the previous asynchronous save) `CheckpointWriteError`.
    """
    step = int(step)
    self._guard(self._writing, self._mgr.wait_until_finished)  # the previous save's error, if any
    self._writing = None
    if step in self._mgr.all_steps():
      return False
    sums, nonfinite = checksum.fingerprint(state)
    if nonfinite and not allow_nonfinite:
      raise NonFiniteState(f"the train state at step {step} holds NaN or inf ({_some(nonfinite)}), so it was not "
                           f"saved; {self.last_complete_phrase()}")
    # The dtypes too: a restore may widen an array (a bfloat16 checkpoint into float32 params,
    # exactly), and its checksum is of the stored bits.
    dtypes = {checksum.path_str(p): str(x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(state)}
    meta = {**(meta or {}), "checksums": {"algorithm": checksum.ALGORITHM, "arrays": sums, "dtypes": dtypes}}
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave(meta))
    saved = self._guard(step, lambda: self._mgr.save(step, args=args, force=force))
    self._writing = step if saved else None
    return saved

  def _guard(self, step, write):
    """Runs `write()`; turns its failure into `CheckpointWriteError` naming `step` and the last complete one."""
    try:
      return write()
    except (UserError, KeyboardInterrupt, MemoryError):
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught  (whatever orbax or tensorstore raise)
      self._failed = True
      self._writing = None
      self._remove_partial(step)
      what = f"no space left on {filesystem_of(self.directory)}" if is_no_space(e) else (
          f"cannot write {self.directory} ({_one_line(e)})")
      raise CheckpointWriteError(f"{what} while saving step {step}; {self.last_complete_phrase()}") from e

  def _remove_partial(self, step):
    """Deletes the unfinished save of `step` (process 0), which frees the space it took."""
    if step is None or jax.process_index() != 0 or not os.path.isdir(self.directory):
      return
    for name in os.listdir(self.directory):
      if name.startswith(f"{step}.orbax-checkpoint-tmp"):
        shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def last_complete_phrase(self):
    """'the last complete checkpoint is step M', read from the disk now (for error messages)."""
    steps = ocp.path.step.checkpoint_steps(self.directory) if os.path.isdir(self.directory) else []
    return f"the last complete checkpoint is step {max(steps)}" if steps else "no checkpoint was completed before it"

  def latest_step(self):
    """The newest complete (or in-flight, from this process) step, or None."""
    return self._mgr.latest_step()

  def all_steps(self):
    """All complete steps, ascending."""
    return sorted(self._mgr.all_steps())

  def _resolve_step(self, step):
    """Waits for pending saves, rescans the disk and validates `step`."""
    self.wait()
    self._mgr.reload()  # Pick up steps written by another job (eval).
    steps = self.all_steps()
    if not steps:
      raise UserError(
          f"no checkpoint in {self.directory}: is --workdir "
          f"'{self.workdir}' right, or has training not saved one yet?")
    if step is None:
      return steps[-1]
    if int(step) not in steps:
      raise UserError(
          f"no checkpoint for step {step} in {self.directory}; "
          f"available steps: {steps}")
    return int(step)

  def _check_shapes(self, step, abstract, prefix=""):
    """Raises UserError on the first leaf whose shape differs from the config; returns the
    stored dtypes, {path: numpy dtype or None}.

    `prefix` restricts the check to one subtree ('params' for params-only
    restores); extra checkpoint entries outside it are fine then.
    """
    stored = self._read(step, lambda: ocp.StandardCheckpointHandler().metadata(
        epath.Path(self.directory) / str(step) / "state"), what="its metadata")
    have = {
        checksum.path_str(p): tuple(getattr(m, "shape", ()))
        for p, m in jax.tree_util.tree_leaves_with_path(stored.tree)
    }
    dtypes = {checksum.path_str(p): getattr(m, "dtype", None)
              for p, m in jax.tree_util.tree_leaves_with_path(stored.tree)}
    want = {
        checksum.path_str(p): _stored_shape(x)
        for p, x in jax.tree_util.tree_leaves_with_path(abstract)
    }
    hint = "was it trained with another config?"
    # Report a parameter before its optimizer moments: it reads better.
    for path, shape in sorted(want.items(),
                              key=lambda kv: not kv[0].startswith("params/")):
      if path not in have:
        raise UserError(
            f"checkpoint {self.directory}/{step} has no {path} but the config "
            f"builds {list(shape)}: {hint}")
      if have[path] != shape:
        raise UserError(
            f"checkpoint has {path} {list(have[path])} but the config builds "
            f"{list(shape)}: {hint}")
    for path, shape in have.items():
      if path.startswith(prefix) and path not in want:
        raise UserError(
            f"checkpoint has {path} {list(shape)} which the config does not "
            f"build: {hint}")
    return dtypes

  def _verify(self, step, tree, meta):
    """Checks `tree` (restored from `step`) against the checksums in `meta`; pops them from `meta`.

    Returns the paths of arrays holding NaN or inf; raises `DamagedCheckpoint` on a mismatch.
    """
    record = meta.pop("checksums", None)
    stored = record.get("dtypes", {}) if isinstance(record, dict) else {}
    tree = jax.tree_util.tree_map_with_path(  # back to the stored dtype (exact: restoring only widens)
        lambda p, x: x.astype(stored[checksum.path_str(p)])
        if str(x.dtype) != stored.get(checksum.path_str(p), str(x.dtype)) else x, tree)
    sums, nonfinite = checksum.fingerprint(tree)
    if "step" in meta and meta["step"] != step:
      raise DamagedCheckpoint(self.directory, step, f"meta/metadata names step {meta['step']}")
    if not isinstance(record, dict) or record.get("algorithm") != checksum.ALGORITHM:
      why = ("was written before checkpoints carried checksums" if record is None else
             f"carries checksums of an unknown kind ({str(record)[:40]})")
      self._log(f"note: checkpoint {self.directory}/{step} {why}: restored without verifying them")
      return nonfinite
    recorded = record.get("arrays", {})
    for path, value in sums.items():
      if path not in recorded:
        raise DamagedCheckpoint(self.directory, step, f"no checksum recorded for {path} (meta/metadata)")
      if recorded[path] != value:
        file = damaged_file(os.path.join(self.directory, str(step)), array=path)
        raise DamagedCheckpoint(self.directory, step,
                                f"{path} does not match its checksum" + (f" (read from {file})" if file else ""))
    return nonfinite

  def _read(self, step, read, what="it"):
    """`read()`, with any failure to read `step` (on any process) as `DamagedCheckpoint`.

    The processes of a multi-host job agree before going on: the checksums that follow are
    computed by all of them together.
    """
    result, error = None, None
    try:
      result = read()
    except (UserError, KeyboardInterrupt, MemoryError):
      raise
    except Exception as e:  # pylint: disable=broad-exception-caught  (whatever orbax or tensorstore raise)
      # orbax's message rarely names the file (a JSON error never does, tensorstore's is cut short)
      file = damaged_file(os.path.join(self.directory, str(step)), error=e)
      error = DamagedCheckpoint(self.directory, step,
                                f"cannot read {what} ({_one_line(e)})" + (f" in {file}" if file else ""))
      error.__cause__ = e
    if not _all_processes(error is None):
      raise error or DamagedCheckpoint(self.directory, step, "another process could not read it")
    return result

  def restore(self, abstract_state, step=None, require_finite=False):
    """Restores `(state, meta)` from `step` (default: latest complete one), verified.

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (`jax.eval_shape`
    of the state init); arrays are restored with the shardings it carries, so
    a sharded train state restores straight onto the mesh. Raises
    `DamagedCheckpoint` if it cannot be read or fails its checksums, and with
    `require_finite`, `NonFiniteCheckpoint` if it holds NaN or inf.
    """
    step = self._resolve_step(step)
    self._check_shapes(step, abstract_state)
    restored = self._read(step, lambda: self._mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_with_default_shardings(abstract_state)),
        meta=ocp.args.JsonRestore())))
    meta = dict(restored.meta or {})
    nonfinite = self._verify(step, restored.state, meta)
    if nonfinite and require_finite:
      raise NonFiniteCheckpoint(self.directory, step, nonfinite)
    return restored.state, meta

  def restore_newest_intact(self, abstract_state):
    """`(state, meta)` of the newest checkpoint that is intact and finite; None if there is none at all.

    For the training job (the only writer): each newer damaged checkpoint gets one warning
    line (through `log`) and is renamed `<step>.corrupt`, so the restored one is the latest
    again and that step can be saved anew. When none is intact nothing is renamed and a
    `UserError` says so; when the newest intact one holds NaN or inf, a `UserError` names
    the newest finite one before it.
    """
    self.wait()
    self._mgr.reload()
    steps = self.all_steps()
    if not steps:
      return None
    damaged = []
    for step in reversed(steps):
      try:
        result, error = self.restore(abstract_state, step, require_finite=True), None
      except (DamagedCheckpoint, NonFiniteCheckpoint) as e:
        result, error = None, e
      if isinstance(error, NonFiniteCheckpoint):
        good = self._newest_finite(abstract_state, [s for s in steps if s < step])
        raise UserError(f"{error}: the state was poisoned before it was saved; "
                        + (f"the last good checkpoint is {self.directory}/{good} (move the later ones aside "
                           f"to resume from it)" if good is not None else "no earlier checkpoint is good"))
      if error is None:
        break
      damaged.append(error)
    else:
      raise UserError(
          f"no intact checkpoint in {self.directory}: step{'s' if len(damaged) > 1 else ''} "
          f"{', '.join(str(e.step) for e in reversed(damaged))} damaged (newest: {damaged[0].reason}); "
          f"restore them from a backup, or move {self.directory} aside to start afresh")
    for error in damaged:
      aside = self._move_aside(error.step)
      self._log(f"warning: {error}; moved it to {aside} and resumed from step {step}")
    if damaged:
      self._mgr.reload()
    return result

  def _newest_finite(self, abstract_state, steps):
    """The newest of `steps` that restores intact and finite, or None (the error path only)."""
    for step in reversed(steps):
      try:
        self.restore(abstract_state, step, require_finite=True)
        return step
      except (DamagedCheckpoint, NonFiniteCheckpoint):
        continue
    return None

  def _move_aside(self, step):
    """Renames `<step>` to `<step>.corrupt` (`.corrupt-2`, ... if taken): out of orbax's listing, kept to inspect."""
    aside = os.path.join(self.directory, f"{step}.corrupt")
    n = 1
    while os.path.exists(aside):
      n += 1
      aside = os.path.join(self.directory, f"{step}.corrupt-{n}")
    if jax.process_index() == 0:
      os.rename(os.path.join(self.directory, str(step)), aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f"jaxformer.move_aside.{step}")
    return aside

  def restore_params(self, abstract_params, step=None):
    """Restores `(params, meta)` alone from a train-state or params checkpoint, verified.

    Reads only the `params` subtree (not the optimizer state), so eval works
    on both training checkpoints and the output of `save_params`; only the
    params' checksums are checked. Raises `DamagedCheckpoint` like `restore`.
    """
    step = self._resolve_step(step)
    abstract = {"params": _with_default_shardings(abstract_params)}
    stored_dtypes = self._check_shapes(step, abstract, prefix="params/")
    step_dir = os.path.join(self.directory, str(step))

    def read(abstract):
      # The manager binds `state` to StandardRestore once it has saved; partial
      # restores need the PyTree handler, so read the item directory directly.
      with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as ckptr:
        state = ckptr.restore(
            os.path.join(step_dir, "state"),
            args=ocp.args.PyTreeRestore(
                item=abstract,
                restore_args=ocp.checkpoint_utils.construct_restore_args(
                    abstract),
                partial_restore=True))
      with ocp.Checkpointer(ocp.JsonCheckpointHandler()) as ckptr:
        meta = ckptr.restore(os.path.join(step_dir, "meta"), args=ocp.args.JsonRestore())
      return state, dict(meta or {})

    flat = traverse_util.flatten_dict(abstract)
    wide = {k: np.dtype(stored_dtypes["/".join(k)]) for k, x in flat.items()
            if stored_dtypes.get("/".join(k)) is not None
            and np.dtype(stored_dtypes["/".join(k)]).itemsize > np.dtype(x.dtype).itemsize}
    if not wide:
      state, meta = self._read(step, lambda: read(abstract))
      self._verify(step, {"params": state["params"]}, meta)
      return state["params"], meta
    return self._restore_narrowed(step, flat, wide, read)

  def _restore_narrowed(self, step, flat, wide, read):
    """restore_params where the abstract asks for a narrower dtype than a leaf was stored in (a
    float32 checkpoint into a bfloat16 LoRA base, train.lora_base_dtype): the leaves are read in
    groups of about NARROW_GROUP_BYTES at their stored dtype, verified against the checksums there (which
    are of the stored values), then cast and the wide copies dropped, so the whole tree never exists
    at the wide dtype (a float32 Llama 3.1 8B base, 32 GB, would not fit the 24 GB card the
    bfloat16 one is for). flat: {("params", ...): ShapeDtypeStruct}; wide: {key: stored dtype}."""
    groups, size, group_bytes = [[]], 0, NARROW_GROUP_BYTES
    for key, x in flat.items():
      nbytes = math.prod(x.shape) * (wide[key] if key in wide else np.dtype(x.dtype)).itemsize
      if groups[-1] and size + nbytes > group_bytes:
        groups.append([])
        size = 0
      groups[-1].append(key)
      size += nbytes
    out, meta = {}, {}
    for keys in groups:
      part = {k: (jax.ShapeDtypeStruct(flat[k].shape, wide[k], sharding=flat[k].sharding) if k in wide else flat[k])
              for k in keys}
      state, meta = self._read(step, lambda part=part: read(traverse_util.unflatten_dict(part)))
      self._verify(step, {"params": state["params"]}, dict(meta))
      got = traverse_util.flatten_dict(state)
      del state
      for k in keys:
        x = got.pop(k)
        out[k] = _cast(x, flat[k].dtype, flat[k].sharding) if k in wide else x
        del x
    meta.pop("checksums", None)
    return traverse_util.unflatten_dict(out)["params"], meta

  def check(self):
    """Raises `CheckpointWriteError` now if an asynchronous save has already failed; never waits.

    Single-process jobs only (the processes of a multi-host job learn of a failure together, at
    the next `save` or `wait`).
    """
    if self._writing is not None and jax.process_count() == 1 and not self._mgr.is_saving_in_progress():
      self.wait()

  def stored_paths(self, step=None):
    """The paths ('params/decoder/layer_0/...') of what `step` (default: latest) holds."""
    step = self._resolve_step(step)
    stored = self._read(step, lambda: ocp.StandardCheckpointHandler().metadata(
        epath.Path(self.directory) / str(step) / "state"), "its array metadata")
    return [checksum.path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(stored.tree)]

  def wait(self):
    """Blocks until pending asynchronous saves are on disk (`CheckpointWriteError` if one failed)."""
    self._guard(self._writing, self._mgr.wait_until_finished)
    self._writing = None

  def close(self):
    """Waits for pending saves and releases orbax's background threads."""
    if self._failed:  # already reported; what is left to wait for is orbax's cleanup
      try:
        self._mgr.close()
      except Exception:  # pylint: disable=broad-exception-caught
        pass
      return
    self.wait()
    self._mgr.close()


def averaged_steps(steps, last_k, until=None, directory="the workdir"):
  """The `last_k` steps of `steps` (sorted) that end at step `until` (default: the newest)."""
  if until is not None:
    if until not in steps:
      raise UserError(f"cannot average the {last_k} checkpoints ending at step {until}: {directory} has no "
                      f"step {until} (it has {steps})")
    steps = [s for s in steps if s <= until]
  if last_k < 1 or len(steps) < last_k:
    ending = f" ending at step {until}" if until is not None else ""
    raise UserError(f"cannot average the last {last_k} checkpoints{ending}: {directory} has {len(steps)} "
                    f"({steps})")
  return steps[-last_k:]


def average_checkpoints(workdir, last_k, abstract_state, log=None, until=None):
  """The mean of the `params` of the last `last_k` checkpoints in `workdir` (those ending at step
  `until`, default the newest), each verified.

  Accumulates in float32 and returns the parameters' own dtypes, on the
  shardings of `abstract_state` (a full train state or just its params).
  """
  abstract_params = _params_of(abstract_state)
  with Checkpointer(workdir, max_to_keep=None, async_save=False, log=log) as ckpt:
    steps = averaged_steps(ckpt.all_steps(), last_k, until, ckpt.directory)
    total = None
    for step in steps:
      params, _ = ckpt.restore_params(abstract_params, step=step)
      params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
      total = params if total is None else jax.tree.map(jnp.add, total, params)
  return jax.tree.map(lambda t, a: (t / last_k).astype(a.dtype),
                      total, abstract_params)


def save_params(path, params, step=0, meta=None):
  """Saves params-only checkpoint `<path>/checkpoints/<step>` for eval (with fresh checksums).

  Read it back with `Checkpointer(path).restore_params(abstract_params)`.
  """
  with Checkpointer(path, max_to_keep=None, async_save=False) as ckpt:
    if int(step) in ckpt.all_steps():
      raise UserError(
          f"{ckpt.directory}/{step} already exists: choose another path")
    ckpt.save(step, {"params": params}, meta or {}, force=True)
