"""Mistral (`MistralForCausalLM`): a Llama whose every layer attends within a sliding window (`sliding_window`,
4096 in v0.1; null, full attention, from v0.2)."""

from jaxformer.convert import llama
from jaxformer.convert.common import unsupported

MODEL_TYPE, NAMES, ARCH, MOE = "mistral", "Mistral", "decoder_only", False
SPM_EXPORT = True
WANTS = {k: v for k, v in llama.WANTS.items() if k != "sliding_window"}
WANTS.update(use_bias=False)
tokenizer, default_ids, tensors = llama.tokenizer, llama.default_ids, llama.tensors


def mismatches(m):
  """(field, wanted) pairs beyond WANTS: Mistral's window is in every layer or none."""
  bad = llama.mismatches(m)
  if m.sliding_window and any(not m.layer_is_local(i) for i in range(m.num_layers)):
    bad.append(("attention_pattern", "every layer local (Mistral has no global layers)"))
  return bad


def config(hf, gen):
  """(model, data, decode) fields from a Mistral config.json: Llama's with a sliding window."""
  for key in ("attention_bias", "mlp_bias"):
    if hf.get(key):
      unsupported(key, hf[key], "Mistral (no biases)")
  model, data, decode = llama.config(hf, gen)
  model.update(sliding_window=int(hf.get("sliding_window") or 0))
  return model, data, decode


def hf_config(cfg, hf):
  """Sets a Mistral config.json's fields from cfg (in place)."""
  m = cfg.model
  llama.hf_config(cfg, hf)
  for key in ("attention_bias", "mlp_bias"):
    hf.pop(key, None)
  hf.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=m.sliding_window or None)
