"""Mixtral (`MixtralForCausalLM`): a Llama whose every FFN is a sparse MoE block of SwiGLU experts (top-k routing)."""

from jaxformer.convert import llama
from jaxformer.convert.common import expert, linear, unsupported

MODEL_TYPE, NAMES, ARCH, MOE = "mixtral", "Mixtral", "decoder_only", True
OTHER_FFN = "llama"  # a Mixtral's layers made dense export as Llama
SPM_EXPORT = True
WANTS = {**{k: v for k, v in llama.WANTS.items() if k != "moe_experts"}, "use_bias": False, "moe_every": 1,
         "moe_shared_experts": 0}
mismatches, default_ids, tokenizer = llama.mismatches, llama.default_ids, llama.tokenizer


def moe_ffn(m, h, ours):
  """One Mixtral layer's sparse MoE block as the hub's checkpoints (and transformers' save_pretrained)
  store it: `block_sparse_moe.gate.weight` [experts, d_model] (the router) and per expert
  `experts.E.w1` / `w3` [d_ff, d_model] (gate / up) and `w2` [d_model, d_ff] (down). transformers
  >= 5 fuses them in memory (`mlp.experts.gate_up_proj`) but converts to and from this layout."""
  t = [linear(f"{h}.block_sparse_moe.gate.weight", ours + ("router", "kernel"))]
  for e in range(m.moe_experts):
    for hf_name, our_name in (("w1", "wi_gate"), ("w2", "wo"), ("w3", "wi_up")):
      t.append(expert(f"{h}.block_sparse_moe.experts.{e}.{hf_name}.weight", ours + (our_name,), e))
  return t


def tensors(m):
  """MixtralForCausalLM's names: Llama's, with `moe_ffn` for every FFN."""
  return llama.tensors(m, moe_ffn)


def config(hf, gen):
  """Llama's fields plus the sparse MoE FFN: num_local_experts, num_experts_per_tok, router_aux_loss_coef."""
  for key, ok, fix in (("sliding_window", None, "attention (full causal attention only: sliding_window null)"),
                       ("router_jitter_noise", 0.0, "MoE router (no jitter noise: set it to 0, which only HF's "
                                                    "training uses)")):
    if (hf.get(key) or ok) != ok:
      unsupported(key, hf.get(key), fix)
  for key in ("attention_bias", "mlp_bias"):  # Mixtral has neither; refuse a variant that sets them
    if hf.get(key):
      unsupported(key, hf[key], "Mixtral (no biases)")
  model, data, decode = llama.config(hf, gen)
  experts, top_k = hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2)
  if not 1 <= top_k <= experts:
    unsupported("num_experts_per_tok", top_k, f"MoE router (1 to num_local_experts={experts})")
  model.update(moe_experts=experts, moe_top_k=top_k, moe_every=1, moe_shared_experts=0, moe_capacity_factor=0.0)
  # HF adds coef x its load-balancing loss only with output_router_logits; jaxformer always adds
  # optim.moe_aux_loss x its own (per layer, then averaged): set it to 0 for none.
  optim = dict(moe_aux_loss=float(hf.get("router_aux_loss_coef", 0.001)), moe_z_loss=0.0)
  return model, data, decode, optim


def hf_config(cfg, hf):
  """Sets a Mixtral config.json's fields from cfg (in place): Llama's, less the biases MixtralConfig has not."""
  m = cfg.model
  llama.hf_config(cfg, hf)
  for key in ("attention_bias", "mlp_bias"):
    hf.pop(key, None)
  hf.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=m.moe_experts,
            num_experts_per_tok=m.moe_top_k, router_aux_loss_coef=cfg.optim.moe_aux_loss, sliding_window=None,
            router_jitter_noise=0.0, head_dim=m.head_dim)  # null (d_model / heads) as the hub's configs have it
