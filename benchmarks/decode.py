"""Greedy generation speed with and without the KV cache, prefill vs decode, memory.

    python benchmarks/decode.py --config shakespeare_char [overrides ...]
        [--batch 8] [--prompt-len 16] [--new-tokens 48] [--repeats 5] [--fast]

With the cache: `decode.generate` (prefill the prompt in one call, then one token per
step in a `lax.while_loop`); its prefill alone is timed with `decode.prefill`, and the
decode phase is the difference. Without: a jitted `fori_loop` that reruns the whole
model over the [batch, prompt + new] buffer for every token (causal, so the unfilled
slots do not matter). With learned positions and prompt + new tokens past the table
(model.max_len), `decode.generate` slides (nanoGPT's crop: each token past the table is
one full forward over the last max_len tokens): it is timed again for the tokens that
fit the table, and the rest is the "past the table" rate; the no-cache baseline then
crops as nanoGPT does. Both are greedy from the same randomly initialised weights; the
outputs are compared token by token. Times are medians over --repeats calls after a
compiling call; memory is the process's peak RSS so far (a running maximum) and the
device's peak where JAX reports one.

    python benchmarks/decode.py --config gpt2_small model.dtype=float32 --quantize 8,4 --batch 1 \
        [--group-size 128] [--embedding int8|int4|float]

With --quantize: the same random weights in float32 and quantized (`jaxformer.quantize`, int8 and/or
int4), side by side in interleaved rounds: prefill time, decode ms per step (one token per row: the
generate call less its prefill, over the steps after the first), the bytes one decode step reads (every
weight once, the tied table whole, the input rows not, plus the KV cache) and the bandwidth that
makes, against this machine's STREAM copy bandwidth (benchmarks/decode_vs_hf.py); tokens compared.
"""

import argparse
import functools
import os
import resource
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxformer import config as config_lib  # pylint: disable=g-import-not-at-top
from jaxformer import decode
from jaxformer import inspect as inspect_lib
from jaxformer import model as model_lib
from jaxformer import qmatmul
from jaxformer import runtime


@functools.partial(jax.jit, static_argnames=("model", "prompt_len", "steps", "context"))
def generate_without_cache(model, params, tokens, prompt_len, steps, context):
  """Greedy: tokens [batch, prompt_len + steps], prompt in front -> the `steps` new tokens.

  Each token reruns the model over the last `context` tokens (nanoGPT's crop when that
  is the position table; the whole buffer otherwise).
  """
  def body(i, tokens):
    start = jnp.maximum(prompt_len + i - context, 0)
    logits = model.apply({"params": params}, jax.lax.dynamic_slice_in_dim(tokens, start, context, axis=1))
    last = jax.lax.dynamic_index_in_dim(logits, prompt_len + i - 1 - start, axis=1, keepdims=False)
    return tokens.at[:, prompt_len + i].set(jnp.argmax(last, -1).astype(tokens.dtype))
  return jax.lax.fori_loop(0, steps, body, tokens)[:, prompt_len:]


def timed(fn, repeats):
  """(first call s, median s of `repeats` further calls, last result)."""
  t = time.perf_counter()
  out = jax.block_until_ready(fn())
  first = time.perf_counter() - t
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    out = jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return first, float(np.median(times)), out


def memory():
  """'peak RSS x GiB' (+ the device's peak bytes in use when JAX reports it)."""
  text = f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB"
  stats = jax.devices()[0].memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    text += f", device peak {stats['peak_bytes_in_use'] / 2**30:.2f} GiB"
  return text


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="shakespeare_char", help="a decoder-only recipe name or path")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=2")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--prompt-len", type=int, default=16)
  parser.add_argument("--new-tokens", type=int, default=48)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--fast", action="store_true", help="smoke run: batch 2, 8 + 8 tokens, 1 repeat")
  parser.add_argument("--quantize", default=None, help="e.g. 8,4: float32 against quantized weights, side by side")
  parser.add_argument("--group-size", type=int, default=128, help="int4 group (with --quantize)")
  parser.add_argument("--embedding", default="int8", choices=qmatmul.EMBEDDINGS, help="tables (with --quantize)")
  args = parser.parse_intermixed_args(argv)
  runtime.keep_freed_memory()  # as `jaxformer.generate` does
  if args.fast:
    args.batch, args.prompt_len, args.new_tokens, args.repeats = 2, 8, 8, 1
  cfg = config_lib.load_config(args.config, args.overrides)
  m = cfg.model
  if m.arch != "decoder_only":
    raise SystemExit(f"{cfg.name} is {m.arch}: this benchmark generates with a decoder-only model")
  total = args.prompt_len + args.new_tokens
  model = model_lib.build_model(m)
  window = decode.sliding_window(model, total - 1)
  if window and args.prompt_len > window:
    raise SystemExit(f"--prompt-len {args.prompt_len} > model.max_len {window}: no token would come from the cache")

  params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, m.vocab_size, (args.batch, args.prompt_len)).astype(np.int32)
  n_new = args.batch * args.new_tokens
  print(f"{cfg.name}: {m.num_layers} layers, d_model {m.d_model}, vocab {m.vocab_size}, {m.dtype} | "
        f"batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens | "
        f"{jax.devices()[0].device_kind} | {memory()} after init")
  slots = min(total - 1, window) if window else total - 1
  kv = inspect_lib.kv_cache_bytes_per_token(cfg, m.dtype) * args.batch * slots
  print(f"KV cache: {kv / 2**20:.2f} MiB ({m.dtype})")
  if window:
    print(f"past the {window}-position table after {window - args.prompt_len + 1} new tokens: "
          f"each further token is a full forward over the last {window} (nanoGPT's crop)")

  prompt_list = [list(p) for p in prompts]
  if args.quantize:
    return quantized_side_by_side(args, cfg, model, params, prompt_list, slots)
  greedy = lambda n: lambda: decode.generate(model, params, prompt_list, n, jax.random.key(0), temperature=0.0)
  prefill = lambda: decode.prefill(model, params, prompt_list, max_len=slots)
  buffer = jnp.zeros((args.batch, total), jnp.int32).at[:, :args.prompt_len].set(prompts)
  full = lambda: generate_without_cache(model, params, buffer, args.prompt_len, args.new_tokens, window or total)

  rows = []
  first, t_cached, cached = timed(greedy(args.new_tokens), args.repeats)
  rows.append(("KV cache (prefill + decode)", first, t_cached, n_new / t_cached, memory()))
  first, t_prefill, _ = timed(prefill, args.repeats)
  rows.append(("  prefill only", first, t_prefill, args.batch * args.prompt_len / t_prefill, "(prompt tokens/s)"))
  if window:
    n_in = window - args.prompt_len + 1                         # new tokens that fit the table
    first, t_in, _ = timed(greedy(n_in), args.repeats)
    t_decode = max(t_in - t_prefill, 1e-9)
    rows.append(("  decode in the table", float("nan"), t_decode, args.batch * (n_in - 1) / t_decode,
                 f"(new tokens 2..{n_in}, cached steps)"))
    t_past = max(t_cached - t_in, 1e-9)
    rows.append(("  decode past the table", float("nan"), t_past, args.batch * (args.new_tokens - n_in) / t_past,
                 f"(new tokens {n_in + 1}..{args.new_tokens}, a forward over {window} each)"))
  else:
    t_decode = max(t_cached - t_prefill, 1e-9)
    rows.append(("  decode phase (difference)", float("nan"), t_decode,
                 args.batch * (args.new_tokens - 1) / t_decode, ""))
  first, t_full, uncached = timed(full, args.repeats)
  rows.append(("no cache (nanoGPT's crop)" if window else "no cache (full recompute)", first, t_full,
               n_new / t_full, memory()))

  print(f"\n{'':30s}{'first call s':>13s}{'median s':>10s}{'tokens/s':>11s}")
  for name, first, t, rate, note in rows:
    print(f"{name:30s}{first:13.3f}{t:10.4f}{rate:11,.0f}  {note}")
  cached, uncached = np.asarray(cached), np.asarray(uncached)
  same = cached == uncached
  where = "" if same.all() else f" (first difference at new token {int(np.argmin(same.all(0)))})"
  print(f"\nidentical greedy output: {'yes' if same.all() else 'no'}{where}; "
        f"cache speed-up {t_full / t_cached:.1f}x")


def step_bytes(cfg, params, kv_bytes):
  """Bytes one decode step reads: every weight once, except the input rows of an untied embedding
  table and of the position table (a row each); plus the KV cache."""
  weights = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
  embed = params["embed"]
  if not cfg.model.tie_output:
    weights -= sum(np.asarray(x).nbytes for x in jax.tree.leaves(embed))
  if "position_embedding" in params.get("decoder", {}):
    weights -= np.asarray(params["decoder"]["position_embedding"]).nbytes
  return weights + kv_bytes


def quantized_side_by_side(args, cfg, model, params, prompt_list, slots):
  """float32 against int8/int4 weights (same weights), interleaved rounds: prefill, decode ms/step, bandwidth."""
  from decode_vs_hf import stream_bandwidth  # pylint: disable=g-import-not-at-top
  from jaxformer import qkernel, quantize  # pylint: disable=g-import-not-at-top
  print(f"quantized-matmul CPU kernel: {qkernel.unavailable() or 'built (jaxformer/csrc/qmatmul.cc)'}")
  params = jax.tree.map(np.asarray, nn.unbox(params))
  variants = {"float32": params}
  for bits in (int(b) for b in args.quantize.split(",")):
    variants[f"int{bits}"] = jax.tree.map(jnp.asarray, quantize.quantize_params(
        params, cfg.model, bits, args.group_size, args.embedding)[0])
  variants["float32"] = jax.tree.map(jnp.asarray, params)  # (first in the table: the reference)
  kv = inspect_lib.kv_cache_bytes_per_token(cfg, cfg.model.dtype) * args.batch * slots
  copy = stream_bandwidth()["copy"]  # bytes/s
  steps = args.new_tokens - 1
  times = {name: {"prefill": [], "generate": []} for name in variants}
  outputs = {}
  for name, p in variants.items():  # compile
    outputs[name] = np.asarray(decode.generate(model, p, prompt_list, args.new_tokens, jax.random.key(0),
                                               temperature=0.0))
    jax.block_until_ready(decode.prefill(model, p, prompt_list, max_len=slots))
  for _ in range(args.repeats):
    for name, p in variants.items():
      t = time.perf_counter()
      jax.block_until_ready(decode.prefill(model, p, prompt_list, max_len=slots))
      times[name]["prefill"].append(time.perf_counter() - t)
      t = time.perf_counter()
      jax.block_until_ready(decode.generate(model, p, prompt_list, args.new_tokens, jax.random.key(0),
                                            temperature=0.0))
      times[name]["generate"].append(time.perf_counter() - t)
  print(f"STREAM copy bandwidth: {copy / 1e9:.1f} GB/s | batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, medians of {args.repeats} interleaved rounds")
  print(f"\n{'weights':10s}{'prefill ms':>11s}{'decode ms/step':>16s}{'x float32':>10s}{'MiB/step':>10s}"
        f"{'GB/s':>7s}{'% copy bw':>10s}{'prefill x':>10s}  tokens vs float32")
  base = None
  for name, p in variants.items():
    prefill = float(np.median(times[name]["prefill"]))
    per_token = max(float(np.median(times[name]["generate"])) - prefill, 1e-9) / steps
    nbytes = step_bytes(cfg, p, kv)
    base = base or (per_token, prefill)
    same = float(np.mean(outputs[name] == outputs["float32"]))
    print(f"{name:10s}{prefill * 1e3:11.1f}{per_token * 1e3:16.2f}{per_token / base[0]:10.2f}{nbytes / 2**20:10.1f}"
          f"{nbytes / per_token / 1e9:7.1f}{100 * nbytes / per_token / copy:9.0f}%{prefill / base[1]:10.2f}  "
          f"{100 * same:.0f}% equal")


if __name__ == "__main__":
  main()
