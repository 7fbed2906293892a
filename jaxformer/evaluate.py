"""Evaluation: BLEU for translation, perplexity for language models, checkpoint averaging.

    python eval.py --workdir DIR [--split test] [--average-last K] [--beam 4] [--alpha 0.6] [decode.*=... data.*=...]
    python eval.py --hyp FILE --ref FILE           # score any system output
    python eval.py --workdir DIR --text FILE       # LM perplexity of a text file
    python eval.py --workdir DIR --text FILE --rolling   # ... in lm-eval's rolling windows
    python eval.py --workdir SFT_DIR               # a fine-tuned run: masked NLL of its held-out chats
"""

import argparse
import functools
import hashlib
import json
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import bleu
from jaxformer import checkpoint as checkpoint_lib
from jaxformer import config as config_lib
from jaxformer import decode
from jaxformer import layers
from jaxformer import lora
from jaxformer import losses
from jaxformer import model as model_lib
from jaxformer import qmatmul
from jaxformer import runtime
from jaxformer import sources as sources_lib
from jaxformer import tasks
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.errors import UserError, cli

_WIDTHS = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)  # few shapes, few compiles


def file_sha256(path):
  """Hash of a tokenizer file, stored in checkpoints so eval can detect a mismatch."""
  if path == "byte" or not os.path.exists(path):
    return path
  with open(path, "rb") as f:
    return hashlib.sha256(f.read()).hexdigest()


def translate(model, params, tokenizer, sources, beam_size=4, alpha=0.6, max_extra_len=50,
              batch_size=64, log=None, length_penalty="gnmt", early_stopping="false", suppress_pad=False):
  """Translates a list of source strings; beam_size 1 is greedy. Returns detokenized strings.

  Sentences are sorted by length and padded to a few fixed widths, so a whole test set
  compiles only a handful of times; nothing is truncated (max length = source + 50).
  length_penalty, early_stopping, suppress_pad: as in `decode.beam_search` (decode.* config).
  """
  ids = [tokenizer.encode(s) + [tokenizer.eos_id] for s in sources]
  tokens = translate_ids(model, params, ids, beam_size, alpha, max_extra_len, batch_size, log, length_penalty,
                         early_stopping, suppress_pad)
  return [tokenizer.decode(t) for t in tokens]


def source_widths(max_source_len):
  """The padded source widths `translate` can use for sources of up to `max_source_len` tokens (with EOS)."""
  widths = [w for w in _WIDTHS if w < max_source_len]
  return widths + [next((w for w in _WIDTHS if w >= max_source_len), max_source_len)]


def translate_ids(model, params, ids, beam_size=4, alpha=0.6, max_extra_len=50, batch_size=64, log=None,
                  length_penalty="gnmt", early_stopping="false", suppress_pad=False):
  """`translate` on token ids: sources [n][len] (EOS included) -> output token arrays [n][steps] (EOS/pad
  after the end, as `decode` returns them), sorted into batches of `batch_size` rows and padded widths."""
  order = np.argsort([len(x) for x in ids], kind="stable")
  hyps = [None] * len(ids)
  start = time.time()
  for n in range(0, len(order), batch_size):
    chunk = order[n:n + batch_size]
    longest = max(len(ids[i]) for i in chunk)
    width = next((w for w in _WIDTHS if w >= longest), longest)
    inputs = np.full((batch_size, width), model.cfg.pad_id, np.int32)
    for row, i in enumerate(chunk):
      inputs[row, :len(ids[i])] = ids[i]
    if beam_size == 1:
      tokens = decode.greedy_translate(model, params, jnp.asarray(inputs), max_extra_len=max_extra_len,
                                       suppress_pad=suppress_pad)
    else:
      tokens = decode.beam_search(model, params, jnp.asarray(inputs), beam_size=beam_size, alpha=alpha,
                                  max_extra_len=max_extra_len, length_penalty_kind=length_penalty,
                                  early_stopping=early_stopping, suppress_pad=suppress_pad)[0][:, 0]
    tokens = np.asarray(tokens)
    for row, i in enumerate(chunk):
      hyps[i] = tokens[row]
    if log:
      done = min(n + batch_size, len(order))
      rate = done / max(time.time() - start, 1e-9)
      log(f"decoded {done:,}/{len(order):,} sentences ({rate:.1f}/s, eta {(len(order) - done) / rate:.0f}s)")
  return hyps


def abstract_params(cfg):
  """Parameter shapes of the config's model (nothing allocated)."""
  model = model_lib.build_model(cfg.model)
  dummy = jnp.ones((1, 8), jnp.int32)
  args = (dummy, dummy) if cfg.model.arch == "encoder_decoder" else (dummy,)
  shapes = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *args))["params"]
  return model, nn.unbox(shapes)


def stored_scan_layers(ckpt, step=None):
  """Whether checkpoint `step` (default: latest) of a `checkpoint.Checkpointer` holds its layers
  stacked (`model.scan_layers`) rather than unrolled (`layer_0`, ...)."""
  return any(p.startswith("params/") and "/layers/" in p for p in ckpt.stored_paths(step))


# What evaluation may change in a run's saved config: how to decode, and which files to read.
EVAL_OVERRIDE_SECTIONS = ("decode", "data")
EVAL_OVERRIDE_KEYS = ("model.quant_activations",)  # how a quantized model multiplies, not what it is


def load_run(workdir, average_last=0, step=None, log=print, overrides=(), scan_layers=None):
  """(cfg, model, params, tokenizer, meta) of a training workdir; averages the last K checkpoints if asked.

  `overrides` (`decode.*`, `data.*` and `model.quant_activations` only) apply on top of the run's saved config.
  The checkpoint may hold its layers unrolled or stacked (`model.scan_layers`): its own
  layout is read from the stored tree, and the params come back in the layout of the run's
  config, or of `scan_layers` when given (the returned cfg and model then follow it).
  """
  path = os.path.join(workdir, "config.json")
  if not os.path.exists(path):
    raise UserError(f"{workdir} has no config.json: is it a training workdir (train.py --workdir)?")
  # Unknown keys (a run saved by another version) are skipped with a warning, never silently.
  cfg = saved = config_lib.load_saved_config(path, warn=lambda msg: print(msg, file=sys.stderr))
  for override in overrides:
    key = override.split("=", 1)[0].strip()
    if key.split(".")[0] not in EVAL_OVERRIDE_SECTIONS and key not in EVAL_OVERRIDE_KEYS:
      raise UserError(f"override {override!r}: evaluation takes decode.*, data.* and model.quant_activations "
                      f"overrides only "
                      f"(the model comes from {path})")
    cfg = config_lib.apply_override(cfg, override)
  try:
    config_lib._validate(cfg)  # an override like decode.length_penalty=typo is an error, not a silent default
  except UserError as e:
    try:
      config_lib._validate(saved)
    except UserError as saved_error:  # the run's own setting (older versions accepted it): warn, evaluate
      if str(saved_error) != str(e):
        raise e from None
      print(f"warning: {path}: {e} (a setting of the run itself; evaluating anyway)", file=sys.stderr)
    else:
      raise
  if scan_layers is not None:
    cfg = config_lib.replace(cfg, **{"model.scan_layers": bool(scan_layers)})
  try:  # a kernel is a speed setting, not part of the model: a TPU run (splash) evaluates on a CPU
    config_lib.check_backend(cfg.model, jax.default_backend())
  except UserError as e:
    print(f"note: {path}: {str(e).split(':')[0]}; evaluating with model.attention_impl=auto", file=sys.stderr)
    cfg = config_lib.replace(cfg, **{"model.attention_impl": "auto"})
  if lora.enabled(cfg):
    return _load_lora_run(cfg, workdir, average_last, step, log)
  # Read-only (no lease, no cleanup): works while training writes the workdir. Every checkpoint
  # read is verified against its checksums; a damaged one is a one-line error.
  ckpt = checkpoint_lib.Checkpointer(workdir, max_to_keep=None, async_save=False, log=log)
  try:
    # --average-last K --step S: the K checkpoints ending at S
    steps = (checkpoint_lib.averaged_steps(ckpt.all_steps(), average_last, step, ckpt.directory)
             if average_last > 1 else [step])
    stored_scan = stored_scan_layers(ckpt, steps[-1])
    _, shapes = abstract_params(config_lib.replace(cfg, **{"model.scan_layers": stored_scan}))
    manifest = qmatmul.read_manifest(workdir)
    if manifest is None and cfg.model.quant_activations != "float":
      raise UserError(f"model.quant_activations={cfg.model.quant_activations} needs int8/int4 weights and {workdir} "
                      "holds float ones: quantize it first (python -m jaxformer.quantize)")
    if manifest is not None:  # int8/int4 weights (python -m jaxformer.quantize): the same model reads them
      if average_last > 1:
        raise UserError(f"--average-last with a quantized run ({workdir}): average the float run, then quantize")
      shapes = qmatmul.quantized_abstract(shapes, manifest)
      log(f"{workdir}: int{manifest['bits']} weights ({len(manifest['kernels'])} kernels"
          + (f", int4 group {manifest['group_size']})" if manifest["bits"] == 4 else ")"))
    if average_last > 1:
      params = checkpoint_lib.average_checkpoints(workdir, average_last, {"params": shapes}, log=log, until=step)
      _, meta = ckpt.restore_params(shapes, step=steps[-1])
      log(f"averaged the last {average_last} checkpoints: steps {steps}")
    else:
      params, meta = ckpt.restore_params(shapes, step=step)
      log(f"restored step {meta.get('step')} from {ckpt.directory}")
  finally:
    ckpt.close()
  if stored_scan != cfg.model.scan_layers:
    params = model_lib.convert_layers(params, cfg.model.scan_layers)
    log(f"converted the checkpoint's layers from the {'scanned' if stored_scan else 'unrolled'} layout")
  model = model_lib.build_model(cfg.model)
  tok_path = tasks.tokenizer_path(cfg, workdir)
  if tok_path != "byte" and not os.path.exists(tok_path):
    raise UserError(f"tokenizer {tok_path} is missing: eval and generate need the tokenizer the model was trained "
                    "with (a model converted without one: copy it there, or convert again with --tokenizer PATH)")
  if meta.get("tokenizer_sha256") not in (None, file_sha256(tok_path)):
    raise UserError(f"tokenizer {tok_path} is not the one checkpoint step {meta.get('step')} was trained "
                    "with (its hash differs): restore the original tokenizer file")
  tokenizer = tokenizer_lib.load_tokenizer(tok_path)
  tokenizer.use_model_ids(cfg.model.pad_id, cfg.model.bos_id, cfg.model.eos_id, path)
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise UserError(f"tokenizer {tok_path} has {tokenizer.vocab_size} ids but the model has "
                    f"{cfg.model.vocab_size}: wrong tokenizer for this checkpoint")
  return cfg, model, params, tokenizer, meta


def load_lora_adapters(cfg, workdir, step=None, log=print):
  """(adapters, meta) of a LoRA run's checkpoint `step` (its params are the adapters alone), in cfg's layout."""
  ckpt = checkpoint_lib.Checkpointer(workdir, max_to_keep=None, async_save=False, log=log)
  try:
    stored_scan = stored_scan_layers(ckpt, step)
    _, shapes = lora.abstract(config_lib.replace(cfg, **{"model.scan_layers": stored_scan}))
    adapters, meta = ckpt.restore_params(nn.unbox(shapes), step=step)
  finally:
    ckpt.close()
  if stored_scan != cfg.model.scan_layers:
    adapters = model_lib.convert_layers(adapters, cfg.model.scan_layers)
  return adapters, meta


def _load_lora_run(cfg, workdir, average_last, step, log):
  """load_run for a LoRA workdir: the base of train.init_from (at the step the adapters were trained on)
  with the adapters merged in, W + (alpha / r) A B: a plain model."""
  if average_last > 1:
    raise UserError("--average-last with a LoRA run: averaging A and B is not averaging the merged weights; "
                    "evaluate one checkpoint (--step)")
  adapters, meta = load_lora_adapters(cfg, workdir, step, log)
  base_dir = meta.get("lora_base") or cfg.train.init_from
  _, _, base, _, base_meta = load_run(base_dir, step=meta.get("lora_base_step"), log=lambda *_: None,
                                      scan_layers=cfg.model.scan_layers)
  meta = {**base_meta, **meta}  # e.g. the base's hf_model_type (jaxformer.convert)
  log(f"restored LoRA adapters of step {meta.get('step')} from {workdir}, merged into {base_dir} step "
      f"{meta.get('lora_base_step')}")
  params = jax.jit(lambda b, a: lora.merge(b, a, cfg))(base, adapters)
  plain = config_lib.replace(cfg, **{"train.lora_rank": 0, "train.init_from": ""})
  model = model_lib.build_model(cfg.model)
  tok_path = tasks.tokenizer_path(cfg, workdir)
  if tok_path != "byte" and not os.path.exists(tok_path):
    raise UserError(f"tokenizer {tok_path} is missing: eval needs the tokenizer the model was trained with")
  tokenizer = tokenizer_lib.load_tokenizer(tok_path)
  tokenizer.use_model_ids(cfg.model.pad_id, cfg.model.bos_id, cfg.model.eos_id, os.path.join(workdir, "config.json"))
  return plain, model, params, tokenizer, meta


def evaluate_translation(cfg, model, params, tokenizer, split, out_path=None, beam_size=None, alpha=None,
                         limit=0, log=print):
  """Decodes a split, writes the hypotheses, and returns the BLEU scores."""
  splits = tasks.load_translation_splits(cfg, need_train=False)
  if split not in splits:
    raise UserError(f"the config has no {split} split (it has {', '.join(splits)})")
  sources, refs = splits[split]
  if limit:
    sources, refs = sources[:limit], refs[:limit]
  beam = cfg.decode.beam_size if beam_size is None else beam_size
  alpha = cfg.decode.alpha if alpha is None else alpha
  log(f"decoding {len(sources):,} {split} sentences: beam {beam}, alpha {alpha} "
      f"({cfg.decode.length_penalty} length penalty), max length = source + {cfg.decode.max_extra_len}")
  hyps = translate(model, params, tokenizer, sources, beam, alpha, cfg.decode.max_extra_len,
                   cfg.decode.batch_size, log=log, length_penalty=cfg.decode.length_penalty,
                   early_stopping=cfg.decode.hf_early_stopping, suppress_pad=cfg.decode.suppress_pad)
  if out_path:
    with open(out_path, "w", encoding="utf-8") as f:
      f.write("".join(h + "\n" for h in hyps))
  scores = {"segments": len(hyps), "sacrebleu": bleu.sacrebleu_scores(hyps, refs),
            "tokenized": bleu.tokenized_bleu(hyps, refs, compound_split=True)}
  return scores, hyps, sources, refs


def perplexity(model, params, tokenizer, text, block_size, batch_size=8, prefix_ids=(), full_last_window=False):
  """NLL of a text under a decoder-only model, in non-overlapping windows of block_size.

  `text`: a str, or an iterable of consecutive str blocks (e.g. `sources.document_blocks`, cut at
  line ends), each encoded alone and scored as they come: memory holds a block and a batch of
  windows, not the text or its ids. Windows and batches are those of the whole token stream
  (window w is ids[w * block_size : (w + 1) * block_size + 1]), so a text given in one block
  scores exactly as before; blocks differ from the whole text only where a tokenizer's pieces
  would cross a block boundary (never for char and byte tokenizers).

  prefix_ids: ids put before the text's in the stream (none by default: the first token is not scored).
  full_last_window: the last, shorter window reads the block_size tokens that end with it and scores
  only its own (by default it starts afresh). With the prefix token first and this, the windows are
  lm-evaluation-harness's `loglikelihood_rolling` ones (`jaxformer.harness`; eval.py --rolling).

  Returns per-token NLL and perplexity, plus the same total normalised per character
  and per whitespace word (so models with different tokenizers compare) and bits/char.
  """
  blocks = [text] if isinstance(text, str) else text

  @jax.jit
  def nll_sum(batch_inputs, batch_targets, batch_weights):
    logits = model.apply({"params": params}, batch_inputs)
    return losses.cross_entropy(logits, batch_targets, batch_weights)[1]

  rows_ids = batch_size * block_size  # the predicted tokens of one full batch
  total, n_pred, n_chars, n_words = 0.0, 0, 0, 0
  pending = np.asarray(prefix_ids, np.int32).reshape(-1)  # ids not yet scored, the last scored one first
  before = np.zeros(0, np.int32)  # up to block_size ids before pending[0] (full_last_window's context)

  def score(ids, context=()):
    """NLL sum of the windows of `ids` [1 + predicted] as one batch of batch_size rows; `context`: ids
    before them, which a last window shorter than block_size reads when full_last_window is set."""
    inputs = np.zeros((batch_size, block_size), np.int32)
    targets = np.zeros((batch_size, block_size), np.int32)
    weights = np.zeros((batch_size, block_size), np.float32)
    for w in range(-(-(len(ids) - 1) // block_size)):
      chunk = ids[w * block_size: w * block_size + block_size + 1]
      new = len(chunk) - 1
      if full_last_window and new < block_size:
        chunk = np.concatenate([context, ids[:w * block_size + new + 1]])[-(block_size + 1):]
      inputs[w, :len(chunk) - 1], targets[w, :len(chunk) - 1] = chunk[:-1], chunk[1:]
      weights[w, len(chunk) - 1 - new:len(chunk) - 1] = 1.0
    return float(nll_sum(inputs, targets, weights))

  for block in blocks:
    n_chars, n_words = n_chars + len(block), n_words + len(block.split())  # blocks cut at whitespace
    pending = np.concatenate([pending, np.asarray(tokenizer.encode(block), np.int32)])
    while len(pending) > rows_ids:  # a full batch and the target of its last window
      total += score(pending[:rows_ids + 1])
      n_pred += rows_ids
      before = np.concatenate([before, pending[:rows_ids]])[-block_size:]
      pending = pending[rows_ids:]
  if len(pending) > 1:
    total += score(pending, before)
    n_pred += len(pending) - 1
  if n_pred < 1:
    raise UserError("the text has fewer than 2 tokens: nothing to score")
  n_chars, n_words = max(n_chars, 1), max(n_words, 1)
  return {"tokens": n_pred, "nll_per_token": total / n_pred, "ppl_per_token": float(np.exp(total / n_pred)),
          "chars": n_chars, "ppl_per_char": float(np.exp(total / n_chars)),
          "bits_per_char": total / n_chars / np.log(2), "words": n_words,
          "ppl_per_word": float(np.exp(min(total / n_words, 700.0)))}


@functools.partial(jax.jit, static_argnames=("model",))
def hidden_states(model, params, inputs):
  """The final hidden states [batch, width, d_model] of inputs [batch, width] (the model without its
  output projection: `target_logprobs` projects only the positions it scores)."""
  return model.apply({"params": params}, inputs, project=False)


@functools.partial(jax.jit, static_argnames=("model",))
def target_logprobs(model, params, hidden, rows, positions, targets):
  """Scores the tokens requests predict, several requests sharing one input row.

  hidden [batch, width, d_model] (`hidden_states`); rows [requests] names each request's row;
  positions [requests, span] the input positions whose next token it scores; targets [requests, span]
  those tokens. -> (log p(target) [requests, span] float32, whether each target is the argmax
  [requests, span] bool); the caller masks the padding of span. Only these positions go through the
  vocabulary projection (the model's own, `layers.project_logits`, as the chunked training loss does):
  a multiple-choice question's few answer tokens, not every context position.
  """
  h = hidden[rows[:, None], positions]                                                  # [requests, span, d_model]
  (weight, bias), spec = model.apply({"params": params}, method="output_weight")
  logits = layers.project_logits(h.reshape(-1, h.shape[-1]), weight, spec, model.cfg, bias=bias)
  logp = jax.nn.log_softmax(logits).reshape(*targets.shape, -1)                         # [requests, span, vocab]
  picked = jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
  return picked, jnp.argmax(logp, -1) == targets


def eval_sums(model, task, params, batch):
  """(loss_sum, nll_sum, tokens) of one batch: no dropout, no label smoothing (an MoE model's router
  statistics dropped). The evaluation step of the training loop (`train.make_eval_step`) and of eval.py."""
  return task.loss(model, params, batch, {}, True, 0.0)[:3]


def mean_nll(eval_step, params, batches):
  """Token-weighted mean NLL and perplexity over batches, `eval_step(params, batch)` giving
  (loss_sum, nll_sum, tokens): {"val_nll", "val_ppl", "val_tokens"}."""
  total = np.zeros(3)
  for batch in batches:
    total += np.asarray(jax.device_get(eval_step(params, batch)), np.float64)
  nll = total[1] / max(total[2], 1.0)
  return {"val_nll": nll, "val_ppl": float(np.exp(min(nll, 50.0))), "val_tokens": int(total[2])}


def chat_perplexity(cfg, workdir, model, params):
  """The masked NLL of a fine-tuning (SFT) run's held-out chats: the evaluation its training loop runs.

  The prepared val split (data.chat_val_path, else the records data.train_fraction held out),
  every example of it, in the rows the loop evaluates ([batch_size, block_size], packed as
  data.packing), scored by `eval_sums` and summed by `mean_nll` as the loop does: the NLL per token of
  the loss mask (data.loss_on), so it equals the last `val_nll` in metrics.jsonl for the
  checkpoint that logged it. Returns {"val_nll", "val_ppl", "val_tokens", "examples"}.
  """
  if cfg.train.objective == "dpo":
    raise UserError(f"{workdir} is a DPO run: its held-out preference metrics are the training log's "
                    "(metrics.jsonl); give --text FILE for the perplexity of a text")
  task = tasks.make_task(cfg, workdir, log=lambda *_: None)  # the shards the run trained on (prepared if absent)
  if task.val is None or not task.val.examples:
    held = ("no example of data.chat_val_path keeps a loss token within data.block_size" if task.val is not None
            else f"data.chat_val_path is unset and data.train_fraction={cfg.data.train_fraction:g} held none out")
    raise UserError(f"{workdir} has no held-out chats to evaluate ({held}): give --text FILE for the perplexity of "
                    "a text, or train with data.chat_val_path=FILE")
  step = jax.jit(lambda params, batch: eval_sums(model, task, params, batch))
  result = mean_nll(step, params, task.eval_batches("dev", 0))
  return {**result, "examples": task.val.examples}


def format_chat_perplexity(cfg, p):
  """Two lines: which held-out chats, and `chat_perplexity`'s result `p`."""
  d = cfg.data
  held = (d.chat_val_path if d.chat_val_path else
          f"the records of {d.chat_path} that data.train_fraction={d.train_fraction:g} held out")
  return (f"held-out chats ({held}, {p['examples']:,} examples):\n"
          f"perplexity per loss token: {p['val_ppl']:.3f} (masked NLL {p['val_nll']:.4f} nats over "
          f"{p['val_tokens']:,} tokens of data.loss_on={d.loss_on}: the val_nll training logs)")


def _text_blocks(paths):
  """The files' text a block of whole lines at a time (`sources.document_blocks`), one after the other."""
  for path in paths:
    yield from sources_lib.document_blocks(sources_lib.check_not_empty(path))


def format_perplexity(p):
  return (f"perplexity per token: {p['ppl_per_token']:.3f} (NLL {p['nll_per_token']:.4f} nats over "
          f"{p['tokens']:,} predicted tokens)\nper character: {p['ppl_per_char']:.4f} "
          f"({p['bits_per_char']:.4f} bits/char over {p['chars']:,} chars)\nper word: "
          f"{p['ppl_per_word']:.2f} (same total NLL over {p['words']:,} whitespace-separated words)")


def parse_args(argv):
  parser = argparse.ArgumentParser(description="Evaluate a jaxformer run or score a system output.")
  parser.add_argument("--workdir", help="training workdir (config.json, tokenizer, checkpoints)")
  parser.add_argument("--split", default="test", help="dev or test (translation)")
  parser.add_argument("--average-last", type=int, default=0,
                      help="average the last K checkpoints (with --step S: the K ending at step S)")
  parser.add_argument("--save-average", help="save the averaged params as a checkpoint in this directory")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  parser.add_argument("--beam", type=int, default=None, help="beam size (1 = greedy)")
  parser.add_argument("--alpha", type=float, default=None, help="length penalty alpha")
  parser.add_argument("--limit", type=int, default=0, help="only the first N sentences")
  parser.add_argument("--out", help="hypothesis file (default: WORKDIR/<split>.hyp.txt)")
  parser.add_argument("--hyp", help="scoring mode: system output file")
  parser.add_argument("--ref", help="scoring mode: reference file")
  parser.add_argument("--text", help="LM: perplexity of this text file")
  parser.add_argument("--rolling", action="store_true",
                      help="LM: lm-evaluation-harness's rolling windows (loglikelihood_rolling): the first token "
                      "scored after BOS (else EOS), windows of model.max_len, the last one full")
  parser.add_argument("--tasks", help=argparse.SUPPRESS)  # eval.py sends --tasks to jaxformer.harness
  parser.add_argument("overrides", nargs="*",
                      help="decode.* / data.* overrides of the run's config, e.g. decode.max_extra_len=100")
  return parser.parse_intermixed_args(argv)  # overrides before, between or after flags


@cli
def main(argv):
  """The `eval.py` entry point."""
  args = parse_args(argv)
  if args.tasks:
    raise UserError("--tasks runs lm-evaluation-harness tasks: use eval.py --tasks ... or python -m jaxformer.harness")
  runtime.keep_freed_memory()
  runtime.use_compilation_cache()  # re-running (e.g. a length-penalty sweep) skips compiling
  if args.hyp or args.ref:
    if not (args.hyp and args.ref):
      raise UserError("scoring mode needs both --hyp FILE and --ref FILE")
    if args.overrides:
      raise UserError(f"overrides ({' '.join(args.overrides)}) apply to a --workdir run, not to --hyp/--ref scoring")
    print(bleu.format_scores(bleu.score_files(args.hyp, args.ref)))
    return
  if not args.workdir:
    raise UserError("give --workdir DIR (a training run) or --hyp FILE --ref FILE")
  cfg, model, params, tokenizer, meta = load_run(args.workdir, args.average_last, args.step,
                                                overrides=args.overrides)
  if args.save_average:
    checkpoint_lib.save_params(args.save_average, params, step=int(meta.get("step", 0)), meta=meta)
    print(f"saved averaged params to {args.save_average}/checkpoints/{meta.get('step', 0)}")
  if cfg.data.task == "lm":
    fine_tuned = bool(cfg.data.chat_path) or cfg.train.objective == "dpo"
    given = {o.split("=", 1)[0].strip() for o in args.overrides}
    if args.text:
      # Read a block of lines at a time: the text as `data.read_lines` joins it, never whole.
      if not os.path.isfile(args.text):
        raise UserError(f"{args.text}: file not found")
      text, name = _text_blocks([args.text]), args.text
    elif fine_tuned and "data.text_path" in given:
      # A fine-tuning run's data dir holds chat shards: the text is read here, whole (as --text), not prepared.
      text, name = _text_blocks(sources_lib.local_files("data.text_path", cfg.data.text_path)), cfg.data.text_path
    elif fine_tuned:
      if given & {"data.source", "data.hub_name"}:
        raise UserError("eval.py on a fine-tuning run scores its held-out chats, or a text file: --text FILE "
                        "or data.text_path=FILE (not data.source)")
      result = chat_perplexity(cfg, args.workdir, model, params)
      print(format_chat_perplexity(cfg, result))
      return result
    else:
      text, name = tasks.LMTask(cfg, args.workdir, log=lambda *_: None).val_blocks(), "the validation split"
    if args.rolling:  # as jaxformer.harness scores a document (its tok_encode: BOS first under data.add_bos)
      prefix = [tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id]
      prefix += [tokenizer.bos_id] if cfg.data.add_bos else []
      result = perplexity(model, params, tokenizer, text, cfg.model.max_len, prefix_ids=prefix, full_last_window=True)
    else:
      result = perplexity(model, params, tokenizer, text, cfg.data.block_size)
    print(f"{name}:\n{format_perplexity(result)}")
    return result
  out = args.out or os.path.join(args.workdir, f"{args.split}.hyp.txt")
  scores, hyps, sources, refs = evaluate_translation(cfg, model, params, tokenizer, args.split, out,
                                                     args.beam, args.alpha, args.limit)
  for s, h, r in list(zip(sources, hyps, refs))[:3]:
    print(f"  src: {s}\n  hyp: {h}\n  ref: {r}")
  print(f"hypotheses: {out}")
  print(bleu.format_scores(scores))
  return scores


if __name__ == "__main__":  # python -m jaxformer.evaluate (an installed wheel has no eval.py)
  main()
