"""The two tasks the one training loop serves: translation and language modelling.

A task owns its data (text -> tokenizer -> token shards prepared once on disk by
`jaxformer.prepare` -> static-shape batches read through memory maps, with the model's special
ids) and its loss. Batches are pure functions of the step (`train_batch(step)`), which makes
resuming exact without any iterator state.
"""

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import chat
from jaxformer import data as data_lib
from jaxformer import layers
from jaxformer import losses
from jaxformer import moe
from jaxformer import prepare
from jaxformer import shards
from jaxformer import sources
from jaxformer.config import Config
from jaxformer.errors import UserError

# Where the data and tokenizer live, and the dev/test text BLEU reads: `prepare` and `sources`.
tokenizer_path = prepare.tokenizer_path
local_file = sources.local_file
load_translation_splits = sources.load_translation_splits


class TranslationTask:
  """Parallel text -> joint sentencepiece -> token-budget buckets -> label-smoothed loss."""

  name = "translation"

  def __init__(self, cfg: Config, workdir, batch_multiple=1, log=print, part=None):
    """Prepares the data on first use (`prepare.ensure_prepared`) and reads it memory-mapped.

    `part` (see `data.row_range`): this process reads only its rows of each batch.
    """
    d = cfg.data
    self.cfg = cfg
    manifest = prepare.ensure_prepared(cfg, workdir, log)
    self.tokenizer_path = tokenizer_path(cfg, workdir)
    self.tokenizer = tok = prepare.load_run_tokenizer(cfg, self.tokenizer_path)
    if self.tokenizer.vocab_size > cfg.model.vocab_size:
      raise UserError(f"tokenizer has {self.tokenizer.vocab_size} ids but model.vocab_size="
                      f"{cfg.model.vocab_size}")
    ddir = prepare.data_dir(cfg, workdir)
    self.ids = {n: (shards.RaggedShards(ddir, n, "src", manifest), shards.RaggedShards(ddir, n, "tgt", manifest))
                for n in ("train", "dev", "test") if n in manifest["splits"]}
    self._splits = None
    # Gradient accumulation splits each step's batch into equal micro-batches inside
    # the jitted step, so bucket batch sizes must be multiples of both. The lcm (not the
    # product) with the data-parallel size keeps the global batch the same on 1 or 8 devices.
    multiple = int(np.lcm(d.batch_multiple, batch_multiple)) * cfg.optim.grad_accum_steps
    kept, counts = data_lib.filter_pairs(*self.ids["train"], d.max_len)
    log(f"train pairs: {counts['kept']:,} kept, {counts['empty']:,} empty and "
        f"{counts['too_long']:,} longer than {d.max_len - 1} tokens dropped")
    special = {"pad_id": tok.pad_id, "bos_id": tok.bos_id, "eos_id": tok.eos_id}
    self.train = data_lib.Batcher(*self.ids["train"], d.tokens_per_batch, d.max_len, seed=cfg.train.seed,
                                  batch_multiple=multiple, indices=kept, part=part, **special)
    self.eval = {}
    for split in ("dev", "test"):
      if split in self.ids:
        # Evaluation keeps every pair: long ones get a bucket of their own length.
        src, tgt = self.ids[split]
        need = int(max(max(src.lengths, default=0), max(tgt.lengths, default=0))) + 1
        buckets = data_lib.DEFAULT_BUCKETS + (need,)
        eval_max = max(d.max_len, need)
        self.eval[split] = data_lib.Batcher(src, tgt, max(d.tokens_per_batch // 2, eval_max * batch_multiple),
                                            eval_max, shuffle=False, batch_multiple=batch_multiple,
                                            buckets=tuple(sorted(set(buckets))), part=part, **special)
    log(f"train: {self.train.steps_per_epoch:,} batches per epoch, shapes {self.train.shapes()}, "
        f"padding {100 * self.train.padding_fraction():.1f}%")

  def close(self):
    """Closes the token shards' files (they reopen on the next read)."""
    for readers in self.ids.values():
      for r in readers:
        r.close()

  @property
  def splits(self):
    """The dev/test text, {"dev": (sources, references), ...}: read on first use (BLEU needs it)."""
    if self._splits is None:
      self._splits = load_translation_splits(self.cfg, names=tuple(n for n in ("dev", "test") if n in self.ids))
    return self._splits

  def train_batch(self, step):
    """The batch of global `step`: dict of [batch, length] int32 numpy arrays."""
    return self.train.batch_at(step)

  def eval_batches(self, split="dev", limit=0):
    """The split's batches in a fixed order (all of them when limit is 0)."""
    batches = self.eval[split].epoch_batches(0)
    batches = batches[:limit] if limit else batches
    return [self.eval[split].make_batch(b) for b in batches]

  @staticmethod
  def num_tokens(batch):
    """Real (non-pad) source + target tokens in a batch (for tokens/s)."""
    return int(batch["inputs_segmentation"].sum() + batch["targets_segmentation"].sum())

  @staticmethod
  def loss(model, params, batch, rngs, deterministic, label_smoothing):
    """(smoothed loss sum, NLL sum, target token count) of a teacher-forced batch."""
    args = (batch["inputs"], batch["decoder_inputs"], batch["inputs_segmentation"], batch["targets_segmentation"],
            batch["inputs_position"], batch["targets_position"])
    weights = batch["targets_segmentation"].astype(jnp.float32)
    return model_loss(model, params, args, rngs, deterministic, batch["targets"], weights, label_smoothing)

  @staticmethod
  def init_inputs(batch):
    return (batch["inputs"], batch["decoder_inputs"])


def _run_tokenizer(cfg, workdir):
  """(path, tokenizer) of the run's prepared tokenizer; one line if it has more ids than the model."""
  path = tokenizer_path(cfg, workdir)
  tok = prepare.load_run_tokenizer(cfg, path)
  if tok.vocab_size > cfg.model.vocab_size:
    raise UserError(f"the {cfg.data.tokenizer} tokenizer has {tok.vocab_size} ids but "
                    f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size={tok.vocab_size}")
  return path, tok


class LMTask:
  """Prepared token shards -> random windows or packed rows -> next-token loss."""

  name = "lm"

  def __init__(self, cfg: Config, workdir, batch_multiple=1, log=print, part=None):
    """Prepares the data on first use (`prepare.ensure_prepared`) and reads it memory-mapped.

    `part` (see `data.row_range`): this process reads only its rows of each batch.
    """
    d = cfg.data
    self.cfg = cfg
    manifest = prepare.ensure_prepared(cfg, workdir, log)
    self.tokenizer_path, self.tokenizer = _run_tokenizer(cfg, workdir)
    self.data_dir = prepare.data_dir(cfg, workdir)
    self.train_stream = shards.TokenStream(self.data_dir, "train", "text", manifest)
    self.val_stream = shards.TokenStream(self.data_dir, "val", "text", manifest)
    self._manifest = manifest
    if d.batch_size % batch_multiple or d.batch_size % cfg.optim.grad_accum_steps:
      raise UserError(f"data.batch_size={d.batch_size} must be a multiple of the data-parallel size "
                      f"({batch_multiple}) and of optim.grad_accum_steps ({cfg.optim.grad_accum_steps})")
    if d.packing == "packed":  # segments from the stored document offsets
      batcher = data_lib.PackedLMBatcher
    else:  # random windows: segments start after the model's EOS (a single document has none), as before shards
      batcher = functools.partial(data_lib.LMBatcher, eos_id=self.tokenizer.eos_id)
    self.train = batcher(self.train_stream, d.block_size, d.batch_size, seed=cfg.train.seed, part=part)
    self.val = batcher(self.val_stream, d.block_size, d.batch_size, seed=cfg.train.seed + 1, part=part)
    log(f"lm: {len(self.train_stream):,} train tokens, {len(self.val_stream):,} val tokens, "
        f"vocab {self.tokenizer.vocab_size} ({d.packing.replace('_', ' ')} from {self.data_dir})")

  @property
  def val_text(self):
    """The validation documents' text, joined by newlines."""
    return "".join(self.val_blocks())

  def val_blocks(self, block_size=1 << 20):
    """The validation text (`val_text`) as consecutive blocks of whole lines, read a block at a time
    (eval.py's perplexity: memory holds a block, whatever the split's size)."""
    for k in range(len(self._manifest["splits"]["val"]["shards"])):
      if k:
        yield "\n"
      # No BOM step: the text is the documents' own, a leading U+FEFF included.
      path = shards.text_path(shards.shard_stem(self.data_dir, "val", k))
      yield from (text for text, _ in sources.line_blocks(path, block_size, strip_bom=False))

  def close(self):
    """Closes the token shards' files (they reopen on the next read)."""
    self.train_stream.close()
    self.val_stream.close()

  def _prepare(self, batch):
    if not self.cfg.data.use_segments:
      batch = {k: v for k, v in batch.items() if k in ("inputs", "targets", "weights")}
    return batch

  def train_batch(self, step):
    return self._prepare(self.train.batch_at(step))

  def eval_batches(self, split="dev", limit=0):
    """`limit` fixed random windows of the validation stream (nanoGPT's estimate: eval_iters batches),
    or with `limit` 0 (train.eval_batches=0) the whole stream, each token predicted once."""
    if limit:
      return [self._prepare(self.val.batch_at(i)) for i in range(limit)]
    d = self.cfg.data
    return [self._prepare(b) for b in data_lib.whole_stream_batches(self.val_stream, d.block_size, d.batch_size,
                                                                     self.tokenizer.eos_id)]

  @staticmethod
  def num_tokens(batch):
    return int(np.prod(batch["inputs"].shape))

  @staticmethod
  def loss(model, params, batch, rngs, deterministic, label_smoothing, moe_coefs=(0.0, 0.0)):
    """(smoothed loss sum, NLL sum, target count[, MoE router statistics]): see `model_loss`; a batch's
    `weights` [batch, length] (SFT's loss mask) selects the targets, else every target counts."""
    args = (batch["inputs"], batch.get("segment_ids"), batch.get("positions"))
    weights = (batch["weights"].astype(jnp.float32) if "weights" in batch
               else jnp.ones(batch["targets"].shape, jnp.float32))
    return model_loss(model, params, args, rngs, deterministic, batch["targets"], weights, label_smoothing,
                      moe_coefs)

  @staticmethod
  def init_inputs(batch):
    return (batch["inputs"],)


def model_loss(model, params, args, rngs, deterministic, targets, weights, label_smoothing, moe_coefs=(0.0, 0.0)):
  """`losses.cross_entropy` of `model.apply(params, *args)` against targets, weights [batch, length].

  With model.logits_chunk set (or automatic, see `losses.logits_chunk`) the model stops
  at its final hidden states and `losses.chunked_cross_entropy` projects them a chunk at
  a time, so the whole logits never exist.

  An MoE model (model.moe_experts > 0) returns a fourth item, its router statistics
  (`moe.aux_losses`), and its smoothed loss sum gains (aux x load_balancing + z x z_loss) x
  the weight sum, moe_coefs = (optim.moe_aux_loss, optim.moe_z_loss): per target token, like the loss.
  """
  variables = {"params": params}
  mesh = jax.sharding.get_abstract_mesh()  # the batch is split over data x fsdp x expert while a step is traced
  batch_shards = math.prod(mesh.shape.get(axis, 1) for axis in ("data", "fsdp", "expert")) if mesh.shape else 1
  chunk = losses.logits_chunk(model.cfg.logits_chunk, targets.size, model.cfg.vocab_size, batch_shards)
  is_moe = model.cfg.moe_experts > 0
  apply = functools.partial(model.apply, variables, *args, deterministic=deterministic, rngs=rngs,
                            **({"mutable": ["intermediates"]} if is_moe else {}))
  if not chunk:
    out = apply()
    logits, sown = out if is_moe else (out, None)
    result = losses.cross_entropy(logits, targets, weights, label_smoothing)
  else:
    out = apply(project=False)
    hidden, sown = out if is_moe else (out, None)
    weights_and_bias, spec = model.apply(variables, method="output_weight")
    project = lambda h, wb: layers.project_logits(h, wb[0], spec, model.cfg, bias=wb[1])
    result = losses.chunked_cross_entropy(hidden, weights_and_bias, targets, weights, label_smoothing, chunk, project)
  if not is_moe:
    return result
  stats = moe.aux_losses(sown.get("intermediates", {}))
  loss, nll, weight = result
  loss = loss + (moe_coefs[0] * stats["load_balancing"] + moe_coefs[1] * stats["z_loss"]) * weight
  return loss, nll, weight, stats


class _FineTuning:
  """What SFT and DPO data share: shards from `chat.ensure_prepared`, the run's tokenizer."""

  def train_batch(self, step):
    return self.train.batch_at(step)

  def eval_batches(self, split="dev", limit=0):
    """The validation examples in stored order (all of them when limit is 0)."""
    if self.val is None or not self.val.examples:
      return []
    steps = self.val.steps_per_epoch if not limit else min(limit, self.val.steps_per_epoch)
    return [self.val.batch_at(i) for i in range(steps)]

  def _open(self, cfg, workdir, batch_multiple, log):
    d = cfg.data
    self.cfg = cfg
    manifest = chat.ensure_prepared(cfg, workdir, log)
    self.tokenizer_path, self.tokenizer = _run_tokenizer(cfg, workdir)
    if d.batch_size % batch_multiple or d.batch_size % cfg.optim.grad_accum_steps:
      raise UserError(f"data.batch_size={d.batch_size} must be a multiple of the data-parallel size "
                      f"({batch_multiple}) and of optim.grad_accum_steps ({cfg.optim.grad_accum_steps})")
    self.data_dir = prepare.data_dir(cfg, workdir)
    self.streams = {split: {f: shards.TokenStream(self.data_dir, split, f, manifest) for f in chat.fields(cfg)}
                    for split in ("train", "val") if split in manifest["splits"]}
    return manifest

  def _report(self, batcher, split, log):
    log(f"{split}: {batcher.examples:,} examples in rows of {self.cfg.data.block_size + 1} tokens, "
        f"{batcher.empty:,} with no loss token left after cutting to that length skipped")
    if not batcher.examples:
      raise UserError(f"no {split} example of {self.cfg.data.chat_path} keeps a loss token within data.block_size="
                      f"{self.cfg.data.block_size}: raise data.block_size (or check data.loss_on)")

  @staticmethod
  def num_tokens(batch):
    return int((batch["segment_ids"] > 0).sum())

  @staticmethod
  def init_inputs(batch):
    return (batch["inputs"].reshape(-1, batch["inputs"].shape[-1]),)


class ChatTask(_FineTuning):
  """SFT: the LM task on rows of whole chat/instruction examples, the loss on the mask's tokens.

  data.packing=packed packs consecutive examples into a row (segment ids and positions restart
  per example; `data.example_rows` zeroes targets across examples); else one example per row.
  """

  name = "lm"

  def __init__(self, cfg: Config, workdir, batch_multiple=1, log=print, part=None):
    d = cfg.data
    self._open(cfg, workdir, batch_multiple, log)
    make = lambda split, **kw: data_lib.ExampleBatcher(
        self.streams[split]["text"], self.streams[split]["mask"], d.block_size, d.batch_size,
        packed=d.packing == "packed", pad_id=cfg.model.pad_id, part=part, **kw)
    self.train = make("train", seed=cfg.train.seed)
    self._report(self.train, "train", log)
    self.val = make("val", shuffle=False) if "val" in self.streams else None

  loss = staticmethod(LMTask.loss)


class PreferenceTask(_FineTuning):
  """DPO: (chosen, rejected) pairs, batches [batch, 2, block_size]; the loss is `preference_loss`."""

  name = "dpo"

  def __init__(self, cfg: Config, workdir, batch_multiple=1, log=print, part=None):
    d = cfg.data
    self._open(cfg, workdir, batch_multiple, log)
    make = lambda split, **kw: data_lib.PairBatcher(
        *(self.streams[split][f] for f in chat.fields(cfg)), d.block_size, d.batch_size,
        pad_id=cfg.model.pad_id, part=part, **kw)
    self.train = make("train", seed=cfg.train.seed)
    self._report(self.train, "train", log)
    self.val = make("val", shuffle=False) if "val" in self.streams else None

  @staticmethod
  def sequence_log_probs(model, params, batch, rngs, deterministic):
    """Summed log-probabilities of each sequence's loss tokens (the response and its EOS) [batch, 2]."""
    rows, two, length = batch["inputs"].shape
    flat = {k: v.reshape(rows * two, length) for k, v in batch.items()}
    logits = model.apply({"params": params}, flat["inputs"], flat["segment_ids"], flat["positions"],
                         deterministic=deterministic, rngs=rngs)
    logp = losses.token_log_probs(logits, flat["targets"])
    return jnp.sum(logp * flat["weights"].astype(jnp.float32), axis=-1).reshape(rows, two)

  @staticmethod
  def preference_loss(model, params, reference, batch, rngs, deterministic, beta, policy_scope=None):
    """(DPO loss sum, sums): `losses.dpo_loss` of the policy `params` against the frozen
    `reference` (no gradient), summed over pairs; sums: nll_sum (the chosen responses' NLL),
    tokens (pairs), rewards/chosen_sum, rewards/rejected_sum, rewards/accuracy_sum.

    policy_scope: a context manager entered for the policy's forward pass alone. With LoRA it is
    `lora.adapters_active(cfg)`, `params` the base with the adapters and `reference` the base: the
    reference is the same weights with the adapters off (no second copy)."""
    with policy_scope if policy_scope is not None else contextlib.nullcontext():
      policy = PreferenceTask.sequence_log_probs(model, params, batch, rngs, deterministic)
    ref = jax.lax.stop_gradient(PreferenceTask.sequence_log_probs(model, reference, batch, {}, True))
    real = (batch["weights"][:, 0].sum(-1) > 0).astype(jnp.float32)  # filler rows (evaluation) count for nothing
    loss, chosen, rejected = losses.dpo_loss(policy[:, 0], policy[:, 1], ref[:, 0], ref[:, 1], beta)
    sums = {"nll_sum": -jnp.sum(policy[:, 0] * real), "tokens": jnp.sum(real),
            "rewards/chosen_sum": jnp.sum(chosen * real), "rewards/rejected_sum": jnp.sum(rejected * real),
            "rewards/accuracy_sum": jnp.sum((chosen > rejected) * real)}
    return jnp.sum(loss * real), sums


def make_task(cfg: Config, workdir, batch_multiple=1, log=print, part=None):
  """The task the config names (`data.task`; data.chat_path: SFT, or DPO with train.objective=dpo);
  `part`: this process's rows (see `data.row_range`)."""
  if cfg.train.objective == "dpo":
    cls = PreferenceTask
  elif cfg.data.task == "lm" and cfg.data.chat_path:
    cls = ChatTask
  else:
    cls = TranslationTask if cfg.data.task == "translation" else LMTask
  return cls(cfg, workdir, batch_multiple=batch_multiple, log=log, part=part)
