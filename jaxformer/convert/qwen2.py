"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): a Llama with biases on the q/k/v projections (none on o_proj or
the FFN), embeddings tied in the small models."""

from jaxformer.convert import llama
from jaxformer.convert.common import derived_head_dim, unsupported, windows

MODEL_TYPE, NAMES, ARCH, MOE = "qwen2", "Qwen2/2.5", "decoder_only", False
WANTS = {**llama.WANTS, "use_bias": False, "qkv_bias": True}
tokenizer, default_ids, tensors = llama.tokenizer, llama.default_ids, llama.tensors


def mismatches(m):
  """(field, wanted) pairs beyond WANTS that Qwen2 cannot express: head_dim is hidden / heads there."""
  return llama.mismatches(m) + derived_head_dim(m)


def config(hf, gen):
  """(model, data, decode) fields from a Qwen2 config.json: Llama's, with q/k/v biases."""
  if hf.get("use_sliding_window"):  # layers from max_window_layers on are local (layer_types says which)
    if hf.get("layer_types") is None:
      unsupported("use_sliding_window", True, "Qwen2 import without layer_types (convert with transformers >= 5)")
  model, data, decode = llama.config({**hf, "attention_bias": False, "mlp_bias": False}, gen)
  model.update(use_bias=False, qkv_bias=True, head_dim=None, **(windows(hf) if hf.get("use_sliding_window") else {}))
  return model, {**data, "add_bos": False}, decode  # Qwen's tokenizer adds no BOS


def hf_config(cfg, hf):
  """Sets a Qwen2 config.json's fields from cfg (in place)."""
  m = cfg.model
  llama.hf_config(cfg, hf)
  for key in ("attention_bias", "mlp_bias", "head_dim"):
    hf.pop(key, None)
  hf.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False, sliding_window=None,
            max_window_layers=m.num_layers, layer_types=["full_attention"] * m.num_layers)
