"""A LoRA run's adapters as a PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`)."""

import json
import math
import os
import re

import numpy as np

from jaxformer import config as config_lib
from jaxformer import evaluate
from jaxformer import lora
from jaxformer.convert import families
from jaxformer.convert.common import get, has, leaf_paths, numpy_dtype, read_json
from jaxformer.convert.hf_out import infer_model_type
from jaxformer.errors import UserError


def to_peft(workdir, out, step=None, dtype="float32", log=print):
  """Writes a LoRA run's adapters as a PEFT adapter: `out/adapter_config.json` + `adapter_model.safetensors`.

  Keys `base_model.model.<HF module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], as
  peft's `save_pretrained` writes them, on the base that `--to-hf` of train.init_from writes.
  """
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise UserError(f"{workdir} has no config.json: is it a training workdir (train.py --workdir)?")
  cfg = config_lib.load_config(path)
  if not lora.enabled(cfg):
    raise UserError(f"--peft: {workdir} is not a LoRA run (train.lora_rank=0); export it without --peft")
  cfg = config_lib.replace(cfg, **{"model.scan_layers": False})  # HF's layout is per layer
  adapters, meta = evaluate.load_lora_adapters(cfg, workdir, step, log=lambda *_: None)
  base_dir = meta.get("lora_base") or cfg.train.init_from
  hf_path = os.path.join(base_dir, "hf_config.json")
  recorded = (read_json(hf_path, "") if os.path.isfile(hf_path) else {}).get("model_type")
  kind = infer_model_type(cfg, recorded)
  fam = families.FAMILIES[kind]
  if fam.ARCH == "encoder_decoder":
    raise UserError("--peft exports decoder-only models (GPT-2, Llama); export a Marian LoRA run merged")
  if os.path.exists(os.path.join(out, "adapter_config.json")):
    raise UserError(f"--out {out} already holds an adapter: choose a new directory")
  _, shapes = evaluate.abstract_params(cfg)
  r, alpha = cfg.train.lora_rank, cfg.train.lora_alpha
  tensors, targets, rank_pattern, alpha_pattern, exported = {}, [], {}, {}, set()
  for t in fam.tensors(cfg.model):
    modules = [p[:-1] for p in t.ours if p[-1] == "kernel"]
    if not t.hf.endswith(".weight") or len(modules) != len(t.ours):
      continue
    found = [get(adapters, m) if has(adapters, m + (lora.A,)) else None for m in modules]
    if not any(f is not None for f in found):
      continue
    # One adapter for the HF module: the A of each of our kernels side by side [in, n r], B block-diagonal
    # [n r, sum of outs] (zero blocks where a fused part has no adapter): x A B = the sum of the parts.
    outs = [math.prod(get(shapes, m + ("kernel",)).shape[1 if m[-1] != "out" else 2:]) for m in modules]
    n = sum(f is not None for f in found)
    a_hf = np.zeros((n * r, math.prod(get(shapes, modules[0] + ("kernel",)).shape) // outs[0]), np.float32)
    b_hf = np.zeros((sum(outs), n * r), np.float32)
    j, col = 0, 0
    for f, size in zip(found, outs):
      if f is not None:
        a_hf[j * r:(j + 1) * r] = np.asarray(f[lora.A]).reshape(-1, r).T
        b_hf[col:col + size, j * r:(j + 1) * r] = np.asarray(f[lora.B]).reshape(r, -1).T
        j += 1
      col += size
    module = t.hf[:-len(".weight")]
    tensors[f"base_model.model.{module}.lora_A.weight"] = a_hf
    tensors[f"base_model.model.{module}.lora_B.weight"] = b_hf
    targets.append(module)
    if n != 1:
      rank_pattern[re.escape(module)], alpha_pattern[re.escape(module)] = n * r, n * alpha
    exported.update(m for m, f in zip(modules, found) if f is not None)
  missing = [m for m in leaf_paths(adapters) if m[:-1] not in exported]
  if missing:
    raise UserError(f"--peft: the adapter on {'/'.join(missing[0][:-1])} has no Hugging Face {kind} module to "
                    "hold it: export this run merged (without --peft)")
  os.makedirs(out, exist_ok=True)
  np_dtype = numpy_dtype(dtype)
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  save_file({k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in tensors.items()},
            os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
            "target_modules": targets, "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": getattr(fam, "PEFT_FAN_IN_FAN_OUT", False),
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
            "base_model_name_or_path": None, "inference_mode": True}
  with open(os.path.join(out, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  log(f"wrote a PEFT LoRA adapter for {kind} ({sum(v.size for v in tensors.values()):,} parameters, rank {r}, "
      f"{len(targets)} modules) to {out}; its base: python -m jaxformer.convert --to-hf {base_dir} --out BASE")
  return out
