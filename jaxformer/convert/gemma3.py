"""Gemma 3, text (`Gemma3ForCausalLM`, model_type gemma3_text): Gemma 2's layout with (1 + w) RMSNorms over each
head's q and k instead of attention soft-capping, five local layers per global one, and a RoPE base of their
own for the local layers (10,000, unscaled; the global ones 1,000,000, linearly scaled in the 4B and larger)."""

from jaxformer.convert import gemma2
from jaxformer.convert.common import first_eos, rope, rope_parameters, unsupported

MODEL_TYPE, NAMES, ARCH, MOE = "gemma3_text", "Gemma 3 (text)", "decoder_only", False
WANTS = {**gemma2.WANTS, "qk_norm": True, "attn_softcap": 0.0, "final_softcap": 0.0}
del WANTS["rope_local_theta"]
tokenizer, default_ids, tensors, mismatches = gemma2.tokenizer, gemma2.default_ids, gemma2.tensors, gemma2.mismatches


def config(hf, gen):
  """(model, data, decode) fields from a Gemma 3 text config.json: rope_parameters per layer type (transformers 5)
  or rope_theta, rope_scaling and rope_local_base_freq with sliding_window_pattern (4.x)."""
  n = hf["num_hidden_layers"]
  types = hf.get("layer_types")
  if not types:
    every = hf.get("sliding_window_pattern", 6)
    types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
  model = gemma2.layout(hf, types)
  model.update(qk_norm=True)
  params = hf.get("rope_parameters") or {}
  if "full_attention" in params or "sliding_attention" in params:
    local = params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
      unsupported("rope_parameters.sliding_attention.rope_type", local.get("rope_type"),
                  "local layers' RoPE (default, with a base of their own)")
    model.update(rope({**hf, "rope_parameters": params.get("full_attention") or {}}))
    local_theta = local.get("rope_theta", model["rope_theta"])
  else:  # 4.x: the global layers' rope_theta and rope_scaling, the local ones' rope_local_base_freq
    model.update(rope({k: v for k, v in hf.items() if k != "rope_parameters"}))
    local_theta = hf.get("rope_local_base_freq", 10000.0)
  if model["sliding_window"]:
    model["rope_local_theta"] = float(local_theta)
  return model, {"task": "lm", "add_bos": True}, {}


def hf_config(cfg, hf):
  """Sets a Gemma 3 text config.json's fields from cfg (in place)."""
  m = cfg.model
  for key in ("rope_scaling", "rope_theta", "rope_local_base_freq", "sliding_window_pattern", "hidden_act"):
    hf.pop(key, None)
  local = {"rope_type": "default", "rope_theta": m.rope_local_theta if m.rope_local_theta is not None else m.rope_theta}
  hf.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
            rope_parameters={"full_attention": rope_parameters(m), "sliding_attention": local},
            eos_token_id=hf.get("eos_token_id") if first_eos(hf) == m.eos_id else m.eos_id, **gemma2.hf_fields(m))
