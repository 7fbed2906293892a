"""Model arithmetic without weights: parameters, FLOPs, KV cache and a decode roofline.

  python -m jaxformer.inspect --config llama3_8b [model.num_layers=2] [--dtype bfloat16]
      [--batch 1] [--context 4096,32768] [--seq-len 8192]

Shapes come from `jax.eval_shape(model.init)`: nothing is allocated, and the counts are
the model's own rather than a formula that could drift from it. `DEVICES`, `peak_flops`
and `matmul_peak` are shared by the trainer's MFU and the benchmarks.
"""

import argparse
import functools
import math
import re
import time
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from jaxformer.config import ModelConfig, load_config
from jaxformer.errors import UserError, cli
from jaxformer.model import build_model


class Device(NamedTuple):
  """An accelerator for the roofline: HBM bandwidth (bytes/s) and dense bf16 peak (FLOP/s)."""
  memory_bandwidth: float
  peak_flops: float


# Datasheet numbers; peaks are dense (no structured sparsity) bf16.
DEVICES = {
    "A100": Device(2.039e12, 312e12),  # 80GB SXM
    "H100": Device(3.35e12, 989e12),   # SXM
    "H200": Device(4.8e12, 989e12),
    "TPU v4": Device(1.2e12, 275e12),
    "TPU v5e": Device(0.819e12, 197e12),
    "TPU v5p": Device(2.765e12, 459e12),
    "TPU v6e": Device(1.64e12, 918e12),
}

# `jax.devices()[0].device_kind` (lower-cased) -> DEVICES key. H100 PCIe/NVL have lower
# peaks than SXM, so they are left unknown rather than overstated.
_DEVICE_KINDS = (
    (r"a100", "A100"),
    (r"h100(?!.*(pcie|nvl))", "H100"),
    (r"h200", "H200"),
    (r"tpu v4$", "TPU v4"),
    (r"tpu v5 ?(lite|e)", "TPU v5e"),
    (r"tpu v5p?$", "TPU v5p"),
    (r"tpu v6 ?(lite|e)", "TPU v6e"),
)

COMPONENTS = ("embeddings", "attention", "ffn", "norms", "output")


def device_name(device_kind):
  """The `DEVICES` key for a `device_kind` string ("NVIDIA H100 80GB HBM3", "TPU v5 lite"), or None."""
  kind = device_kind.lower().strip()
  return next((name for pattern, name in _DEVICE_KINDS if re.search(pattern, kind)), None)


def peak_flops(device_kind):
  """Dense bf16 peak FLOP/s for a `jax.devices()[0].device_kind` string, or None if unknown."""
  name = device_name(device_kind)
  return DEVICES[name].peak_flops if name else None


def matmul_dtype(cfg):
  """The operand dtype of a config's matmuls: "bfloat16" when model.dtype or model.matmul_dtype is."""
  return "bfloat16" if "bfloat16" in (cfg.model.dtype, cfg.model.matmul_dtype) else "float32"


def matmul_peak(n=1024, repeats=5, dtype="float32", clock=time.perf_counter):
  """FLOP/s of the best of `repeats` jitted [n, n] x [n, n] products (operands in `dtype`,
  float32 accumulation) on the default device: the practical peak that MFU divides by
  where no datasheet applies (CPUs). On a 2-core CPU n=1024 gives the rate of n=2048 in
  ~0.1 s. `clock` is the timer (a test passes a fake one)."""
  rng = np.random.default_rng(0)
  a, b = (jnp.asarray(rng.standard_normal((n, n), np.float32), dtype) for _ in range(2))
  f = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32))
  f(a, b).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t = clock()
    f(a, b).block_until_ready()
    best = min(best, clock() - t)
  return 2 * n ** 3 / best


def _model_cfg(cfg):
  return getattr(cfg, "model", cfg)  # a Config or a ModelConfig


@functools.lru_cache(maxsize=32)
def _shapes(m: ModelConfig):
  """{param path: shape}, traced with eval_shape so no weight is allocated."""
  model = build_model(m)

  def init():  # all inside eval_shape: nothing is compiled or run
    ids = jnp.ones((1, 1), jnp.int32)
    return model.init(jax.random.key(0), *((ids, ids) if m.arch == "encoder_decoder" else (ids,)))

  variables = jax.eval_shape(init)
  params = traverse_util.flatten_dict(nn.unbox(variables["params"]))
  return {path: tuple(x.shape) for path, x in params.items()}


def _component(path):
  """Which component a parameter path belongs to (norms first: `self_attention_norm` is a norm)."""
  if path[-1] in ("embedding", "position_embedding"):
    return "embeddings"
  if any(p.endswith("_norm") for p in path):
    return "norms"
  if "logits" in path:
    return "output"
  if "ffn" in path:
    return "ffn"
  if "self_attention" in path or "cross_attention" in path:
    return "attention"
  return "other"  # a new kind of module: still counted, shown separately


def count_parameters(cfg):
  """Parameters per component (embeddings incl. position tables, attention, ffn, norms, output) and "total"."""
  counts = dict.fromkeys(COMPONENTS, 0)
  for path, shape in _shapes(_model_cfg(cfg)).items():
    key = _component(path)
    counts[key] = counts.get(key, 0) + math.prod(shape)
  counts["total"] = sum(counts.values())
  return counts


def matmul_parameters(cfg):
  """Kernel weights used per token: dict(encoder, decoder, decoder_step, output).

  `decoder_step` leaves out cross-attention key/value kernels: they read only the
  source, so a decoder that caches them runs them once per sentence, not per token.
  `output` is the vocabulary projection, counted even when tied to the embedding.
  """
  m = _model_cfg(cfg)
  counts = dict(encoder=0, decoder=0, decoder_step=0, output=0 if not m.tie_output else m.vocab_size * m.d_model)
  for path, shape in _shapes(m).items():
    if path[-1] != "kernel":
      continue
    n = math.prod(shape)
    if path[0] == "logits":
      counts["output"] += n
    elif path[0] == "encoder":
      counts["encoder"] += n
    else:
      counts["decoder"] += n
      if not ("cross_attention" in path and path[-2] in ("key", "value")):
        counts["decoder_step"] += n
  return counts


def flops_per_token(cfg, seq_len, context=None):
  """FLOPs per (target) token: dict(train, forward, decode).

  forward = 2 x matmul weights (see `matmul_parameters`; embedding lookups and position
  tables are not matmuls) + 4 x heads x head_dim per layer per key attended (q.k scores
  and the weighted sum of v). Causal self-attention at length L attends to (L+1)/2 keys
  on average; the encoder and cross-attention attend to all L (source length = target
  length). train = 3 x forward (backward ~ 2 x forward). decode = one new token of the
  decoder at `context` cached keys (default seq_len; cross-attention over a source of
  the same length); the encoder runs once per sentence and is not counted.
  """
  m = _model_cfg(cfg)
  context = seq_len if context is None else context
  p = matmul_parameters(m)
  per_key = 4 * m.num_heads * m.dim_per_head
  cross = m.arch == "encoder_decoder"
  keys = m.num_layers * (seq_len + 1) / 2 + m.encoder_layers * seq_len + (m.num_layers * seq_len if cross else 0)
  forward = 2 * (p["encoder"] + p["decoder"] + p["output"]) + per_key * keys
  decode = 2 * (p["decoder_step"] + p["output"]) + per_key * m.num_layers * context * (2 if cross else 1)
  return dict(train=3 * forward, forward=forward, decode=decode)


def _itemsize(dtype):
  try:
    return jnp.dtype(dtype).itemsize
  except TypeError:
    raise UserError(f"unknown dtype {dtype!r} (e.g. bfloat16, float16, float32, int8)") from None


def kv_cache_bytes_per_token(cfg, dtype="bfloat16"):
  """Bytes of KV cache per token per sequence: 2 x layers x kv_heads x head_dim x bytes(dtype).

  For an encoder-decoder this is the decoder's self-attention cache.
  """
  m = _model_cfg(cfg)
  return 2 * m.num_layers * m.kv_heads * m.dim_per_head * _itemsize(dtype)


def decode_roofline(cfg, dtype="bfloat16", batch=1, context=2048):
  """Lower bound on one decode step (a token for each of `batch` sequences) per device.

  A step reads every weight once (shared by the batch) plus each sequence's KV cache at
  `context`, and does batch x decode FLOPs: time = max(bytes / bandwidth, FLOPs / peak).
  Returns {device: dict(seconds, bound="memory"|"compute")}.
  """
  nbytes = (count_parameters(cfg)["total"] * _itemsize(dtype)
            + kv_cache_bytes_per_token(cfg, dtype) * context * batch)
  flops = batch * flops_per_token(cfg, context, context)["decode"]
  result = {}
  for name, device in DEVICES.items():
    memory, compute = nbytes / device.memory_bandwidth, flops / device.peak_flops
    result[name] = dict(seconds=max(memory, compute), bound="memory" if memory >= compute else "compute")
  return result


def _si(x, unit):
  """12345678 -> '12.35 M<unit>'."""
  for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if abs(x) >= scale:
      return f"{x / scale:.2f} {prefix}{unit}"
  return f"{x:.0f} {unit}"


def report(cfg, dtype="bfloat16", batch=1, contexts=(4096, 32768), seq_len=None):
  """The human-readable report printed by the CLI."""
  m = cfg.model
  if seq_len is None:  # the length the recipe trains at
    seq_len = cfg.data.block_size if cfg.data.task == "lm" else cfg.data.max_len
  layers = f"{m.encoder_layers}+{m.num_layers}" if m.arch == "encoder_decoder" else str(m.num_layers)
  lines = [f"{cfg.name}: {m.arch}, {layers} layers, d_model {m.d_model}, {m.num_heads} heads "
           f"({m.kv_heads} kv) x {m.dim_per_head}, d_ff {m.d_ff} ({m.activation}), vocab {m.vocab_size:,}, "
           f"position {m.position}, {'tied' if m.tie_output else 'untied'} output", ""]

  counts = count_parameters(cfg)
  total = counts["total"]
  lines.append("Parameters")
  for key, n in counts.items():
    if key != "total" and (n or key in COMPONENTS):
      lines.append(f"  {key:<12}{n:>16,}  {100 * n / total:5.1f}%")
  lines.append(f"  {'total':<12}{total:>16,}  ({_si(total * _itemsize(dtype), 'B')} in {dtype})")
  lines.append(f"  FFN share: {100 * counts['ffn'] / total:.1f}%")

  flops = flops_per_token(cfg, seq_len)
  p = matmul_parameters(cfg)
  lines += ["", f"FLOPs per token at sequence length {seq_len:,}"
            f" ({2 * sum(v for k, v in p.items() if k != 'decoder_step'):,} from matmul weights)",
            f"  forward       {_si(flops['forward'], 'FLOP')}",
            f"  train (3x)    {_si(flops['train'], 'FLOP')}",
            f"  decode        {_si(flops['decode'], 'FLOP')} at context {seq_len:,}",
            f"  (causal self-attention counted honestly: {(seq_len + 1) / 2:,} keys per query on average,"
            f" (L+1)/2{'; source length = target length' if m.arch == 'encoder_decoder' else ''})"]

  per_token = kv_cache_bytes_per_token(cfg, dtype)
  what = "decoder self-attention, " if m.arch == "encoder_decoder" else ""
  lines += ["", f"KV cache ({what}{dtype}): {per_token:,} bytes/token"]
  for c in contexts:
    lines.append(f"  context {c:>7,} x batch {batch}: {per_token * c * batch / 2**30:8.2f} GiB")

  lines += ["", f"Decode roofline: batch {batch}, context {seq_len:,}, weights and KV cache in {dtype}"
            f" (one token per sequence per step; peak = dense bf16)",
            f"  {'device':<9}{'TB/s':>7}{'TFLOP/s':>9}{'ms/token':>10}  bound"]
  for name, r in decode_roofline(cfg, dtype, batch, seq_len).items():
    d = DEVICES[name]
    lines.append(f"  {name:<9}{d.memory_bandwidth / 1e12:>7.3g}{d.peak_flops / 1e12:>9.0f}"
                 f"{r['seconds'] * 1e3:>10.2f}  {r['bound']}")
  return "\n".join(lines)


@cli
def main(argv):
  """CLI entry point: `python -m jaxformer.inspect --config NAME [overrides...]`."""
  parser = argparse.ArgumentParser(prog="python -m jaxformer.inspect", description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True, help="recipe name (configs/<name>.py) or path")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=2")
  parser.add_argument("--dtype", default="bfloat16", help="bytes per weight and KV entry (default bfloat16)")
  parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
  parser.add_argument("--context", default="4096,32768", help="comma-separated context lengths for the KV cache")
  parser.add_argument("--seq-len", type=int, default=None,
                      help="training length for FLOPs and decode context for the roofline (default: the recipe's)")
  args = parser.parse_intermixed_args(argv)  # overrides before, between or after flags
  try:
    contexts = [int(c.replace("_", "")) for c in args.context.split(",") if c.strip()]
  except ValueError:
    raise UserError(f"--context {args.context!r}: expected comma-separated integers, e.g. 4096,32768") from None
  cfg = load_config(args.config, args.overrides)
  print(report(cfg, args.dtype, args.batch, contexts, args.seq_len))


if __name__ == "__main__":
  main()
