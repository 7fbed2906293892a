"""One command for a GPU or TPU machine: which attention kernel each program runs, train-step MFU, decode roofline.

    python benchmarks/device_check.py [--steps 20] [--rounds 3] [--fast]

On whatever devices JAX sees (all of them, FSDP over every device as train.py's default
mesh does), in bf16 (the recipes' own model.dtype):
- `gpt2_small` (1,024 tokens, 8 sequences per device) and `wmt_base` (64 sentence pairs
  of 64 + 64 tokens per device) train steps, the trainer's own `make_train_step`, on
  random full batches (no data set is read: the machine may have no internet), once per
  `model.attention_impl` (auto and the backend's kernels, `KERNELS`, or --kernels), so the
  line per program says which kernel is fastest there and how auto compares. Printed:
  the kernel the attention dispatcher chose for each shape (its log lines), ms/step,
  tokens/s, MFU against the datasheet bf16 peak in `inspect.DEVICES` x device count, and
  XLA's temporaries.
- Batch-1 greedy decode of `gpt2_small` (random weights, 128-token prompt, 128 new
  tokens, `decode.generate`): ms per token against the bandwidth roofline of
  `decode_vs_hf.roofline` (weights + KV cache read once per token), with the datasheet
  memory bandwidth; on a CPU, the measured STREAM bandwidth instead.
Timings are medians over --rounds of --steps steps, the two train steps interleaved.
It reuses `train_step.Variant`/`random_batch` and `decode_vs_hf.build`/`ours_lm`/`roofline`.

--fast: `gpt2_tiny` and `tiny_encdec` shapes on this CPU, a few steps (the smoke test in
tests/test_benchmarks.py). It has NOT run on a GPU or TPU yet (BENCHMARKS.md).
"""

import argparse
import datetime
import functools
import importlib.util
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from jaxformer import aot  # pylint: disable=g-import-not-at-top
from jaxformer import config as config_lib
from jaxformer import inspect as inspect_lib
from jaxformer import layers
from jaxformer import model as model_lib
from jaxformer import optim
from jaxformer import sharding
from jaxformer import tasks
from jaxformer import train


def _load(name):
  """A sibling benchmark module (benchmarks/ is not a package)."""
  spec = importlib.util.spec_from_file_location(name, os.path.join(HERE, f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


train_step = _load("train_step")
decode_vs_hf = _load("decode_vs_hf")

# (recipe, overrides, per-device batch shape: B,T for an LM, B,S,T for translation)
FULL = {"gpt2_small": ("gpt2_small", ["model.dtype=bfloat16"], (8, 1024)),
        "wmt_base": ("wmt_base", ["model.dtype=bfloat16"], (64, 64, 64))}
FAST = {"gpt2_small": ("gpt2_tiny", ["model.dtype=bfloat16", "model.num_layers=1"], (2, 32)),
        "wmt_base": ("tiny_encdec", ["model.dtype=bfloat16", "model.num_layers=1"], (2, 16, 16))}
# model.attention_impl values timed beside `auto` per platform: the dense path auto keeps below its
# length threshold, the vendor kernel, the tiled one (a request that cannot run logs its fallback).
KERNELS = {"gpu": ["xla", "cudnn", "tiled"], "tpu": ["einsum", "splash", "tiled"], "cpu": ["einsum", "tiled"]}
DECODE = {False: ("gpt2_small", ["model.dtype=bfloat16"], 128, 128), True: ("gpt2_tiny", ["model.dtype=bfloat16"], 8, 8)}


def capture_kernels():
  """(lines, stop): the dispatcher's choices (`layers.log_attention_choices`) while programs are traced."""
  lines = []
  layers.log_attention_choices(lines.append)
  return lines, lambda: layers.log_attention_choices(None)


def train_variant(name, recipe, overrides, shape, mesh, seed=0):
  """(train_step.Variant, cfg, FLOPs per step, tokens per step, kernel log lines) for random batches of `shape`."""
  cfg = config_lib.load_config(recipe, [*overrides, "mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=1"])
  model = model_lib.build_model(cfg.model)
  tx, schedule = optim.build_optimizer(cfg)
  lm = cfg.data.task == "lm"
  task = tasks.LMTask if lm else tasks.TranslationTask  # the step uses the class's loss only (as aot.py)
  ids = jnp.ones((1, 4), jnp.int32)
  init_fn = functools.partial(train.init_state, model, tx, (ids,) if lm else (ids, ids))
  rng = jax.random.key(cfg.train.seed)
  state_sharding = sharding.logical_sharding(jax.eval_shape(init_fn, rng), mesh)
  devices = mesh.devices.size
  shape = (shape[0] * devices, *shape[1:])
  like = aot.abstract_batch(cfg, shape[0], shape[1:])
  batches = [train_step.random_batch(like, shape, cfg.model.vocab_size, seed + i) for i in range(2)]
  tokens = sum(b["targets"].size + (b["inputs"].size if not lm else 0) for b in batches[:1])
  flops = batches[0]["targets"].size * inspect_lib.flops_per_token(cfg, shape[-1])["train"]
  batches = [sharding.global_batch(b, sharding.batch_sharding(mesh)) for b in batches]
  lines, done = capture_kernels()
  try:
    variant = train_step.Variant(name, 1, {}, cfg, (mesh, task, model, tx, schedule, init_fn, rng, state_sharding),
                                 batches)
  finally:
    done()
  return variant, cfg, flops, tokens, lines


def decode_check(fast, bandwidth, peak):
  """(lines) batch-1 greedy decode of gpt2_small against the bandwidth roofline."""
  recipe, overrides, prompt_len, new = DECODE[fast]
  lines, done = capture_kernels()
  try:
    cfg, model, params = decode_vs_hf.build(recipe, overrides)
    params = jax.device_put(jax.tree.map(lambda x: jnp.asarray(x, jnp.bfloat16), params))
    prompts = np.random.default_rng(0).integers(3, cfg.model.vocab_size, (1, prompt_len)).astype(np.int32)
    decode_vs_hf.ours_lm(model, params, prompts, new)  # compile
  finally:
    done()
  runs = [decode_vs_hf.ours_lm(model, params, prompts, new)[:2] for _ in range(3)]
  prefill, total = (float(np.median(x)) for x in zip(*runs))
  per_token = (total - prefill) / (new - 1)
  bound, weights, kv = decode_vs_hf.roofline(cfg, jax.tree.map(np.asarray, params), 1, prompt_len + new // 2,
                                             bandwidth, peak, "bfloat16")
  return lines, [
      f"decode {cfg.name} batch 1, prompt {prompt_len}, {new} new tokens (bf16 weights and cache): "
      f"prefill {prefill * 1e3:.1f} ms, {per_token * 1e3:.2f} ms/token; roofline {bound * 1e3:.3f} ms/token "
      f"(weights {weights / 2**20:.0f} MiB + KV {kv / 2**20:.1f} MiB at {bandwidth / 1e9:.0f} GB/s) "
      # Prefill is timed alone and subtracted; on a tiny smoke run that difference can be noise.
      + (f"= {100 * bound / per_token:.0f}% of the roofline" if per_token > 0 else "(decode below timer noise)")]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=20, help="steps per train program per round")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--fast", action="store_true", help="smoke run on tiny configs (CPU)")
  parser.add_argument("--kernels", type=lambda s: s.split(","), default=None,
                      help="model.attention_impl values timed beside auto (default: the backend's, KERNELS)")
  args = parser.parse_args(argv)
  if args.fast:
    args.steps, args.rounds = 2, 1
  t0 = time.perf_counter()
  device = jax.devices()[0]
  name = inspect_lib.device_name(device.device_kind)
  mesh = sharding.make_mesh(config_lib.MeshConfig(data=1, fsdp=-1, tensor=1))
  print(f"{datetime.datetime.now():%Y-%m-%d %H:%M} | jax {jax.__version__} | {jax.device_count()} x "
        f"{device.device_kind} ({device.platform}) | datasheet: {name or 'none'} | load {os.getloadavg()[0]:.2f}")
  if name:
    peak = inspect_lib.DEVICES[name].peak_flops * jax.device_count()
    bandwidth = inspect_lib.DEVICES[name].memory_bandwidth
    peak_note = f"{name} dense bf16 datasheet x {jax.device_count()}"
  else:  # CPU (the smoke run): a timed matmul and STREAM, as the other benchmarks measure them
    peak = inspect_lib.matmul_peak(512 if args.fast else 2048, dtype="bfloat16")
    bandwidth = max(decode_vs_hf.stream_bandwidth(mib=16 if args.fast else 512, repeats=2).values())
    peak_note = "bf16-operand matmul measured here"
  print(f"peak for MFU: {peak / 1e12:.3f} TFLOP/s ({peak_note}); bandwidth {bandwidth / 1e9:.0f} GB/s")

  programs = FAST if args.fast else FULL
  impls = ["auto", *[k for k in (args.kernels or KERNELS.get(device.platform, ["einsum", "tiled"])) if k != "auto"]]
  variants = []
  for label, (recipe, overrides, shape) in programs.items():
    for impl in impls:
      variant, cfg, flops, tokens, kernels = train_variant(f"{label}/{impl}", recipe,
                                                           [*overrides, f"model.attention_impl={impl}"], shape, mesh)
      variants.append((variant, cfg, flops, tokens))
      print(f"\n{variant.name} ({cfg.name}, {cfg.model.dtype}), batch {shape[0]} x "
            f"{'+'.join(map(str, shape[1:]))} per device; compiled in {variant.compile_s:.1f} s")
      for line in kernels or ["(none logged: these shapes were traced before in this process)"]:
        print(f"  kernel: {line}")
  for _ in range(args.rounds):  # interleaved, so a drifting machine slows all alike
    for variant, *_ in variants:
      variant.run(args.steps)
  print(f"\n{'program':<22}{'ms/step':>9}{'tokens/s':>12}{'TFLOP/s':>9}{'MFU':>7}{'temp MiB':>10}")
  walls = {}
  for variant, cfg, flops, tokens in variants:
    wall = walls[variant.name] = float(np.median(variant.wall))
    print(f"{variant.name:<22}{wall * 1e3:9.2f}{tokens / wall:12,.0f}{flops / wall / 1e12:9.3f}"
          f"{100 * flops / wall / peak:6.1f}%{variant.temp_mib:10,.0f}")
  for label in programs:  # what `auto`'s rule (layers.choose_attention) should be here, measured
    mine = {impl: walls[f"{label}/{impl}"] for impl in impls}
    best = min(mine, key=mine.get)
    print(f"{label}: fastest kernel request {best} ({mine[best] * 1e3:.2f} ms); auto {mine['auto'] * 1e3:.2f} ms "
          f"= {mine['auto'] / mine[best]:.2f}x the fastest")
  kernels, lines = decode_check(args.fast, bandwidth, peak)
  print()
  for line in kernels or ["(none logged: these shapes were traced before in this process)"]:
    print(f"  kernel: {line}")
  for line in lines:
    print(line)
  print(f"\n{args.rounds} rounds x {args.steps} steps; medians; {time.perf_counter() - t0:.0f} s in all; "
        f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
  main()
