"""Temporaries of a quantized table's lookup on the TPU compiler (libtpu, deviceless; no TPU needed), by ids.

    /work/venv-tpu/bin/python benchmarks/tpu_lookup.py [--topology v6e:1x1] [--ids 1,2,4,8,64,2048] \
        [--tables 128256x4096:int8,128256x2048:uint8,50304x768:int8]

For each table (rows x width, int8 or uint8: an int8 table or a packed int4 one) and number of ids, compiles
`jnp.take` of the rows (converted to float32) and `qmatmul.lookup` (rows dequantized) and prints XLA's
temporaries. A temporary the size of the table is a re-tiling copy of it (BENCHMARKS.md, "Quantized weights,
part 5"). Needs `jax[tpu]` (libtpu), as benchmarks/aot_compile.py does.
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxformer import qmatmul  # pylint: disable=g-import-not-at-top


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--topology", default="v6e:1x1", help="libtpu topology name of one chip (default v6e:1x1)")
  parser.add_argument("--ids", default="1,2,4,8,64,2048")
  parser.add_argument("--tables", default="128256x4096:int8,128256x2048:uint8,50304x768:int8")
  args = parser.parse_args(argv)
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  chip = topologies.get_topology_desc(platform="tpu", topology_name=args.topology, chip_config_name="default",
                                      chips_per_host_bounds=(1, 1, 1), num_slices=1).devices[0]
  place = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=jax.sharding.SingleDeviceSharding(chip))
  take = lambda q, s, i: jnp.take(q, i, axis=0).astype(jnp.float32)
  print(f"{args.topology}, jax {jax.__version__}: XLA temporaries in bytes (jnp.take / qmatmul.lookup)")
  for spec in args.tables.split(","):
    shape, dtype = spec.split(":")
    rows, width = (int(v) for v in shape.split("x"))
    q = place((rows, width), jnp.dtype(dtype))
    s = place((rows,) if dtype == "int8" else (rows, width // 64), jnp.float32)  # int4: groups of 128 inputs
    line = []
    for n in (int(v) for v in args.ids.split(",")):
      ids = place((n,), jnp.int32)
      temps = [jax.jit(f).lower(q, s, ids).compile().memory_analysis().temp_size_in_bytes for f in (take, qmatmul.lookup)]
      line.append(f"{n} ids {temps[0]:,} / {temps[1]:,}")
    print(f"{dtype}[{rows}, {width}] ({rows * width / 2**20:.0f} MiB): " + "; ".join(line))


if __name__ == "__main__":
  main()
