"""Export: a jaxformer workdir (a LoRA run merged) -> an HF folder transformers' `from_pretrained` loads."""

import json
import os
import shutil

import jax
import numpy as np

from jaxformer import evaluate
from jaxformer import qmatmul
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.convert import families
from jaxformer.convert.common import get, numpy_dtype, put, read_json
from jaxformer.convert.hf_files import write_shards
from jaxformer.errors import UserError


def infer_model_type(cfg, recorded=None):
  """Which HF family can hold this config exactly; a UserError names the first field that does not fit.

  `recorded`: the model_type the run was imported from (kept, unless its FFN changed: a Llama given
  MoE layers exports as Mixtral, and back)."""
  m = cfg.model
  moe = m.moe_experts > 0
  if recorded in families.FAMILIES and families.FAMILIES[recorded].MOE != moe:
    recorded = getattr(families.FAMILIES[recorded], "OTHER_FFN", recorded)
  candidates = [recorded] if recorded in families.FAMILIES else [
      k for k, f in families.FAMILIES.items() if f.ARCH == m.arch and f.MOE == moe]
  for kind in candidates:
    fam = families.FAMILIES[kind]
    bad = [(f, v) for f, v in fam.WANTS.items() if getattr(m, f) != v] + fam.mismatches(m)
    if not bad:
      return kind
    if len(candidates) == 1 or kind == candidates[-1]:
      field, value = bad[0]
      raise UserError(f"model.{field}={getattr(m, field)!r} has no Hugging Face {kind} equivalent "
                      f"(it needs {value!r}): this model cannot be exported exactly")
  raise UserError(f"model.arch={m.arch!r}: no Hugging Face architecture fits")


def hf_config_for(cfg, kind, base=None):
  """The HF config.json dict: the imported one (if any) with every architecture field set from cfg."""
  hf = dict(base or {})
  for stale in ("_name_or_path", "transformers_version", "torch_dtype"):
    hf.pop(stale, None)
  families.FAMILIES[kind].hf_config(cfg, hf)
  hf["dtype"] = "float32"
  return hf


def chat_export(cfg, kind, workdir, tokenizer_workdir):
  """(template text, special-token strings) that `--to-hf` writes into tokenizer_config.json, or None.

  A fine-tuned run (data.chat_path) carries the template it trained with (`data.chat_template`,
  checked against the hash its prepared data recorded), turned into what transformers renders
  to the same ids (`chat.hf_template`); another run carries the template beside its tokenizer
  (a converted instruct model's), if any. `tokenizer_workdir`: where the tokenizer lives (a LoRA
  run's base). Runs before anything is written, so a template that cannot be carried is one line.
  """
  from jaxformer import chat, prepare, shards, tasks
  path = tasks.tokenizer_path(cfg, tokenizer_workdir)
  if families.FAMILIES[kind].ARCH == "encoder_decoder" or path == "byte" or not os.path.isfile(path):
    return None  # no chat model, or no tokenizer to write (export_tokenizer says so)
  tok = tokenizer_lib.load_tokenizer(path)
  if isinstance(tok, tokenizer_lib.HFTokenizer):
    token_text = tok.tok.id_to_token
  elif isinstance(tok, tokenizer_lib.SentencePieceTokenizer):
    token_text = tok.sp.id_to_piece
  else:
    return None
  tok.use_model_ids(cfg.model.pad_id, cfg.model.bos_id, cfg.model.eos_id, os.path.join(workdir, "config.json"))
  hf = isinstance(tok, tokenizer_lib.HFTokenizer)
  try:
    template = chat.load_template(cfg.data.chat_template, path, hf)
  except UserError as e:
    if cfg.data.chat_path:
      raise UserError(f"cannot export the chat template {workdir} trained with: {e}") from None
    return None  # a model without a chat template: none to carry
  if cfg.data.chat_path:
    ddir = prepare.data_dir(cfg, workdir)
    trained = ((shards.read_manifest(ddir) or {}).get("chat") or {}).get("settings", {}).get("template_sha256")
    if trained and trained != template.sha256:
      raise UserError(f"chat template {template.name} is not the one {workdir} trained with (its hash differs from "
                      f"{ddir}'s manifest): restore that template, or set data.chat_template to it in "
                      f"{os.path.join(workdir, 'config.json')}")
  return chat.hf_template(template, tok, hf, cfg.data.add_bos, token_text)


def export_tokenizer(cfg, kind, workdir, out, chat_template=None):
  """Writes the tokenizer files and tokenizer_config.json; `chat_template`: (text, special-token strings)
  from `chat_export`, written into the config (transformers' `apply_chat_template` reads it)."""
  from jaxformer import tasks
  path = tasks.tokenizer_path(cfg, workdir)
  if path == "byte" or not os.path.isfile(path):
    raise UserError(f"tokenizer {path} cannot be written in a Hugging Face format (byte / missing)")
  tok = tokenizer_lib.load_tokenizer(path)
  if isinstance(tok, tokenizer_lib.MarianTokenizer):
    tok.save_hf(out)
    config = {"tokenizer_class": "MarianTokenizer", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
  elif isinstance(tok, tokenizer_lib.HFTokenizer):
    if tok.config_tokens:  # special tokens that only the source's tokenizer_config.json named: into the file
      tok.tok.save(os.path.join(out, "tokenizer.json"))
    else:
      shutil.copyfile(path, os.path.join(out, "tokenizer.json"))
    token = tok.tok.id_to_token
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token(cfg.model.bos_id),
              "eos_token": token(cfg.model.eos_id)}
    if tok.tok.encode_special_tokens:
      config["split_special_tokens"] = True
  elif isinstance(tok, tokenizer_lib.SentencePieceTokenizer) and getattr(families.FAMILIES[kind], "SPM_EXPORT", False):
    shutil.copyfile(path, os.path.join(out, "tokenizer.model"))
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": cfg.data.add_bos, "add_eos_token": False}
  else:
    raise UserError(f"tokenizer {path} ({type(tok).__name__}) has no Hugging Face form for {kind}; "
                    "the weights and config were written")
  if chat_template is not None:
    text, special = chat_template
    config.update(special)  # the strings the template renders as bos_token, eos_token, ...
    config["chat_template"] = text
  with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)


def generation_config(cfg, kind, workdir):
  """generation_config.json: the imported one (if any) with our ids and the family's decode settings."""
  path = os.path.join(workdir, "hf_generation_config.json")
  gen = read_json(path, "") if os.path.isfile(path) else {}
  gen.pop("transformers_version", None)
  fam = families.FAMILIES[kind]
  gen.setdefault("eos_token_id", cfg.model.eos_id)
  if fam.ARCH != "encoder_decoder":  # an encoder-decoder (Marian) has no BOS: it starts from decoder_start_token_id
    gen.setdefault("bos_token_id", cfg.model.bos_id)
  getattr(fam, "generation", lambda *_: None)(cfg, gen)
  return gen


def to_hf(workdir, out, step=None, dtype="float32", max_shard_mb=2048, log=print):
  """Writes `out/config.json`, the safetensors weights and the tokenizer from a workdir's checkpoint.

  Each parameter is dropped once its HF tensor is made, so the peak is about one copy of the
  model plus one shard (`max_shard_mb`).
  """
  if qmatmul.read_manifest(workdir) is not None:
    raise UserError(f"--to-hf {workdir}: a quantized run (jaxformer.quantize) has no HF float export; "
                    "convert the float run it was made from")
  # HF's layout is per layer: a model.scan_layers checkpoint is unstacked on the way in.
  cfg, _, params, _, meta = evaluate.load_run(workdir, step=step, log=lambda *_: None, scan_layers=False)
  run_dir, workdir = workdir, meta.get("lora_base") or workdir  # a LoRA run (merged above): the rest is its base's
  base_path = os.path.join(workdir, "hf_config.json")
  base = read_json(base_path, "") if os.path.isfile(base_path) else None
  kind = infer_model_type(cfg, meta.get("hf_model_type") or (base or {}).get("model_type"))
  hf = hf_config_for(cfg, kind, base)
  template = chat_export(cfg, kind, run_dir, workdir)
  if os.path.exists(os.path.join(out, "config.json")):
    raise UserError(f"--out {out} already holds a model: choose a new directory")
  os.makedirs(out, exist_ok=True)
  np_dtype = numpy_dtype(dtype)
  params = jax.tree.map(lambda x: x, params)  # our own dict tree, emptied as we go
  count = [0]

  def tensors():
    for t in families.FAMILIES[kind].tensors(cfg.model):
      value = t.to_hf(tuple(np.asarray(get(params, p)) for p in t.ours))
      for p in t.ours:  # free each parameter once converted: the peak stays near one copy of the model
        if not isinstance(p[-1], int):
          put(params, p, None)
        elif p[-1] == len(get(params, p[:-1])) - 1:  # a stacked expert parameter: with its last row
          put(params, p[:-1], None)
      count[0] += value.size
      yield t.hf, np.ascontiguousarray(value).astype(np_dtype, copy=False)

  write_shards(out, tensors(), max_shard_mb)
  hf["dtype"] = dtype
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump(generation_config(cfg, kind, workdir), f, indent=2)
  export_tokenizer(cfg, kind, workdir, out, template)
  log(f"wrote {kind} ({count[0]:,} parameters, {dtype}) to {out}" + (" with its chat template" if template else ""))
  return out
