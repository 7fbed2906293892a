"""`inspect.memory_plan` against XLA: the real train step compiled for 8 simulated CPU devices.

    python benchmarks/memory_plan.py --config llama_tiny [overrides ...] --rows 32 --lengths 128
        [--mesh data=8 --mesh fsdp=8 ...] [--variant 'model.remat=full' --variant '' ...]

For every (mesh, variant) pair it lowers and compiles the trainer's own step from abstract
inputs (`jaxformer.aot`: nothing allocated) and prints XLA's per-device bytes (arguments +
outputs - donated + temporaries) next to the plan's total and their ratio. The devices are
this host's CPU split in 8 (XLA_FLAGS=--xla_force_host_platform_device_count=8, set here), or
--devices N (e.g. 1, with --mesh data=1, for one device's figures).
"""

import argparse
import os
import sys

_DEVICES = sys.argv[sys.argv.index("--devices") + 1] if "--devices" in sys.argv else "8"  # before jax is imported
_FLAG = f"--xla_force_host_platform_device_count={_DEVICES}"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # pylint: disable=g-import-not-at-top
from jaxformer import aot, config  # pylint: disable=g-import-not-at-top


def mesh_overrides(text):
  """"data=2,fsdp=4" -> ["mesh.data=2", "mesh.fsdp=4", "mesh.tensor=1"] (unnamed axes 1)."""
  sizes = {"data": 1, "fsdp": 1, "tensor": 1}
  for part in filter(None, text.split(",")):
    axis, _, n = part.partition("=")
    sizes[axis.strip()] = int(n)
  return [f"mesh.{a}={n}" for a, n in sizes.items()]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", required=True)
  parser.add_argument("overrides", nargs="*")
  parser.add_argument("--rows", type=int, required=True, help="global batch (sequences)")
  parser.add_argument("--lengths", required=True, help="LEN (LM) or SRC,TGT (translation)")
  parser.add_argument("--mesh", action="append", default=None, help="e.g. data=8 or fsdp=8 (repeatable)")
  parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices (read before jax starts)")
  parser.add_argument("--variant", action="append", default=None, help="extra overrides, space-separated (repeatable)")
  args = parser.parse_args(argv)
  lengths = tuple(int(x) for x in args.lengths.split(","))
  print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}; {args.config} "
        f"{' '.join(args.overrides)}; batch {args.rows} x {lengths}; MiB per device")
  print(f"{'mesh':<16}{'variant':<58}{'XLA':>9}{'plan':>9}{'plan/XLA':>9}  XLA temp  compile s")
  for mesh in args.mesh or ["data=8", "fsdp=8"]:
    for variant in args.variant or [""]:
      cfg = config.load_config(args.config, args.overrides + mesh_overrides(mesh) + variant.split())
      plan, xla, compile_s = aot.plan_vs_xla(cfg, jax.devices(), args.rows, lengths)
      print(f"{mesh:<16}{variant or '(defaults)':<58}{xla['total'] / 2**20:9.1f}{plan['total'] / 2**20:9.1f}"
            f"{plan['total'] / xla['total']:9.2f}  {xla['temp'] / 2**20:8.1f}  {compile_s:9.1f}", flush=True)


if __name__ == "__main__":
  main()
