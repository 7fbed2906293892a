"""What every family's conversion shares: HF tensor <-> parameter mappings, tree paths, config.json helpers."""

import dataclasses
import json
import math

import numpy as np

from jaxformer.errors import UserError


def read_json(path, what):
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except FileNotFoundError:
    raise UserError(f"{path} not found: {what}") from None
  except json.JSONDecodeError as e:
    raise UserError(f"{path} is not valid JSON: {e}") from e


@dataclasses.dataclass
class Tensor:
  """One HF tensor <-> one or more jaxformer parameters (paths in the params tree)."""
  hf: str                                   # the name HF writes
  ours: tuple                               # parameter paths, e.g. (("embed", "embedding"),)
  to_ours: object                           # (hf array, our shapes) -> tuple of our arrays
  to_hf: object                             # tuple of our arrays -> hf array
  aliases: tuple = ()                       # other names checkpoints use for it


def same(hf, ours, aliases=()):
  return Tensor(hf, (ours,), lambda a, shapes: (a.reshape(shapes[0]),), lambda xs: xs[0], aliases)


def linear(hf, ours, n_in=1):
  """torch.nn.Linear weight [out, in] <-> kernel [*in_axes, *out_axes] (n_in leading input axes)."""
  def to_hf(xs):
    x = xs[0]
    return x.reshape(math.prod(x.shape[:n_in]), -1).T
  return Tensor(hf, (ours,), lambda a, shapes: (a.T.reshape(shapes[0]),), to_hf)


def expert(hf, ours, e):
  """One expert's torch.nn.Linear weight [out, in] <-> row e of our stacked [experts, in, out]
  parameter: `ours + (e,)` names the row (see `get` / `read_params`)."""
  return Tensor(hf, (ours + (e,),), lambda a, shapes: (a.T.reshape(shapes[0]),), lambda xs: xs[0].T)


def vector(hf, ours):
  """A bias or norm vector (our bias may be [heads, head_dim])."""
  return Tensor(hf, (ours,), lambda a, shapes: (a.reshape(shapes[0]),), lambda xs: xs[0].reshape(-1))


def conv1d(hf, ours, n_in=1):
  """GPT-2's Conv1D weight [in, out] <-> kernel [*in_axes, *out_axes]: no transpose."""
  def to_hf(xs):
    x = xs[0]
    return x.reshape(math.prod(x.shape[:n_in]), -1)
  return Tensor(hf, (ours,), lambda a, shapes: (a.reshape(shapes[0]),), to_hf)


def fused_qkv(hf, attention, weight):
  """GPT-2's c_attn [d, 3d] (weight) or [3d] (bias) <-> query / key / value kernels or biases."""
  leaf = "kernel" if weight else "bias"
  ours = tuple(attention + (p, leaf) for p in ("query", "key", "value"))

  def to_ours(a, shapes):
    parts = np.split(a, 3, axis=-1)
    return tuple(p.reshape(s) for p, s in zip(parts, shapes))

  def to_hf(xs):
    return np.concatenate([x.reshape(x.shape[0], -1) if weight else x.reshape(-1) for x in xs], axis=-1)
  return Tensor(hf, ours, to_ours, to_hf)


def fused_linear(hf, ours, sizes):
  """One torch.nn.Linear weight [sum(sizes), in] whose output rows stack several of our kernels
  (Phi-3's qkv_proj: q, k, v; gate_up_proj: gate, up) <-> those kernels [in, *out_axes]."""
  def to_ours(a, shapes):
    parts = np.split(a, np.cumsum(sizes)[:-1], axis=0)
    return tuple(x.T.reshape(s) for x, s in zip(parts, shapes))

  def to_hf(xs):
    return np.concatenate([x.reshape(x.shape[0], -1).T for x in xs], axis=0)
  return Tensor(hf, tuple(ours), to_ours, to_hf)


def attention(prefix, ours, names, bias, qkv_bias=False):
  """q/k/v/o Linear layers (Llama, Marian) <-> our query/key/value/out; `bias` on all four,
  `qkv_bias` on q/k/v only (Qwen2)."""
  out = []
  for hf_name, our_name in zip(names, ("query", "key", "value", "out")):
    out.append(linear(f"{prefix}.{hf_name}.weight", ours + (our_name, "kernel"), n_in=2 if our_name == "out" else 1))
    if bias or (qkv_bias and our_name != "out"):
      out.append(vector(f"{prefix}.{hf_name}.bias", ours + (our_name, "bias")))
  return out


# The decoder features of issue 36 switched off: what a family that has none of them WANTS.
PLAIN = dict(qkv_bias=False, qk_norm=False, norm_unit_offset=False, post_norms=False, sliding_window=0,
             attention_pattern="", attn_softcap=0.0, final_softcap=0.0, query_pre_attn_scalar=None,
             rope_local_theta=None)


def windows(hf, types=None):
  """model.sliding_window and model.attention_pattern from config.json's `sliding_window` and `layer_types`
  (`types`: the list when config.json states it another way): the shortest repeating cycle of local
  (sliding_attention) and global (full_attention) layers; "" when all are local, no window when none is."""
  types = hf.get("layer_types") if types is None else types
  window = int(hf.get("sliding_window") or 0)
  if not types:
    return {"sliding_window": window, "attention_pattern": ""}
  kinds = []
  for t in types:
    if t not in ("sliding_attention", "full_attention"):
      unsupported("layer_types entry", t, "attention patterns (sliding_attention, full_attention)")
    kinds.append("local" if t == "sliding_attention" else "global")
  if "local" not in kinds:
    return {"sliding_window": 0, "attention_pattern": ""}
  if not window:
    unsupported("sliding_window", hf.get("sliding_window"), "local layers (layer_types has sliding_attention: "
                "a window in tokens is needed)")
  if "global" not in kinds:
    return {"sliding_window": window, "attention_pattern": ""}
  period = next(p for p in range(1, len(kinds) + 1) if all(kinds[i] == kinds[i % p] for i in range(len(kinds))))
  return {"sliding_window": window, "attention_pattern": ",".join(kinds[:period])}


def derived_head_dim(m):
  """[("head_dim", None)] where a family without a head_dim field (hidden / heads) cannot hold the model's."""
  return [("head_dim", None)] if m.head_dim is not None and m.head_dim != m.d_model // m.num_heads else []


def layer_types(m):
  """config.json's `layer_types` for model.attention_pattern (the inverse of `layer_pattern`)."""
  return ["sliding_attention" if m.layer_is_local(i) else "full_attention" for i in range(m.num_layers)]


def norm(prefix, ours, bias=True):
  out = [vector(f"{prefix}.weight", ours + ("scale",))]
  if bias:
    out.append(vector(f"{prefix}.bias", ours + ("bias",)))
  return out


# ---------------------------------------------------------------- parameter tree paths


def get(tree, path):
  for k in path:
    tree = tree[k]
  return tree


def put(tree, path, value):
  for k in path[:-1]:
    tree = tree.setdefault(k, {})
  tree[path[-1]] = value


def leaf_paths(tree, prefix=()):
  if isinstance(tree, dict):
    for k, v in tree.items():
      yield from leaf_paths(v, prefix + (k,))
  else:
    yield prefix


def shape_of(shapes, path):
  """The shape a tensor's parameter path has in the abstract tree; an int last key is one expert's row."""
  if isinstance(path[-1], int):
    return tuple(get(shapes, path[:-1]).shape[1:])
  return tuple(get(shapes, path).shape)


def has(tree, path):
  try:
    get(tree, path)
    return True
  except (KeyError, TypeError):
    return False


def numpy_dtype(dtype):
  """numpy's dtype for --dtype (bfloat16 through ml_dtypes, a JAX dependency)."""
  if dtype == "bfloat16":
    import ml_dtypes  # pylint: disable=g-import-not-at-top
    return ml_dtypes.bfloat16
  return np.dtype(dtype)


# ---------------------------------------------------------------- config.json fields


def unsupported(what, value, fix):
  raise UserError(f"{what}={value!r} is not supported by jaxformer's {fix}")


def first_eos(hf):
  eos = hf.get("eos_token_id")
  return eos[0] if isinstance(eos, list) else eos  # Llama 3 instruct lists several; the first ends decoding


def rope(hf):
  """RoPE fields from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling` (config.json of 4.x)."""
  params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  if any(isinstance(v, dict) for v in params.values()):
    unsupported("rope_parameters per layer type", list(params), "single RoPE")
  kind = params.get("rope_type", params.get("type", "default"))
  theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
  if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
    unsupported("partial_rotary_factor", params.get("partial_rotary_factor", hf.get("partial_rotary_factor")),
                 "RoPE (whole head_dim only)")
  fields = {"position": "rope", "rope_theta": float(theta)}
  if kind == "default":
    return fields
  if kind == "linear":
    return {**fields, "rope_scaling": "linear", "rope_scaling_factor": float(params["factor"])}
  if kind not in ("llama3", "yarn"):
    unsupported("rope type", kind, "RoPE scalings (default, linear, llama3, yarn)")
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


def rope_parameters(m):
  """config.json's `rope_parameters` (transformers >= 5) for the model's RoPE fields (the inverse of `rope`)."""
  rope = {"rope_type": "default", "rope_theta": m.rope_theta}
  if m.rope_scaling == "linear":
    rope.update(rope_type="linear", factor=m.rope_scaling_factor)
  elif m.rope_scaling == "llama3":
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
  return rope


ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu", "gelu": "gelu_exact",
                "relu": "relu", "silu": "silu", "swish": "silu"}


def activation(hf, key):
  act = hf.get(key, "gelu_new")
  if act not in ACTIVATIONS:
    unsupported(key, act, f"FFN activations ({', '.join(ACTIVATIONS)})")
  return ACTIVATIONS[act]
