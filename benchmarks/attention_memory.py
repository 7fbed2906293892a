"""Train-step memory and compile time against the length: dense attention vs the tiled kernel.

    python benchmarks/attention_memory.py [--lengths 1024,2048,4096,8192,16384,32768]
        [--dense-max 8192] [--plot docs/attention_memory.png] [--config shakespeare_char] [overrides ...]
    python benchmarks/attention_memory.py --replot SAVED_OUTPUT --plot docs/attention_memory.png

Compile only (`jaxformer.aot`, one CPU device, nothing allocated): for each length the
trainer's own step for one sequence of a 2-layer, d_model 256, 4-head LM (RoPE, so no
position table bounds the length) with model.attention_impl=einsum (today's dense path;
only up to --dense-max, above it needs > 4 GB) and =tiled (jaxformer.attention). Prints
XLA's temporaries (`memory_analysis`), the growth per doubling and the compile seconds
(wall and the process's CPU seconds to lower + compile); --plot draws both curves.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # pylint: disable=g-import-not-at-top
from jaxformer import aot, config  # pylint: disable=g-import-not-at-top

MODEL = ["model.num_layers=2", "model.d_model=256", "model.num_heads=4", "model.d_ff=1024",
         "model.position=rope", "mesh.data=1", "train.steps_per_call=1"]
MIB = 2 ** 20


def measure(name, overrides, impl, length):
  """(temporaries MiB, total MiB, compile wall s, lower + compile CPU s) of one train step."""
  cfg = config.load_config(name, MODEL + overrides + [f"model.attention_impl={impl}", f"model.max_len={length}",
                                                      f"data.block_size={length}"])
  cpu = time.process_time()
  compiled, _, compile_s = aot.compile_train_step(cfg, jax.devices()[:1], 1, (length,))
  cpu = time.process_time() - cpu
  mem = aot.memory(compiled)
  return mem["temp"] / MIB, mem["total"] / MIB, compile_s, cpu


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="shakespeare_char")
  parser.add_argument("overrides", nargs="*")
  parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
  parser.add_argument("--dense-max", type=int, default=8192, help="longest length to compile the dense path at")
  parser.add_argument("--plot", help="write the curves to this PNG")
  parser.add_argument("--replot", help="no compiles: redraw --plot from this script's printed table (a saved log)")
  args = parser.parse_args(argv)
  if args.replot:
    results = {"einsum": {}, "tiled": {}}
    with open(args.replot) as f:
      for line in f:
        parts = line.split()
        if len(parts) >= 6 and parts[0].isdigit() and parts[1] in results:
          nums = [float(x) for x in parts[2:] if x.replace(".", "", 1).isdigit()]
          temp, total, wall, cpu = nums[0], nums[-3], nums[-2], nums[-1]
          results[parts[1]][int(parts[0])] = (temp, total, wall, cpu)
    return plot(results, args.plot)
  lengths = [int(x) for x in args.lengths.split(",")]
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({os.cpu_count()} CPUs), load {os.getloadavg()[0]:.1f}; "
        f"{args.config} {' '.join(MODEL + args.overrides)}; batch 1; MiB and seconds")
  print(f"{'length':>7} {'kernel':>7} {'temp MiB':>9} {'x prev':>7} {'total MiB':>10} {'compile s':>10} {'cpu s':>7}")
  results = {"einsum": {}, "tiled": {}}
  for length in lengths:
    for impl in ("einsum", "tiled"):
      if impl == "einsum" and length > args.dense_max:
        continue
      temp, total, wall, cpu = measure(args.config, args.overrides, impl, length)
      prev = results[impl].get(length // 2)
      results[impl][length] = (temp, total, wall, cpu)
      growth = f"{temp / prev[0]:.2f}" if prev else ""
      print(f"{length:>7} {impl:>7} {temp:>9.1f} {growth:>7} {total:>10.1f} {wall:>10.1f} {cpu:>7.1f}", flush=True)
  if args.plot:
    plot(results, args.plot)


def plot(results, path):
  """Temporaries and compile CPU seconds against the length, one curve per kernel."""
  if True:  # pylint: disable=using-constant-test
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
    fig, (mem_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 4))
    labels = {"einsum": "dense (attention_impl=einsum)", "tiled": "tiled (jaxformer.attention)"}
    for impl, rows in results.items():
      xs = sorted(rows)
      mem_ax.plot(xs, [rows[x][0] for x in xs], "o-", label=labels[impl])
      time_ax.plot(xs, [rows[x][3] for x in xs], "o-", label=labels[impl])
    for ax, what in ((mem_ax, "XLA temporaries (MiB)"), (time_ax, "lower + compile (CPU s)")):
      ax.set_xscale("log", base=2)
      ax.set_xlabel("tokens per sequence (batch 1)")
      ax.set_ylabel(what)
      ax.grid(alpha=0.3)
      ax.legend()
    mem_ax.set_yscale("log")
    fig.suptitle("Train step of a 2-layer d_model 256 LM, compile only (benchmarks/attention_memory.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


if __name__ == "__main__":
  main()
