"""Hugging Face checkpoints in and out: GPT-2, Llama (1, 2, 3, 3.1), Mixtral and Marian (OPUS-MT) <-> jaxformer workdirs.

    python -m jaxformer.convert --from-hf HF_DIR --workdir W        # config.json + Orbax checkpoint + tokenizer
    python -m jaxformer.convert --to-hf W --out HF_DIR [--step N] [--dtype bfloat16]
    python -m jaxformer.convert --to-hf LORA_W --out DIR --peft    # a LoRA run's adapters, as PEFT writes them

Import reads `config.json` (and `generation_config.json`), the `*.safetensors` weights (one
file or a sharded index) one tensor at a time, maps each onto jaxformer's parameter tree
(transposing torch's [out, in] Linear weights, splitting GPT-2's fused qkv, stacking Mixtral's
per-expert weights into our [experts, in, out] ones), checks every
shape against the model the config builds, and writes a params-only checkpoint at step 0
(`checkpoint.save_params`) with the tokenizer: W then works with eval.py,
`python -m jaxformer.generate` and `train.py --config W/config.json train.init_from=W`.
Export writes `config.json`, `model.safetensors` (the same tensor names HF saves) and the
tokenizer files, which transformers' `from_pretrained` loads. A LoRA run (train.lora_rank) exports
as the merged model W + (alpha / r) A B, or with `--peft` as its adapters alone:
`adapter_config.json` + `adapter_model.safetensors` with PEFT's names, for `PeftModel.from_pretrained`
on the base exported from train.init_from (GPT-2's fused c_attn gets one adapter of rank 3r whose B is
block-diagonal, with `rank_pattern`/`alpha_pattern` keeping the scale alpha / r: the same function).

Memory: tensors are read one at a time (safetensors maps the files; only the tensor being
converted is copied) and keep their dtype (bf16 for Llama: restoring widens them to float32
exactly), so the peak is the tree being written (the source's size) plus one tensor and Orbax's
write buffers, not the checkpoint plus a float32 copy (BENCHMARKS.md measures it). Export frees
each parameter as its HF tensor is made and writes one shard at a time.
"""

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shutil

import jax
import numpy as np

from jaxformer import checkpoint as checkpoint_lib
from jaxformer import config as config_lib
from jaxformer import evaluate
from jaxformer import lora
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.errors import UserError, cli

SUPPORTED = ("gpt2", "llama", "mixtral", "marian")
# HF buffers that are no weights: GPT-2's causal-mask buffers, rotary caches, Marian's fixed sinusoid.
_IGNORED = re.compile(r"(\.attn\.(masked_)?bias$|rotary_emb\.inv_freq$|embed_positions\.weight$)")


# ----------------------------------------------------------------------------- reading HF folders


def _read_json(path, what):
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    raise UserError(f"{path} not found: {what}") from None
  except json.JSONDecodeError as e:
    raise UserError(f"{path} is not valid JSON: {e}") from e


class SafetensorsReader:
  """The tensors of an HF folder: `model.safetensors`, or shards listed in `model.safetensors.index.json`."""

  def __init__(self, directory):
    from safetensors import safe_open  # Lazy: only conversion needs it.
    self._open = safe_open
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
      weight_map = _read_json(index, "the shard index")["weight_map"]
      files = sorted(set(weight_map.values()))
    else:
      files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
      if not files:
        hint = (" (only pytorch_model.bin: save it as safetensors first, e.g. transformers'"
                " model.save_pretrained(dir, safe_serialization=True))"
                if os.path.isfile(os.path.join(directory, "pytorch_model.bin")) else "")
        raise UserError(f"{directory} has no *.safetensors weights{hint}")
      weight_map = {}
    self.directory = directory
    self.location = {}
    for name in files:
      path = os.path.join(directory, name)
      if not os.path.isfile(path):
        raise UserError(f"{path} is listed in the shard index but missing")
      with safe_open(path, framework="np") as f:
        for key in f.keys():
          self.location[key] = path
    for key, name in weight_map.items():
      if key not in self.location:
        raise UserError(f"{os.path.join(directory, name)} lacks {key}, which the shard index lists there")

  def shape(self, name):
    with self._open(self.location[name], framework="np") as f:
      return tuple(f.get_slice(name).get_shape())

  def get(self, name):
    """One tensor as numpy, in its stored dtype (bf16 through ml_dtypes)."""
    with self._open(self.location[name], framework="np") as f:
      return f.get_tensor(name)


# ----------------------------------------------------------------------------- tensor mapping


@dataclasses.dataclass
class Tensor:
  """One HF tensor <-> one or more jaxformer parameters (paths in the params tree)."""
  hf: str                                   # the name HF writes
  ours: tuple                               # parameter paths, e.g. (("embed", "embedding"),)
  to_ours: object                           # (hf array, our shapes) -> tuple of our arrays
  to_hf: object                             # tuple of our arrays -> hf array
  aliases: tuple = ()                       # other names checkpoints use for it


def _same(hf, ours, aliases=()):
  return Tensor(hf, (ours,), lambda a, shapes: (a.reshape(shapes[0]),), lambda xs: xs[0], aliases)


def _linear(hf, ours, n_in=1):
  """torch.nn.Linear weight [out, in] <-> kernel [*in_axes, *out_axes] (n_in leading input axes)."""
  def to_hf(xs):
    x = xs[0]
    return x.reshape(math.prod(x.shape[:n_in]), -1).T
  return Tensor(hf, (ours,), lambda a, shapes: (a.T.reshape(shapes[0]),), to_hf)


def _expert(hf, ours, e):
  """One expert's torch.nn.Linear weight [out, in] <-> row e of our stacked [experts, in, out]
  parameter: `ours + (e,)` names the row (see `_get` / `read_params`)."""
  return Tensor(hf, (ours + (e,),), lambda a, shapes: (a.T.reshape(shapes[0]),), lambda xs: xs[0].T)


def _vector(hf, ours):
  """A bias or norm vector (our bias may be [heads, head_dim])."""
  return Tensor(hf, (ours,), lambda a, shapes: (a.reshape(shapes[0]),), lambda xs: xs[0].reshape(-1))


def _conv1d(hf, ours, n_in=1):
  """GPT-2's Conv1D weight [in, out] <-> kernel [*in_axes, *out_axes]: no transpose."""
  def to_hf(xs):
    x = xs[0]
    return x.reshape(math.prod(x.shape[:n_in]), -1)
  return Tensor(hf, (ours,), lambda a, shapes: (a.reshape(shapes[0]),), to_hf)


def _fused_qkv(hf, attention, weight):
  """GPT-2's c_attn [d, 3d] (weight) or [3d] (bias) <-> query / key / value kernels or biases."""
  leaf = "kernel" if weight else "bias"
  ours = tuple(attention + (p, leaf) for p in ("query", "key", "value"))

  def to_ours(a, shapes):
    parts = np.split(a, 3, axis=-1)
    return tuple(p.reshape(s) for p, s in zip(parts, shapes))

  def to_hf(xs):
    return np.concatenate([x.reshape(x.shape[0], -1) if weight else x.reshape(-1) for x in xs], axis=-1)
  return Tensor(hf, ours, to_ours, to_hf)


def _attention(prefix, ours, names, bias):
  """q/k/v/o Linear layers (Llama, Marian) <-> our query/key/value/out."""
  out = []
  for hf_name, our_name in zip(names, ("query", "key", "value", "out")):
    out.append(_linear(f"{prefix}.{hf_name}.weight", ours + (our_name, "kernel"), n_in=2 if our_name == "out" else 1))
    if bias:
      out.append(_vector(f"{prefix}.{hf_name}.bias", ours + (our_name, "bias")))
  return out


def _norm(prefix, ours, bias=True):
  out = [_vector(f"{prefix}.weight", ours + ("scale",))]
  if bias:
    out.append(_vector(f"{prefix}.bias", ours + ("bias",)))
  return out


def gpt2_tensors(m):
  """GPT2LMHeadModel's names (`transformer.` prefix, as save_pretrained writes it)."""
  t = [_same("transformer.wte.weight", ("embed", "embedding"), ("wte.weight",)),
       _same("transformer.wpe.weight", ("decoder", "position_embedding"), ("wpe.weight",))]
  for i in range(m.num_layers):
    h, ours = f"transformer.h.{i}", ("decoder", f"layer_{i}")
    t += _norm(f"{h}.ln_1", ours + ("self_attention_norm",))
    t += [_fused_qkv(f"{h}.attn.c_attn.weight", ours + ("self_attention",), True),
          _fused_qkv(f"{h}.attn.c_attn.bias", ours + ("self_attention",), False),
          _conv1d(f"{h}.attn.c_proj.weight", ours + ("self_attention", "out", "kernel"), n_in=2),
          _vector(f"{h}.attn.c_proj.bias", ours + ("self_attention", "out", "bias"))]
    t += _norm(f"{h}.ln_2", ours + ("ffn_norm",))
    t += [_conv1d(f"{h}.mlp.c_fc.weight", ours + ("ffn", "wi", "kernel")),
          _vector(f"{h}.mlp.c_fc.bias", ours + ("ffn", "wi", "bias")),
          _conv1d(f"{h}.mlp.c_proj.weight", ours + ("ffn", "wo", "kernel")),
          _vector(f"{h}.mlp.c_proj.bias", ours + ("ffn", "wo", "bias"))]
  t += _norm("transformer.ln_f", ("decoder", "final_norm"))
  if not m.tie_output:
    t.append(_linear("lm_head.weight", ("logits", "kernel")))
  for x in t:  # the original OpenAI checkpoints have no `transformer.` prefix
    if x.hf.startswith("transformer."):
      x.aliases = x.aliases + (x.hf[len("transformer."):],)
  return t


def llama_tensors(m):
  """LlamaForCausalLM's names; with model.moe_experts, MixtralForCausalLM's (`mixtral_ffn`)."""
  t = [_same("model.embed_tokens.weight", ("embed", "embedding"))]
  for i in range(m.num_layers):
    h, ours = f"model.layers.{i}", ("decoder", f"layer_{i}")
    t += _norm(f"{h}.input_layernorm", ours + ("self_attention_norm",), bias=False)
    t += _attention(f"{h}.self_attn", ours + ("self_attention",), ("q_proj", "k_proj", "v_proj", "o_proj"),
                    m.use_bias)
    t += _norm(f"{h}.post_attention_layernorm", ours + ("ffn_norm",), bias=False)
    if m.moe_experts:
      t += mixtral_ffn(m, h, ours + ("moe",))
      continue
    for hf_name, our_name in (("gate_proj", "wi_gate"), ("up_proj", "wi_up"), ("down_proj", "wo")):
      t.append(_linear(f"{h}.mlp.{hf_name}.weight", ours + ("ffn", our_name, "kernel")))
      if m.use_bias:
        t.append(_vector(f"{h}.mlp.{hf_name}.bias", ours + ("ffn", our_name, "bias")))
  t += _norm("model.norm", ("decoder", "final_norm"), bias=False)
  if not m.tie_output:
    t.append(_linear("lm_head.weight", ("logits", "kernel")))
  return t


def mixtral_ffn(m, h, ours):
  """One Mixtral layer's sparse MoE block as the hub's checkpoints (and transformers' save_pretrained)
  store it: `block_sparse_moe.gate.weight` [experts, d_model] (the router) and per expert
  `experts.E.w1` / `w3` [d_ff, d_model] (gate / up) and `w2` [d_model, d_ff] (down). transformers
  >= 5 fuses them in memory (`mlp.experts.gate_up_proj`) but converts to and from this layout."""
  t = [_linear(f"{h}.block_sparse_moe.gate.weight", ours + ("router", "kernel"))]
  for e in range(m.moe_experts):
    for hf_name, our_name in (("w1", "wi_gate"), ("w2", "wo"), ("w3", "wi_up")):
      t.append(_expert(f"{h}.block_sparse_moe.experts.{e}.{hf_name}.weight", ours + (our_name,), e))
  return t


def marian_tensors(m):
  if m.share_embeddings:
    t = [_same("model.shared.weight", ("embed", "embedding"),
               ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight", "lm_head.weight"))]
  else:
    t = [_same("model.encoder.embed_tokens.weight", ("embed", "embedding")),
         _same("model.decoder.embed_tokens.weight", ("decoder_embed", "embedding"),
               ("lm_head.weight",) if m.tie_output else ())]
  names = ("q_proj", "k_proj", "v_proj", "out_proj")
  for side, n in (("encoder", m.encoder_layers), ("decoder", m.num_layers)):
    for i in range(n):
      h, ours = f"model.{side}.layers.{i}", (side, f"layer_{i}")
      t += _attention(f"{h}.self_attn", ours + ("self_attention",), names, True)
      t += _norm(f"{h}.self_attn_layer_norm", ours + ("self_attention_norm",))
      if side == "decoder":
        t += _attention(f"{h}.encoder_attn", ours + ("cross_attention",), names, True)
        t += _norm(f"{h}.encoder_attn_layer_norm", ours + ("cross_attention_norm",))
      for hf_name, our_name in (("fc1", "wi"), ("fc2", "wo")):
        t += [_linear(f"{h}.{hf_name}.weight", ours + ("ffn", our_name, "kernel")),
              _vector(f"{h}.{hf_name}.bias", ours + ("ffn", our_name, "bias"))]
      t += _norm(f"{h}.final_layer_norm", ours + ("ffn_norm",))
  if not m.tie_output:
    t.append(_linear("lm_head.weight", ("logits", "kernel")))
  t.append(Tensor("final_logits_bias", (("logits_bias",),), lambda a, shapes: (a.reshape(shapes[0]),),
                  lambda xs: xs[0].reshape(1, -1)))
  return t


TENSORS = {"gpt2": gpt2_tensors, "llama": llama_tensors, "mixtral": llama_tensors, "marian": marian_tensors}


# ----------------------------------------------------------------------------- configs


def _unsupported(what, value, fix):
  raise UserError(f"{what}={value!r} is not supported by jaxformer's {fix}")


def _eos(hf):
  eos = hf.get("eos_token_id")
  return eos[0] if isinstance(eos, list) else eos  # Llama 3 instruct lists several; the first ends decoding


def _rope(hf):
  """RoPE fields from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (config.json of 4.x)."""
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  if any(isinstance(v, dict) for v in params.values()):
    _unsupported("rope_parameters per layer type", list(params), "single RoPE")
  kind = params.get("rope_type", params.get("type", "default"))
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
    _unsupported("partial_rotary_factor", params.get("partial_rotary_factor", hf.get("partial_rotary_factor")),
                 "RoPE (whole head_dim only)")
  fields = {"position": "rope", "rope_theta": float(theta)}
  if kind == "default":
    return fields
  if kind not in ("llama3", "yarn"):
    _unsupported("rope type", kind, "RoPE scalings (default, llama3, yarn)")
  original = params.get("original_max_position_embeddings") or hf.get("max_position_embeddings")
  factor = params.get("factor")
  if factor is None:  # transformers' rule (DeepSeek-V3)
    factor = hf["max_position_embeddings"] / original
  fields.update(rope_scaling=kind, rope_scaling_factor=float(factor), rope_original_max_len=int(original))
  if kind == "llama3":
    fields.update(rope_low_freq_factor=float(params["low_freq_factor"]),
                  rope_high_freq_factor=float(params["high_freq_factor"]))
  else:
    fields.update(rope_beta_fast=float(params.get("beta_fast") or 32),
                  rope_beta_slow=float(params.get("beta_slow") or 1),
                  rope_truncate=bool(params.get("truncate", True)),
                  rope_attention_factor=params.get("attention_factor"),
                  rope_mscale=float(params.get("mscale") or 0.0),
                  rope_mscale_all_dim=float(params.get("mscale_all_dim") or 0.0))
  return fields


_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu", "gelu": "gelu_exact",
                "relu": "relu", "silu": "silu", "swish": "silu"}


def _activation(hf, key):
  act = hf.get(key, "gelu_new")
  if act not in _ACTIVATIONS:
    _unsupported(key, act, f"FFN activations ({', '.join(_ACTIVATIONS)})")
  return _ACTIVATIONS[act]


def gpt2_config(hf, gen):
  if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx", False):
    _unsupported("attention scaling", {k: hf.get(k) for k in ("scale_attn_weights", "scale_attn_by_inverse_layer_idx")},
                 "attention (1/sqrt(head_dim) only)")
  d, eos = hf["n_embd"], _eos(hf)
  model = dict(arch="decoder_only", vocab_size=hf["vocab_size"], d_model=d, num_heads=hf["n_head"],
               num_layers=hf["n_layer"], d_ff=hf.get("n_inner") or 4 * d,
               activation=_activation(hf, "activation_function"),
               norm="layernorm", norm_position="pre", norm_eps=hf.get("layer_norm_epsilon", 1e-5), use_bias=True,
               position="learned", max_len=hf["n_positions"], tie_output=hf.get("tie_word_embeddings", True),
               scale_embeddings=False, kernel_init="normal", init_std=hf.get("initializer_range", 0.02),
               dropout_rate=hf.get("resid_pdrop", 0.1), attention_dropout_rate=hf.get("attn_pdrop", 0.1),
               bos_id=hf.get("bos_token_id", eos), eos_id=eos, pad_id=hf.get("pad_token_id") or eos)
  return model, {"task": "lm", "add_bos": False}, {}


def llama_config(hf, gen):
  if hf.get("hidden_act", "silu") != "silu":
    _unsupported("hidden_act", hf.get("hidden_act"), "Llama FFN (SwiGLU: silu)")
  if bool(hf.get("attention_bias", False)) != bool(hf.get("mlp_bias", False)):
    _unsupported("attention_bias / mlp_bias", (hf.get("attention_bias"), hf.get("mlp_bias")),
                 "model.use_bias (one switch for attention and FFN)")
  heads = hf["num_attention_heads"]
  eos = _eos(hf)
  model = dict(arch="decoder_only", vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_heads=heads,
               num_kv_heads=hf.get("num_key_value_heads") or heads, head_dim=hf.get("head_dim"),
               num_layers=hf["num_hidden_layers"], d_ff=hf["intermediate_size"], activation="swiglu", norm="rmsnorm",
               norm_position="pre", norm_eps=hf.get("rms_norm_eps", 1e-6),
               use_bias=bool(hf.get("attention_bias", False)),
               max_len=hf.get("max_position_embeddings", 2048), tie_output=hf.get("tie_word_embeddings", False),
               scale_embeddings=False, kernel_init="normal", init_std=hf.get("initializer_range", 0.02),
               dropout_rate=0.0, attention_dropout_rate=hf.get("attention_dropout", 0.0),
               bos_id=hf.get("bos_token_id", 1), eos_id=eos, pad_id=hf.get("pad_token_id") or eos, **_rope(hf))
  return model, {"task": "lm", "add_bos": True}, {}


def mixtral_config(hf, gen):
  """Llama's fields plus the sparse MoE FFN: num_local_experts, num_experts_per_tok, router_aux_loss_coef."""
  for key, ok, fix in (("sliding_window", None, "attention (full causal attention only: sliding_window null)"),
                       ("router_jitter_noise", 0.0, "MoE router (no jitter noise: set it to 0, which only HF's "
                                                    "training uses)")):
    if (hf.get(key) or ok) != ok:
      _unsupported(key, hf.get(key), fix)
  for key in ("attention_bias", "mlp_bias"):  # Mixtral has neither; refuse a variant that sets them
    if hf.get(key):
      _unsupported(key, hf[key], "Mixtral (no biases)")
  model, data, decode = llama_config(hf, gen)
  experts, top_k = hf.get("num_local_experts", 8), hf.get("num_experts_per_tok", 2)
  if not 1 <= top_k <= experts:
    _unsupported("num_experts_per_tok", top_k, f"MoE router (1 to num_local_experts={experts})")
  model.update(moe_experts=experts, moe_top_k=top_k, moe_every=1, moe_shared_experts=0, moe_capacity_factor=0.0)
  # HF adds coef x its load-balancing loss only with output_router_logits; jaxformer always adds
  # optim.moe_aux_loss x its own (per layer, then averaged): set it to 0 for none.
  optim = dict(moe_aux_loss=float(hf.get("router_aux_loss_coef", 0.001)), moe_z_loss=0.0)
  return model, data, decode, optim


def marian_config(hf, gen):
  for enc, dec in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
    if hf.get(enc) != hf.get(dec):
      _unsupported(f"{enc} != {dec}", (hf.get(enc), hf.get(dec)), "encoder-decoder (one value for both sides)")
  if hf.get("decoder_vocab_size") not in (None, hf["vocab_size"]):
    _unsupported("decoder_vocab_size", hf["decoder_vocab_size"], "Marian (one vocabulary)")
  share = hf.get("share_encoder_decoder_embeddings", True)
  model = dict(arch="encoder_decoder", vocab_size=hf["vocab_size"], d_model=hf["d_model"],
               num_heads=hf["decoder_attention_heads"], num_layers=hf["decoder_layers"],
               num_encoder_layers=hf["encoder_layers"], d_ff=hf["decoder_ffn_dim"],
               activation=_activation(hf, "activation_function"), norm="layernorm", norm_position="post",
               norm_eps=1e-5, use_bias=True, position="sinusoidal", sinusoidal_layout="marian",
               max_len=hf.get("max_position_embeddings", 512), share_embeddings=share,
               tie_output=hf.get("tie_word_embeddings", True), logits_bias=True,
               scale_embeddings=hf.get("scale_embedding", False), kernel_init="normal",
               init_std=hf.get("init_std", 0.02), dropout_rate=hf.get("dropout", 0.1),
               attention_dropout_rate=hf.get("attention_dropout", 0.0), pad_id=hf["pad_token_id"],
               bos_id=hf.get("decoder_start_token_id", hf["pad_token_id"]), eos_id=_eos(hf))
  early = gen.get("early_stopping", False)
  bad = gen.get("bad_words_ids") or []
  decode = dict(length_penalty="hf", alpha=float(gen.get("length_penalty", 1.0)),
                beam_size=int(gen.get("num_beams", 1)), hf_early_stopping=str(early).lower(),
                suppress_pad=[hf["pad_token_id"]] in bad)
  return model, {"task": "translation"}, decode


CONFIGS = {"gpt2": gpt2_config, "llama": llama_config, "mixtral": mixtral_config, "marian": marian_config}


def hf_model_type(hf, where):
  kind = hf.get("model_type")
  if kind not in SUPPORTED:
    raise UserError(f"{where}: model_type {kind!r} is not supported; jaxformer.convert supports "
                    f"{', '.join(SUPPORTED)} (GPT-2, Llama 1/2/3/3.1, Mixtral, Marian / OPUS-MT)")
  return kind


# The token ids a model needs, the config.json key each comes from, and the flag that sets it.
_IDS = (("eos_id", "eos_token_id", "--eos-id"), ("bos_id", "bos_token_id", "--bos-id"),
        ("pad_id", "pad_token_id", "--pad-id"))


def _resolve_ids(model, kind, ids, where):
  """Fills `model`'s pad/bos/eos ids from `ids` (the --*-id flags, which win) and refuses a null one.

  transformers writes `"bos_token_id": null` (and eos) for a model built from a bare config object,
  and several published models have null ids: jaxformer needs each id (masks, decoding, data).
  """
  model.update({k: v for k, v in (ids or {}).items() if v is not None})
  if kind != "marian" and model.get("pad_id") is None:  # GPT-2 / Llama pad with EOS (as before)
    model["pad_id"] = model["eos_id"]
  if kind == "gpt2" and model.get("bos_id") is None:  # GPT-2's BOS is its EOS (<|endoftext|>)
    model["bos_id"] = model["eos_id"]
  for field, key, flag in _IDS:
    if model.get(field) is None:
      key = "decoder_start_token_id" if (kind, field) == ("marian", "bos_id") else key
      raise UserError(f"{where} has {key} null (or absent): give the id with {flag} N (the tokenizer's "
                      f"{field[:3]} token id) and convert again")


def config_from_hf(hf_dir, ids=None, tokenizer_source=None):
  """(Config, model_type, generation config dict) for an HF folder.

  `ids`: {"bos_id"|"eos_id"|"pad_id": int} set where config.json has none (or overrides it);
  `tokenizer_source`: where the tokenizer comes from (default: `hf_dir`), which decides Llama's kind.
  """
  hf = _read_json(os.path.join(hf_dir, "config.json"), "is it a Hugging Face model folder?")
  kind = hf_model_type(hf, os.path.join(hf_dir, "config.json"))
  gen_path = os.path.join(hf_dir, "generation_config.json")
  gen = _read_json(gen_path, "") if os.path.isfile(gen_path) else {}
  model, data, decode, *optim_fields = CONFIGS[kind](hf, gen)  # (Mixtral: its MoE loss coefficients too)
  _resolve_ids(model, kind, ids, os.path.join(hf_dir, "config.json"))
  if kind == "marian":  # the translation recipe's defaults suit fine-tuning
    optim = dict(optimizer="adamw", schedule="constant", learning_rate=3e-5, warmup_steps=0, b2=0.999, eps=1e-8,
                 grad_clip=1.0, label_smoothing=0.1)
  else:
    optim = dict(optimizer="adamw", schedule="constant", learning_rate=3e-5, warmup_steps=0, b2=0.95, eps=1e-8,
                 grad_clip=1.0, label_smoothing=0.0)
  optim.update(*optim_fields)
  tokenizer = {"gpt2": "hf", "marian": "marian"}.get(kind)
  if kind in ("llama", "mixtral"):
    source = tokenizer_source or hf_dir
    spm = source.endswith(".model") if os.path.isfile(source) else os.path.isfile(os.path.join(source, "tokenizer.model"))
    tokenizer = "sentencepiece" if spm else "hf"
  cfg = config_lib.Config(
      name=f"hf_{kind}_{os.path.basename(os.path.normpath(hf_dir))}",
      model=config_lib.ModelConfig(**model),
      data=config_lib.DataConfig(tokenizer=tokenizer, tokenizer_path="", max_len=min(model["max_len"], 256),
                                 block_size=min(model["max_len"], 256), **data),
      optim=config_lib.OptimConfig(**optim),
      train=config_lib.TrainConfig(num_steps=1000, eval_every=200, checkpoint_every=200, keep_checkpoints=3),
      decode=config_lib.DecodeConfig(**decode))
  config_lib._validate(cfg)
  return cfg, kind, hf, gen


# ----------------------------------------------------------------------------- import


def _get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def _set(tree, path, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def _leaf_paths(tree, prefix=()):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from _leaf_paths(v, prefix + (k,))
  else:
    yield prefix


def read_params(reader, cfg, kind, where):
  """The params tree from an HF checkpoint, checked against the shapes the config builds."""
  fused = next((n for n in reader.location if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))), None)
  if fused:
    raise UserError(f"{where} holds {fused}: transformers' in-memory fused expert layout; jaxformer reads the "
                    "hub's per-expert layout (block_sparse_moe.experts.E.w1/w2/w3), which save_pretrained writes")
  _, shapes = evaluate.abstract_params(cfg)
  params, used = {}, set()
  for t in TENSORS[kind](cfg.model):
    name = next((n for n in (t.hf,) + t.aliases if n in reader.location), None)
    if name is None:
      raise UserError(f"{where} has no tensor {t.hf} but config.json describes it (a mismatched config.json?)")
    want = [_shape(shapes, p) for p in t.ours]
    have = reader.shape(name)
    expected = t.to_hf(tuple(np.zeros(s, np.float32) for s in want)).shape  # what HF's shape must be
    if tuple(have) != tuple(expected):
      raise UserError(f"{where}: tensor {name} has shape {list(have)} but config.json implies {list(expected)} "
                      "(mismatched config.json and weights)")
    for path, value in zip(t.ours, t.to_ours(reader.get(name), want)):
      # Kept in the checkpoint's own dtype (bf16 for Llama): restoring widens it to float32 exactly.
      if isinstance(path[-1], int):  # one expert's row of a stacked [experts, ...] parameter
        if not _has(params, path[:-1]):
          _set(params, path[:-1], np.empty(_get(shapes, path[:-1]).shape, value.dtype))
        _get(params, path[:-1])[path[-1]] = value
      else:
        _set(params, path, np.ascontiguousarray(value))
    used.update((t.hf,) + t.aliases)
  extra = [n for n in reader.location if n not in used and not _IGNORED.search(n)]
  if extra:
    raise UserError(f"{where} has {len(extra)} tensor(s) the config does not use, e.g. {extra[0]} "
                    "(a mismatched config.json, or a variant jaxformer does not support)")
  missing = [p for p in _leaf_paths(shapes) if not _has(params, p)]
  if missing:  # a mapping bug, not the user's: say so plainly
    raise RuntimeError(f"jaxformer.convert filled no value for {'/'.join(missing[0])}")
  return params


def _shape(shapes, path):
  """The shape a tensor's parameter path has in the abstract tree; an int last key is one expert's row."""
  if isinstance(path[-1], int):
    return tuple(_get(shapes, path[:-1]).shape[1:])
  return tuple(_get(shapes, path).shape)


def _has(tree, path):
  try:
    _get(tree, path)
    return True
  except (KeyError, TypeError):
    return False


MARIAN_TOKENIZER_FILES = ("source.spm", "target.spm", "vocab.json")


def tokenizer_file(source, cfg):
  """The tokenizer file (or Marian's folder) `source` (a folder, or a file) gives for `cfg`, or None."""
  if cfg.data.tokenizer == "marian":
    if os.path.isfile(source):
      raise UserError(f"--tokenizer {source}: a Marian tokenizer is a folder ({', '.join(MARIAN_TOKENIZER_FILES)})")
    return source if all(os.path.isfile(os.path.join(source, f)) for f in MARIAN_TOKENIZER_FILES) else None
  name = "tokenizer.model" if cfg.data.tokenizer == "sentencepiece" else "tokenizer.json"
  if os.path.isfile(source):
    if not source.endswith(os.path.splitext(name)[1]):
      raise UserError(f"--tokenizer {source}: expected a {name} (or a folder holding one)")
    return source
  path = os.path.join(source, name)
  return path if os.path.isfile(path) else None


def import_tokenizer(hf_dir, cfg, kind, workdir, source=None, log=print):
  """Copies (or packs, for Marian) the tokenizer from `source` (default: `hf_dir`) into the workdir;
  returns its path there, or None (with a warning) when there is none: the weights alone still import."""
  from jaxformer import tasks
  dest = tasks.tokenizer_path(cfg, workdir)
  found = tokenizer_file(source or hf_dir, cfg)
  if found is None:
    if source:
      raise UserError(f"--tokenizer {source} holds no {cfg.data.tokenizer} tokenizer (tokenizer.json, Llama-1/2's "
                      f"tokenizer.model, or Marian's {', '.join(MARIAN_TOKENIZER_FILES)})")
    log(f"warning: {hf_dir} has no tokenizer files: imported the weights only; eval.py and jaxformer.generate "
        f"need a tokenizer: copy it to {dest} or convert again with --tokenizer PATH")
    return None
  if cfg.data.tokenizer == "marian":
    tok = tokenizer_lib.MarianTokenizer.from_hf_dir(found)
    tok.save(dest)
  else:
    shutil.copyfile(found, dest)
  template_dir = os.path.dirname(found) if os.path.isfile(found) else found
  for name in ("tokenizer_config.json", "chat_template.jinja"):  # the chat template, for SFT/DPO (jaxformer.chat)
    if os.path.isfile(os.path.join(template_dir, name)):
      shutil.copyfile(os.path.join(template_dir, name), os.path.join(os.path.dirname(os.path.abspath(dest)), name))
  tok = tokenizer_lib.load_tokenizer(dest)
  tok.use_model_ids(cfg.model.pad_id, cfg.model.bos_id, cfg.model.eos_id, os.path.join(hf_dir, "config.json"))
  if tok.vocab_size > cfg.model.vocab_size:
    raise UserError(f"the tokenizer in {source or hf_dir} has {tok.vocab_size} ids but config.json's vocab_size is "
                    f"{cfg.model.vocab_size}")
  return dest


@contextlib.contextmanager
def _numpy_saved_in_place():
  """Orbax deep-copies numpy leaves before writing them (a guard against their change during an
  asynchronous save): for a params tree nothing else touches, that copy would double the peak."""
  import orbax.checkpoint as ocp
  from absl import logging as absl_logging  # orbax logs a warning on every re-registration
  handlers, verbosity = ocp.type_handlers, absl_logging.get_verbosity()
  old = handlers.get_type_handler(np.ndarray)
  absl_logging.set_verbosity(absl_logging.ERROR)
  handlers.register_type_handler(np.ndarray, handlers.NumpyHandler(deepcopy_host_arrays=False), override=True)
  try:
    yield
  finally:
    handlers.register_type_handler(np.ndarray, old, override=True)
    absl_logging.set_verbosity(verbosity)


def from_hf(hf_dir, workdir, log=print, ids=None, tokenizer=None):
  """Converts an HF folder into a jaxformer workdir; returns the Config.

  `ids`: token ids config.json lacks (see `config_from_hf`); `tokenizer`: a tokenizer file or folder
  to import instead of `hf_dir`'s (a folder without one imports the weights alone, with a warning).
  """
  if not os.path.isdir(hf_dir):
    raise UserError(f"--from-hf {hf_dir}: not a directory")
  if tokenizer and not os.path.exists(tokenizer):
    raise UserError(f"--tokenizer {tokenizer}: not found")
  cfg, kind, hf, gen = config_from_hf(hf_dir, ids, tokenizer)
  if os.path.exists(os.path.join(workdir, "config.json")) or os.path.isdir(os.path.join(workdir, "checkpoints")):
    raise UserError(f"--workdir {workdir} already holds a run: choose a new directory")
  reader = SafetensorsReader(hf_dir)
  params = read_params(reader, cfg, kind, hf_dir)
  os.makedirs(workdir, exist_ok=True)
  tok_path = import_tokenizer(hf_dir, cfg, kind, workdir, tokenizer, log)
  for name, content in (("hf_config.json", hf), ("hf_generation_config.json", gen)):  # kept for --to-hf
    with open(os.path.join(workdir, name), "w") as f:
      json.dump(content, f, indent=2)
  meta = {"step": 0, "config": cfg.name, "tokenizer": tok_path,
          "tokenizer_sha256": evaluate.file_sha256(tok_path) if tok_path else None,
          "converted_from": os.path.abspath(hf_dir), "hf_model_type": kind}
  with _numpy_saved_in_place():
    checkpoint_lib.save_params(workdir, params, step=0, meta=meta)
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config_lib.to_json(cfg))
  n = sum(_get(params, p).size for p in _leaf_paths(params))
  log(f"converted {kind} from {hf_dir}: {n:,} parameters -> {workdir} (checkpoint step 0, tokenizer "
      f"{tok_path or 'none'})")
  return cfg


# ----------------------------------------------------------------------------- export


def infer_model_type(cfg, recorded=None):
  """Which HF architecture can hold this config exactly; a UserError names the first field that does not fit."""
  m = cfg.model
  wants = {
      "gpt2": dict(arch="decoder_only", norm="layernorm", norm_position="pre", position="learned", use_bias=True,
                   logits_bias=False, scale_embeddings=False),
      "llama": dict(arch="decoder_only", norm="rmsnorm", norm_position="pre", position="rope", activation="swiglu",
                    logits_bias=False, scale_embeddings=False),
      "marian": dict(arch="encoder_decoder", norm="layernorm", norm_position="post", position="sinusoidal",
                     sinusoidal_layout="marian", use_bias=True, norm_eps=1e-5, logits_bias=True),
  }
  wants["mixtral"] = dict(wants["llama"], use_bias=False, moe_every=1, moe_shared_experts=0)
  for kind in ("gpt2", "llama"):
    wants[kind]["moe_experts"] = 0
  if recorded in ("llama", "mixtral"):  # a Llama with MoE layers added (or the reverse) goes by its FFN
    recorded = "mixtral" if m.moe_experts else "llama"
  candidates = [recorded] if recorded in wants else [
      k for k, w in wants.items() if w["arch"] == m.arch and (k == "mixtral") == (m.moe_experts > 0)]
  for kind in candidates:
    bad = [(f, v) for f, v in wants[kind].items() if getattr(m, f) != v]
    if kind == "gpt2" and m.activation not in ("gelu", "gelu_exact", "relu", "silu"):
      bad.append(("activation", "gelu"))
    if kind == "marian" and m.activation == "swiglu":
      bad.append(("activation", "silu"))
    if kind in ("llama", "mixtral") and m.rope_scaling == "ntk":
      bad.append(("rope_scaling", "none, llama3 or yarn"))
    if not bad:
      return kind
    if len(candidates) == 1 or kind == candidates[-1]:
      field, value = bad[0]
      raise UserError(f"model.{field}={getattr(m, field)!r} has no Hugging Face {kind} equivalent "
                      f"(it needs {value!r}): this model cannot be exported exactly")
  raise UserError(f"model.arch={m.arch!r}: no Hugging Face architecture fits")


def hf_config_for(cfg, kind, base=None):
  """The HF config.json dict: the imported one (if any) with every architecture field set from cfg."""
  m = cfg.model
  hf = dict(base or {})
  for stale in ("_name_or_path", "transformers_version", "torch_dtype"):
    hf.pop(stale, None)
  if kind == "gpt2":
    act = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu", "silu": "silu"}[m.activation]
    hf.update(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=m.vocab_size, n_positions=m.max_len,
              n_embd=m.d_model, n_layer=m.num_layers, n_head=m.num_heads, n_inner=m.d_ff, activation_function=act,
              layer_norm_epsilon=m.norm_eps, tie_word_embeddings=m.tie_output, bos_token_id=m.bos_id,
              eos_token_id=m.eos_id)
    if m.num_kv_heads not in (None, m.num_heads) or m.head_dim not in (None, m.d_model // m.num_heads):
      raise UserError("GPT-2 has plain multi-head attention: model.num_kv_heads and model.head_dim must be unset")
  elif kind in ("llama", "mixtral"):
    rope = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling == "llama3":
      rope.update(rope_type="llama3", factor=m.rope_scaling_factor, low_freq_factor=m.rope_low_freq_factor,
                  high_freq_factor=m.rope_high_freq_factor, original_max_position_embeddings=m.rope_original_max_len)
    elif m.rope_scaling == "yarn":
      rope.update(rope_type="yarn", factor=m.rope_scaling_factor, beta_fast=m.rope_beta_fast,
                  beta_slow=m.rope_beta_slow,
                  original_max_position_embeddings=m.rope_original_max_len, truncate=m.rope_truncate)
      if m.rope_attention_factor is not None:
        rope["attention_factor"] = m.rope_attention_factor
      if m.rope_mscale and m.rope_mscale_all_dim:
        rope.update(mscale=m.rope_mscale, mscale_all_dim=m.rope_mscale_all_dim)
    hf.pop("rope_scaling", None)
    hf.pop("rope_theta", None)
    hf.update(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=m.vocab_size, hidden_size=m.d_model,
              num_attention_heads=m.num_heads, num_key_value_heads=m.kv_heads, head_dim=m.dim_per_head,
              num_hidden_layers=m.num_layers, intermediate_size=m.d_ff, hidden_act="silu", rms_norm_eps=m.norm_eps,
              attention_bias=m.use_bias, mlp_bias=m.use_bias, max_position_embeddings=m.max_len,
              tie_word_embeddings=m.tie_output, rope_parameters=rope, bos_token_id=m.bos_id,
              eos_token_id=hf.get("eos_token_id") if _eos(hf) == m.eos_id else m.eos_id,
              pad_token_id=hf.get("pad_token_id"))
    if kind == "mixtral":  # MixtralConfig has no attention_bias / mlp_bias fields
      for key in ("attention_bias", "mlp_bias"):
        hf.pop(key, None)
      hf.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=m.moe_experts,
                num_experts_per_tok=m.moe_top_k, router_aux_loss_coef=cfg.optim.moe_aux_loss, sliding_window=None,
                router_jitter_noise=0.0, head_dim=m.head_dim)  # null (d_model / heads) as the hub's configs have it
  else:
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
  hf["dtype"] = "float32"
  return hf


def chat_export(cfg, kind, workdir, tokenizer_workdir):
  """(template text, special-token strings) that `--to-hf` writes into tokenizer_config.json, or None.

  A fine-tuned run (data.chat_path) carries the template it trained with (`data.chat_template`,
  checked against the hash its prepared data recorded), turned into what transformers renders
  to the same ids (`chat.hf_template`); another run carries the template beside its tokenizer
  (a converted instruct model's), if any. `tokenizer_workdir`: where the tokenizer lives (a LoRA
  run's base). Runs before anything is written, so a template that cannot be carried is one line.
  """
  from jaxformer import chat, prepare, shards, tasks
  path = tasks.tokenizer_path(cfg, tokenizer_workdir)
  if kind == "marian" or path == "byte" or not os.path.isfile(path):
    return None  # no chat model, or no tokenizer to write (export_tokenizer says so)
  tok = tokenizer_lib.load_tokenizer(path)
  if isinstance(tok, tokenizer_lib.HFTokenizer):
    token_text = tok.tok.id_to_token
  elif isinstance(tok, tokenizer_lib.SentencePieceTokenizer):
    token_text = tok.sp.id_to_piece
  else:
    return None
  tok.use_model_ids(cfg.model.pad_id, cfg.model.bos_id, cfg.model.eos_id, os.path.join(workdir, "config.json"))
  hf = isinstance(tok, tokenizer_lib.HFTokenizer)
  try:
    template = chat.load_template(cfg.data.chat_template, path, hf)
  except UserError as e:
    if cfg.data.chat_path:
      raise UserError(f"cannot export the chat template {workdir} trained with: {e}") from None
    return None  # a model without a chat template: none to carry
  if cfg.data.chat_path:
    ddir = prepare.data_dir(cfg, workdir)
    trained = ((shards.read_manifest(ddir) or {}).get("chat") or {}).get("settings", {}).get("template_sha256")
    if trained and trained != template.sha256:
      raise UserError(f"chat template {template.name} is not the one {workdir} trained with (its hash differs from "
                      f"{ddir}'s manifest): restore that template, or set data.chat_template to it in "
                      f"{os.path.join(workdir, 'config.json')}")
  return chat.hf_template(template, tok, hf, cfg.data.add_bos, token_text)


def export_tokenizer(cfg, kind, workdir, out, chat_template=None):
  """Writes the tokenizer files and tokenizer_config.json; `chat_template`: (text, special-token strings)
  from `chat_export`, written into the config (transformers' `apply_chat_template` reads it)."""
  from jaxformer import tasks
  path = tasks.tokenizer_path(cfg, workdir)
  if path == "byte" or not os.path.isfile(path):
    raise UserError(f"tokenizer {path} cannot be written in a Hugging Face format (byte / missing)")
  tok = tokenizer_lib.load_tokenizer(path)
  if isinstance(tok, tokenizer_lib.MarianTokenizer):
    tok.save_hf(out)
    config = {"tokenizer_class": "MarianTokenizer", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}
  elif isinstance(tok, tokenizer_lib.HFTokenizer):
    shutil.copyfile(path, os.path.join(out, "tokenizer.json"))
    token = tok.tok.id_to_token
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token(cfg.model.bos_id),
              "eos_token": token(cfg.model.eos_id)}
  elif isinstance(tok, tokenizer_lib.SentencePieceTokenizer) and kind in ("llama", "mixtral"):
    shutil.copyfile(path, os.path.join(out, "tokenizer.model"))
    config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": cfg.data.add_bos, "add_eos_token": False}
  else:
    raise UserError(f"tokenizer {path} ({type(tok).__name__}) has no Hugging Face form for {kind}; "
                    "the weights and config were written")
  if chat_template is not None:
    text, special = chat_template
    config.update(special)  # the strings the template renders as bos_token, eos_token, ...
    config["chat_template"] = text
  with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)


def _write_shards(out, tensors_iter, max_shard_mb):
  """Writes (name, array) pairs as safetensors shards of at most max_shard_mb each, in order.

  One shard is `model.safetensors`; more are `model-0000k-of-0000n.safetensors` plus
  `model.safetensors.index.json`, as transformers writes them. Only the shard being written is
  held (safetensors serialises a whole file at once).
  """
  from safetensors.numpy import save_file
  written, current, size = [], {}, 0

  def flush():
    path = os.path.join(out, f".shard-{len(written)}.tmp")
    save_file(current, path, metadata={"format": "pt"})
    written.append((path, list(current), sum(v.nbytes for v in current.values())))

  for name, value in tensors_iter:
    if current and size + value.nbytes > max_shard_mb * 2**20:
      flush()
      current, size = {}, 0
    current[name] = value
    size += value.nbytes
  flush()
  current = None
  if len(written) == 1:
    os.replace(written[0][0], os.path.join(out, "model.safetensors"))
    return
  weight_map = {}
  for i, (path, names, _) in enumerate(written):
    fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
    os.replace(path, os.path.join(out, fname))
    weight_map.update({n: fname for n in names})
  with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": sum(w[2] for w in written)}, "weight_map": weight_map}, f, indent=2)


def to_hf(workdir, out, step=None, dtype="float32", max_shard_mb=2048, log=print):
  """Writes `out/config.json`, the safetensors weights and the tokenizer from a workdir's checkpoint.

  Each parameter is dropped once its HF tensor is made, so the peak is about one copy of the
  model plus one shard (`max_shard_mb`).
  """
  # HF's layout is per layer: a model.scan_layers checkpoint is unstacked on the way in.
  cfg, _, params, _, meta = evaluate.load_run(workdir, step=step, log=lambda *_: None, scan_layers=False)
  run_dir, workdir = workdir, meta.get("lora_base") or workdir  # a LoRA run (merged above): the rest is its base's
  base_path = os.path.join(workdir, "hf_config.json")
  base = _read_json(base_path, "") if os.path.isfile(base_path) else None
  kind = infer_model_type(cfg, meta.get("hf_model_type") or (base or {}).get("model_type"))
  hf = hf_config_for(cfg, kind, base)
  template = chat_export(cfg, kind, run_dir, workdir)
  if os.path.exists(os.path.join(out, "config.json")):
    raise UserError(f"--out {out} already holds a model: choose a new directory")
  os.makedirs(out, exist_ok=True)
  if dtype == "bfloat16":
    import ml_dtypes  # numpy's bfloat16 (a JAX dependency)
    np_dtype = ml_dtypes.bfloat16
  else:
    np_dtype = np.dtype(dtype)
  params = jax.tree.map(lambda x: x, params)  # our own dict tree, emptied as we go
  count = [0]

  def tensors():
    for t in TENSORS[kind](cfg.model):
      value = t.to_hf(tuple(np.asarray(_get(params, p)) for p in t.ours))
      for p in t.ours:  # free each parameter once converted: the peak stays near one copy of the model
        if not isinstance(p[-1], int):
          _set(params, p, None)
        elif p[-1] == len(_get(params, p[:-1])) - 1:  # a stacked expert parameter: with its last row
          _set(params, p[:-1], None)
      count[0] += value.size
      yield t.hf, np.ascontiguousarray(value).astype(np_dtype, copy=False)

  _write_shards(out, tensors(), max_shard_mb)
  hf["dtype"] = dtype
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(hf, f, indent=2)
  with open(os.path.join(out, "generation_config.json"), "w") as f:
    json.dump(generation_config(cfg, kind, workdir), f, indent=2)
  export_tokenizer(cfg, kind, workdir, out, template)
  log(f"wrote {kind} ({count[0]:,} parameters, {dtype}) to {out}" + (" with its chat template" if template else ""))
  return out


def to_peft(workdir, out, step=None, dtype="float32", log=print):
  """Writes a LoRA run's adapters as a PEFT adapter: `out/adapter_config.json` + `adapter_model.safetensors`.

  Keys `base_model.model.<HF module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r], as
  peft's `save_pretrained` writes them, on the base that `--to-hf` of train.init_from writes.
  """
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise UserError(f"{workdir} has no config.json: is it a training workdir (train.py --workdir)?")
  cfg = config_lib.load_config(path)
  if not lora.enabled(cfg):
    raise UserError(f"--peft: {workdir} is not a LoRA run (train.lora_rank=0); export it without --peft")
  cfg = config_lib.replace(cfg, **{"model.scan_layers": False})  # HF's layout is per layer
  adapters, meta = evaluate.load_lora_adapters(cfg, workdir, step, log=lambda *_: None)
  base_dir = meta.get("lora_base") or cfg.train.init_from
  hf_path = os.path.join(base_dir, "hf_config.json")
  recorded = (_read_json(hf_path, "") if os.path.isfile(hf_path) else {}).get("model_type")
  kind = infer_model_type(cfg, recorded)
  if kind == "marian":
    raise UserError("--peft exports decoder-only models (GPT-2, Llama); export a Marian LoRA run merged")
  if os.path.exists(os.path.join(out, "adapter_config.json")):
    raise UserError(f"--out {out} already holds an adapter: choose a new directory")
  _, shapes = evaluate.abstract_params(cfg)
  r, alpha = cfg.train.lora_rank, cfg.train.lora_alpha
  tensors, targets, rank_pattern, alpha_pattern, exported = {}, [], {}, {}, set()
  for t in TENSORS[kind](cfg.model):
    modules = [p[:-1] for p in t.ours if p[-1] == "kernel"]
    if not t.hf.endswith(".weight") or len(modules) != len(t.ours):
      continue
    found = [_get(adapters, m) if _has(adapters, m + (lora.A,)) else None for m in modules]
    if not any(f is not None for f in found):
      continue
    # One adapter for the HF module: the A of each of our kernels side by side [in, n r], B block-diagonal
    # [n r, sum of outs] (zero blocks where a fused part has no adapter): x A B = the sum of the parts.
    outs = [math.prod(_get(shapes, m + ("kernel",)).shape[1 if m[-1] != "out" else 2:]) for m in modules]
    n = sum(f is not None for f in found)
    a_hf = np.zeros((n * r, math.prod(_get(shapes, modules[0] + ("kernel",)).shape) // outs[0]), np.float32)
    b_hf = np.zeros((sum(outs), n * r), np.float32)
    j, col = 0, 0
    for f, size in zip(found, outs):
      if f is not None:
        a_hf[j * r:(j + 1) * r] = np.asarray(f[lora.A]).reshape(-1, r).T
        b_hf[col:col + size, j * r:(j + 1) * r] = np.asarray(f[lora.B]).reshape(r, -1).T
        j += 1
      col += size
    module = t.hf[:-len(".weight")]
    tensors[f"base_model.model.{module}.lora_A.weight"] = a_hf
    tensors[f"base_model.model.{module}.lora_B.weight"] = b_hf
    targets.append(module)
    if n != 1:
      rank_pattern[re.escape(module)], alpha_pattern[re.escape(module)] = n * r, n * alpha
    exported.update(m for m, f in zip(modules, found) if f is not None)
  missing = [m for m in _leaf_paths(adapters) if m[:-1] not in exported]
  if missing:
    raise UserError(f"--peft: the adapter on {'/'.join(missing[0][:-1])} has no Hugging Face {kind} module to "
                    "hold it: export this run merged (without --peft)")
  os.makedirs(out, exist_ok=True)
  if dtype == "bfloat16":
    import ml_dtypes  # numpy's bfloat16 (a JAX dependency)
    np_dtype = ml_dtypes.bfloat16
  else:
    np_dtype = np.dtype(dtype)
  from safetensors.numpy import save_file  # pylint: disable=g-import-not-at-top
  save_file({k: np.ascontiguousarray(v.astype(np_dtype)) for k, v in tensors.items()},
            os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha,
            "target_modules": targets, "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": kind == "gpt2",  # GPT-2's Conv1D [in, out]
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
            "base_model_name_or_path": None, "inference_mode": True}
  with open(os.path.join(out, "adapter_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  log(f"wrote a PEFT LoRA adapter for {kind} ({sum(v.size for v in tensors.values()):,} parameters, rank {r}, "
      f"{len(targets)} modules) to {out}; its base: python -m jaxformer.convert --to-hf {base_dir} --out BASE")
  return out


def generation_config(cfg, kind, workdir):
  path = os.path.join(workdir, "hf_generation_config.json")
  gen = _read_json(path, "") if os.path.isfile(path) else {}
  gen.pop("transformers_version", None)
  m, d = cfg.model, cfg.decode
  gen.setdefault("eos_token_id", m.eos_id)
  if kind != "marian":  # Marian has no BOS: it starts from decoder_start_token_id
    gen.setdefault("bos_token_id", m.bos_id)
  if kind == "marian":
    gen.update(decoder_start_token_id=m.bos_id, pad_token_id=m.pad_id, num_beams=d.beam_size)
    if d.length_penalty == "hf":
      early = {"false": False, "true": True}.get(d.hf_early_stopping, "never")
      gen.update(length_penalty=d.alpha, early_stopping=early)
    if d.suppress_pad:
      gen["bad_words_ids"] = [[m.pad_id]]
  return gen


# ----------------------------------------------------------------------------- command line


def parse_args(argv):
  parser = argparse.ArgumentParser(description="Convert Hugging Face checkpoints (GPT-2, Llama, Mixtral, Marian) to and "
                                               "from jaxformer workdirs.")
  group = parser.add_mutually_exclusive_group(required=True)
  group.add_argument("--from-hf", metavar="HF_DIR", help="a local Hugging Face model folder to import")
  group.add_argument("--to-hf", metavar="WORKDIR", help="a jaxformer workdir to export")
  parser.add_argument("--workdir", help="with --from-hf: the new jaxformer workdir")
  parser.add_argument("--out", help="with --to-hf: the new Hugging Face folder")
  parser.add_argument("--step", type=int, default=None, help="with --to-hf: checkpoint step (default: latest)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                      help="with --to-hf: tensor dtype written")
  parser.add_argument("--max-shard-mb", type=int, default=2048, help="with --to-hf: safetensors shard size")
  parser.add_argument("--tokenizer", metavar="PATH", help="with --from-hf: the tokenizer to import (a tokenizer.json "
                      "or tokenizer.model, or a folder holding it) when HF_DIR has none")
  for _, key, flag in _IDS:
    parser.add_argument(flag, type=int, default=None, metavar="N",
                        help=f"with --from-hf: the id when config.json's {key} is null (overrides it)")
  parser.add_argument("--peft", action="store_true",
                      help="with --to-hf of a LoRA run: write its adapters as a PEFT adapter (not the merged model)")
  return parser.parse_intermixed_args(argv)


@cli
def main(argv):
  """The `python -m jaxformer.convert` entry point."""
  args = parse_args(argv)
  if args.from_hf:
    if not args.workdir:
      raise UserError("--from-hf needs --workdir W (the jaxformer workdir to write)")
    ids = {"bos_id": args.bos_id, "eos_id": args.eos_id, "pad_id": args.pad_id}
    return from_hf(args.from_hf, args.workdir, ids=ids, tokenizer=args.tokenizer)
  if not args.out:
    raise UserError("--to-hf needs --out DIR (the Hugging Face folder to write)")
  if args.peft:
    return to_peft(args.to_hf, args.out, args.step, args.dtype)
  return to_hf(args.to_hf, args.out, args.step, args.dtype, args.max_shard_mb)


if __name__ == "__main__":
  main()
