"""Mixture-of-experts FFN (Switch, Mixtral): a top-k router and `moe_experts` expert FFNs.

Each token's router probabilities p = softmax(x W_router) [experts] pick its top `moe_top_k`
experts; their probabilities, renormalised to sum to 1 (Mixtral), weight the experts' outputs.

Dropless (model.moe_capacity_factor=0, the default): the token copies are sorted by expert
and each expert's rows go through one grouped matmul (`jax.lax.ragged_dot` on TPU/GPU; on CPU,
where that lowers to every expert on every row, padded blocks: `block_layout`); no token is
ever dropped and only the active experts' work is done.

Capacity mode (model.moe_capacity_factor=c > 0): each expert takes at most
C = ceil(c * tokens * top_k / experts) token copies per call (tokens = batch x length of
the call). Copies are ranked by choice first, then by token: every token's first choice
ranks before any token's second choice, and within one choice tokens rank in order
(row-major over [batch, length]), as in GShard/Switch. A copy ranked C or later at its
expert is dropped: it adds nothing (the token keeps its residual), and the other copies'
weights are not renormalised. The experts then run as one batched matmul on [experts, C, d].
Capacity is a training-time device (a static buffer per expert, whatever the routing): with
deterministic=True (evaluation, decoding, generation) the layer routes dropless, so a prompt's
tokens never depend on which other prompts share its batch. Training sows the fraction of
token copies dropped (`dropped_fraction`, logged as `moe_dropped_fraction`).

Both modes sow the router statistics into the `intermediates` collection, which
`aux_losses` reads: the load-balancing loss (Switch/Mixtral, HF's `load_balancing_loss_func`:
experts x sum_e f_e P_e with f_e the fraction of token copies routed to expert e and P_e
its mean router probability; k when perfectly balanced, experts x k when collapsed on one
expert), the router z-loss (ST-MoE: mean logsumexp(logits)^2) and f itself.
Padding tokens are routed like any other (LM batches have none).
"""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from jaxformer import layers, qmatmul, sharding
from jaxformer.config import ModelConfig

# The expert FFN's weights, [experts, d_model, d_ff] / [experts, d_ff, d_model]; `inspect` counts
# top_k / experts of them as active per token.
EXPERT_PARAMS = ("wi_gate", "wi_up", "wi", "wo")


def is_moe_layer(cfg: ModelConfig, i):
  """Whether decoder layer i (from 0) has an MoE FFN: every `moe_every`-th layer, the last of each group."""
  return cfg.moe_experts > 0 and i % cfg.moe_every == cfg.moe_every - 1


def route(logits, top_k):
  """Router: logits [tokens, experts] -> (weights, experts) [tokens, top_k] each, and probs [tokens, experts].

  weights are the top-k softmax probabilities renormalised to sum to 1 per token (Mixtral).
  """
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  top_p, top_e = jax.lax.top_k(probs, top_k)
  return top_p / jnp.sum(top_p, axis=-1, keepdims=True), top_e, probs


def capacity(cfg: ModelConfig, tokens):
  """Token copies each expert takes per call in capacity mode: ceil(factor x tokens x top_k / experts)."""
  return max(1, math.ceil(cfg.moe_capacity_factor * tokens * cfg.moe_top_k / cfg.moe_experts))


def rank_at_expert(flat_e, num_experts):
  """flat_e [copies] -> each copy's rank among the earlier copies at its expert [copies], and the
  copies per expert [experts]."""
  one_hot = jax.nn.one_hot(flat_e, num_experts, dtype=jnp.int32)
  return jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1), jnp.sum(one_hot, axis=0)


def capacity_slots(top_e, num_experts, cap):
  """Each copy's rank at its expert, and whether it is kept (rank < cap): [tokens, top_k] each.

  top_e [tokens, top_k]: ranks run over choices first, then tokens (see the module docstring).
  """
  choice_major = top_e.T.reshape(-1)  # [top_k * tokens]: all first choices, then all second ...
  rank, _ = rank_at_expert(choice_major, num_experts)
  rank = rank.reshape(top_e.shape[1], top_e.shape[0]).T
  return rank, rank < cap


# The dropless grouped matmul: "auto" = "ragged_dot" on TPU/GPU, "blocks" on CPU (see
# `block_layout`); benchmarks/aot_compile.py sets "ragged_dot" to compile TPU programs on a CPU.
DROPLESS_IMPL = "auto"


def dropless_impl():
  """The dropless path this backend takes: "ragged_dot" or "blocks"."""
  if DROPLESS_IMPL != "auto":
    return DROPLESS_IMPL
  return "blocks" if jax.default_backend() == "cpu" else "ragged_dot"


def block_rows(rows, num_e):
  """Rows per block of the CPU layout: the largest power of two in [32, 512] whose padding (at
  most num_e blocks) stays within half the rows. XLA:CPU's batched matmul runs 32-row blocks at
  several times the time per FLOP of 256-row ones (benchmarks/block_matmul.py), which outweighs
  the padded rows: measured best at 64-128 rows for 1,536 copies and 256-512 for 6,144 (BENCHMARKS.md)."""
  b = 32
  while b < 512 and 2 * b * num_e * 2 <= rows:
    b *= 2
  return b


def block_layout(top_e, num_e, b):
  """top_e [tokens, top_k] -> each copy's row in the block layout [tokens * top_k], each
  block's expert [blocks], and the static number of blocks.

  The layout for XLA:CPU, which has no grouped-matmul kernel (jax lowers `ragged_dot` there,
  in jax/_src/lax/lax.py `_ragged_dot_general_impl`, to every row against every expert under a
  mask: `experts` times the work): expert e's copies fill consecutive rows, in token order,
  from the first row of its first block, and its rows are padded to a multiple of b, so each
  block holds one expert's rows. ceil(copies / b) + num_e blocks hold any split of the copies.
  """
  flat = top_e.reshape(-1)
  blocks = -(-flat.shape[0] // b) + num_e
  rank, sizes = rank_at_expert(flat, num_e)
  padded = -(-sizes // b) * b
  ends = jnp.cumsum(padded)
  dest = (ends - padded)[flat] + rank
  block_group = jnp.minimum(jnp.searchsorted(ends, jnp.arange(blocks) * b, side="right"), num_e - 1)
  return dest, block_group, blocks


class MoEFeedForward(nn.Module):
  """Top-k routed expert FFNs (+ optional shared experts), [batch, length, d_model] -> same shape.

  Parameters: router/kernel [d_model, experts]; wi_gate, wi_up (swiglu) or wi [experts,
  d_model, d_ff] and wo [experts, d_ff, d_model] (no biases, as in Mixtral); `shared`, a dense
  FeedForward of moe_shared_experts x d_ff every token passes through (DeepSeek's shared experts).
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, deterministic=True):
    cfg = self.cfg
    batch, length, d = x.shape
    num_e, k, f = cfg.moe_experts, cfg.moe_top_k, cfg.d_ff
    tokens = x.reshape(-1, d)  # [n, d_model]
    n = tokens.shape[0]
    router = layers.dense(cfg, num_e, ("embed", None), use_bias=False, name="router")
    logits = router(tokens.astype(jnp.float32)).astype(jnp.float32)  # routing in float32
    weights, top_e, probs = route(logits, k)

    init = layers._param(layers.kernel_init(cfg), ("expert", "embed", "mlp"))
    init_out = layers._param(layers.kernel_init(cfg), ("expert", "mlp", "embed"))
    names_in = ("wi_gate", "wi_up") if cfg.gated else ("wi",)
    dtype = jnp.dtype(cfg.matmul_dtype if cfg.matmul_dtype != "float32" else cfg.dtype)

    def param(name, init, shape):  # a quantized workdir's expert weights are dequantized into the dot
      w = qmatmul.expert_weight(self, name, dtype)
      return self.param(name, init, shape, jnp.float32) if w is None else w
    w_in = [self.expert_weight(name, param(name, init, (num_e, d, f))) for name in names_in]
    w_out = self.expert_weight("wo", param("wo", init_out, (num_e, f, d)))

    def ffn(h, matmul, w_in=w_in, w_out=w_out):
      """The experts' FFN on rows h through `matmul(rows, weight [experts, in, out])`."""
      def project(h, w):
        if isinstance(w, tuple):  # LoRA adapters (see `expert_weight`): h W + (h A) (s B), each row by its expert
          w, a, b = w
          return matmul(h, w.astype(dtype)) + matmul(matmul(h, a.astype(dtype)).astype(dtype), b.astype(dtype))
        return matmul(h, w.astype(dtype))
      hidden = [project(h, w) for w in w_in]
      return project(layers.ffn_activation(cfg, hidden).astype(dtype), w_out)

    if cfg.moe_capacity_factor > 0 and not deterministic:  # training only (see the module docstring)
      cap = capacity(cfg, n)
      rank, keep = capacity_slots(top_e, num_e, cap)
      slot = jnp.where(keep, top_e * cap + rank, num_e * cap)  # [n, k]; dropped -> out of range
      rows = jnp.broadcast_to(tokens[:, None], (n, k, d)).reshape(n * k, d).astype(dtype)
      buffer = jnp.zeros((num_e * cap, d), dtype).at[slot.reshape(-1)].set(rows, mode="drop")
      buffer = nn.with_logical_constraint(buffer.reshape(num_e, cap, d), ("expert", None, "embed"))
      out = ffn(buffer, lambda h, w: jnp.einsum("ecd,edf->ecf", h, w, preferred_element_type=jnp.float32))
      copies = out.reshape(num_e * cap, d).at[slot.reshape(-1)].get(mode="fill", fill_value=0)
      weights = weights * keep
      self.sow("intermediates", "dropped_fraction", 1.0 - jnp.mean(keep.astype(jnp.float32)))
    elif cfg.moe_dispatch == "all_to_all" and _expert_axis_size() > 1:
      copies = all_to_all_dispatch(x.astype(dtype), top_e.reshape(batch, length, k), w_in, w_out, ffn)
      copies = copies.reshape(n * k, d)
    elif dropless_impl() == "blocks":
      # The whole FFN in the block layout: one scatter in, one gather out (padding rows are 0).
      b = block_rows(n * k, num_e)
      dest, block_group, blocks = block_layout(top_e, num_e, b)
      rows = jnp.broadcast_to(tokens[:, None], (n, k, d)).reshape(n * k, d).astype(dtype)
      x_blocks = jnp.zeros((blocks * b, d), dtype).at[dest].set(rows, unique_indices=True)
      out = ffn(x_blocks.reshape(blocks, b, d),
                lambda h, w: jnp.einsum("bri,bio->bro", h, w[block_group], preferred_element_type=jnp.float32))
      copies = out.reshape(blocks * b, d)[dest]  # [n * k] in token order
    else:
      flat_e = top_e.reshape(-1)  # [n * k]
      order = jnp.argsort(flat_e, stable=True)
      group_sizes = jnp.bincount(flat_e, length=num_e).astype(jnp.int32)
      rows = tokens[order // k].astype(dtype)  # token copies sorted by expert
      out = ffn(rows, lambda h, w: jax.lax.ragged_dot(h, w, group_sizes, preferred_element_type=jnp.float32))
      copies = jnp.zeros_like(out).at[order].set(out, unique_indices=True)  # back to [n * k] order
    y = jnp.einsum("nkd,nk->nd", copies.reshape(n, k, d), weights.astype(copies.dtype))
    y = y.astype(cfg.dtype).reshape(batch, length, d)

    sow_router_statistics(self, logits, top_e, probs)
    if cfg.moe_shared_experts:
      shared = dataclasses.replace(cfg, d_ff=cfg.moe_shared_experts * cfg.d_ff, use_bias=False)
      y = y + layers.FeedForward(shared, name="shared")(x, deterministic)
    return y

  def expert_weight(self, name, w):
    """The expert weight `name` (w [experts, in, out]) as the FFN multiplies by it: w itself.

    `lora.adapters_active` intercepts this method to return (w, A [experts, in, r], s B [experts,
    r, out]) instead, per-expert adapters whose product every dispatch path applies to each row
    through the same matmul as W (so the adapters go wherever the expert's rows go).
    """
    del name
    return w


def _expert_axis_size():
  """The size of the current mesh's `expert` axis (1 without a mesh: init, decoding)."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.shape.get("expert", 1) if mesh.axis_names else 1


def all_to_all_dispatch(x, top_e, w_in, w_out, ffn):
  """Dropless expert parallelism by explicit token exchange (model.moe_dispatch=all_to_all).

  x [batch, length, d_model] and top_e [batch, length, top_k] (batch over data x fsdp x expert,
  as sharding.RULES splits it), the expert weights [experts, ...] (over `expert`; each an array or
  LoRA's (W, A, s B), all split on their leading experts axis) -> each
  token copy's expert output [batch, length, top_k, d_model], in `shard_map` over the mesh:
  each device writes its n' tokens' copies into a [experts, n', d_model] buffer (an expert
  gets at most one copy per token, so n' rows never drop one), `jax.lax.all_to_all` over the
  `expert` axis sends every expert's rows to the device that holds it, that device runs its
  experts on what it received from all X devices ([experts / X, X x n', d_model], one batched
  matmul), and a second all_to_all sends the results back. The buffers are static: X x n' x
  experts / X rows per device where top_k x n' are real, so both the exchange and the expert
  matmul carry experts / top_k times the active rows (the price of no dropping without
  ragged all-to-all). Weights sharded over fsdp or tensor are gathered at the shard_map boundary.
  """
  mesh = jax.sharding.get_abstract_mesh()
  batch_axes = tuple(a for a in dict(sharding.RULES)["batch"] if a in mesh.axis_names)
  num_e, x_size = jax.tree.leaves(w_out)[0].shape[0], mesh.shape["expert"]  # (w_out: an array or LoRA's tuple)

  def local(x, top_e, w_in, w_out):
    b, t, d = x.shape
    n, k = b * t, top_e.shape[-1]
    top = top_e.reshape(n, k)
    rank, _ = capacity_slots(top, num_e, n)  # every copy ranks below n at its expert
    slot = (top * n + rank).reshape(-1)  # [n * k] rows of the [experts * n] buffer
    rows = jnp.broadcast_to(x.reshape(n, 1, d), (n, k, d)).reshape(n * k, d)
    buffer = jnp.zeros((num_e * n, d), x.dtype).at[slot].set(rows, unique_indices=True)
    # [X destination, experts / X, n, d] -> [X source, experts / X, n, d]
    received = jax.lax.all_to_all(buffer.reshape(x_size, num_e // x_size, n, d), "expert", 0, 0, tiled=True)
    h = received.transpose(1, 0, 2, 3).reshape(num_e // x_size, x_size * n, d)
    out = ffn(h, lambda h, w: jnp.einsum("ecd,edf->ecf", h, w, preferred_element_type=jnp.float32),
              w_in=w_in, w_out=w_out)
    out = out.reshape(num_e // x_size, x_size, n, d).transpose(1, 0, 2, 3)
    back = jax.lax.all_to_all(out, "expert", 0, 0, tiled=True)  # [X, experts / X, n, d]: experts in order
    return back.reshape(num_e * n, d)[slot].reshape(b, t, k, d)

  spec = jax.sharding.PartitionSpec(batch_axes)
  expert_spec = jax.sharding.PartitionSpec("expert")
  fn = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, [expert_spec] * len(w_in), expert_spec),
                     out_specs=spec)
  return fn(x, top_e, list(w_in), w_out)


def sow_router_statistics(module, logits, top_e, probs):
  """Sows load_balancing, z_loss and expert_fraction [experts] (see the module docstring) from
  the router's logits, probs [tokens, experts] and choices top_e [tokens, top_k]."""
  num_e, k = probs.shape[-1], top_e.shape[-1]
  fraction = jnp.mean(jnp.sum(jax.nn.one_hot(top_e, num_e, dtype=jnp.float32), axis=1), axis=0) / k
  module.sow("intermediates", "load_balancing", num_e * k * jnp.sum(fraction * jnp.mean(probs, axis=0)))
  module.sow("intermediates", "z_loss", jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2))
  module.sow("intermediates", "expert_fraction", fraction)


def dense_reference(params, cfg: ModelConfig, x):
  """Every expert on every token, combined by the router weights (zero off the top k): the
  test reference for `MoEFeedForward` (dropless, no shared experts). x [batch, length, d_model]."""
  tokens = x.reshape(-1, x.shape[-1])
  weights, top_e, _ = route(tokens @ params["router"]["kernel"], cfg.moe_top_k)
  gate = jnp.sum(jax.nn.one_hot(top_e, cfg.moe_experts) * weights[..., None], axis=1)  # [n, experts]
  names = ("wi_gate", "wi_up") if cfg.gated else ("wi",)
  hidden = [jnp.einsum("nd,edf->enf", tokens, params[name]) for name in names]
  out = jnp.einsum("enf,efd->end", layers.ffn_activation(cfg, hidden), params["wo"])
  return jnp.einsum("end,ne->nd", out, gate).reshape(x.shape)


def aux_losses(intermediates):
  """The router statistics `MoEFeedForward` sowed -> dict(load_balancing, z_loss: means over the
  MoE layers; expert_fraction [experts]: mean fraction of token copies per expert; in capacity-mode
  training, dropped_fraction: mean fraction of token copies dropped). Empty without MoE."""
  found = {}
  for path, value in traverse_util.flatten_dict(intermediates).items():
    if path[-1] in ("load_balancing", "z_loss", "expert_fraction", "dropped_fraction"):
      for v in value:  # sow keeps a tuple per call; nn.scan stacks layers on axis 0
        found.setdefault(path[-1], []).append(v.reshape(-1, v.shape[-1]) if path[-1] == "expert_fraction"
                                              else v.reshape(-1))
  return {name: jnp.mean(jnp.concatenate(vs), axis=0) for name, vs in found.items()}
