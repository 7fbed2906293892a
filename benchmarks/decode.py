"""Greedy generation speed with and without the KV cache, prefill vs decode, memory.

    python benchmarks/decode.py --config shakespeare_char [overrides ...]
        [--batch 8] [--prompt-len 16] [--new-tokens 48] [--repeats 5] [--fast]

With the cache: `decode.generate` (prefill the prompt in one call, then one token per
step in a `lax.while_loop`); its prefill alone is timed with `decode.prefill`, and the
decode phase is the difference. Without: a jitted `fori_loop` that reruns the whole
model over the [batch, prompt + new] buffer for every token (causal, so the unfilled
slots do not matter). Both are greedy from the same randomly initialised weights; the
outputs are compared token by token. Times are medians over --repeats calls after a
compiling call; memory is the process's peak RSS so far (a running maximum) and the
device's peak where JAX reports one.
"""

import argparse
import functools
import os
import resource
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxformer import config as config_lib  # pylint: disable=g-import-not-at-top
from jaxformer import decode
from jaxformer import inspect as inspect_lib
from jaxformer import model as model_lib
from jaxformer import runtime


@functools.partial(jax.jit, static_argnames=("model", "prompt_len", "steps"))
def generate_without_cache(model, params, tokens, prompt_len, steps):
  """Greedy: tokens [batch, prompt_len + steps], prompt in front -> the `steps` new tokens."""
  def body(i, tokens):
    logits = model.apply({"params": params}, tokens)
    last = jax.lax.dynamic_index_in_dim(logits, prompt_len + i - 1, axis=1, keepdims=False)
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
  args = parser.parse_intermixed_args(argv)
  runtime.keep_freed_memory()  # as `jaxformer.generate` does
  if args.fast:
    args.batch, args.prompt_len, args.new_tokens, args.repeats = 2, 8, 8, 1
  cfg = config_lib.load_config(args.config, args.overrides)
  m = cfg.model
  if m.arch != "decoder_only":
    raise SystemExit(f"{cfg.name} is {m.arch}: this benchmark generates with a decoder-only model")
  total = args.prompt_len + args.new_tokens
  if m.position == "learned" and total > m.max_len:
    raise SystemExit(f"prompt + new tokens = {total} > model.max_len = {m.max_len} (learned positions)")

  model = model_lib.build_model(m)
  params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, total), jnp.int32))["params"]
  rng = np.random.default_rng(0)
  prompts = rng.integers(3, m.vocab_size, (args.batch, args.prompt_len)).astype(np.int32)
  n_new = args.batch * args.new_tokens
  print(f"{cfg.name}: {m.num_layers} layers, d_model {m.d_model}, vocab {m.vocab_size}, {m.dtype} | "
        f"batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens | "
        f"{jax.devices()[0].device_kind} | {memory()} after init")
  kv = inspect_lib.kv_cache_bytes_per_token(cfg, m.dtype) * args.batch * (total - 1)
  print(f"KV cache: {kv / 2**20:.2f} MiB ({m.dtype})")

  prompt_list = [list(p) for p in prompts]
  greedy = lambda: decode.generate(model, params, prompt_list, args.new_tokens, jax.random.key(0),
                                   temperature=0.0)
  prefill = lambda: decode.prefill(model, params, prompt_list, max_len=total - 1)
  buffer = jnp.zeros((args.batch, total), jnp.int32).at[:, :args.prompt_len].set(prompts)
  full = lambda: generate_without_cache(model, params, buffer, args.prompt_len, args.new_tokens)

  rows = []
  first, t_cached, cached = timed(greedy, args.repeats)
  rows.append(("KV cache (prefill + decode)", first, t_cached, n_new / t_cached, memory()))
  first, t_prefill, _ = timed(prefill, args.repeats)
  rows.append(("  prefill only", first, t_prefill, args.batch * args.prompt_len / t_prefill, "(prompt tokens/s)"))
  t_decode = max(t_cached - t_prefill, 1e-9)
  rows.append(("  decode phase (difference)", float("nan"), t_decode,
               args.batch * (args.new_tokens - 1) / t_decode, ""))
  first, t_full, uncached = timed(full, args.repeats)
  rows.append(("no cache (full recompute)", first, t_full, n_new / t_full, memory()))

  print(f"\n{'':30s}{'first call s':>13s}{'median s':>10s}{'tokens/s':>11s}")
  for name, first, t, rate, note in rows:
    print(f"{name:30s}{first:13.3f}{t:10.4f}{rate:11,.0f}  {note}")
  cached, uncached = np.asarray(cached), np.asarray(uncached)
  same = cached == uncached
  where = "" if same.all() else f" (first difference at new token {int(np.argmin(same.all(0)))})"
  print(f"\nidentical greedy output: {'yes' if same.all() else 'no'}{where}; "
        f"cache speed-up {t_full / t_cached:.1f}x")


if __name__ == "__main__":
  main()
