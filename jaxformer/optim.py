"""The one place the optimizer and learning-rate schedule are built."""

import jax.numpy as jnp
import optax

from jaxformer.config import Config


def rsqrt_schedule(d_model, warmup_steps, scale=1.0):
  """The paper's schedule: scale * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5).

  Steps count from 1 (optax passes the number of updates done so far, so we add 1):
  linear warmup to the peak at `warmup_steps`, then inverse-square-root decay.
  """
  def schedule(count):
    step = jnp.asarray(count, jnp.float32) + 1.0
    return scale * d_model ** -0.5 * jnp.minimum(step ** -0.5, step * warmup_steps ** -1.5)
  return schedule


def learning_rate_schedule(cfg: Config):
  """The schedule the config names (rsqrt, cosine with linear warmup, or constant)."""
  o = cfg.optim
  if o.schedule == "rsqrt":
    return rsqrt_schedule(cfg.model.d_model, o.warmup_steps, o.learning_rate)
  if o.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
        0.0, o.learning_rate, max(o.warmup_steps, 1), max(cfg.train.num_steps, o.warmup_steps + 1),
        end_value=o.min_learning_rate)
  return optax.constant_schedule(o.learning_rate)


def _decay_mask(params):
  """Weight decay on matrices only (not biases, norms), as GPT-2/nanoGPT do; a layer's
  parameters stacked by model.scan_layers have one more (leading) axis."""
  import jax
  def is_matrix(path, p):
    stacked = any(getattr(k, "key", None) == "layers" for k in path)
    return p.ndim - stacked >= 2
  return jax.tree_util.tree_map_with_path(is_matrix, params)


def build_optimizer(cfg: Config):
  """Adam/AdamW with the config's schedule, optional clipping and gradient accumulation.

  Gradient accumulation is done by the train step itself (it averages micro-batch
  gradients inside one jitted call), so the optimizer always sees one update per step.
  """
  o = cfg.optim
  schedule = learning_rate_schedule(cfg)
  if o.optimizer == "adamw":
    opt = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=_decay_mask)
  else:
    opt = optax.adam(schedule, b1=o.b1, b2=o.b2, eps=o.eps)
  if o.grad_clip > 0:
    opt = optax.chain(optax.clip_by_global_norm(o.grad_clip), opt)
  return opt, schedule
