"""Where a GPT-2 prefill's time goes, float32 against quantized: XLA:CPU's ops from a profiler trace, by class.

    python benchmarks/prefill_profile.py [--rows 128] [--bits 8,4] [--path default|kernel|xla] [--runs 5]

GPT-2 124M shapes (random weights; int8 tables, int4 group 128), one prompt of `rows` tokens through
`decode.prefill`'s program, as benchmarks/prefill_rows.py runs it (--path forces the prompt's quantized products
onto the C++ kernel or the XLA path). Each program runs --runs times under `jax.profiler.trace` (a perfetto trace);
every op's median duration is summed by class: the projections (2-D dots and the kernel's custom calls, the LM
head included), the attention's dots, and everything else (norms, activations, cache writes, conversions).
`overlap` is how much of the op time ran concurrently with other ops (XLA:CPU runs independent ops at once):
sum of durations minus their union, per run. `wall` is the median run. The header gives this machine's float32
matmul rate (`inspect.matmul_peak`, best of 5 [2048, 2048] products) to set the projections against.
"""

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from prefill_rows import gpt2_params, prefill_program  # pylint: disable=g-import-not-at-top,wrong-import-position
from jaxformer import inspect  # pylint: disable=g-import-not-at-top,wrong-import-position


def classes(hlo_text, rows):
  """{op name: 'projections' | 'attention' | 'other'} from the compiled HLO's instruction lines."""
  out = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[([\d,]*)\]\S* (fusion|custom-call|dot)\(", line)
    if not m:
      continue
    name, dims, kind = m.group(1), [int(d) for d in m.group(3).split(",") if d], m.group(4)
    two_d = len(dims) == 2 and dims[0] in (rows, 1)
    if kind == "custom-call" or (two_d and ("ynn" in name or kind == "dot" or "dot" in name)):
      out[name] = "projections"
    elif "ynn" in name or kind == "dot":
      out[name] = "attention"
  return out


def profile(run, runs):
  """(per-op durations {name: [ms]}, per-run (wall, sum of op durations, union of op intervals)) from a trace."""
  with tempfile.TemporaryDirectory() as d:
    with jax.profiler.trace(d, create_perfetto_trace=True):
      for _ in range(runs):
        run()
    events = json.load(gzip.open(glob.glob(f"{d}/**/*.json.gz", recursive=True)[0]))
  events = events["traceEvents"] if isinstance(events, dict) else events
  ops = sorted((e for e in events if e.get("ph") == "X" and "hlo_op" in e.get("args", {})), key=lambda e: e["ts"])
  waits = sorted((e for e in events if e.get("ph") == "X" and e["name"].startswith("ThunkExecutor::Execute (wait")),
                 key=lambda e: e["ts"])
  per_op = collections.defaultdict(list)
  for e in ops:
    per_op[e["name"]].append(e["dur"] / 1e3)
  per_run = []
  for w in waits:
    inside = [e for e in ops if w["ts"] <= e["ts"] <= w["ts"] + w["dur"]]
    union, end = 0.0, w["ts"]
    for e in inside:
      start, stop = max(e["ts"], end), e["ts"] + e["dur"]
      if stop > start:
        union, end = union + stop - start, stop
    per_run.append((w["dur"] / 1e3, sum(e["dur"] for e in inside) / 1e3, union / 1e3))
  return per_op, per_run


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rows", type=int, default=128)
  parser.add_argument("--bits", default="8,4")
  parser.add_argument("--path", default="default", choices=("default", "kernel", "xla"))
  parser.add_argument("--runs", type=int, default=5)
  args = parser.parse_args(argv)
  model, params = gpt2_params([int(b) for b in args.bits.split(",")])
  limit = {"default": None, "kernel": 10 ** 6, "xla": 1}[args.path]
  print(f"GPT-2 124M prefill of {args.rows} tokens, quantized products: {args.path} path; medians of {args.runs} "
        f"traced runs (ms); float32 2048^3 matmul here: {inspect.matmul_peak(2048) / 1e9:.0f} GFLOP/s")
  print(f"{'':10} {'wall':>7} {'projections':>12} {'attention':>10} {'other':>7} {'overlap':>8}")
  for bits, p in params.items():
    run, compiled = prefill_program(model, p, bits, args.rows, None if bits == 32 else limit)
    kinds = classes(compiled.as_text(), args.rows)
    for _ in range(2):
      run()
    per_op, per_run = profile(run, args.runs)
    by = collections.Counter()
    for op, times in per_op.items():
      by[kinds.get(op, "other")] += float(np.median(times))
    wall = float(np.median([r[0] for r in per_run]))
    overlap = float(np.median([r[1] - r[2] for r in per_run]))
    name = "float32" if bits == 32 else f"int{bits}"
    print(f"{name:10} {wall:7.1f} {by['projections']:12.1f} {by['attention']:10.1f} {by['other']:7.1f} {overlap:8.1f}",
          flush=True)

if __name__ == "__main__":
  main()
