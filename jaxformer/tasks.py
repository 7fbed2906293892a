"""The two tasks the one training loop serves: translation and language modelling.

A task owns its data (text -> tokenizer -> cached ids -> static-shape batches) and
its loss. Batches are pure functions of the step (`train_batch(step)`), which makes
resuming exact without any iterator state.
"""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import data as data_lib
from jaxformer import hub
from jaxformer import layers
from jaxformer import losses
from jaxformer import synthetic
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.config import Config
from jaxformer.errors import UserError


def tokenizer_path(cfg: Config, workdir):
  """Where the run's tokenizer lives (the config's path, or inside the workdir)."""
  if cfg.data.tokenizer_path:
    return cfg.data.tokenizer_path
  if cfg.data.tokenizer == "byte":
    return "byte"
  json_kinds = ("char", "hf", "marian")
  return os.path.join(workdir, "tokenizer.json" if cfg.data.tokenizer in json_kinds else "tokenizer.model")


def local_file(key, path):
  """`path` (the value of config field `key`) if it is a file, else a one-line error saying how to set it."""
  if not os.path.isfile(path):
    raise UserError(f"{key}={path}: file not found; set {key}=FILE (recipes that read the small corpora "
                    "beside a checkout, ../shared/data, find them elsewhere through JAXFORMER_DATA=DIR)")
  return path


def load_translation_splits(cfg: Config, need_train=True):
  """{"train": (src, tgt), "dev": ..., "test": ...} as lists of str, from the configured source.

  need_train=False (evaluation, e.g. of a converted model): a local source may give only dev/test files.
  """
  d = cfg.data
  if d.source == "synthetic":
    en, de = synthetic.numbers_corpus(d.synthetic_size, seed=0)
    (train_en, train_de), (test_en, test_de) = synthetic.split_train_test(en, de, 0.1, seed=0)
    half = len(test_en) // 2
    return {"train": (train_en, train_de), "dev": (test_en[:half], test_de[:half]),
            "test": (test_en[half:], test_de[half:])}
  if d.source == "hub":
    name = f"hf:{d.hub_name}"
    get = lambda split: data_lib.load_translation(name, split, d.src_lang, d.tgt_lang, d.hub_config)
    return {"train": get("train"), "dev": get("validation"), "test": get("test")}
  if d.source == "local":
    splits = {}
    for split in ("train", "dev", "test"):
      src, tgt = getattr(d, f"{split}_src"), getattr(d, f"{split}_tgt")
      if src or tgt:
        splits[split] = data_lib.read_parallel(local_file(f"data.{split}_src", src),
                                               local_file(f"data.{split}_tgt", tgt))
    if "train" not in splits and need_train:
      raise UserError("data.source=local needs data.train_src and data.train_tgt")
    return splits
  raise UserError(f"data.source={d.source!r}: choose local, hub or synthetic")


class TranslationTask:
  """Parallel text -> joint sentencepiece -> token-budget buckets -> label-smoothed loss."""

  name = "translation"

  def __init__(self, cfg: Config, workdir, batch_multiple=1, log=print, splits=None):
    d = cfg.data
    self.cfg = cfg
    self.splits = splits or load_translation_splits(cfg)
    self.tokenizer_path = tokenizer_path(cfg, workdir)
    train_src, train_tgt = self.splits["train"]
    if d.tokenizer in ("sentencepiece", "char") and not os.path.exists(self.tokenizer_path):
      log(f"training a joint {d.tokenizer} tokenizer ({cfg.model.vocab_size} pieces) on "
          f"{len(train_src):,} pairs -> {self.tokenizer_path}")
    self.tokenizer = tokenizer_lib.load_or_train_tokenizer(
        d.tokenizer, self.tokenizer_path, [*train_src, *train_tgt], cfg.model.vocab_size)
    if self.tokenizer.vocab_size > cfg.model.vocab_size:
      raise UserError(f"tokenizer has {self.tokenizer.vocab_size} ids but model.vocab_size="
                      f"{cfg.model.vocab_size}")
    tok = self.tokenizer.use_model_ids(cfg.model.pad_id, cfg.model.bos_id, cfg.model.eos_id, "the config")
    names = list(self.splits)
    # Sources and targets alternate; a tokenizer with a target side of its own (Marian) splits targets with it.
    own_target = type(tok).encode_target is not tokenizer_lib.Tokenizer.encode_target
    ids = data_lib.tokenize_corpus(self.tokenizer_path, [t for n in names for t in self.splits[n]],
                                   cache_path=os.path.join(workdir, "cache"), num_proc=d.num_proc,
                                   targets=tuple(range(1, 2 * len(names), 2)) if own_target else ())
    self.ids = {n: (ids[2 * i], ids[2 * i + 1]) for i, n in enumerate(names)}
    # Gradient accumulation splits each step's batch into equal micro-batches inside
    # the jitted step, so bucket batch sizes must be multiples of both. The lcm (not the
    # product) with the data-parallel size keeps the global batch the same on 1 or 8 devices.
    multiple = int(np.lcm(d.batch_multiple, batch_multiple)) * cfg.optim.grad_accum_steps
    kept, counts = data_lib.filter_pairs(*self.ids["train"], d.max_len)
    log(f"train pairs: {counts['kept']:,} kept, {counts['empty']:,} empty and "
        f"{counts['too_long']:,} longer than {d.max_len - 1} tokens dropped")
    special = {"pad_id": tok.pad_id, "bos_id": tok.bos_id, "eos_id": tok.eos_id}
    self.train = data_lib.Batcher(*self.ids["train"], d.tokens_per_batch, d.max_len, seed=cfg.train.seed,
                                  batch_multiple=multiple, indices=kept, **special)
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
                                            buckets=tuple(sorted(set(buckets))), **special)
    log(f"train: {self.train.steps_per_epoch:,} batches per epoch, shapes {self.train.shapes()}, "
        f"padding {100 * self.train.padding_fraction():.1f}%")

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
  """Text -> tokenizer -> one token stream -> random windows -> next-token loss."""

  name = "lm"

  def __init__(self, cfg: Config, workdir, batch_multiple=1, log=print):
    d = cfg.data
    self.cfg = cfg
    if d.source == "local":
      if not d.text_path:
        raise UserError("data.source=local needs data.text_path for a language model")
      text = "\n".join(data_lib.read_lines(local_file("data.text_path", d.text_path))) + "\n"
      train_text, val_text = data_lib.nanogpt_split(text, d.train_fraction)
      train_docs, val_docs = [train_text], [val_text]
    elif d.source == "hub":
      ds = hub.load_dataset(d.hub_name, d.hub_config,
                            local_hint="to use a local text file set data.source=local data.text_path=FILE")
      train_docs, val_docs = ds["train"]["text"], ds["validation"]["text"]
    else:
      raise UserError(f"data.source={d.source!r}: a language model reads local or hub text")
    self.tokenizer_path = tokenizer_path(cfg, workdir)
    self.tokenizer = tokenizer_lib.load_or_train_tokenizer(
        d.tokenizer, self.tokenizer_path, train_docs,
        cfg.model.vocab_size if d.tokenizer == "sentencepiece" else None)
    if self.tokenizer.vocab_size > cfg.model.vocab_size:
      raise UserError(f"the {d.tokenizer} tokenizer has {self.tokenizer.vocab_size} ids but "
                      f"model.vocab_size={cfg.model.vocab_size}; set model.vocab_size={self.tokenizer.vocab_size}")
    self.tokenizer.use_model_ids(cfg.model.pad_id, cfg.model.bos_id, cfg.model.eos_id, "the config")
    # A single document (Tiny Shakespeare) gets no EOS, matching nanoGPT's stream.
    add_eos = len(train_docs) > 1
    self.train_stream = data_lib.lm_token_stream(train_docs, self.tokenizer, add_eos, d.add_bos)
    self.val_stream = data_lib.lm_token_stream(val_docs, self.tokenizer, add_eos, d.add_bos)
    self.val_text = "\n".join(val_docs)
    if d.batch_size % batch_multiple or d.batch_size % cfg.optim.grad_accum_steps:
      raise UserError(f"data.batch_size={d.batch_size} must be a multiple of the data-parallel size "
                      f"({batch_multiple}) and of optim.grad_accum_steps ({cfg.optim.grad_accum_steps})")
    eos = self.tokenizer.eos_id
    self.train = data_lib.LMBatcher(self.train_stream, d.block_size, d.batch_size, seed=cfg.train.seed, eos_id=eos)
    self.val = data_lib.LMBatcher(self.val_stream, d.block_size, d.batch_size, seed=cfg.train.seed + 1, eos_id=eos)
    log(f"lm: {len(self.train_stream):,} train tokens, {len(self.val_stream):,} val tokens, "
        f"vocab {self.tokenizer.vocab_size}")

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
  def loss(model, params, batch, rngs, deterministic, label_smoothing):
    args = (batch["inputs"], batch.get("segment_ids"), batch.get("positions"))
    weights = jnp.ones(batch["targets"].shape, jnp.float32)
    return model_loss(model, params, args, rngs, deterministic, batch["targets"], weights, label_smoothing)

  @staticmethod
  def init_inputs(batch):
    return (batch["inputs"],)


def model_loss(model, params, args, rngs, deterministic, targets, weights, label_smoothing):
  """`losses.cross_entropy` of `model.apply(params, *args)` against targets, weights [batch, length].

  With model.logits_chunk set (or automatic, see `losses.logits_chunk`) the model stops
  at its final hidden states and `losses.chunked_cross_entropy` projects them a chunk at
  a time, so the whole logits never exist.
  """
  variables = {"params": params}
  mesh = jax.sharding.get_abstract_mesh()  # the batch is split over data x fsdp while a step is traced
  shards = math.prod(mesh.shape.get(axis, 1) for axis in ("data", "fsdp")) if mesh.shape else 1
  chunk = losses.logits_chunk(model.cfg.logits_chunk, targets.size, model.cfg.vocab_size, shards)
  if not chunk:
    logits = model.apply(variables, *args, deterministic=deterministic, rngs=rngs)
    return losses.cross_entropy(logits, targets, weights, label_smoothing)
  hidden = model.apply(variables, *args, deterministic=deterministic, rngs=rngs, project=False)
  weights_and_bias, spec = model.apply(variables, method="output_weight")
  project = lambda h, wb: layers.project_logits(h, wb[0], spec, model.cfg, bias=wb[1])
  return losses.chunked_cross_entropy(hidden, weights_and_bias, targets, weights, label_smoothing, chunk, project)


def make_task(cfg: Config, workdir, batch_multiple=1, log=print):
  """The task the config's `data.task` names."""
  cls = TranslationTask if cfg.data.task == "translation" else LMTask
  return cls(cfg, workdir, batch_multiple=batch_multiple, log=log)
