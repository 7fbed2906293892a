"""Llama 1/2/3/3.1 (`LlamaForCausalLM`): RMSNorm, RoPE (default, llama3, yarn scalings), SwiGLU, GQA; Mistral-style
Llamas with q/k/v and FFN biases where `attention_bias` and `mlp_bias` agree."""

import os

from jaxformer.convert.common import (PLAIN, attention, first_eos, linear, norm, rope, rope_parameters, same,
                                      unsupported, vector)

MODEL_TYPE, NAMES, ARCH, MOE = "llama", "Llama 1/2/3/3.1", "decoder_only", False
OTHER_FFN = "mixtral"  # a Llama given MoE layers exports as Mixtral
SPM_EXPORT = True  # a sentencepiece tokenizer.model exports as LlamaTokenizer
WANTS = dict(arch="decoder_only", norm="rmsnorm", norm_position="pre", position="rope", activation="swiglu",
             logits_bias=False, scale_embeddings=False, moe_experts=0, **PLAIN)


def mismatches(m):
  """(field, wanted) pairs beyond WANTS that a Llama cannot express."""
  return [("rope_scaling", "none, linear, llama3 or yarn")] if m.rope_scaling == "ntk" else []


def tensors(m, moe_ffn=None):
  """LlamaForCausalLM's names; `moe_ffn(m, prefix, ours)` gives an MoE layer's (Mixtral's). The Llama
  variants share them: q/k/v biases (Qwen2: model.qkv_bias), q/k norms (Qwen3: model.qk_norm)."""
  t = [same("model.embed_tokens.weight", ("embed", "embedding"))]
  for i in range(m.num_layers):
    h, ours = f"model.layers.{i}", ("decoder", f"layer_{i}")
    t += norm(f"{h}.input_layernorm", ours + ("self_attention_norm",), bias=False)
    t += attention(f"{h}.self_attn", ours + ("self_attention",), ("q_proj", "k_proj", "v_proj", "o_proj"),
                    m.use_bias, m.qkv_bias)
    if m.qk_norm:
      for hf_name, our_name in (("q_norm", "query_norm"), ("k_norm", "key_norm")):
        t += norm(f"{h}.self_attn.{hf_name}", ours + ("self_attention", our_name), bias=False)
    t += norm(f"{h}.post_attention_layernorm", ours + ("ffn_norm",), bias=False)
    if moe_ffn is not None:
      t += moe_ffn(m, h, ours + ("moe",))
      continue
    for hf_name, our_name in (("gate_proj", "wi_gate"), ("up_proj", "wi_up"), ("down_proj", "wo")):
      t.append(linear(f"{h}.mlp.{hf_name}.weight", ours + ("ffn", our_name, "kernel")))
      if m.use_bias:
        t.append(vector(f"{h}.mlp.{hf_name}.bias", ours + ("ffn", our_name, "bias")))
  t += norm("model.norm", ("decoder", "final_norm"), bias=False)
  if not m.tie_output:
    t.append(linear("lm_head.weight", ("logits", "kernel")))
  return t


def config(hf, gen):
  """(model, data, decode) config fields from a Llama config.json."""
  if hf.get("hidden_act", "silu") != "silu":
    unsupported("hidden_act", hf.get("hidden_act"), "Llama FFN (SwiGLU: silu)")
  if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
    unsupported("attention_bias / mlp_bias", (hf.get("attention_bias"), hf.get("mlp_bias")),
                 "model.use_bias (one switch for attention and FFN)")
  heads = hf["num_attention_heads"]
  eos = first_eos(hf)
  model = dict(arch="decoder_only", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_heads=heads,
               num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim"),
               num_layers=hf["num_hidden_layers"], d_ff=hf["intermediate_size"], activation="swiglu", norm="rmsnorm",
               norm_position="pre", norm_eps=hf.get("rms_norm_eps", 1e-6),
               use_bias=bool(hf.get("attention_bias", False)),
               max_len=hf.get("max_position_embeddings", 2048), tie_output=hf.get("tie_word_embeddings", False),
               scale_embeddings=False, kernel_init="normal", init_std=hf.get("initializer_range", 0.02),
               dropout_rate=0.0, attention_dropout_rate=hf.get("attention_dropout", 0.0),
               bos_id=hf.get("bos_token_id", 1), eos_id=eos, pad_id=hf.get("pad_token_id") or eos, **rope(hf))
  return model, {"task": "lm", "add_bos": True}, {}


def default_ids(model):
  """Llama pads with EOS where config.json names no pad token."""
  if model.get("pad_id") is None:
    model["pad_id"] = model["eos_id"]


def tokenizer(source):
  """sentencepiece where the source has Llama-1/2's tokenizer.model, else a tokenizer.json."""
  spm = source.endswith(".model") if os.path.isfile(source) else os.path.isfile(os.path.join(source, "tokenizer.model"))
  return "sentencepiece" if spm else "hf"


def hf_config(cfg, hf):
  """Sets a Llama config.json's fields from cfg (in place)."""
  m = cfg.model
  rope = rope_parameters(m)
  hf.pop("rope_scaling", None)
  hf.pop("rope_theta", None)
  hf.update(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=m.vocab_size, hidden_size=m.d_model,
            num_attention_heads=m.num_heads, num_key_value_heads=m.kv_heads, head_dim=m.dim_per_head,
            num_hidden_layers=m.num_layers, intermediate_size=m.d_ff, hidden_act="silu", rms_norm_eps=m.norm_eps,
            attention_bias=m.use_bias, mlp_bias=m.use_bias, max_position_embeddings=m.max_len,
            tie_word_embeddings=m.tie_output, rope_parameters=rope, bos_token_id=m.bos_id,
            eos_token_id=hf.get("eos_token_id") if first_eos(hf) == m.eos_id else m.eos_id,
            pad_token_id=hf.get("pad_token_id"))
