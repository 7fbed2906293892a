"""Gemma 2 (`Gemma2ForCausalLM`): (1 + w) RMSNorms before and after attention and the FFN, embeddings scaled by
sqrt(d_model) and tied, GeGLU, query_pre_attn_scalar, tanh soft-capping of attention and output logits, and
local (sliding-window) layers alternating with global ones."""

from jaxformer.convert import llama
from jaxformer.convert.common import (PLAIN, attention, first_eos, layer_types, linear, norm, rope, rope_parameters,
                                      same, unsupported, windows)

MODEL_TYPE, NAMES, ARCH, MOE = "gemma2", "Gemma 2", "decoder_only", False
WANTS = {**{k: v for k, v in llama.WANTS.items() if k not in PLAIN}, "activation": "geglu", "scale_embeddings": True,
         "use_bias": False, "norm_unit_offset": True, "post_norms": True, "qkv_bias": False, "qk_norm": False,
         "rope_local_theta": None, "tie_output": True}
tokenizer, default_ids = llama.tokenizer, llama.default_ids


def mismatches(m):
  """(field, wanted) pairs beyond WANTS that Gemma 2 cannot express."""
  return llama.mismatches(m)


def tensors(m):
  """Gemma2ForCausalLM's names: its post_attention_layernorm is the norm on attention's output (Llama's
  is the one before the FFN, Gemma's pre_feedforward_layernorm); the output layer is the embedding."""
  t = [same("model.embed_tokens.weight", ("embed", "embedding"))]
  for i in range(m.num_layers):
    h, ours = f"model.layers.{i}", ("decoder", f"layer_{i}")
    t += norm(f"{h}.input_layernorm", ours + ("self_attention_norm",), bias=False)
    t += attention(f"{h}.self_attn", ours + ("self_attention",), ("q_proj", "k_proj", "v_proj", "o_proj"), False)
    if m.qk_norm:  # Gemma 3
      for hf_name, our_name in (("q_norm", "query_norm"), ("k_norm", "key_norm")):
        t += norm(f"{h}.self_attn.{hf_name}", ours + ("self_attention", our_name), bias=False)
    t += norm(f"{h}.post_attention_layernorm", ours + ("self_attention_post_norm",), bias=False)
    t += norm(f"{h}.pre_feedforward_layernorm", ours + ("ffn_norm",), bias=False)
    t += norm(f"{h}.post_feedforward_layernorm", ours + ("ffn_post_norm",), bias=False)
    for hf_name, our_name in (("gate_proj", "wi_gate"), ("up_proj", "wi_up"), ("down_proj", "wo")):
      t.append(linear(f"{h}.mlp.{hf_name}.weight", ours + ("ffn", our_name, "kernel")))
  t += norm("model.norm", ("decoder", "final_norm"), bias=False)
  return t


def layout(hf, types):
  """The fields Gemma 2 and 3 share, from config.json; `types`: layer_types (derived for 4.x configs)."""
  act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
  if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
    unsupported("hidden_activation", act, "GeGLU (gelu_pytorch_tanh)")
  if hf.get("attention_bias"):
    unsupported("attention_bias", True, "Gemma (no biases)")
  if hf.get("use_bidirectional_attention"):
    unsupported("use_bidirectional_attention", True, "decoder (causal attention only)")
  if hf.get("tie_word_embeddings", True) is False:
    unsupported("tie_word_embeddings", False, "Gemma (the output layer is the embedding)")
  heads = hf["num_attention_heads"]
  head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
  eos = first_eos(hf)
  return dict(arch="decoder_only", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_heads=heads,
              num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=head_dim,
              num_layers=hf["num_hidden_layers"], d_ff=hf["intermediate_size"], activation="geglu", norm="rmsnorm",
              norm_position="pre", norm_eps=hf.get("rms_norm_eps", 1e-6), norm_unit_offset=True, post_norms=True,
              use_bias=False, max_len=hf.get("max_position_embeddings", 8192), tie_output=True,
              scale_embeddings=True, kernel_init="normal", init_std=hf.get("initializer_range", 0.02),
              dropout_rate=0.0, attention_dropout_rate=hf.get("attention_dropout", 0.0),
              query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or head_dim),
              attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0),
              final_softcap=float(hf.get("final_logit_softcapping") or 0.0),
              bos_id=hf.get("bos_token_id", 2), eos_id=eos, pad_id=hf.get("pad_token_id", 0), **windows(hf, types))


def config(hf, gen):
  """(model, data, decode) fields from a Gemma 2 config.json (transformers 4.x ones alternate local and global
  layers from layer 0 without layer_types)."""
  n = hf["num_hidden_layers"]
  types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
  model = layout(hf, types)
  model.update(rope(hf))
  return model, {"task": "lm", "add_bos": True}, {}


def hf_fields(m):
  """The config.json fields Gemma 2 and 3 share, from the model config."""
  return dict(vocab_size=m.vocab_size, hidden_size=m.d_model, num_attention_heads=m.num_heads,
              num_key_value_heads=m.kv_heads, head_dim=m.dim_per_head, num_hidden_layers=m.num_layers,
              intermediate_size=m.d_ff, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=m.norm_eps,
              attention_bias=False, max_position_embeddings=m.max_len, tie_word_embeddings=True,
              # an int in config.json (Gemma2Config validates its type); our field is a float
              query_pre_attn_scalar=_number(m.query_pre_attn_scalar if m.query_pre_attn_scalar is not None
                                            else m.dim_per_head),
              attn_logit_softcapping=m.attn_softcap or None, final_logit_softcapping=m.final_softcap or None,
              sliding_window=m.sliding_window or None, layer_types=layer_types(m), bos_token_id=m.bos_id,
              pad_token_id=m.pad_id)


def _number(x):
  return int(x) if float(x).is_integer() else x


def hf_config(cfg, hf):
  """Sets a Gemma 2 config.json's fields from cfg (in place)."""
  m = cfg.model
  for key in ("rope_scaling", "rope_theta", "hidden_act", "sliding_window_size", "cache_implementation"):
    hf.pop(key, None)
  hf.update(architectures=["Gemma2ForCausalLM"], model_type="gemma2", rope_parameters=rope_parameters(m),
            eos_token_id=hf.get("eos_token_id") if first_eos(hf) == m.eos_id else m.eos_id, **hf_fields(m))
