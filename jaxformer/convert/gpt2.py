"""GPT-2 (`GPT2LMHeadModel`): learned positions, pre-LN, fused qkv in Conv1D [in, out] layers, tied embeddings."""

from jaxformer.convert.common import (PLAIN, activation, conv1d, first_eos, fused_qkv, linear, norm, same, unsupported,
                                      vector)
from jaxformer.errors import UserError

MODEL_TYPE, NAMES, ARCH, MOE = "gpt2", "GPT-2", "decoder_only", False
PEFT_FAN_IN_FAN_OUT = True  # Conv1D holds [in, out]: PEFT's fan_in_fan_out
# The model fields an exact GPT-2 needs (export).
WANTS = dict(arch="decoder_only", norm="layernorm", norm_position="pre", position="learned", use_bias=True,
             logits_bias=False, scale_embeddings=False, moe_experts=0, **PLAIN)


def mismatches(m):
  """(field, wanted) pairs beyond WANTS that GPT-2 cannot express."""
  return [] if m.activation in ("gelu", "gelu_exact", "relu", "silu") else [("activation", "gelu")]


def tensors(m):
  """GPT2LMHeadModel's names (`transformer.` prefix, as save_pretrained writes it)."""
  t = [same("transformer.wte.weight", ("embed", "embedding"), ("wte.weight",)),
       same("transformer.wpe.weight", ("decoder", "position_embedding"), ("wpe.weight",))]
  for i in range(m.num_layers):
    h, ours = f"transformer.h.{i}", ("decoder", f"layer_{i}")
    t += norm(f"{h}.ln_1", ours + ("self_attention_norm",))
    t += [fused_qkv(f"{h}.attn.c_attn.weight", ours + ("self_attention",), True),
          fused_qkv(f"{h}.attn.c_attn.bias", ours + ("self_attention",), False),
          conv1d(f"{h}.attn.c_proj.weight", ours + ("self_attention", "out", "kernel"), n_in=2),
          vector(f"{h}.attn.c_proj.bias", ours + ("self_attention", "out", "bias"))]
    t += norm(f"{h}.ln_2", ours + ("ffn_norm",))
    t += [conv1d(f"{h}.mlp.c_fc.weight", ours + ("ffn", "wi", "kernel")),
          vector(f"{h}.mlp.c_fc.bias", ours + ("ffn", "wi", "bias")),
          conv1d(f"{h}.mlp.c_proj.weight", ours + ("ffn", "wo", "kernel")),
          vector(f"{h}.mlp.c_proj.bias", ours + ("ffn", "wo", "bias"))]
  t += norm("transformer.ln_f", ("decoder", "final_norm"))
  if not m.tie_output:
    t.append(linear("lm_head.weight", ("logits", "kernel")))
  for x in t:  # the original OpenAI checkpoints have no `transformer.` prefix
    if x.hf.startswith("transformer."):
      x.aliases = x.aliases + (x.hf[len("transformer."):],)
  return t


def config(hf, gen):
  """(model, data, decode) config fields from GPT-2's config.json."""
  if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
    unsupported("attention scaling", {k: hf.get(k) for k in ("scale_attn_weights", "scale_attn_by_inverse_layer_idx")},
                 "attention (1/sqrt(head_dim) only)")
  d, eos = hf["n_embd"], first_eos(hf)
  model = dict(arch="decoder_only", vocab_size=hf["vocab_size"], d_model=d, num_heads=hf["n_head"],
               num_layers=hf["n_layer"], d_ff=hf.get("n_inner") or 4 * d,
               activation=activation(hf, "activation_function"),
               norm="layernorm", norm_position="pre", norm_eps=hf.get("layer_norm_epsilon", 1e-5), use_bias=True,
               position="learned", max_len=hf["n_positions"], tie_output=hf.get("tie_word_embeddings", True),
               scale_embeddings=False, kernel_init="normal", init_std=hf.get("initializer_range", 0.02),
               dropout_rate=hf.get("resid_pdrop", 0.1), attention_dropout_rate=hf.get("attn_pdrop", 0.1),
               bos_id=hf.get("bos_token_id", eos), eos_id=eos, pad_id=hf.get("pad_token_id") or eos)
  return model, {"task": "lm", "add_bos": False}, {}


def default_ids(model):
  """GPT-2 pads with EOS, and its BOS is its EOS (<|endoftext|>)."""
  if model.get("pad_id") is None:
    model["pad_id"] = model["eos_id"]
  if model.get("bos_id") is None:
    model["bos_id"] = model["eos_id"]


def tokenizer(source):
  return "hf"


def hf_config(cfg, hf):
  """Sets GPT-2's config.json fields from cfg (in place)."""
  m = cfg.model
  act = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu", "silu": "silu"}[m.activation]
  hf.update(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=m.vocab_size, n_positions=m.max_len,
            n_embd=m.d_model, n_layer=m.num_layers, n_head=m.num_heads, n_inner=m.d_ff, activation_function=act,
            layer_norm_epsilon=m.norm_eps, tie_word_embeddings=m.tie_output, bos_token_id=m.bos_id,
            eos_token_id=m.eos_id)
  if m.num_kv_heads not in (None, m.num_heads) or m.head_dim not in (None, m.d_model // m.num_heads):
    raise UserError("GPT-2 has plain multi-head attention: model.num_kv_heads and model.head_dim must be unset")
