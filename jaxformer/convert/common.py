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


def attention(prefix, ours, names, bias):
  """q/k/v/o Linear layers (Llama, Marian) <-> our query/key/value/out."""
  out = []
  for hf_name, our_name in zip(names, ("query", "key", "value", "out")):
    out.append(linear(f"{prefix}.{hf_name}.weight", ours + (our_name, "kernel"), n_in=2 if our_name == "out" else 1))
    if bias:
      out.append(vector(f"{prefix}.{hf_name}.bias", ours + (our_name, "bias")))
  return out


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
  if kind not in ("llama3", "yarn"):
    unsupported("rope type", kind, "RoPE scalings (default, llama3, yarn)")
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


ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "gelu_fast": "gelu", "gelu": "gelu_exact",
                "relu": "relu", "silu": "silu", "swish": "silu"}


def activation(hf, key):
  act = hf.get(key, "gelu_new")
  if act not in ACTIVATIONS:
    unsupported(key, act, f"FFN activations ({', '.join(ACTIVATIONS)})")
  return ACTIVATIONS[act]
