"""Training-step speed: ms/step, tokens/s, model TFLOP/s, MFU, compile time.

    python benchmarks/train_step.py --config shakespeare_char [overrides ...]
        [--steps-per-call 1,25] [--xla-option KEY=VALUE ...] [--rounds 7] [--steps 50]
        [--peak TFLOPS] [--batch B,S,T] [--also 'model.matmul_dtype=bfloat16'] [--fast]

Each variant (every --steps-per-call value, each also with the --xla-option compiler
options when given) runs interleaved in one process, A, B, A, B, ..., and the figures
are medians over rounds, so a busy machine slows all variants alike. Timed is the
jitted step (the trainer's own `make_train_step`/`make_multi_step`); batches are built
and put on the device beforehand (benchmarks/input_pipeline.py measures the data side).
With --batch B,S,T (translation) or B,T (LM) the batches are random tokens of exactly
that shape with no padding, e.g. `--config multi30k <wmt_base sizes> --batch 64,24,24`
for Multi30k-length sentences (the data still builds the tokenizer). --also 'OVERRIDES' adds
a variant per K: the same batches through a model built with those extra overrides (e.g.
`--also model.matmul_dtype=bfloat16`), interleaved with the others.
CPU ms/step is the process's CPU time (all threads): under load it is steadier than
wall time. temp MiB is the compiled step's temporary memory by XLA's `memory_analysis`
(the same figure on any backend: what, besides the state and batch, must fit on a device).

Model FLOPs come from `inspect.flops_per_token`: 2 x matmul weights per token plus
attention, with causal self-attention counted as half the square ((L+1)/2 keys per
query), and backward = 2 x forward. MFU divides by the device's dense bf16 peak from
`inspect.DEVICES`, by --peak, or on CPU by a large matmul timed after every round (float32,
or bf16 operands for a model whose matmuls are bf16: model.dtype or model.matmul_dtype);
each round's MFU uses its own round's peak and the median is shown.
"""

import argparse
import datetime
import os
import resource
import sys
import tempfile
import time

import flax.linen as nn
import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxformer import config as config_lib  # pylint: disable=g-import-not-at-top
from jaxformer import inspect as inspect_lib
from jaxformer import runtime
from jaxformer import sharding
from jaxformer import train


def _parse_options(items):
  """["key=value", ...] -> {key: value} with true/false/ints parsed (XLA debug options)."""
  options = {}
  for item in items:
    key, _, value = item.partition("=")
    key = key.lstrip("-")
    low = value.lower()
    options[key] = True if low == "true" else False if low == "false" else int(value) if value.isdigit() else value
  return options


def random_batch(like, shape, vocab, seed):
  """A batch with `like`'s keys: random tokens of `shape` (B,S,T or B,T), every slot real."""
  rng = np.random.default_rng(seed)
  batch_size, lengths = shape[0], shape[1:]
  if "decoder_inputs" in like:  # translation: inputs [B, S]; targets, decoder_inputs [B, T]
    if len(lengths) != 2:
      raise SystemExit("error: --batch for a translation config is B,S,T (e.g. 64,24,24)")
    s, t = lengths
    targets = rng.integers(3, vocab, (batch_size, t), dtype=np.int32)
    return {"inputs": rng.integers(3, vocab, (batch_size, s), dtype=np.int32), "targets": targets,
            "decoder_inputs": np.concatenate([np.ones((batch_size, 1), np.int32), targets[:, :-1]], 1),
            "inputs_segmentation": np.ones((batch_size, s), np.int32),
            "targets_segmentation": np.ones((batch_size, t), np.int32),
            "inputs_position": np.broadcast_to(np.arange(s, dtype=np.int32), (batch_size, s)).copy(),
            "targets_position": np.broadcast_to(np.arange(t, dtype=np.int32), (batch_size, t)).copy()}
  if len(lengths) != 1:
    raise SystemExit("error: --batch for a language-model config is B,T (e.g. 16,256)")
  tokens = rng.integers(3, vocab, (batch_size, lengths[0] + 1), dtype=np.int32)
  out = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones_like(tokens[:, 1:]),
         "positions": np.broadcast_to(np.arange(lengths[0], dtype=np.int32), tokens[:, 1:].shape).copy()}
  return {k: out[k] for k in like}


class Variant:
  """One jitted train step (K steps per call) with its own state and timings."""

  def __init__(self, name, k, options, cfg, parts, batches):
    mesh, task, model, tx, schedule, init_fn, rng, state_sharding = parts
    self.name, self.k, self.cfg = name, k, cfg
    step = train.make_train_step(model, task, cfg, tx, schedule)
    fn = step if k == 1 else train.make_multi_step(step)
    # As in train.train_and_evaluate, so the step compiles once.
    self.jitted = jax.jit(fn, in_shardings=(state_sharding, sharding.batch_sharding(mesh)),
                          out_shardings=(state_sharding, None), donate_argnums=0,
                          compiler_options=options or None)
    self.call = train._under_mesh(mesh, self.jitted)  # pylint: disable=protected-access
    self.state = jax.jit(lambda r: nn.unbox(init_fn(r)), out_shardings=state_sharding)(rng)
    n = len(batches) // k
    self.inputs = batches[:n] if k == 1 else [tuple(batches[i * k:(i + 1) * k]) for i in range(n)]
    self.wall, self.cpu, self.faults = [], [], []
    before = len(runtime.COMPILES)
    t = time.perf_counter()
    self.state, metrics = self.call(self.state, self.inputs[0])
    jax.block_until_ready(metrics)
    self.first_call = time.perf_counter() - t
    self.compile_s = sum(runtime.COMPILES[before:])
    # XLA's own account of the step's temporary buffers (activations kept for the backward
    # pass, logits, gradients in flight): the figure that decides what fits on a GPU/TPU.
    # Lowered again for it: JAX's in-memory caches make that ~5 ms, no second compile.
    with sharding.use_mesh(mesh):
      memory = self.jitted.lower(self.state, self.inputs[0]).compile().memory_analysis()
    self.temp_mib = memory.temp_size_in_bytes / 2**20 if memory is not None else float("nan")

  def run(self, steps):
    """Runs about `steps` steps; records wall, CPU time and page faults per step."""
    calls = max(1, steps // self.k)
    f0, c0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
    for i in range(calls):
      self.state, metrics = self.call(self.state, self.inputs[i % len(self.inputs)])
    jax.block_until_ready(metrics)
    n = calls * self.k
    self.wall.append((time.perf_counter() - t0) / n)
    self.cpu.append((time.process_time() - c0) / n)
    self.faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / n)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="shakespeare_char", help="recipe name or path")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.num_layers=2")
  parser.add_argument("--steps-per-call", default=None,
                      help="comma-separated K values (default: 1 and the config's train.steps_per_call)")
  parser.add_argument("--xla-option", action="append", default=[],
                      help="XLA debug option KEY=VALUE for extra variants, e.g. "
                           "xla_cpu_experimental_ynn_fusion_type= (repeatable; all go into one variant)")
  parser.add_argument("--also", action="append", default=[],
                      help="extra model overrides for another variant on the same batches, e.g. "
                           "'model.matmul_dtype=bfloat16' (repeatable; space-separated overrides)")
  parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (median over them)")
  parser.add_argument("--steps", type=int, default=50, help="steps per variant per round")
  parser.add_argument("--peak", type=float, default=None, help="peak TFLOP/s for MFU (overrides the lookup)")
  parser.add_argument("--batch", default=None,
                      help="B,S,T (translation) or B,T (LM): random full batches of this shape instead of data")
  parser.add_argument("--fast", action="store_true", help="smoke run: 2 rounds, few steps, small matmul")
  args = parser.parse_intermixed_args(argv)
  kept = runtime.keep_freed_memory()  # as train.py does (JAXFORMER_KEEP_MEMORY=off: glibc's default)
  if args.fast:
    args.rounds, args.steps = 2, 4

  cfg = config_lib.load_config(args.config, args.overrides)
  alsos = [(also, config_lib.load_config(args.config, args.overrides + also.split())) for also in args.also]
  if any(cfg_also.data != cfg.data for _, cfg_also in alsos):
    raise SystemExit("error: --also may change the model (or optimizer), not the data: the variants share batches")
  ks = sorted({1, cfg.train.steps_per_call}) if args.steps_per_call is None else [
      int(k) for k in args.steps_per_call.split(",")]
  if args.fast:
    args.steps = max(args.steps, max(ks))
  options = _parse_options(args.xla_option)
  workdir = tempfile.mkdtemp(prefix="bench_train_step_")
  mesh, task, model, tx, schedule, init_fn, rng, _, state_sharding = train.setup(cfg, workdir, log=lambda *a: None)
  parts = (mesh, task, model, tx, schedule, init_fn, rng, state_sharding)
  if task.name != "lm" and ks != [1]:
    print("translation trains one step per call (see train._steps_this_call): K=1 only")
    ks = [1]

  # Batches of the first batch's shape only (translation buckets vary), ready on the device.
  first = task.train_batch(0)
  shape = {k: v.shape for k, v in first.items()}
  batches, i = [], 0
  while len(batches) < 2 * max(ks) and i < 50 * max(ks):
    b = task.train_batch(i)
    if {k: v.shape for k, v in b.items()} == shape:
      batches.append(b)
    i += 1
  while len(batches) < 2 * max(ks):
    batches += batches[:2 * max(ks) - len(batches)]
  if args.batch:
    batches = [random_batch(first, [int(x) for x in args.batch.split(",")], cfg.model.vocab_size, i)
               for i in range(len(batches))]
    first = batches[0]
  tokens = np.mean([task.num_tokens(b) for b in batches])
  seq_len = first["targets"].shape[1]
  flops_per_token = inspect_lib.flops_per_token(cfg, seq_len)["train"]
  target_tokens = np.mean([b["targets_segmentation"].sum() if "targets_segmentation" in b else b["targets"].size
                           for b in batches])
  flops_per_step = target_tokens * flops_per_token
  batches = [sharding.global_batch(b, sharding.batch_sharding(mesh)) for b in batches]

  device = jax.devices()[0]
  measure_peak = False  # on CPU: a matmul timed after every round, per operand dtype
  if args.peak:
    peak, peak_note = args.peak * 1e12, "--peak"
  elif inspect_lib.peak_flops(device.device_kind):
    peak = inspect_lib.peak_flops(device.device_kind) * jax.device_count()
    peak_note = f"{inspect_lib.device_name(device.device_kind)} dense bf16 x {jax.device_count()}"
  elif device.platform == "cpu":
    n = 1024 if args.fast else 2048
    measure_peak = True
    peak, peak_note = inspect_lib.matmul_peak(n), f"float32 {n}^3 matmul, best of 5, re-measured every round"
    if any(inspect_lib.matmul_dtype(c) == "bfloat16" for c in [cfg] + [c for _, c in alsos]):
      peak_note += "; bf16 variants against a bf16-operand matmul"
  else:
    peak, peak_note = None, "unknown"

  m = cfg.model
  print(f"{datetime.date.today()} | jax {jax.__version__} | {jax.device_count()} x {device.device_kind} "
        f"({os.cpu_count()} CPUs) | XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r} | "
        f"freed memory {'kept' if kept else 'returned to the OS'}")
  print(f"config {cfg.name}: {m.arch}, {m.num_layers} layers, d_model {m.d_model}, {m.num_heads} heads, "
        f"d_ff {m.d_ff}, vocab {m.vocab_size}, {m.dtype}; batch {tuple(first['inputs'].shape)}, "
        f"{tokens:,.0f} tokens/step")
  print(f"model FLOPs: {flops_per_token / 1e6:.2f} MFLOP per target token in training (causal attention "
        f"counted as half the square, backward = 2 x forward) = {flops_per_step / 1e9:.2f} GFLOP/step")
  if peak:
    print(f"peak for MFU: {peak / 1e12:.3f} TFLOP/s ({peak_note})")

  variants = []
  for k in ks:
    for opts in ([{}, options] if options else [{}]):
      name = f"K={k}" + (" +" + ",".join(f"{a}={b}" for a, b in opts.items()) if opts else "")
      variants.append(Variant(name, k, opts, cfg, parts, batches))
    for also, cfg_also in alsos:  # the same batches through a model built with more overrides
      *setup_also, _, state_sharding_also = train.setup(cfg_also, workdir, log=lambda *a: None)
      parts_also = (*setup_also[:7], state_sharding_also)
      variants.append(Variant(f"K={k} +{also}", k, {}, cfg_also, parts_also, batches))
  # On a CPU the matmul peak moves with the machine's load and clock (+/-15% between
  # runs here), so it is measured again every round and each round's MFU uses its own.
  # bf16 matmuls (model.dtype or model.matmul_dtype) are measured against a bf16 peak.
  peaks = {dtype: [] for dtype in {inspect_lib.matmul_dtype(v.cfg) for v in variants}} if measure_peak else {}
  for _ in range(args.rounds):
    for v in variants:
      v.run(args.steps)
    for dtype, values in peaks.items():
      values.append(inspect_lib.matmul_peak(n, dtype=dtype))

  width = max(len(v.name) for v in variants)
  print(f"\n{'variant':<{width}}  ms/step  (min)  cpu ms/step  tokens/s  TFLOP/s    MFU  faults/step"
        f"  temp MiB  compile s  first call s  compilations")
  for v in variants:
    wall = float(np.median(v.wall))
    peak_of_round = np.array(peaks[inspect_lib.matmul_dtype(v.cfg)]) if measure_peak else peak
    mfu = (f"{100 * np.median(flops_per_step / np.array(v.wall) / peak_of_round):5.1f}%"
           if peak else "    -")
    print(f"{v.name:<{width}}  {1e3 * wall:7.2f} {1e3 * min(v.wall):6.2f}  {1e3 * np.median(v.cpu):11.2f}"
          f"  {tokens / wall:8,.0f}  {flops_per_step / wall / 1e12:7.4f}  {mfu}  {np.median(v.faults):11,.0f}"
          f"  {v.temp_mib:8,.0f}  {v.compile_s:9.2f}  {v.first_call:12.2f}  {v.jitted._cache_size():12d}")  # pylint: disable=protected-access
  print(f"\n{args.rounds} interleaved rounds x {args.steps} steps per variant; medians (min = best round)")
  for dtype, values in peaks.items():
    print(f"{dtype} matmul peak per round: {', '.join(f'{p / 1e12:.3f}' for p in values)} TFLOP/s; "
          f"MFU = median over rounds of (model FLOP/s in the round / that round's peak)")


if __name__ == "__main__":
  main()
