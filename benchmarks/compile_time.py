"""Compile time of the train step against depth, with and without model.scan_layers.

    python benchmarks/compile_time.py --config gpt2_small [overrides ...] [--layers 2,6,12,24]
        [--batch 8 --seq-len 256] [--also 'model.remat=full']

For each depth it lowers and compiles the trainer's own step from abstract inputs
(`jaxformer.aot`, one device, nothing run) unrolled and scanned, and prints the seconds of
the process's CPU seconds to lower + compile it (steadier than wall time on a shared
machine: XLA compiles mostly on one thread) and the wall seconds of the compile alone.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # pylint: disable=g-import-not-at-top
from jaxformer import aot, config  # pylint: disable=g-import-not-at-top


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="gpt2_small")
  parser.add_argument("overrides", nargs="*")
  parser.add_argument("--layers", default="2,6,12,24")
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq-len", default="256", help="LEN, or SRC,TGT for translation")
  parser.add_argument("--also", default="", help="overrides added to both variants, e.g. 'model.remat=full'")
  args = parser.parse_args(argv)
  lengths = tuple(int(x) for x in args.seq_len.split(","))
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({os.cpu_count()} CPUs); {args.config} "
        f"{' '.join(args.overrides)} {args.also}; batch {args.batch} x {lengths}; seconds")
  print(f"{'layers':>6}  {'unrolled cpu s':>14} {'wall':>6}  {'scanned cpu s':>13} {'wall':>6}  "
        f"{'unrolled / scanned':>18}")
  for n in (int(x) for x in args.layers.split(",")):
    row = []
    for scan in ("false", "true"):
      extra = [f"model.num_layers={n}", f"model.scan_layers={scan}", "mesh.data=1"] + args.also.split()
      cfg = config.load_config(args.config, args.overrides + extra)
      cpu = time.process_time()
      _, _, compile_s = aot.compile_train_step(cfg, jax.devices()[:1], args.batch, lengths)
      row += [time.process_time() - cpu, compile_s]
    print(f"{n:>6}  {row[0]:>14.1f} {row[1]:>6.1f}  {row[2]:>13.1f} {row[3]:>6.1f}  {row[0] / row[2]:>18.2f}",
          flush=True)


if __name__ == "__main__":
  main()
