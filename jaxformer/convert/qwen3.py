"""Qwen3 (`Qwen3ForCausalLM`): a Llama with an RMSNorm over each head's q and k before RoPE and a head_dim of
its own (not hidden / heads); no biases."""

from jaxformer.convert import llama
from jaxformer.convert.common import unsupported

MODEL_TYPE, NAMES, ARCH, MOE = "qwen3", "Qwen3", "decoder_only", False
WANTS = {**llama.WANTS, "use_bias": False, "qk_norm": True}
tokenizer, default_ids, tensors, mismatches = llama.tokenizer, llama.default_ids, llama.tensors, llama.mismatches


def config(hf, gen):
  """(model, data, decode) fields from a Qwen3 config.json: Llama's, with q/k norms."""
  if hf.get("use_sliding_window"):
    unsupported("use_sliding_window", True, "Qwen3 import (full attention in every layer)")
  if hf.get("attention_bias"):  # on q/k/v and o, none in the FFN: neither use_bias nor qkv_bias
    unsupported("attention_bias", True, "Qwen3 (model.use_bias puts biases in the FFN too)")
  model, data, decode = llama.config({**hf, "attention_bias": False, "mlp_bias": False}, gen)
  model.update(qk_norm=True, head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"])
  return model, {**data, "add_bos": False}, decode


def hf_config(cfg, hf):
  """Sets a Qwen3 config.json's fields from cfg (in place)."""
  m = cfg.model
  llama.hf_config(cfg, hf)
  hf.pop("mlp_bias", None)
  hf.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False, use_sliding_window=False,
            sliding_window=None, max_window_layers=m.num_layers, layer_types=["full_attention"] * m.num_layers)
