"""Phi-3 (`Phi3ForCausalLM`): a Llama with q/k/v fused in one `qkv_proj` and the FFN's gate and up in one
`gate_up_proj`, and a sliding window (Phi-3-mini: 2047)."""

from jaxformer.convert import llama, mistral
from jaxformer.convert.common import derived_head_dim, fused_linear, linear, norm, same, unsupported

MODEL_TYPE, NAMES, ARCH, MOE = "phi3", "Phi-3", "decoder_only", False
WANTS = mistral.WANTS
tokenizer, default_ids = llama.tokenizer, llama.default_ids


def mismatches(m):
  """Mistral's, and head_dim is hidden / heads (Phi-3 has no head_dim field)."""
  return mistral.mismatches(m) + derived_head_dim(m)


def tensors(m):
  """Phi3ForCausalLM's names: qkv_proj rows are q, k, v; gate_up_proj rows are gate, then up."""
  h_dim, kv_dim = m.num_heads * m.dim_per_head, m.kv_heads * m.dim_per_head
  t = [same("model.embed_tokens.weight", ("embed", "embedding"))]
  for i in range(m.num_layers):
    h, ours = f"model.layers.{i}", ("decoder", f"layer_{i}")
    att = ours + ("self_attention",)
    t += norm(f"{h}.input_layernorm", ours + ("self_attention_norm",), bias=False)
    t += [fused_linear(f"{h}.self_attn.qkv_proj.weight", [att + (p, "kernel") for p in ("query", "key", "value")],
                       (h_dim, kv_dim, kv_dim)),
          linear(f"{h}.self_attn.o_proj.weight", att + ("out", "kernel"), n_in=2)]
    t += norm(f"{h}.post_attention_layernorm", ours + ("ffn_norm",), bias=False)
    t += [fused_linear(f"{h}.mlp.gate_up_proj.weight", [ours + ("ffn", p, "kernel") for p in ("wi_gate", "wi_up")],
                       (m.d_ff, m.d_ff)),
          linear(f"{h}.mlp.down_proj.weight", ours + ("ffn", "wo", "kernel"))]
  t += norm("model.norm", ("decoder", "final_norm"), bias=False)
  if not m.tie_output:
    t.append(linear("lm_head.weight", ("logits", "kernel")))
  return t


def config(hf, gen):
  """(model, data, decode) fields from a Phi-3 config.json (rope_scaling longrope, Phi-3's 128k models, is refused
  in one line by the RoPE reader)."""
  model, data, decode = llama.config(hf, gen)
  model.update(sliding_window=int(hf.get("sliding_window") or 0),
               dropout_rate=float(hf.get("resid_pdrop", 0.0)))
  if hf.get("embd_pdrop", 0.0) != hf.get("resid_pdrop", 0.0):
    unsupported("embd_pdrop / resid_pdrop", (hf.get("embd_pdrop"), hf.get("resid_pdrop")),
                "model.dropout_rate (one rate for embeddings and residuals)")
  return model, data, decode


def hf_config(cfg, hf):
  """Sets a Phi-3 config.json's fields from cfg (in place)."""
  m = cfg.model
  llama.hf_config(cfg, hf)
  for key in ("attention_bias", "mlp_bias", "head_dim"):
    hf.pop(key, None)
  hf["rope_parameters"]["partial_rotary_factor"] = 1.0  # (what Phi3Config writes; other factors are refused on import)
  hf.update(architectures=["Phi3ForCausalLM"], model_type="phi3", sliding_window=m.sliding_window or None,
            resid_pdrop=m.dropout_rate, embd_pdrop=m.dropout_rate, original_max_position_embeddings=m.max_len)
