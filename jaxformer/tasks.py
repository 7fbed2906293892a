"""The two tasks the one training loop serves: translation and language modelling.

A task owns its data (text -> tokenizer -> token shards prepared once on disk by
`jaxformer.prepare` -> static-shape batches read through memory maps, with the model's special
ids) and its loss. Batches are pure functions of the step (`train_batch(step)`), which makes
resuming exact without any iterator state.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

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
    self.tokenizer_path = tokenizer_path(cfg, workdir)
    self.tokenizer = prepare.load_run_tokenizer(cfg, self.tokenizer_path)
    if self.tokenizer.vocab_size > cfg.model.vocab_size:
      raise UserError(f"the {d.tokenizer} tokenizer has {self.tokenizer.vocab_size} ids but "
                      f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size={self.tokenizer.vocab_size}")
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
    """The validation documents' text, joined by newlines (eval.py's perplexity reads it)."""
    parts = []
    for k in range(len(self._manifest["splits"]["val"]["shards"])):
      with open(shards.text_path(shards.shard_stem(self.data_dir, "val", k)), encoding="utf-8") as f:
        parts.append(f.read())
    return "\n".join(parts)

  def _prepare(self, batch):
    if not self.cfg.data.use_segments:
      batch = {k: v for k, v in batch.items() if k in ("inputs", "targets")}
    return batch

  def train_batch(self, step):
    return self._prepare(self.train.batch_at(step))

  def eval_batches(self, split="dev", limit=0):
    """Fixed random windows of the validation stream (nanoGPT's estimate: eval_iters batches)."""
    return [self._prepare(self.val.batch_at(i)) for i in range(limit or 20)]

  @staticmethod
  def num_tokens(batch):
    return int(np.prod(batch["inputs"].shape))

  @staticmethod
  def loss(model, params, batch, rngs, deterministic, label_smoothing, moe_coefs=(0.0, 0.0)):
    """(smoothed loss sum, NLL sum, token count[, MoE router statistics]): see `model_loss`."""
    args = (batch["inputs"], batch.get("segment_ids"), batch.get("positions"))
    weights = jnp.ones(batch["targets"].shape, jnp.float32)
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


def make_task(cfg: Config, workdir, batch_multiple=1, log=print, part=None):
  """The task the config's `data.task` names; `part`: this process's rows (see `data.row_range`)."""
  cls = TranslationTask if cfg.data.task == "translation" else LMTask
  return cls(cfg, workdir, batch_multiple=batch_multiple, log=log, part=part)
