"""Checkpointing: a thin wrapper over `orbax.checkpoint.CheckpointManager`.

Layout: `<workdir>/checkpoints/<step>/{state,meta}`; `state` is the train-state
pytree (orbax StandardSave), `meta` a JSON dict (data position, config name...).

Unfinished saves: on local disks orbax writes `<step>.orbax-checkpoint-tmp` and
renames it to `<step>` only once complete (on GCS it writes
`commit_success.txt` last instead), and its step listing skips both kinds of
unfinished step, so a save killed midway is never restored.
"""

import os

from etils import epath
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from jaxformer.errors import UserError


def _path_str(path):
  """`(DictKey('params'), GetAttrKey('mu'), SequenceKey(0))` -> 'params/mu/0'."""
  parts = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return "/".join(parts)


def _stored_shape(leaf):
  """Shape as orbax stores it: typed PRNG keys are saved as their key data."""
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    return tuple(jax.eval_shape(jax.random.key_data, leaf).shape)
  return tuple(leaf.shape)


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
  """Saves and restores (train state, JSON meta) pairs under a workdir."""

  def __init__(self, workdir, max_to_keep=5, async_save=True, cleanup_tmp=False):
    """Opens `<workdir>/checkpoints`; `max_to_keep=None` keeps everything.

    `cleanup_tmp` deletes unfinished saves left by a killed job: only for the job
    that writes (eval would delete the save a running training job has in flight).
    """
    self.workdir = os.fspath(workdir)
    self.directory = os.path.join(os.path.abspath(self.workdir), "checkpoints")
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

  def save(self, step, state, meta, force=False):
    """Saves `state` and the JSON-able `meta` dict; returns whether it saved.

    Asynchronous by default: device arrays are copied to host before this
    returns, so the caller may donate or overwrite them. Steps at or below the
    latest one are skipped unless `force`; an existing step is never rewritten.
    """
    step = int(step)
    if step in self._mgr.all_steps():
      return False
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave(dict(meta or {})))
    return self._mgr.save(step, args=args, force=force)

  def latest_step(self):
    """The newest complete (or in-flight, from this process) step, or None."""
    return self._mgr.latest_step()

  def all_steps(self):
    """All complete steps, ascending."""
    return sorted(self._mgr.all_steps())

  def _resolve_step(self, step):
    """Waits for pending saves, rescans the disk and validates `step`."""
    self._mgr.wait_until_finished()
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
    """Raises UserError on the first leaf whose shape differs from the config.

    `prefix` restricts the check to one subtree ('params' for params-only
    restores); extra checkpoint entries outside it are fine then.
    """
    stored = ocp.StandardCheckpointHandler().metadata(
        epath.Path(self.directory) / str(step) / "state")
    have = {
        _path_str(p): tuple(getattr(m, "shape", ()))
        for p, m in jax.tree_util.tree_leaves_with_path(stored.tree)
    }
    want = {
        _path_str(p): _stored_shape(x)
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

  def restore(self, abstract_state, step=None):
    """Restores `(state, meta)` from `step` (default: latest complete one).

    `abstract_state` is a pytree of `jax.ShapeDtypeStruct` (`jax.eval_shape`
    of the state init); arrays are restored with the shardings it carries, so
    a sharded train state restores straight onto the mesh.
    """
    step = self._resolve_step(step)
    self._check_shapes(step, abstract_state)
    restored = self._mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(_with_default_shardings(abstract_state)),
        meta=ocp.args.JsonRestore()))
    return restored.state, dict(restored.meta or {})

  def restore_params(self, abstract_params, step=None):
    """Restores `(params, meta)` alone from a train-state or params checkpoint.

    Reads only the `params` subtree (not the optimizer state), so eval works
    on both training checkpoints and the output of `save_params`.
    """
    step = self._resolve_step(step)
    abstract = {"params": _with_default_shardings(abstract_params)}
    self._check_shapes(step, abstract, prefix="params/")
    step_dir = os.path.join(self.directory, str(step))
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
      meta = ckptr.restore(os.path.join(step_dir, "meta"),
                           args=ocp.args.JsonRestore())
    return state["params"], dict(meta or {})

  def stored_paths(self, step=None):
    """The paths ('params/decoder/layer_0/...') of what `step` (default: latest) holds."""
    step = self._resolve_step(step)
    stored = ocp.StandardCheckpointHandler().metadata(epath.Path(self.directory) / str(step) / "state")
    return [_path_str(p) for p, _ in jax.tree_util.tree_leaves_with_path(stored.tree)]

  def wait(self):
    """Blocks until pending asynchronous saves are on disk."""
    self._mgr.wait_until_finished()

  def close(self):
    """Waits for pending saves and releases orbax's background threads."""
    self._mgr.wait_until_finished()
    self._mgr.close()


def average_checkpoints(workdir, last_k, abstract_state):
  """The mean of the `params` of the last `last_k` checkpoints in `workdir`.

  Accumulates in float32 and returns the parameters' own dtypes, on the
  shardings of `abstract_state` (a full train state or just its params).
  """
  abstract_params = _params_of(abstract_state)
  with Checkpointer(workdir, max_to_keep=None, async_save=False) as ckpt:
    steps = ckpt.all_steps()
    if last_k < 1 or len(steps) < last_k:
      raise UserError(
          f"cannot average the last {last_k} checkpoints: "
          f"{ckpt.directory} has {len(steps)} ({steps})")
    total = None
    for step in steps[-last_k:]:
      params, _ = ckpt.restore_params(abstract_params, step=step)
      params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
      total = params if total is None else jax.tree.map(jnp.add, total, params)
  return jax.tree.map(lambda t, a: (t / last_k).astype(a.dtype),
                      total, abstract_params)


def save_params(path, params, step=0, meta=None):
  """Saves params-only checkpoint `<path>/checkpoints/<step>` for eval.

  Read it back with `Checkpointer(path).restore_params(abstract_params)`.
  """
  with Checkpointer(path, max_to_keep=None, async_save=False) as ckpt:
    if int(step) in ckpt.all_steps():
      raise UserError(
          f"{ckpt.directory}/{step} already exists: choose another path")
    ckpt.save(step, {"params": params}, meta or {}, force=True)
