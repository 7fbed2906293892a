"""Compile the real train step for a TPU topology on a machine without a TPU, and read XLA's figures.

    /work/wt/venv-tpu/bin/python benchmarks/aot_compile.py --topology v5p-64 --config llama3_8b \
        --batch 32 --seq-len 8192 [model.remat=full model.scan_layers=true mesh.fsdp=-1 ...]

Install (once; libtpu is not a runtime dependency of jaxformer, nor part of CI):

    python3 -m venv venv-tpu && venv-tpu/bin/pip install "jax[tpu]==0.10.2" && venv-tpu/bin/pip install -e .

(`pip install -e ".[tpu]"` does the same). With libtpu present, `jax.experimental.topologies`
describes the chips of a topology that is not attached; the step is lowered with abstract,
sharded inputs over a Mesh of those devices and compiled by the real TPU compiler
(`jaxformer.aot`, as MaxText's train_compile.py does). Printed per chip: XLA's
memory_analysis (arguments, outputs, donated, temporaries, total), cost_analysis FLOPs,
the compile time, and `inspect.memory_plan` for the same config, mesh and batch next to it.

--topology takes a Cloud TPU name (v5p-8 ... v5p-256 count TensorCores, two per chip, as
Cloud TPU names do; v5e-1 ... v5e-256 and v6e-N count chips; v4-8 ... v4-256 like v5p).
The mesh defaults to mesh.fsdp=-1 (every chip in FSDP) unless overrides set it.
One decode step instead (`aot.compile_decode_step`: one token per sequence through a KV cache of
CONTEXT slots, on one chip, nothing sharded), float or with the int8/int4 weights `jaxformer.quantize`
writes, printed next to `inspect`'s weight and KV-cache bytes:

    /work/venv-tpu/bin/python benchmarks/aot_compile.py --topology v6e-1 --config llama3_8b --batch 1 \
        --decode 2048 [--quantize 8|4 [--group-size 128] [--embedding int8|int4|float]] [--param-dtype bfloat16]

(the model holds float32 params whatever model.dtype is; --param-dtype bfloat16 casts the float
leaves, as a bfloat16 checkpoint would be read; a quantized model's scales stay float32).

One serving-engine decode step through JAX's Pallas paged-attention kernel instead (`aot.lower_engine_decode`:
BATCH slots of one token over a block pool, block tables of CONTEXT tokens; prints whether the compiled program
holds the Mosaic kernel, and XLA's memory next to the pool's bytes):

    /work/venv-tpu/bin/python benchmarks/aot_compile.py --topology v6e-1 --config llama3_8b --batch 16 \
        --serve-decode 2048 [--block-size 16] [--param-dtype bfloat16]

--platform cuda tries the same for GPUs (`jax-cuda12-plugin`); see BENCHMARKS.md for what happened.
libtpu serves one process at a time (/tmp/libtpu_lockfile): run these one after another. A
program that cannot fit is refused by the compiler; that is printed as "does NOT fit" with
the bytes it needed.
"""

import argparse
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # pylint: disable=g-import-not-at-top
from jax.experimental import topologies  # pylint: disable=g-import-not-at-top

from jaxformer import aot, config, inspect, moe, sharding  # pylint: disable=g-import-not-at-top
from jaxformer.errors import UserError  # pylint: disable=g-import-not-at-top

# chips -> topology shape of a slice (Cloud TPU's shapes).
_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8"}
_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
HBM_GB = {"v5p": 95, "v5e": 16, "v6e": 32, "v4": 32}


def tpu_topology(name):
  """"v5p-64" -> (topology_name, chip_config_name, chips_per_host_bounds, generation)."""
  generation, _, count = name.partition("-")
  if not count.isdigit():
    raise SystemExit(f"error: --topology {name!r}: expected a Cloud TPU name such as v5p-64, v5e-8, v4-32")
  n = int(count)
  if generation in ("v5p", "v4"):
    chips = n // 2  # Cloud TPU names count TensorCores: two per chip (megacore)
    if chips not in _3D:
      raise SystemExit(f"error: --topology {name}: known sizes are {', '.join(f'{generation}-{2 * c}' for c in _3D)}")
    chip_config = "megachip_tccontrol" if generation == "v5p" else "megacore"
    return f"{generation}:{_3D[chips]}", chip_config, (2, 2, 1), generation
  if generation in ("v5e", "v6e"):
    if n not in _2D:
      raise SystemExit(f"error: --topology {name}: known sizes are {', '.join(f'{generation}-{c}' for c in _2D)}")
    return f"{generation}:{_2D[n]}", "default", (1, 1, 1) if n == 1 else (2, 2, 1), generation
  raise SystemExit(f"error: --topology {name}: choose a v5p, v5e, v6e or v4 slice")


def devices_for(args):
  """The device descriptions of the target and its memory per device (GB)."""
  if args.platform == "tpu":
    topology_name, chip_config, per_host, generation = tpu_topology(args.topology)
    topo = topologies.get_topology_desc(platform="tpu", topology_name=topology_name, chip_config_name=chip_config,
                                        chips_per_host_bounds=per_host, num_slices=1)
    return topo.devices, HBM_GB[generation]
  topo = topologies.get_topology_desc(platform="cuda", topology_name=args.topology)
  return topo.devices, 80


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--topology", required=True, help="e.g. v5p-64, v5e-8, v5e-1")
  parser.add_argument("--platform", default="tpu", choices=("tpu", "cuda"))
  parser.add_argument("--config", required=True)
  parser.add_argument("overrides", nargs="*")
  parser.add_argument("--batch", type=int, required=True, help="global batch (sequences)")
  parser.add_argument("--seq-len", default=None, help="LEN, or SRC,TGT for translation (default: the recipe's)")
  parser.add_argument("--show-ops", metavar="REGEX", default=None,
                      help="print the compiled (per-device) HLO instructions matching REGEX, e.g. 'ragged-dot|sort'")
  parser.add_argument("--decode", type=int, default=None, metavar="CONTEXT",
                      help="compile one decode step with a KV cache of CONTEXT slots (one chip) instead of a train step")
  parser.add_argument("--quantize", type=int, default=None, metavar="8|4", help="with --decode: int8 or int4 weights")
  parser.add_argument("--group-size", type=int, default=128, help="with --quantize 4: inputs per scale (default 128)")
  parser.add_argument("--embedding", default="int8", help="with --quantize: tables int8 (default), int4 or float")
  parser.add_argument("--param-dtype", default=None, help="with --decode: float32 (the model's) or bfloat16")
  parser.add_argument("--serve-decode", type=int, default=None, metavar="CONTEXT",
                      help="compile the serving engine's decode step (Pallas paged attention) for BATCH slots")
  parser.add_argument("--block-size", type=int, default=16, help="with --serve-decode: tokens per KV block")
  args = parser.parse_args(argv)
  if args.decode is None and (args.quantize is not None or (args.param_dtype is not None and args.serve_decode is None)):
    raise SystemExit("error: --quantize goes with --decode CONTEXT; --param-dtype with --decode or --serve-decode")
  if args.param_dtype not in (None, "float32", "bfloat16"):
    raise SystemExit(f"error: --param-dtype {args.param_dtype}: float32 or bfloat16")
  t = time.perf_counter()
  devices, hbm_gb = devices_for(args)
  if args.serve_decode is not None:
    try:
      return serve_decode_step(args, devices, hbm_gb, t)
    except UserError as e:
      raise SystemExit(f"error: {e}") from None
  if args.decode is not None:
    try:
      return decode_step(args, devices, hbm_gb, t)
    except UserError as e:
      raise SystemExit(f"error: {e}") from None
  if args.platform == "tpu":
    # MoE's grouped matmul: "auto" picks by jax.default_backend(), which is "cpu" here; the TPU
    # program (and the plan, traced below) must use what a TPU runs: jax.lax.ragged_dot.
    moe.DROPLESS_IMPL = "ragged_dot"
  overrides = args.overrides if any(o.startswith("mesh.") for o in args.overrides) else ["mesh.data=1", "mesh.fsdp=-1",
                                                                                          *args.overrides]
  cfg = config.load_config(args.config, overrides)
  default_len = cfg.data.block_size if cfg.data.task == "lm" else cfg.data.max_len
  lengths = tuple(int(x) for x in args.seq_len.split(",")) if args.seq_len else (default_len,)
  if cfg.data.task != "lm" and len(lengths) == 1:
    lengths = lengths * 2
  mesh = dict(sharding.make_mesh(cfg.mesh, list(devices)).shape)
  plan = inspect.memory_plan(cfg, mesh, args.batch, lengths)
  gib = lambda b: f"{b / 2**30:8.2f} GiB"
  plan_line = "inspect's plan: " + ", ".join(f"{k} {gib(v).strip()}" for k, v in plan.items())
  print(f"{args.topology} ({len(devices)} x {devices[0].device_kind}, {hbm_gb} GB each), jax {jax.__version__}; "
        f"{cfg.name} {' '.join(overrides)}; batch {args.batch} x {'+'.join(map(str, lengths))}; mesh {mesh}")
  try:
    compiled, lower_s, compile_s = aot.compile_train_step(cfg, devices, args.batch, lengths)
  except jax.errors.JaxRuntimeError as e:  # the TPU compiler refuses a program that cannot fit
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    print(f"does NOT fit ({time.perf_counter() - t:.0f} s): {str(e).splitlines()[0][:300]}")
    print(plan_line)
    return
  xla = aot.memory(compiled)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  print(f"lowered in {lower_s:.1f} s, compiled in {compile_s:.1f} s "
        f"({time.perf_counter() - t:.1f} s in all)")
  print(f"XLA per device: arguments {gib(xla['argument'])}, outputs {gib(xla['output'])}, donated "
        f"{gib(xla['alias'])}, temporaries {gib(xla['temp'])}; total {gib(xla['total'])} "
        f"-> {'fits' if xla['total'] <= hbm_gb * 1e9 else 'does NOT fit'} in {hbm_gb} GB")
  print(plan_line + f"; plan / XLA = {plan['total'] / xla['total']:.2f}")
  if cost and "flops" in cost:
    print(f"XLA cost analysis: {cost['flops'] / 1e12:.2f} TFLOP per device per step")
  if args.show_ops:  # the partitioned program's shapes: what each device holds and computes
    _show_ops(compiled, args.show_ops)


def decode_step(args, devices, hbm_gb, t):
  """--decode: compile one decode step on one chip; print XLA's memory_analysis next to inspect's bytes."""
  cfg = config.load_config(args.config, args.overrides)
  float_dtype = args.param_dtype or "float32"
  manifest = None
  if args.quantize is not None:
    manifest = inspect.quantized_manifest(cfg, args.quantize, args.group_size, args.embedding)
  weights = inspect.weight_bytes(cfg, float_dtype, manifest)
  cache = inspect.kv_cache_bytes(cfg, args.decode, cfg.model.dtype) * args.batch
  what = (f"int{args.quantize} weights" + (f" (group {args.group_size})" if args.quantize == 4 else "")
          + f", tables {args.embedding}, other leaves {float_dtype}" if manifest else f"{float_dtype} params")
  print(f"{args.topology} (one {devices[0].device_kind} of {len(devices)}, {hbm_gb} GB), jax {jax.__version__}; "
        f"{cfg.name} {' '.join(args.overrides)} (model.dtype {cfg.model.dtype}); decode step: batch {args.batch} x "
        f"1 token, KV cache {args.decode:,} slots; {what}")
  compiled, lower_s, compile_s = aot.compile_decode_step(cfg, devices, args.batch, args.decode, args.quantize,
                                                         args.group_size, args.embedding, args.param_dtype)
  xla = aot.memory(compiled)
  gib = lambda b: f"{b / 2**30:.3f} GiB"
  print(f"lowered in {lower_s:.1f} s, compiled in {compile_s:.1f} s ({time.perf_counter() - t:.1f} s in all)")
  print(f"XLA per chip: arguments {gib(xla['argument'])}, outputs {gib(xla['output'])}, donated {gib(xla['alias'])}, "
        f"temporaries {gib(xla['temp'])} ({xla['temp']:,} bytes); total {gib(xla['total'])}")
  print(f"inspect: weights {gib(weights['total'])} (kernels {gib(weights['kernels'])}, tables {gib(weights['tables'])}, "
        f"float {gib(weights['float'])}) + KV cache {gib(cache)} ({cfg.model.dtype}) = {gib(weights['total'] + cache)}; "
        f"XLA arguments - that = {xla['argument'] - weights['total'] - cache:,} bytes")
  if manifest:  # were the weights dequantized into buffers of their own? Temporaries would hold at least the largest
    largest = max(e["k"] * e["n"] for e in manifest["kernels"].values()) * jax.numpy.dtype(cfg.model.dtype).itemsize
    print(f"the largest kernel dequantized to {cfg.model.dtype} would be {gib(largest)}: temporaries / that = "
          f"{xla['temp'] / largest:.3f}")
  if args.show_ops:
    _show_ops(compiled, args.show_ops)


def serve_decode_step(args, devices, hbm_gb, t):
  """--serve-decode: compile the engine's decode step (Pallas paged attention) on one chip."""
  cfg = config.load_config(args.config, args.overrides)
  print(f"{args.topology} (one {devices[0].device_kind} of {len(devices)}, {hbm_gb} GB), jax {jax.__version__}; "
        f"{cfg.name} {' '.join(args.overrides)} (model.dtype {cfg.model.dtype}); engine decode step: {args.batch} slots"
        f" x 1 token, block tables of {args.serve_decode:,} tokens in blocks of {args.block_size}")
  lowered, lower_s = aot.lower_engine_decode(cfg, devices[0], args.batch, args.serve_decode, args.block_size,
                                             param_dtype=args.param_dtype)
  c = time.perf_counter()
  compiled = lowered.compile()
  compile_s = time.perf_counter() - c
  xla = aot.memory(compiled)
  text = compiled.as_text()
  kernels = len(re.findall(r'custom_call_target="tpu_custom_call"', text))
  pool = inspect.kv_cache_bytes(cfg, args.serve_decode, cfg.model.dtype) * args.batch
  gib = lambda b: f"{b / 2**30:.3f} GiB"
  print(f"lowered in {lower_s:.1f} s, compiled in {compile_s:.1f} s ({time.perf_counter() - t:.1f} s in all)")
  print(f"Mosaic kernels (tpu_custom_call) in the compiled program: {kernels} (layers: {cfg.model.num_layers})")
  print(f"XLA per chip: arguments {gib(xla['argument'])}, outputs {gib(xla['output'])}, donated {gib(xla['alias'])}, "
        f"temporaries {gib(xla['temp'])}; total {gib(xla['total'])}; the pool (inspect's KV cache of "
        f"{args.batch} x {args.serve_decode:,} tokens, {cfg.model.dtype}) {gib(pool)}")
  if args.show_ops:
    _show_ops(compiled, args.show_ops)


def _show_ops(compiled, pattern):
  """Prints the compiled HLO instructions matching `pattern`, each once."""
  seen = set()
  for line in compiled.as_text().splitlines():
    if re.search(pattern, line):
      op = re.sub(r"^\s*(ROOT )?%?[\w.\-]+ = ", "", line.strip())
      op = re.sub(r"\s*(, )?metadata=\{.*", "", op)[:240]
      if op not in seen:
        seen.add(op)
        print("  " + op)


if __name__ == "__main__":
  main()
