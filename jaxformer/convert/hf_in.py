"""Import: an HF folder (config.json, safetensors, tokenizer) -> a jaxformer workdir at step 0."""

import contextlib
import json
import os
import re
import shutil

import numpy as np

from jaxformer import checkpoint as checkpoint_lib
from jaxformer import config as config_lib
from jaxformer import evaluate
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.convert import families
from jaxformer.convert.common import get, has, leaf_paths, put, read_json, shape_of
from jaxformer.convert.hf_files import SafetensorsReader
from jaxformer.errors import UserError

# HF buffers that are no weights: GPT-2's causal-mask buffers, rotary caches, Marian's fixed sinusoid.
IGNORED = re.compile(r"(\.attn\.(masked_)?bias$|rotary_emb\.inv_freq$|embed_positions\.weight$)")
# The token ids a model needs, the config.json key each comes from, and the flag that sets it.
IDS = (("eos_id", "eos_token_id", "--eos-id"), ("bos_id", "bos_token_id", "--bos-id"),
        ("pad_id", "pad_token_id", "--pad-id"))


def _resolve_ids(model, fam, ids, where):
  """Fills `model`'s pad/bos/eos ids from `ids` (the --*-id flags, which win) and refuses a null one.

  transformers writes `"bos_token_id": null` (and eos) for a model built from a bare config object,
  and several published models have null ids: jaxformer needs each id (masks, decoding, data).
  """
  model.update({k: v for k, v in (ids or {}).items() if v is not None})
  getattr(fam, "default_ids", lambda _: None)(model)  # (GPT-2 / Llama pad with EOS; Marian has no default)
  for field, key, flag in IDS:
    if model.get(field) is None:
      key = getattr(fam, "BOS_KEY", key) if field == "bos_id" else key
      raise UserError(f"{where} has {key} null (or absent): give the id with {flag} N (the tokenizer's "
                      f"{field[:3]} token id) and convert again")


def config_from_hf(hf_dir, ids=None, tokenizer_source=None):
  """(Config, model_type, generation config dict) for an HF folder.

  `ids`: {"bos_id"|"eos_id"|"pad_id": int} set where config.json has none (or overrides it);
  `tokenizer_source`: where the tokenizer comes from (default: `hf_dir`), which decides Llama's kind.
  """
  hf = read_json(os.path.join(hf_dir, "config.json"), "is it a Hugging Face model folder?")
  kind = families.hf_model_type(hf, os.path.join(hf_dir, "config.json"))
  gen_path = os.path.join(hf_dir, "generation_config.json")
  gen = read_json(gen_path, "") if os.path.isfile(gen_path) else {}
  fam = families.FAMILIES[kind]
  model, data, decode, *optim_fields = fam.config(hf, gen)  # (Mixtral: its MoE loss coefficients too)
  _resolve_ids(model, fam, ids, os.path.join(hf_dir, "config.json"))
  if fam.ARCH == "encoder_decoder":  # the translation recipe's defaults suit fine-tuning
    optim = dict(optimizer="adamw", schedule="constant", learning_rate=3e-5, warmup_steps=0, b2=0.999, eps=1e-8,
                 grad_clip=1.0, label_smoothing=0.1)
  else:
    optim = dict(optimizer="adamw", schedule="constant", learning_rate=3e-5, warmup_steps=0, b2=0.95, eps=1e-8,
                 grad_clip=1.0, label_smoothing=0.0)
  optim.update(*optim_fields)
  tokenizer = fam.tokenizer(tokenizer_source or hf_dir)
  cfg = config_lib.Config(
      name=f"hf_{kind}_{os.path.basename(os.path.normpath(hf_dir))}",
      model=config_lib.ModelConfig(**model),
      data=config_lib.DataConfig(tokenizer=tokenizer, tokenizer_path="", max_len=min(model["max_len"], 256),
                                 block_size=min(model["max_len"], 256), **data),
      optim=config_lib.OptimConfig(**optim),
      train=config_lib.TrainConfig(num_steps=1000, eval_every=200, checkpoint_every=200, keep_checkpoints=3),
      decode=config_lib.DecodeConfig(**decode))
  config_lib._validate(cfg)
  return cfg, kind, hf, gen


def read_params(reader, cfg, kind, where):
  """The params tree from an HF checkpoint, checked against the shapes the config builds."""
  fused = next((n for n in reader.location if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))), None)
  if fused:
    raise UserError(f"{where} holds {fused}: transformers' in-memory fused expert layout; jaxformer reads the "
                    "hub's per-expert layout (block_sparse_moe.experts.E.w1/w2/w3), which save_pretrained writes")
  _, shapes = evaluate.abstract_params(cfg)
  params, used = {}, set()
  for t in families.FAMILIES[kind].tensors(cfg.model):
    name = next((n for n in (t.hf,) + t.aliases if n in reader.location), None)
    if name is None:
      raise UserError(f"{where} has no tensor {t.hf} but config.json describes it (a mismatched config.json?)")
    want = [shape_of(shapes, p) for p in t.ours]
    have = reader.shape(name)
    expected = t.to_hf(tuple(np.zeros(s, np.float32) for s in want)).shape  # what HF's shape must be
    if tuple(have) != tuple(expected):
      raise UserError(f"{where}: tensor {name} has shape {list(have)} but config.json implies {list(expected)} "
                      "(mismatched config.json and weights)")
    for path, value in zip(t.ours, t.to_ours(reader.get(name), want)):
      # Kept in the checkpoint's own dtype (bf16 for Llama): restoring widens it to float32 exactly.
      if isinstance(path[-1], int):  # one expert's row of a stacked [experts, ...] parameter
        if not has(params, path[:-1]):
          put(params, path[:-1], np.empty(get(shapes, path[:-1]).shape, value.dtype))
        get(params, path[:-1])[path[-1]] = value
      else:
        put(params, path, np.ascontiguousarray(value))
    used.update((t.hf,) + t.aliases)
  extra = [n for n in reader.location if n not in used and not IGNORED.search(n)]
  if extra:
    raise UserError(f"{where} has {len(extra)} tensor(s) the config does not use, e.g. {extra[0]} "
                    "(a mismatched config.json, or a variant jaxformer does not support)")
  missing = [p for p in leaf_paths(shapes) if not has(params, p)]
  if missing:  # a mapping bug, not the user's: say so plainly
    raise RuntimeError(f"jaxformer.convert filled no value for {'/'.join(missing[0])}")
  return params



MARIAN_TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json")


def tokenizer_file(source, cfg):
  """The tokenizer file (or Marian's folder) `source` (a folder, or a file) gives for `cfg`, or None."""
  if cfg.data.tokenizer == "marian":
    if os.path.isfile(source):
      raise UserError(f"--tokenizer {source}: a Marian tokenizer is a folder ({', '.join(MARIAN_TOKENIZER_FILES)})")
    return source if all(os.path.isfile(os.path.join(source, f)) for f in MARIAN_TOKENIZER_FILES) else None
  name = "tokenizer.model" if cfg.data.tokenizer == "sentencepiece" else "tokenizer.json"
  if os.path.isfile(source):
    if not source.endswith(os.path.splitext(name)[1]):
      raise UserError(f"--tokenizer {source}: expected a {name} (or a folder holding one)")
    return source
  path = os.path.join(source, name)
  return path if os.path.isfile(path) else None


def import_tokenizer(hf_dir, cfg, kind, workdir, source=None, log=print):
  """Copies (or packs, for Marian) the tokenizer from `source` (default: `hf_dir`) into the workdir;
  returns its path there, or None (with a warning) when there is none: the weights alone still import."""
  from jaxformer import tasks
  dest = tasks.tokenizer_path(cfg, workdir)
  found = tokenizer_file(source or hf_dir, cfg)
  if found is None:
    if source:
      raise UserError(f"--tokenizer {source} holds no {cfg.data.tokenizer} tokenizer (tokenizer.json, Llama-1/2's "
                      f"tokenizer.model, or Marian's {', '.join(MARIAN_TOKENIZER_FILES)})")
    log(f"warning: {hf_dir} has no tokenizer files: imported the weights only; eval.py and jaxformer.generate "
        f"need a tokenizer: copy it to {dest} or convert again with --tokenizer PATH")
    return None
  if cfg.data.tokenizer == "marian":
    tok = tokenizer_lib.MarianTokenizer.from_hf_dir(found)
    tok.save(dest)
  else:
    shutil.copyfile(found, dest)
  template_dir = os.path.dirname(found) if os.path.isfile(found) else found
  # tokenizer_config.json / special_tokens_map.json: special tokens the tokenizer loads beside tokenizer.json
  # (tokenizer.HFTokenizer); tokenizer_config.json / chat_template.jinja: the chat template (jaxformer.chat).
  for name in tokenizer_lib.HF_TOKENIZER_SIDE_FILES:
    if os.path.isfile(os.path.join(template_dir, name)):
      shutil.copyfile(os.path.join(template_dir, name), os.path.join(os.path.dirname(os.path.abspath(dest)), name))
  tok = tokenizer_lib.load_tokenizer(dest)
  tok.use_model_ids(cfg.model.pad_id, cfg.model.bos_id, cfg.model.eos_id, os.path.join(hf_dir, "config.json"))
  if tok.vocab_size > cfg.model.vocab_size:
    new = getattr(tok, "new_tokens", None)  # special tokens the vocabulary lacks: new ids, as in transformers
    why = (f" ({', '.join(f'{t!r} from {f}' for t, f in new.items())}: not in the vocabulary, so given new ids "
           "as transformers does; the model needs their embedding rows, or drop them from that file)") if new else ""
    raise UserError(f"the tokenizer in {source or hf_dir} has {tok.vocab_size} ids but config.json's vocab_size is "
                    f"{cfg.model.vocab_size}{why}")
  return dest


@contextlib.contextmanager
def _numpy_saved_in_place():
  """Orbax deep-copies numpy leaves before writing them (a guard against their change during an
  asynchronous save): for a params tree nothing else touches, that copy would double the peak."""
  import orbax.checkpoint as ocp
  from absl import logging as absl_logging  # orbax logs a warning on every re-registration
  handlers, verbosity = ocp.type_handlers, absl_logging.get_verbosity()
  old = handlers.get_type_handler(np.ndarray)
  absl_logging.set_verbosity(absl_logging.ERROR)
  handlers.register_type_handler(np.ndarray, handlers.NumpyHandler(deepcopy_host_arrays=False), override=True)
  try:
    yield
  finally:
    handlers.register_type_handler(np.ndarray, old, override=True)
    absl_logging.set_verbosity(verbosity)


def from_hf(hf_dir, workdir, log=print, ids=None, tokenizer=None):
  """Converts an HF folder into a jaxformer workdir; returns the Config.

  `ids`: token ids config.json lacks (see `config_from_hf`); `tokenizer`: a tokenizer file or folder
  to import instead of `hf_dir`'s (a folder without one imports the weights alone, with a warning).
  """
  if not os.path.isdir(hf_dir):
    raise UserError(f"--from-hf {hf_dir}: not a directory")
  if tokenizer and not os.path.exists(tokenizer):
    raise UserError(f"--tokenizer {tokenizer}: not found")
  cfg, kind, hf, gen = config_from_hf(hf_dir, ids, tokenizer)
  if os.path.exists(os.path.join(workdir, "config.json")) or os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise UserError(f"--workdir {workdir} already holds a run: choose a new directory")
  reader = SafetensorsReader(hf_dir)
  params = read_params(reader, cfg, kind, hf_dir)
  os.makedirs(workdir, exist_ok=True)
  tok_path = import_tokenizer(hf_dir, cfg, kind, workdir, tokenizer, log)
  for name, content in (("hf_config.json", hf), ("hf_generation_config.json", gen)):  # kept for --to-hf
    with open(os.path.join(workdir, name), "w") as f:
      json.dump(content, f, indent=2)
  meta = {"step": 0, "config": cfg.name, "tokenizer": tok_path,
          "tokenizer_sha256": evaluate.file_sha256(tok_path) if tok_path else None,
          "converted_from": os.path.abspath(hf_dir), "hf_model_type": kind}
  with _numpy_saved_in_place():
    checkpoint_lib.save_params(workdir, params, step=0, meta=meta)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config_lib.to_json(cfg))
  n = sum(get(params, p).size for p in leaf_paths(params))
  log(f"converted {kind} from {hf_dir}: {n:,} parameters -> {workdir} (checkpoint step 0, tokenizer "
      f"{tok_path or 'none'})")
  return cfg
