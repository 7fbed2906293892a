"""The training loop: one pure, jitted `train_step` for both tasks.

    python train.py --config wmt_base --workdir runs/wmt_base [model.num_layers=2 ...]

The state is a dict {step, params, opt_state, skipped}; the data position is the step
(batches are pure functions of it) and the dropout key is `fold_in(seed, step)`, so a
run restarted from a checkpoint continues exactly as if it had never stopped.
"""

import argparse
import contextlib
import functools
import os
import shlex
import shutil
import signal
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils

from jaxformer import bleu
from jaxformer import checkpoint as checkpoint_lib
from jaxformer import checksum
from jaxformer import config as config_lib
from jaxformer import decode
from jaxformer import evaluate as evaluate_lib
from jaxformer import hosts
from jaxformer import inspect as inspect_lib
from jaxformer import layers
from jaxformer import lease as lease_lib
from jaxformer import lora
from jaxformer import metrics as metrics_lib
from jaxformer import model as model_lib
from jaxformer import optim
from jaxformer import runtime
from jaxformer import sharding
from jaxformer import tasks
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.errors import UserError, cli

def make_train_step(model, task, cfg, tx, schedule):
  """Returns `train_step(state, batch) -> (state, metrics)`, pure and jittable.

  The batch's leading axis is split into `grad_accum_steps` equal micro-batches whose
  summed gradients are divided by the total number of target tokens: the update is
  the same as for one big batch. A step whose loss or gradient is not finite leaves
  params and optimizer state untouched and is counted in `state["skipped"]`.

  With LoRA (train.lora_rank > 0) `state["params"]` holds the adapters alone and the step takes
  the frozen base params as a third argument, `train_step(state, batch, base)`: only the
  adapters get gradients and optimizer updates (`jaxformer.lora`). DPO's frozen reference is
  `state["ref_params"]`, or with LoRA that same base with the adapters off (`preference_loss`).
  """
  accum = cfg.optim.grad_accum_steps
  base_rng = jax.random.PRNGKey(cfg.train.seed)
  dpo = cfg.train.objective == "dpo"

  moe = {"moe_coefs": (cfg.optim.moe_aux_loss, cfg.optim.moe_z_loss)} if cfg.model.moe_experts else {}

  def grads_of(params, batch, rng, reference, base):
    def loss_fn(p):
      if dpo:  # the second objective: a preference loss against the frozen reference (LoRA: the base)
        return preference_loss(model, task, cfg, p, batch, {"dropout": rng}, False,
                               base if base is not None else reference)
      with lora.adapters_active(cfg):  # LoRA: p are the adapters, on the frozen base
        full = p if base is None else lora.combine(base, p)
        loss, nll, weight, *stats = task.loss(model, full, batch, {"dropout": rng}, False,
                                              cfg.optim.label_smoothing, **moe)
      # stats: [MoE router statistics: load_balancing, z_loss, expert_fraction] or []
      return loss, {"nll_sum": nll, "tokens": weight, **{f"moe_{k}": v for k, v in (stats[0] if stats else {}).items()}}
    (loss, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return grads, loss, sums

  def train_step(state, batch, base=None):
    rng = jax.random.fold_in(base_rng, state["step"])
    reference = state.get("ref_params")
    if accum == 1:
      grads, loss, sums = grads_of(state["params"], batch, rng, reference, base)
    else:
      micro = jax.tree.map(lambda x: x.reshape(accum, x.shape[0] // accum, *x.shape[1:]), batch)

      def body(carry, xs):
        i, mb = xs
        out = grads_of(state["params"], mb, jax.random.fold_in(rng, i), reference, base)
        return jax.tree.map(jnp.add, carry, out), None

      zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grads_of, state["params"], jax.tree.map(lambda x: x[0], micro),
                                                          rng, reference, base))
      (grads, loss, sums), _ = jax.lax.scan(body, zeros, (jnp.arange(accum), micro))
      sums = {k: v / accum if k.startswith("moe_") else v for k, v in sums.items()}  # MoE: means over micro-batches
    weight = jnp.maximum(sums["tokens"], 1.0)
    grads = jax.tree.map(lambda g: g / weight, grads)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = {"step": state["step"] + 1, "params": keep(params, state["params"]),
                 "opt_state": keep(opt_state, state["opt_state"]),
                 "skipped": state["skipped"] + (~finite).astype(jnp.int32)}
    if reference is not None:
      new_state["ref_params"] = reference  # frozen: passed through untouched
    metrics = {"loss_sum": loss, **sums, "tokens": weight, "grad_norm": grad_norm,
               "lr": schedule(state["step"]), "finite": finite}
    return new_state, metrics

  return train_step


def make_multi_step(train_step):
  """Returns `multi_step(state, batches) -> (state, metrics)`: a tuple of same-shape batches
  run as consecutive steps in one `lax.scan`, metrics stacked on a leading step axis.

  The trained state is bitwise that of calling `train_step` on each batch in turn (the
  metrics agree to float32 rounding: XLA may order a sum differently in the loop). What
  it saves is the per-call cost, large for small models on CPU: Python dispatch, and
  XLA's scratch buffer, freshly allocated (and page-faulted in) at every call.
  """
  def multi_step(state, batches, *extra):  # extra: the frozen base params of a LoRA run
    return jax.lax.scan(lambda s, b: train_step(s, b, *extra), state, jax.tree.map(lambda *xs: jnp.stack(xs), *batches))
  return multi_step


def preference_loss(model, task, cfg, params, batch, rngs, deterministic, frozen):
  """DPO's `(loss sum, sums)` (`tasks.PreferenceTask.preference_loss`) of `params` against `frozen`.

  Full fine-tuning: `params` is the policy and `frozen` the reference params. LoRA (the one-GPU
  way): `params` are the adapters and `frozen` the base; the policy is the base with the adapters
  on, the reference the same base with them off, so no second copy of the weights exists and at
  step 0 (B = 0) the policy is the reference.
  """
  if lora.enabled(cfg):
    return task.preference_loss(model, lora.combine(frozen, params), frozen, batch, rngs, deterministic,
                                cfg.train.dpo_beta, policy_scope=lora.adapters_active(cfg))
  return task.preference_loss(model, params, frozen, batch, rngs, deterministic, cfg.train.dpo_beta)


def make_eval_step(model, task, cfg=None):
  """Returns `eval_step(params, batch[, base]) -> (loss_sum, nll_sum, tokens)` (no dropout, no smoothing);
  a LoRA run's `params` are its adapters, on the frozen `base`.

  DPO (train.objective=dpo): `eval_step(params, batch, frozen) -> (DPO loss sum, sums)`, frozen being
  the reference params, or a LoRA run's base (`preference_loss`); batches [batch, 2, length]."""
  if cfg is not None and cfg.train.objective == "dpo":
    return lambda params, batch, frozen: preference_loss(model, task, cfg, params, batch, {}, True, frozen)

  def eval_step(params, batch, base=None):
    with lora.adapters_active(cfg) if cfg is not None else contextlib.nullcontext():
      full = params if base is None else lora.combine(base, params)
      return evaluate_lib.eval_sums(model, task, full, batch)
  return eval_step


def evaluate_preferences(eval_step, params, frozen, batches):
  """DPO's held-out figures over batches (a DPO `make_eval_step`), means over the real pairs (filler
  rows count for nothing): val_loss (the DPO loss), val_rewards/chosen, val_rewards/rejected
  (beta x log-ratio to the reference), val_rewards/margin (chosen - rejected), val_rewards/accuracy
  (the fraction with chosen > rejected), val_nll (the chosen response's summed NLL) and val_pairs."""
  total = {}
  for batch in batches:
    loss, sums = jax.device_get(eval_step(params, batch, frozen))
    for key, value in {"loss_sum": loss, **sums}.items():
      total[key] = total.get(key, 0.0) + float(np.asarray(value, np.float64))
  if not total:
    return {}
  pairs = max(total["tokens"], 1.0)
  mean = lambda key: total[key] / pairs
  return {"val_loss": mean("loss_sum"), "val_rewards/accuracy": mean("rewards/accuracy_sum"),
          "val_rewards/margin": mean("rewards/chosen_sum") - mean("rewards/rejected_sum"),
          "val_rewards/chosen": mean("rewards/chosen_sum"), "val_rewards/rejected": mean("rewards/rejected_sum"),
          "val_nll": mean("nll_sum"), "val_pairs": int(total["tokens"])}


def init_state(model, tx, init_inputs, rng, reference=False, cfg=None):
  """A fresh train state with boxed (logically named) params, for eval_shape and init.

  reference (train.objective=dpo): `ref_params`, DPO's frozen reference, starts as a copy of the params.
  With LoRA (`cfg` given, train.lora_rank > 0) the params are the adapters alone (A random,
  B zero); the base the model also creates is dropped (XLA removes its initialisation).
  """
  with lora.adapters_active(cfg) if cfg is not None else contextlib.nullcontext():
    params = model.init(rng, *init_inputs)["params"]
  if cfg is not None and lora.enabled(cfg):
    params = lora.split(params)[1]
  state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
           "skipped": jnp.zeros((), jnp.int32)}
  if reference:
    state["ref_params"] = jax.tree.map(jnp.copy, params)
  return state


class _StopFlag:
  """SIGTERM/SIGINT set a flag; the loop finishes its step, saves, and exits cleanly.

  `signal` is the decision to stop. On one process a signal decides at once. In a multi-host
  job a signal is only `received` here, and all processes agree on it at the loop's next log
  step (`_agreed_stops`): hosts are signalled at different moments. SIGTERM is also passed on to
  JAX's preemption notifier, whose sync point (`multihost_utils.reached_preemption_sync_point`)
  stops all processes sooner, at one step (it misses a notice that comes before the loop's first
  check: the log step still catches that one).
  """

  def __init__(self, agree=False):
    self.signal = self.received = None
    self._agree = agree
    self._jax_notifier = runtime.c_signal_handler(signal.SIGTERM) if agree else None
    self._old = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
      self._old[sig] = signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    if self.received is not None:  # A second Ctrl-C means "now".
      raise KeyboardInterrupt
    self.received = signal.Signals(signum).name
    if not self._agree:
      self.signal = self.received
    elif signum == signal.SIGTERM and self._jax_notifier is not None:
      self._jax_notifier(signum)

  def restore(self):
    for sig, handler in self._old.items():
      signal.signal(sig, signal.SIG_DFL if handler is None else handler)  # None: a C handler (JAX's)


def setup(cfg, workdir, log=print):
  """Builds mesh, task, model, optimizer and the (restored or fresh) sharded state."""
  config_lib.check_backend(cfg.model, jax.default_backend())
  layers.log_attention_choices(log)  # which attention kernel each program runs, once per program
  mesh = sharding.make_mesh(cfg.mesh, experts=cfg.model.moe_experts)
  data_parallel = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape["expert"]
  # Multi-host: process 0 copies train.init_from's tokenizer, trains one or prepares the data (on
  # first use) before the others read them (a shared workdir would otherwise see concurrent writes). Each
  # stage ends with all processes learning whether any failed, so all stop together.
  def make_task():
    if cfg.train.init_from and jax.process_index() == 0:  # before the tokenizer is loaded (or would be trained)
      copy_init_tokenizer(cfg, workdir, log)
    return tasks.make_task(cfg, workdir, batch_multiple=data_parallel, log=log,
                           part=sharding.batch_part(sharding.batch_sharding(mesh)))  # only its rows
  task = None
  for stage in ("first", "others") if jax.process_count() > 1 else ("first",):
    error = None
    if (stage == "first") == (jax.process_index() == 0):
      try:
        task = make_task()
      except Exception as e:  # pylint: disable=broad-except
        error = e
    agree_error(error, "preparing the data")
  model = model_lib.build_model(cfg.model)
  tx, schedule = optim.build_optimizer(cfg)
  example = task.train_batch(0)
  init_inputs = [jnp.asarray(x[:1]) for x in task.init_inputs(example)]
  # DPO: the state holds its reference (LoRA's is the frozen base with the adapters off: no copy)
  init_fn = functools.partial(init_state, model, tx, init_inputs,
                              reference=cfg.train.objective == "dpo" and not lora.enabled(cfg),
                              **({"cfg": cfg} if lora.enabled(cfg) else {}))
  rng = jax.random.PRNGKey(cfg.train.seed)
  abstract = jax.eval_shape(init_fn, rng)
  state_sharding = sharding.logical_sharding(abstract, mesh)
  return mesh, task, model, tx, schedule, init_fn, rng, abstract, state_sharding


def agree_error(error, what):
  """Multi-host: every process learns whether any failed at this point (one small allgather),
  and raises: the failed one its own error, the others a UserError naming it. On one process,
  raises `error` if there is one. So a user error on one host never leaves the others waiting
  in a collective."""
  if jax.process_count() == 1:
    if error is not None:
      raise error
    return
  text = "" if error is None else str(error) if isinstance(error, UserError) else f"{type(error).__name__}: {error}"
  buf = np.zeros(1024, np.uint8)
  raw = (text or "failed").encode()[:1023] if error is not None else b""
  buf[:len(raw)] = np.frombuffer(raw, np.uint8)
  buf[-1] = error is not None
  every = np.asarray(multihost_utils.process_allgather(buf))
  if error is not None:
    raise error
  for i, row in enumerate(every):
    if row[-1]:
      raise UserError(f"process {i} failed while {what}: " + bytes(row[:-1]).rstrip(b"\0").decode(errors="replace"))


def _refuse_urls(cfg, workdir):
  """Paths are local filesystem paths: a URL (gs://, s3://, file://) would become a local folder
  named `gs:`. A pod's hosts share a workdir through a mounted filesystem instead."""
  for name, value in (("--workdir", workdir), ("train.init_from", cfg.train.init_from),
                      ("data.data_dir", cfg.data.data_dir), ("data.text_path", cfg.data.text_path)):
    if "://" in value:
      raise UserError(f"{name}={value} is a URL: jaxformer reads and writes local paths only; give every host "
                      "the same shared filesystem (NFS, Filestore, or a bucket mounted with GCS FUSE, e.g. "
                      "`gcsfuse BUCKET /mnt/BUCKET`) and pass its path, e.g. --workdir /mnt/BUCKET/run")


def train_and_evaluate(cfg: config_lib.Config, workdir: str, log=print):
  """Trains `cfg` in `workdir` (resuming from its newest intact checkpoint) and returns final metrics.

  Holds the workdir's lease (`jaxformer.lease`) while it runs: a second run on the same
  workdir stops at once with one line naming this one.
  """
  _refuse_urls(cfg, workdir)
  if cfg.model.quant_activations != "float":
    raise UserError(f"model.quant_activations={cfg.model.quant_activations} is for a quantized workdir's eval, "
                    "generate and serve, not for training: leave it at float")
  if lora.enabled(cfg):
    if not cfg.train.init_from:
      raise UserError("train.lora_rank needs train.init_from=WORKDIR: the frozen model the adapters are trained on")
    lora.target_paths(cfg)  # train.lora_targets matching no kernel: one line, before any work
  if cfg.train.objective == "dpo" and not cfg.train.init_from and not cfg.train.dpo_from_scratch:
    raise UserError("train.objective=dpo needs train.init_from=WORKDIR (usually the SFT run) to start the policy "
                    "from (and, without train.dpo_reference, as the reference): without it both are random weights; "
                    "set train.dpo_from_scratch=true if that is meant")
  error = None
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f".write-test-{jax.process_index()}")
    open(probe, "w").close()
    os.remove(probe)
  except OSError as e:
    error = UserError(f"cannot write to workdir {workdir}: {e.strerror}")
  agree_error(error, "opening the workdir")
  lease = _take_lease(cfg, workdir, log)
  # Multi-host: signals are caught from here on, so a preemption notice during set-up is not lost
  # (JAX's notifier would swallow it before the loop's first sync-point check).
  early_stop = _StopFlag(agree=True) if jax.process_count() > 1 else None
  try:
    return _train_and_evaluate(cfg, workdir, log, lease, early_stop)
  finally:
    layers.log_attention_choices(None)  # later programs (a notebook's sampling cell) log through `logging` again
    if early_stop is not None:
      early_stop.restore()
    if lease is not None:
      lease.release()


def _take_lease(cfg, workdir, log):
  """Process 0 takes the workdir lease (all hosts share the workdir); every process learns
  whether it did, so all stop together when another run holds it."""
  error, lease = None, None
  if jax.process_index() == 0:
    try:
      lease = lease_lib.acquire(workdir, cfg.train.lease_timeout_s, command=f"python {shlex.join(sys.argv)}",
                                log=log)
    except UserError as e:
      error = e
  if jax.process_count() > 1 and not multihost_utils.broadcast_one_to_all(np.int32(error is None)):
    error = error or UserError(f"another run holds the lease on workdir {workdir} (process 0 says which)")
  if error is not None:
    raise error
  return lease


def _agreed_stops(stop, timed_out, lease):
  """(signal, timed out, lease-lost message or None), the same on every process: at a log step.
  Multi-host, "timed out" is "first on process I" (whose clock passed train.max_minutes) or False.

  One process decides alone. A multi-host job does one small allgather (no device sync
  beyond the log step's own): a SIGINT on any process, train.max_minutes on any process's
  clock, or process 0's lost lease stops all of them at this step.
  """
  lost = lease.lost if lease is not None else None
  if jax.process_count() == 1:
    return stop.signal, timed_out, lost
  received = int(signal.Signals[stop.received]) if stop.received else 0
  every = np.asarray(multihost_utils.process_allgather(np.int32([received, timed_out, lost is not None])))
  if every[:, 0].any() and stop.signal is None:
    first = int(np.argmax(every[:, 0] > 0))
    stop.signal = f"{signal.Signals(int(every[first, 0])).name} (on process {first})"
  if every[:, 2].any():
    lost = lost or "process 0 lost the workdir lease to another run"
  timed = np.flatnonzero(every[:, 1])
  return stop.signal, f"first on process {int(timed[0])}" if timed.size else False, lost


def _last_complete(directory):
  """'the last complete checkpoint is step N in DIR', from the disk now, without orbax (this runs on
  the peer-watch thread of a job that is going down): a local save is named `<step>` only once
  all processes finished writing it."""
  steps = sorted(int(d) for d in os.listdir(directory) if d.isdigit()) if os.path.isdir(directory) else []
  return f"the last complete checkpoint is step {steps[-1]} in {directory}" if steps else \
      f"no checkpoint was completed in {directory}"


def _skip_streak(metrics_list, in_row):
  """Non-finite (skipped) steps in a row at the end of the logged steps, continuing `in_row`
  (entries may hold several steps each, in order)."""
  for finite in np.concatenate([np.ravel(m["finite"]) for m in metrics_list]):
    in_row = 0 if finite else in_row + 1
  return in_row


def _poisoned_message(in_row, step, limit, ckpt):
  """The one line for `in_row` skipped steps in a row ending at `step`, naming the last good checkpoint."""
  first = step - in_row + 1
  steps = ckpt.all_steps()
  before = [s for s in steps if s < first]
  if before:
    where = f"the last good checkpoint is {ckpt.directory}/{before[-1]}"
  elif steps:  # the older ones were pruned (train.keep_checkpoints); a skipped step changes no weights
    where = f"checkpoints {steps} were saved during the skipped steps and hold the weights of step {first - 1}"
  else:
    where = f"no checkpoint was saved before step {first}"
  return (f"{in_row} non-finite steps in a row (steps {first}-{step} skipped, train.max_skipped_steps={limit}): "
          f"the state or the data is poisoned; {where}")


def _train_and_evaluate(cfg, workdir, log, lease, early_stop=None):
  compiles_before = len(runtime.COMPILES)
  is_main = jax.process_index() == 0
  if not is_main:
    log = lambda *args, **kwargs: None  # One process speaks for the job.
  mesh, task, model, tx, schedule, init_fn, rng, abstract, state_sharding = setup(cfg, workdir, log)
  batch_sharding = sharding.batch_sharding(mesh)

  ckpt = checkpoint_lib.Checkpointer(workdir, max_to_keep=cfg.train.keep_checkpoints, cleanup_tmp=True, log=log)
  abstract_unboxed = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  nn.unbox(abstract), state_sharding)
  resumed = ckpt.restore_newest_intact(abstract_unboxed)  # damaged newer ones are moved aside, with a warning
  if resumed is not None:
    state, meta = resumed
    if meta.get("tokenizer_sha256") not in (None, evaluate_lib.file_sha256(task.tokenizer_path)):
      raise UserError(f"tokenizer {task.tokenizer_path} is not the one checkpoint step {meta.get('step')} was "
                      "trained with (its hash differs): restore the original tokenizer or use a new --workdir")
    log(f"resumed from {ckpt.directory}/{ckpt.latest_step()} (step {int(state['step'])})")
  elif cfg.train.init_from and not lora.enabled(cfg):  # fine-tuning: its own checkpoints (above) win once saved
    state = init_from_checkpoint(cfg, tx, abstract_unboxed, state_sharding, task.tokenizer_path, log)
  else:  # a new run, or new LoRA adapters (B = 0) on the base read below
    state = jax.jit(lambda r: nn.unbox(init_fn(r)), out_shardings=state_sharding)(rng)
  if resumed is None and cfg.train.dpo_reference and "ref_params" in abstract_unboxed:  # (not LoRA's: its base)
    state["ref_params"], where, _ = restore_params(cfg, cfg.train.dpo_reference, abstract_unboxed["ref_params"], log)
    log(f"DPO reference: {where} (frozen)")
  base, base_sharding, extra, ckpt_meta = None, None, (), {}
  if lora.enabled(cfg):  # the frozen base: read from train.init_from (at the step the adapters were trained on)
    base, base_sharding, ckpt_meta = load_lora_base(cfg, mesh, task.tokenizer_path,
                                                    resumed[1].get("lora_base_step") if resumed else None, log)
    extra = (base,)
  if is_main:  # only now: a command that fails above leaves the workdir as it was
    with open(os.path.join(workdir, "config.json.tmp"), "w") as f:
      f.write(config_lib.to_json(cfg))
    os.replace(os.path.join(workdir, "config.json.tmp"), os.path.join(workdir, "config.json"))
  n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  log(f"model: {cfg.model.arch}, {n_params:,} parameters; mesh {dict(mesh.shape)}")
  if base is not None:
    log(f"LoRA: {n_params:,} adapter parameters (rank {cfg.train.lora_rank}, alpha {cfg.train.lora_alpha:g}) on "
        f"{lora.num_adapted(cfg)} kernels{_expert_note(cfg)} of a frozen base of {lora.count(base):,} from "
        f"{cfg.train.init_from}")

  step_in = (state_sharding, batch_sharding) + ((base_sharding,) if base is not None else ())
  train_step = _under_mesh(mesh, jax.jit(make_train_step(model, task, cfg, tx, schedule), in_shardings=step_in,
                                         out_shardings=(state_sharding, None), donate_argnums=0))
  multi_step = _under_mesh(mesh, jax.jit(make_multi_step(make_train_step(model, task, cfg, tx, schedule)),
                                         in_shardings=step_in, out_shardings=(state_sharding, None),
                                         donate_argnums=0))
  dpo = cfg.train.objective == "dpo"
  frozen_sharding = (base_sharding if base is not None else state_sharding["ref_params"]) if dpo else None
  eval_jit = _under_mesh(mesh, jax.jit(make_eval_step(model, task, cfg),
                                       in_shardings=(state_sharding["params"], batch_sharding, frozen_sharding)
                                       if dpo else (state_sharding["params"],) + step_in[1:]))
  eval_step = eval_jit if dpo else lambda params, batch: eval_jit(params, batch, *extra)
  # Decoding (samples, BLEU) reads plain params: a LoRA run's merged W + (alpha / r) A B.
  full_params = ((lambda p: p) if base is None else
                 _under_mesh(mesh, jax.jit(functools.partial(lora.merge, cfg=cfg), out_shardings=base_sharding)))
  harness_run = _harness_runner(cfg, model, task, log)  # None without train.eval_harness_tasks
  writer = metrics_lib.MetricWriter(workdir, cfg.train.num_steps, enabled=is_main)
  dev_batches = task.eval_batches("dev", cfg.train.eval_batches) if _has_dev(task) else []
  dev_batches = [sharding.global_batch(b, batch_sharding) for b in dev_batches]

  tokenizer_hash = evaluate_lib.file_sha256(task.tokenizer_path)
  step = int(state["step"])
  multi = jax.process_count() > 1
  stop = early_stop or _StopFlag()
  hosts.LOST_PROCESS["where"] = lambda: _last_complete(ckpt.directory)
  pending, tokens_since, flops_since, steps_since, t_last = [], 0, 0.0, 0, time.time()
  peak = runtime.peak_flops(cfg, log)
  deadline = time.time() + 60 * cfg.train.max_minutes if cfg.train.max_minutes else None
  writer.deadline = deadline  # the ETA never promises more than train.max_minutes
  result = {}
  skipped_in_row = 0  # non-finite steps in a row, as of the last log
  try:
    while step < cfg.train.num_steps:
      batches = [task.train_batch(s) for s in range(step, step + _steps_this_call(step, cfg.train, task))]
      tokens_since += sum(task.num_tokens(b) for b in batches)
      flops_since += sum(_train_flops(cfg, b) for b in batches) if peak else 0.0
      batches = [sharding.global_batch(b, batch_sharding) for b in batches]
      if len(batches) > 1:
        state, metrics = multi_step(state, tuple(batches), *extra)
      else:
        state, metrics = train_step(state, batches[0], *extra)
      # JAX's preemption notice (SIGTERM on any host) names the same step on every process; a
      # local check, no collective (every step id: orbax asks with step ids too).
      if multi and any([multihost_utils.reached_preemption_sync_point(s) for s in range(step + 1, step + len(batches) + 1)]):
        stop.signal = "SIGTERM (a preemption notice)"
      step += len(batches)
      steps_since += len(batches)
      pending.append(metrics)
      if len(pending) > 1:  # run at most one step ahead, so signals and time limits act promptly
        jax.block_until_ready(pending[-2]["loss_sum"])
      timed_out = deadline is not None and time.time() > deadline
      last = step == cfg.train.num_steps or (timed_out and not multi)  # multi-host: agreed at log steps
      nan_stop = cfg.train.nan_policy == "stop" and not jnp.all(metrics["finite"])  # a sync, only for stop
      if step % cfg.train.log_every == 0 or last or stop.signal or nan_stop:
        ckpt.check()  # a failed background save stops the run here, before more is written to a full disk
        fetched = jax.device_get(pending)
        summary = _summarize(fetched)
        skipped_in_row = _skip_streak(fetched, skipped_in_row)
        pending = []
        now = time.time()
        summary["tokens_per_sec"] = tokens_since / max(now - t_last, 1e-9)
        summary["step_ms"] = 1e3 * (now - t_last) / max(steps_since, 1)  # includes any eval since the last log
        if peak:
          summary["mfu"] = flops_since / max(now - t_last, 1e-9) / peak
        tokens_since, flops_since, steps_since, t_last = 0, 0.0, 0, now
        summary["compilations"] = train_step._cache_size() + multi_step._cache_size()
        summary["skipped"] = int(state["skipped"])
        writer.write(step, summary, when=now)  # the time its step_ms and tokens/s were measured at
        writer.progress(step, summary)
        if summary.pop("nonfinite") and cfg.train.nan_policy == "stop":
          raise UserError(f"non-finite loss or gradient before step {step} (train.nan_policy=stop); "
                          f"the last good checkpoint is in {ckpt.directory}")
        if cfg.train.max_skipped_steps and skipped_in_row >= cfg.train.max_skipped_steps:
          raise UserError(_poisoned_message(skipped_in_row, step, cfg.train.max_skipped_steps, ckpt))
        _, timed_out, lost = _agreed_stops(stop, timed_out, lease)
        last = last or bool(timed_out)
        if lost:
          raise UserError(lost)
        result.update(summary)
      if dev_batches and (step % cfg.train.eval_every == 0 or last):
        if dpo:  # held-out pairs against the reference (LoRA: the base with the adapters off)
          val = evaluate_preferences(eval_step, state["params"], base if base is not None else state["ref_params"],
                                     dev_batches)
        else:
          val = evaluate_lib.mean_nll(eval_step, state["params"], dev_batches)
        if task.name == "translation" and cfg.train.eval_bleu_sentences:
          sources, refs = task.splits["dev"]
          n = cfg.train.eval_bleu_sentences
          hyps = evaluate_lib.translate(model, full_params(*extra, state["params"]), task.tokenizer, sources[:n],
                                        beam_size=1, max_extra_len=cfg.decode.max_extra_len,
                                        batch_size=cfg.decode.batch_size, suppress_pad=cfg.decode.suppress_pad)
          val["val_bleu"] = bleu.sacrebleu_scores(hyps, refs[:n])["bleu"]
        writer.write(step, val)
        log(f"step {step} | " + " | ".join(f"{k} {v:.4f}" for k, v in val.items() if k not in ("val_tokens", "val_pairs")))
        if task.name == "lm" and cfg.train.sample_every_eval:
          log("sample: " + repr(sample_text(model, full_params(*extra, state["params"]), task.tokenizer, cfg, step)))
        result.update(val)
      if harness_run and (step % (cfg.train.eval_harness_every or cfg.train.eval_every) == 0 or last):
        scores = harness_run(full_params(*extra, state["params"]))
        writer.write(step, scores)
        log(f"step {step} | " + " | ".join(f"{k} {v:.4f}" for k, v in scores.items()))
        result.update(scores)
      if step % cfg.train.checkpoint_every == 0 or last or stop.signal:
        ckpt.save(step, state, {"step": step, "config": cfg.name, "tokenizer": task.tokenizer_path,
                                "tokenizer_sha256": tokenizer_hash, **ckpt_meta})
      if stop.signal:
        ckpt.wait()
        log(f"{stop.signal} received: saved a checkpoint at step {step} in {ckpt.directory}. "
            f"Resume with the same command: python {shlex.join(sys.argv)}")
        result["interrupted"] = stop.signal
        break
      if last:
        if step < cfg.train.num_steps:
          log(f"train.max_minutes={cfg.train.max_minutes} reached at step {step}"
              + (f" ({timed_out})" if isinstance(timed_out, str) else ""))
        break
    ckpt.wait()  # a failed last save stops the run here, before any final evaluation
    if task.name == "translation" and cfg.train.final_eval_split and "interrupted" not in result:
      split = cfg.train.final_eval_split
      scores, hyps, sources, refs = evaluate_lib.evaluate_translation(
          cfg, model, full_params(*extra, state["params"]), task.tokenizer, split, os.path.join(workdir, f"{split}.hyp.txt"),
          log=lambda *_: None)
      for src, hyp, ref in list(zip(sources, hyps, refs))[:5]:
        log(f"  src: {src}\n  hyp: {hyp}\n  ref: {ref}")
      log(bleu.format_scores(scores))
      writer.write(step, {f"{split}_bleu": scores["sacrebleu"]["bleu"]})
      result["final_scores"] = scores
    compiles = runtime.COMPILES[compiles_before:]
    result.update(programs_compiled=len(compiles), compile_s=sum(compiles))
    writer.write(step, {"programs_compiled": len(compiles), "compile_s": sum(compiles)})
    log(f"compiled {len(compiles)} XLA programs in {sum(compiles):.1f} s (train/eval steps per batch shape, "
        f"decoding, sampling; programs found in the compilation cache count with their load time)")
  except jax.errors.JaxRuntimeError:
    if multi:  # a collective failed (gloo: "Connection closed by peer"): the peer watch names the dead one
      hosts.await_lost_process()
    raise
  except OSError as e:
    if not checkpoint_lib.is_no_space(e):
      raise
    raise UserError(f"no space left on {checkpoint_lib.filesystem_of(e.filename or workdir)} while writing "
                    f"{e.filename or 'to the workdir'} at step {step}; {ckpt.last_complete_phrase()}") from e
  finally:
    if stop is not early_stop:
      stop.restore()
    try:
      ckpt.close()
    finally:
      writer.close()
  if is_main and os.path.exists(os.path.join(workdir, "metrics.jsonl")):
    metrics_lib.plot_metrics(os.path.join(workdir, "metrics.jsonl"), os.path.join(workdir, "metrics.png"))
  result["step"] = step
  result["state"] = state
  result["lora_base"] = base
  result["task"] = task
  result["model"] = model
  return result


def _harness_runner(cfg, model, task, log):
  """params -> {"harness/<task>/<metric>": value} of train.eval_harness_tasks (lm-evaluation-harness through
  `jaxformer.harness`), or None when none are set. The tasks are checked now, before the first step."""
  t = cfg.train
  if not t.eval_harness_tasks:
    return None
  from jaxformer import harness  # pylint: disable=g-import-not-at-top  (lm-eval: an optional extra)
  harness.require_lm_eval()
  if jax.process_count() > 1:
    raise UserError("train.eval_harness_tasks runs on one process: run the tasks on a checkpoint with "
                    "eval.py --tasks instead, on a multi-host job")
  names = [n.strip() for n in t.eval_harness_tasks.split(",") if n.strip()]
  manager = harness._task_manager(t.eval_harness_include_path)  # pylint: disable=protected-access
  harness._check_tasks(names, manager)  # pylint: disable=protected-access

  def run(params):
    lm = harness.JaxformerLM(run=(cfg, model, params, task.tokenizer))
    results = harness.run_tasks(lm, names, None if t.eval_harness_fewshot < 0 else t.eval_harness_fewshot,
                                t.eval_harness_limit or None, manager=manager, bootstrap_iters=0, log=log)
    return harness.main_metrics(results)
  return run


def sample_text(model, params, tokenizer, cfg, step, prompt=None, max_new_tokens=200):
  """A short sample from a decoder-only model (temperature 0.8, top-k 200, as nanoGPT samples).

  The default prompt is a newline (nanoGPT's), or BOS alone when the tokenizer cannot encode one
  (a char vocabulary built with data.doc_per=line has no "\n")."""
  if prompt is None:
    try:
      prompt = "\n" if tokenizer.encode("\n") else ""
    except UserError:
      prompt = ""
  ids = ([tokenizer.bos_id] if cfg.data.add_bos else []) + tokenizer.encode(prompt) or [tokenizer.bos_id]
  # Past a learned-position table the context slides (nanoGPT's crop); other positions grow the cache.
  tokens = decode.generate(model, params, [ids], max_new_tokens, jax.random.PRNGKey(step),
                           temperature=0.8, top_k=200, max_cache_len=cfg.decode.max_cache_len)
  return prompt + tokenizer.decode(np.asarray(tokens[0]))


def copy_init_tokenizer(cfg, workdir, log=print):
  """train.init_from: the run uses that workdir's tokenizer, copied in (unless data.tokenizer_path names one).

  Called before the task is made: data preparation then finds the tokenizer where it looks
  (`tasks.tokenizer_path`: the workdir, or data.data_dir) and reuses it instead of training one.
  """
  if cfg.data.tokenizer_path:
    return
  source = cfg.train.init_from
  saved = os.path.join(source, "config.json")  # where that run keeps its tokenizer (its data.data_dir, maybe)
  source_cfg = (config_lib.load_saved_config(saved, warn=log) if os.path.isfile(saved)
                else config_lib.replace(cfg, **{"data.data_dir": ""}))
  mine, theirs = tasks.tokenizer_path(cfg, workdir), tasks.tokenizer_path(source_cfg, source)
  if mine == "byte" or os.path.exists(mine) or not os.path.isfile(theirs):
    return
  for name in tokenizer_lib.HF_TOKENIZER_SIDE_FILES:  # a converted model's special tokens and chat template
    config = os.path.join(os.path.dirname(theirs), name)
    if os.path.isfile(config):
      os.makedirs(os.path.dirname(os.path.abspath(mine)), exist_ok=True)
      shutil.copyfile(config, os.path.join(os.path.dirname(os.path.abspath(mine)), name))
  os.makedirs(os.path.dirname(os.path.abspath(mine)), exist_ok=True)  # data.data_dir may not exist yet
  shutil.copyfile(theirs, mine + ".tmp")
  os.replace(mine + ".tmp", mine)
  log(f"tokenizer: {theirs} (from train.init_from) -> {mine}")


def init_from_checkpoint(cfg, tx, abstract, state_sharding, tokenizer_path, log=print):
  """A fresh train state (step 0, a new optimizer) whose params are train.init_from's latest checkpoint.

  `abstract` is the train state's ShapeDtypeStructs with shardings: params restore straight onto the mesh.
  """
  params, where, _ = _restore_init_params(cfg, abstract["params"], tokenizer_path, log)
  zero = jnp.zeros((), jnp.int32)
  reference = "ref_params" in abstract  # DPO: the reference starts as these params (a copy)
  state = jax.jit(lambda p: {"step": zero, "params": p, "opt_state": tx.init(p), "skipped": zero,
                             **({"ref_params": jax.tree.map(jnp.copy, p)} if reference else {})},
                  out_shardings=state_sharding)(params)
  log(f"initialised from {where}: its params, a fresh optimizer, step 0")
  return state


def restore_params(cfg, source, abstract_params, log=print, key="train.dpo_reference", step=None):
  """(params, "dir/step", meta) of workdir `source`'s checkpoint `step` (default: latest), restored onto
  `abstract_params`' shardings (its layers converted when it was saved with the other model.scan_layers)."""
  if not os.path.isdir(os.path.join(source, "checkpoints")):
    raise UserError(f"{key}={source} has no checkpoints/: give a training workdir or one written by "
                    "python -m jaxformer.convert")
  if _is_lora_run(source):  # its checkpoints hold adapters alone: read it as eval/generate/convert do
    return _restore_merged(cfg, source, abstract_params, key, step)
  with checkpoint_lib.Checkpointer(source, max_to_keep=None, async_save=False) as src:
    if evaluate_lib.stored_scan_layers(src, step) == cfg.model.scan_layers:
      params, meta = src.restore_params(abstract_params, step=step)
    else:  # e.g. a converted Hugging Face model (unrolled) fine-tuned with model.scan_layers=true
      layout = config_lib.replace(cfg, **{"model.scan_layers": not cfg.model.scan_layers})
      # (the dtypes asked for, e.g. a bfloat16 LoRA base, carried over to the stored layout)
      dtypes = jax.eval_shape(lambda t: model_lib.convert_layers(t, not cfg.model.scan_layers), abstract_params)
      stored = jax.tree.map(lambda a, d: jax.ShapeDtypeStruct(a.shape, d.dtype),
                            evaluate_lib.abstract_params(layout)[1], dtypes)
      params, meta = src.restore_params(stored, step=step)
      params = (model_lib.stack_layers_consuming(params) if cfg.model.scan_layers  # (one layout at a time)
                else model_lib.convert_layers(params, False))
      log(f"converted {source}'s layers to the {'scanned' if cfg.model.scan_layers else 'unrolled'} layout")
    where = f"{src.directory}/{meta.get('step')}"
  return params, where, meta


def _is_lora_run(workdir):
  """Whether `workdir` is a LoRA run (its saved config has train.lora_rank > 0): its params are adapters."""
  saved = os.path.join(workdir, "config.json")
  return os.path.isfile(saved) and lora.enabled(config_lib.load_saved_config(saved, warn=lambda *_: None))


def _restore_merged(cfg, source, abstract_params, key, step=None):
  """`restore_params` of a LoRA workdir: its base with its adapters merged in, W + (alpha / r) A B (the
  plain model `evaluate.load_run` reads), placed on `abstract_params`' shardings.

  One process moves them onto the mesh (donated: no second device copy, which matters for a LoRA base
  filling one GPU); a multi-host job's processes each build them all and keep their shards, from the host.
  """
  _, _, params, _, meta = evaluate_lib.load_run(source, step=step, log=lambda *_: None,
                                                scan_layers=cfg.model.scan_layers)
  have = {checksum.path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(params)}
  want = {checksum.path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(abstract_params)}
  for path in sorted(want.keys() | have.keys()):
    if have.get(path) != want.get(path):
      what = f"{list(have[path])}" if path in have else "nothing"
      builds = f"{list(want[path])}" if path in want else "nothing"
      raise UserError(f"{key}={source} (a LoRA run, read merged) has {what} at params/{path} but the config builds "
                      f"{builds}: give the config that run was trained with")
  params = jax.tree.map(lambda x, a: x if x.dtype == a.dtype else x.astype(a.dtype), params, abstract_params)
  if jax.process_count() == 1:
    params = jax.device_put(params, jax.tree.map(lambda a: a.sharding, abstract_params), donate=True)
  else:  # the mesh spans processes: each places its shards from a host copy
    host = jax.device_get(params)
    del params
    params = jax.tree.map(lambda a, x: jax.make_array_from_callback(a.shape, a.sharding, lambda idx: x[idx]),
                          abstract_params, host)
  where = (f"{os.path.join(source, 'checkpoints')}/{meta.get('step')} (LoRA adapters merged into "
           f"{meta.get('lora_base')} step {meta.get('lora_base_step')})")
  return params, where, meta


def _restore_init_params(cfg, abstract_params, tokenizer_path, log, step=None):
  """(params, "dir/step", step) of train.init_from's checkpoint `step` (default: latest), laid out as
  `abstract_params` (ShapeDtypeStructs with shardings) whichever layout it was stored in."""
  params, where, meta = restore_params(cfg, cfg.train.init_from, abstract_params, log, key="train.init_from",
                                       step=step)
  if meta.get("tokenizer_sha256") not in (None, evaluate_lib.file_sha256(tokenizer_path)):
    raise UserError(f"tokenizer {tokenizer_path} is not the one {where} was trained with (its hash differs): "
                    "fine-tune with the tokenizer of train.init_from")
  return params, where, meta.get("step")


def _expert_note(cfg):
  """' (N of them MoE expert stacks, ...)' for the LoRA start-up line of an MoE model, else ''."""
  if not cfg.model.moe_experts:
    return ""
  n = lora.num_adapted(cfg, experts_only=True)
  return (f" ({n} of them MoE expert weights, each with its own A and B per expert of {cfg.model.moe_experts})" if n
          else " (no MoE expert weight: train.lora_targets matches none of .../moe/wi_gate|wi_up|wi|wo)")


def load_lora_base(cfg, mesh, tokenizer_path, step=None, log=print):
  """(base params on the mesh, their shardings, checkpoint meta) for a LoRA run: train.init_from's
  params at `step` (default: its latest), frozen; the meta records where they came from."""
  boxed, _ = lora.abstract(cfg)
  base_sharding = sharding.logical_sharding(boxed, mesh)
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nn.unbox(boxed),
                          base_sharding)
  base, where, base_step = _restore_init_params(cfg, abstract, tokenizer_path, log, step)
  log(f"LoRA base: {where}, frozen, {cfg.train.lora_base_dtype} (not written to this run's checkpoints)")
  return base, base_sharding, {"lora_base": os.path.abspath(cfg.train.init_from), "lora_base_step": base_step}


def _under_mesh(mesh, jitted):
  """Calls `jitted` inside `sharding.use_mesh(mesh)`, so the model's activation
  constraints bind when it is traced (and the trace cache is keyed on the mesh)."""
  def call(*args):
    with sharding.use_mesh(mesh):
      return jitted(*args)
  call._cache_size = jitted._cache_size
  return call


def _has_dev(task):
  return task.name in ("lm", "dpo") or "dev" in getattr(task, "eval", {})


def _steps_this_call(step, train_cfg, task):
  """`train.steps_per_call` when the next that many steps cross no log, eval or checkpoint
  boundary (they may end on one), else 1.

  So boundaries stay exact, and there are only two call shapes to compile (K steps and
  one): choose K dividing the log, eval and checkpoint intervals. Translation always runs
  one step per call: its bucket shapes change from step to step, and the sin/cos of its
  sinusoidal positions compile to other code inside a loop (not bitwise the same).
  """
  t = train_cfg
  if t.steps_per_call < 1:
    raise UserError(f"train.steps_per_call={t.steps_per_call} must be at least 1")
  if task.name != "lm":
    return 1
  gap = min(t.num_steps - step, *(n - step % n for n in (t.log_every, t.eval_every, t.checkpoint_every)))
  return t.steps_per_call if t.steps_per_call <= gap else 1


def _train_flops(cfg, batch):
  """Model FLOPs of a training step (`inspect.flops_per_token` x real target tokens)."""
  targets = batch["targets"]
  tokens = batch["targets_segmentation"].sum() if "targets_segmentation" in batch else targets.size
  return float(tokens) * inspect_lib.flops_per_token(cfg, targets.shape[-1])["train"]


def _summarize(metrics_list):
  """Token-weighted means over the logged steps (entries may hold several steps each)."""
  m = {k: np.concatenate([np.ravel(x[k]) for x in metrics_list]).astype(np.float64) for k in metrics_list[0]}
  tokens = max(float(m["tokens"].sum()), 1.0)
  summary = {"loss": float(m["loss_sum"].sum()) / tokens, "nll": float(m["nll_sum"].sum()) / tokens,
             "lr": float(m["lr"][-1]), "grad_norm": float(m["grad_norm"].mean()),
             "nonfinite": int((m["finite"] == 0).sum())}
  rewards = {k[:-4]: float(m[k].sum()) / tokens for k in m if k.startswith("rewards/")}  # DPO: means over pairs
  if rewards:
    summary.update(rewards, **{"rewards/margin": rewards["rewards/chosen"] - rewards["rewards/rejected"]})
  for key in m:  # MoE router statistics: means over the logged steps, one scalar per expert's fraction
    if key == "moe_expert_fraction":
      fractions = np.concatenate([np.reshape(x[key], (-1, np.shape(x[key])[-1])) for x in metrics_list]).mean(0)
      summary.update({f"moe_fraction_{e}": float(v) for e, v in enumerate(fractions)})
    elif key.startswith("moe_"):
      summary[key] = float(m[key].mean())
  return summary


def parse_args(argv):
  parser = argparse.ArgumentParser(description="Train a jaxformer model.")
  parser.add_argument("--config", default="default", help="recipe name in configs/ or a path to a .py file")
  parser.add_argument("--workdir", default=None, help="run directory (default: runs/<config>)")
  parser.add_argument("--multihost", action="store_true",
                      help="one process per host: call jax.distributed.initialize() (automatic when "
                           "JAX_COORDINATOR_ADDRESS is set)")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=2")
  return parser.parse_intermixed_args(argv)  # overrides before, between or after flags


@cli
def main(argv):
  """`python train.py [--config NAME] [--workdir DIR] [key=value ...]`."""
  args = parse_args(argv)
  runtime.keep_freed_memory()
  cfg = config_lib.load_config(args.config, args.overrides)  # touches no device: before distributed start-up
  runtime.maybe_initialize_distributed(args.multihost, cfg.train.host_timeout_s)
  runtime.use_compilation_cache()
  workdir = args.workdir or os.path.join("runs", cfg.name)
  if jax.process_index() == 0:
    print(f"config {cfg.name} -> {workdir}\n{config_lib.to_json(cfg)}", flush=True)
  result = train_and_evaluate(cfg, workdir)
  hosts.LOST_PROCESS["exit"] = "done"  # the other processes may outlive this one without alarm
  return result


if __name__ == "__main__":  # python -m jaxformer.train (an installed wheel has no train.py)
  main()
