"""Marian / OPUS-MT (`MarianMTModel`): a post-LN encoder-decoder with Marian's sinusoid layout and a logits bias."""

from jaxformer.convert.common import (PLAIN, Tensor, activation, attention, first_eos, linear, norm, same, unsupported,
                                      vector)
from jaxformer.errors import UserError

MODEL_TYPE, NAMES, ARCH, MOE = "marian", "Marian / OPUS-MT", "encoder_decoder", False
BOS_KEY = "decoder_start_token_id"  # Marian has no BOS: decoding starts from this id
WANTS = dict(arch="encoder_decoder", norm="layernorm", norm_position="post", position="sinusoidal",
             sinusoidal_layout="marian", use_bias=True, norm_eps=1e-5, logits_bias=True, moe_experts=0, **PLAIN)


def mismatches(m):
  """(field, wanted) pairs beyond WANTS that Marian cannot express."""
  return [("activation", "silu")] if m.activation == "swiglu" else []


def tensors(m):
  """MarianMTModel's names (shared or separate embeddings, the final logits bias)."""
  if m.share_embeddings:
    t = [same("model.shared.weight", ("embed", "embedding"),
               ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"))]
  else:
    t = [same("model.encoder.embed_tokens.weight", ("embed", "embedding")),
         same("model.decoder.embed_tokens.weight", ("decoder_embed", "embedding"),
               ("lm_head.weight",) if m.tie_output else ())]
  names = ("q_proj", "k_proj", "v_proj", "out_proj")
  for side, n in (("encoder", m.encoder_layers), ("decoder", m.num_layers)):
    for i in range(n):
      h, ours = f"model.{side}.layers.{i}", (side, f"layer_{i}")
      t += attention(f"{h}.self_attn", ours + ("self_attention",), names, True)
      t += norm(f"{h}.self_attn_layer_norm", ours + ("self_attention_norm",))
      if side == "decoder":
        t += attention(f"{h}.encoder_attn", ours + ("cross_attention",), names, True)
        t += norm(f"{h}.encoder_attn_layer_norm", ours + ("cross_attention_norm",))
      for hf_name, our_name in (("fc1", "wi"), ("fc2", "wo")):
        t += [linear(f"{h}.{hf_name}.weight", ours + ("ffn", our_name, "kernel")),
              vector(f"{h}.{hf_name}.bias", ours + ("ffn", our_name, "bias"))]
      t += norm(f"{h}.final_layer_norm", ours + ("ffn_norm",))
  if not m.tie_output:
    t.append(linear("lm_head.weight", ("logits", "kernel")))
  t.append(Tensor("final_logits_bias", (("logits_bias",),), lambda a, shapes: (a.reshape(shapes[0]),),
                  lambda xs: xs[0].reshape(1, -1)))
  return t


def config(hf, gen):
  """(model, data, decode) config fields from a Marian config.json and its generation config."""
  for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
    if hf.get(enc) != hf.get(dec):
      unsupported(f"{enc} != {dec}", (hf.get(enc), hf.get(dec)), "encoder-decoder (one value for both sides)")
  if hf.get("decoder_vocab_size") not in (None, hf["vocab_size"]):
    unsupported("decoder_vocab_size", hf["decoder_vocab_size"], "Marian (one vocabulary)")
  share = hf.get("share_encoder_decoder_embeddings", True)
  model = dict(arch="encoder_decoder", vocab_size=hf["vocab_size"], d_model=hf["d_model"],
               num_heads=hf["decoder_attention_heads"], num_layers=hf["decoder_layers"],
               num_encoder_layers=hf["encoder_layers"], d_ff=hf["decoder_ffn_dim"],
               activation=activation(hf, "activation_function"), norm="layernorm", norm_position="post",
               norm_eps=1e-5, use_bias=True, position="sinusoidal", sinusoidal_layout="marian",
               max_len=hf.get("max_position_embeddings", 512), share_embeddings=share,
               tie_output=hf.get("tie_word_embeddings", True), logits_bias=True,
               scale_embeddings=hf.get("scale_embedding", False), kernel_init="normal",
               init_std=hf.get("init_std", 0.02), dropout_rate=hf.get("dropout", 0.1),
               attention_dropout_rate=hf.get("attention_dropout", 0.0), pad_id=hf["pad_token_id"],
               bos_id=hf.get("decoder_start_token_id", hf["pad_token_id"]), eos_id=first_eos(hf))
  early = gen.get("early_stopping", False)
  bad = gen.get("bad_words_ids") or []
  decode = dict(length_penalty="hf", alpha=float(gen.get("length_penalty", 1.0)),
                beam_size=int(gen.get("num_beams", 1)), hf_early_stopping=str(early).lower(),
                suppress_pad=[hf["pad_token_id"]] in bad)
  return model, {"task": "translation"}, decode


def tokenizer(source):
  return "marian"


def hf_config(cfg, hf):
  """Sets a Marian config.json's fields from cfg (in place)."""
  m = cfg.model
  act = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu", "silu": "swish"}[m.activation]
  hf.update(architectures=["MarianMTModel"], model_type="marian", vocab_size=m.vocab_size,
            decoder_vocab_size=m.vocab_size, d_model=m.d_model, encoder_layers=m.encoder_layers,
            decoder_layers=m.num_layers, encoder_attention_heads=m.num_heads, decoder_attention_heads=m.num_heads,
            encoder_ffn_dim=m.d_ff, decoder_ffn_dim=m.d_ff, activation_function=act,
            max_position_embeddings=m.max_len, scale_embedding=m.scale_embeddings,
            share_encoder_decoder_embeddings=m.share_embeddings, tie_word_embeddings=m.tie_output,
            pad_token_id=m.pad_id, decoder_start_token_id=m.bos_id, eos_token_id=m.eos_id, is_encoder_decoder=True)
  if m.num_kv_heads not in (None, m.num_heads) or m.head_dim not in (None, m.d_model // m.num_heads):
    raise UserError("Marian has plain multi-head attention: model.num_kv_heads and model.head_dim must be unset")


def generation(cfg, gen):
  """Marian's generation_config.json fields: the beam, its length penalty, the banned pad (in place)."""
  m, d = cfg.model, cfg.decode
  gen.update(decoder_start_token_id=m.bos_id, pad_token_id=m.pad_id, num_beams=d.beam_size)
  if d.length_penalty == "hf":
    early = {"false": False, "true": True}.get(d.hf_early_stopping, "never")
    gen.update(length_penalty=d.alpha, early_stopping=early)
  if d.suppress_pad:
    gen["bad_words_ids"] = [[m.pad_id]]
