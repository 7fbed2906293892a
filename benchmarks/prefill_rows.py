"""Quantized prefill by rows, through each CPU path: the C++ kernel and the XLA path, against float32.

    python benchmarks/prefill_rows.py [--rows 8,16,24,32,64,128,256,512] [--rounds 15] [--bits 8,4] [--activations int8,int16]
    python benchmarks/prefill_rows.py --memory [--rows 1,512]    # each default program's temporaries, no timing

GPT-2 124M shapes (random weights; int8 tables, int4 group 128), one prompt of `rows` tokens through
`decode.prefill`'s program. For each row count, in one process: float32, then per scheme its prompt's products
forced onto the C++ kernel (`qkernel.call`) or onto the XLA path (the weights converted for XLA's GEMM right
before each product, `qmatmul._after`); the head's one row stays on the kernel in both. The variants run in
interleaved rounds (this machine's speed drifts by ~10% over a minute) and each prints its median time and
its ratio to float32's, followed by the quartiles of the rounds' own ratios (each round's time over that round's
float32 time): the spread to read the ratio against. `qmatmul.GEMM_MAX_ROWS` (AVX-512 builds: the kernel at every
row count, its blocked product from 25 rows for int8, 16 for int4) and `KERNEL_MAX_ROWS` (other builds) are set
from this table; the last column says which path the default picks. --activations adds per scheme the opt-in integer
activations named (`model.quant_activations=int8` / `int16`: the kernel's VNNI product from `qmatmul.ACT_MIN_ROWS`
rows, the default paths below). --memory prints instead the temporaries
(`memory_analysis()`) of the programs the defaults compile, float32 and each scheme; it runs without the kernel too (`JAXFORMER_QKERNEL=off`: the XLA path).
"""

import argparse
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxformer import config as config_lib  # pylint: disable=g-import-not-at-top
from jaxformer import decode, qkernel, qmatmul, quantize
from jaxformer import model as model_lib


def gpt2_params(schemes, activations="float"):
  """(model, {32: float32 params, bits: quantized params per scheme}): GPT-2 124M, random weights, int8 tables,
  int4 group 128; the model's `quant_activations` as given."""
  cfg = config_lib.load_config("gpt2_small", ["model.dtype=float32"])
  model = model_lib.build_model(cfg.model)
  if activations != "float":
    return model_lib.build_model(config_lib.replace(cfg, **{"model.quant_activations": activations}).model), None
  floats = jax.tree.map(np.asarray, nn.unbox(jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]))
  params = {32: jax.tree.map(jnp.asarray, floats)}
  for bits in schemes:
    params[bits] = jax.tree.map(jnp.asarray, quantize.quantize_params(floats, cfg.model, bits, 128, "int8")[0])
  return model, params


def prefill_program(model, params, bits, rows, limit=None):
  """(run, compiled): `decode.prefill`'s program for one prompt of `rows` tokens on `params` (scheme `bits`),
  compiled and run once. limit: the kernel's row limit for `bits` while tracing (10 ** 6: every quantized product
  on the C++ kernel; 1: calls of 2+ rows on the XLA path, the head's one row on the kernel); None: the defaults."""
  prompt = [np.random.default_rng(rows).integers(3, 5000, rows).tolist()]
  tokens, lengths = decode._left_pad(prompt, None)  # pylint: disable=protected-access
  tables = (qmatmul.KERNEL_MAX_ROWS, qmatmul.GEMM_MAX_ROWS)
  saved = [dict(t) for t in tables]
  if limit is not None:
    for table in tables:
      table[bits] = limit  # read when the program is traced, just below
  try:
    # a new function each time: jit reuses a function's traced program for the same argument shapes
    step = jax.jit(lambda *a: decode._prefill(*a), static_argnums=0)  # pylint: disable=protected-access,unnecessary-lambda
    cache = decode.init_cache(model, 1, rows + 8)
    compiled = step.lower(model, params, tokens, lengths, cache).compile()
    run = lambda: jax.block_until_ready(compiled(params, tokens, lengths, cache))
    run()
  finally:
    for table, values in zip(tables, saved):
      table.update(values)
  return run, compiled


def memory(model, params, rows_list):
  """Prints the temporaries of `decode.prefill`'s program, as compiled with the default paths, per scheme and rows."""
  print(f"GPT-2 124M prefill, temporaries (memory_analysis); C++ kernel: {qkernel.unavailable() or 'built'}")
  for bits, p in params.items():
    sizes = []
    for rows in rows_list:
      tokens, lengths = decode._left_pad([list(range(3, 3 + rows))], None)  # pylint: disable=protected-access
      cache = decode.init_cache(model, 1, rows + 8)
      compiled = jax.jit(decode._prefill, static_argnums=0).lower(model, p, tokens, lengths, cache).compile()  # pylint: disable=protected-access
      sizes.append(f"{rows} rows {compiled.memory_analysis().temp_size_in_bytes / 2 ** 20:.1f} MiB")
    print(f"{'float32' if bits == 32 else f'int{bits}'}: " + ", ".join(sizes), flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", default="8,16,24,32,64,128,256,512")
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--bits", default="8,4")
  parser.add_argument("--memory", action="store_true", help="the default programs' temporaries, no timing")
  parser.add_argument("--activations", default="", help="also these integer activations, e.g. int8,int16 "
                      "(model.quant_activations)")
  args = parser.parse_args(argv)
  if qkernel.unavailable() and not args.memory:
    sys.exit(f"prefill_rows: the C++ kernel is unavailable ({qkernel.unavailable()}): nothing to compare")
  schemes = [int(b) for b in args.bits.split(",")]
  model, params = gpt2_params(schemes)
  if args.memory:
    return memory(model, params, [int(r) for r in args.rows.split(",")])
  defaults = {bits: qmatmul.kernel_max_rows(bits) for bits in schemes}
  print(f"GPT-2 124M prefill, one prompt, medians of {args.rounds} interleaved rounds; "
        f"the kernel up to {', '.join(f'int{b}: {v} rows' for b, v in defaults.items())} "
        f"(blocked product from {qkernel.gemm_rows()} rows)", flush=True)
  acts = [a for a in args.activations.split(",") if a]
  act_models = {act: gpt2_params(schemes, act)[0] for act in acts}
  paths = ("kernel", "XLA") + tuple(f"a{qkernel.ACT_BITS[act]}" for act in acts)
  print(f"{'rows':>5} {'float32 ms':>11}" + "".join("".join(f" {f'int{b} {p}':>16}" for p in paths) + f" {'picks':>7}"
                                                  for b in schemes))
  for rows in (int(r) for r in args.rows.split(",")):
    variants = {"float32": (32, None)}
    for bits in schemes:
      variants[f"int{bits} kernel"] = (bits, 10 ** 6)  # every call on the kernel
      variants[f"int{bits} XLA"] = (bits, 1)           # calls of 2+ rows on the XLA path (the head's 1 row: kernel)
    runs = {name: (prefill_program(model, params[bits], bits, rows, limit)[0], [])
            for name, (bits, limit) in variants.items()}
    for act, act_model in act_models.items():
      for bits in schemes:
        runs[f"int{bits} a{qkernel.ACT_BITS[act]}"] = (prefill_program(act_model, params[bits], bits, rows)[0], [])
    for _ in range(args.rounds):
      for run, times in runs.values():
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    median = {name: float(np.median(times)) for name, (_, times) in runs.items()}
    line = f"{rows:>5} {median['float32'] * 1e3:>11.1f}"
    for bits in schemes:
      picks = "kernel" if rows <= defaults[bits] else "XLA"
      for path in paths:
        # the ratio of medians, and the quartiles of the rounds' own ratios (each round's time over its float32's)
        per_round = np.asarray(runs[f"int{bits} {path}"][1]) / np.asarray(runs["float32"][1])
        q1, q3 = np.percentile(per_round, [25, 75])
        line += f" {median[f'int{bits} {path}'] / median['float32']:>5.2f}x {q1:.2f}-{q3:.2f}"
      line += f" {picks:>7}"
    print(line, flush=True)


if __name__ == "__main__":
  main()
