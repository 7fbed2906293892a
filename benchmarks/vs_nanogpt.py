"""nanoGPT and jaxformer side by side: the CPU "baby GPT" on Tiny Shakespeare, one run.

    # The peer lives outside this repository (nothing of it is committed here):
    git clone https://github.com/karpathy/nanoGPT ~/peer/nanoGPT
    cp ../shared/data/tinyshakespeare/input.txt ~/peer/nanoGPT/data/shakespeare_char/
    python -m venv ~/peer/venv && ~/peer/venv/bin/pip install torch==2.13.0 numpy requests
    (cd ~/peer/nanoGPT && ~/peer/venv/bin/python data/shakespeare_char/prepare.py)

    python benchmarks/vs_nanogpt.py --nanogpt ~/peer/nanoGPT --python ~/peer/venv/bin/python [--rounds 2]

Each round runs both trainers, one after the other (the order alternates between rounds,
so neither always gets the cooler machine): nanoGPT's README command for CPU (2,000
iterations, evals every 250 on 20 batches, `--compile=False`, OMP_NUM_THREADS = cores)
and `train.py --config shakespeare_char` (the same model and recipe) in a fresh workdir.
Reported per run: whole-process wall time, median time per iteration, val loss at
iteration 2,000. nanoGPT's per-iteration times are its own `iter N: ... time X ms` lines
(log_interval=1); ours come from `metrics.jsonl` of the unchanged command (one `ms/step`
per log interval of 100 steps; the first interval, which compiles, and intervals that
contain an eval are dropped; `train.log_every=25` gives finer intervals but adds a host
sync per call). Medians over each run's intervals.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from jaxformer import metrics  # pylint: disable=g-import-not-at-top

NANOGPT_ARGS = ["config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
                "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4",
                "--n_embd=128", "--max_iters=2000", "--lr_decay_iters=2000", "--dropout=0.0"]


def run_nanogpt(path, python, out_dir):
  """Runs nanoGPT's CPU command; -> (wall s, median ms/iter, val loss at 2000)."""
  env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()))
  t = time.perf_counter()
  proc = subprocess.run([python, "train.py", *NANOGPT_ARGS, f"--out_dir={out_dir}"], cwd=path, env=env,
                        capture_output=True, text=True, check=False)
  wall = time.perf_counter() - t
  if proc.returncode:
    sys.exit(f"error: nanoGPT failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
  times = [float(ms) for it, ms in re.findall(r"^iter (\d+): loss [\d.]+, time ([\d.]+)ms", proc.stdout, re.M)
           if int(it) > 0]
  val = re.findall(r"^step 2000: train loss [\d.]+, val loss ([\d.]+)", proc.stdout, re.M)
  return wall, statistics.median(times), float(val[0]) if val else float("nan")


def run_ours(workdir, overrides):
  """Runs train.py --config shakespeare_char; -> (wall s, median ms/step, val loss at 2000)."""
  t = time.perf_counter()
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--config", "shakespeare_char",
                         "--workdir", workdir, *overrides],
                        capture_output=True, text=True, check=False)
  wall = time.perf_counter() - t
  if proc.returncode:
    sys.exit(f"error: train.py failed (exit {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
  records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  evals = [r["step"] for r in records if "val_nll" in r]
  logs = [r for r in records if "step_ms" in r]
  # An eval at step s runs after the step-s log, so it lands in the interval that ends next.
  times = [r["step_ms"] for prev, r in zip(logs, logs[1:])
           if not any(prev["step"] <= s < r["step"] for s in evals)]
  val = [r["val_nll"] for r in records if "val_nll" in r and r["step"] == 2000]  # = loss: no smoothing
  return wall, statistics.median(times), val[0] if val else float("nan")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--nanogpt", required=True, help="a nanoGPT checkout with data/shakespeare_char prepared")
  parser.add_argument("--python", default=sys.executable, help="the Python that has torch (for nanoGPT)")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("overrides", nargs="*", help="dotted overrides for our run, e.g. train.steps_per_call=1")
  args = parser.parse_intermixed_args(argv)
  if not os.path.exists(os.path.join(args.nanogpt, "data", "shakespeare_char", "train.bin")):
    sys.exit(f"error: {args.nanogpt}/data/shakespeare_char/train.bin not found: run its prepare.py first")

  version = subprocess.run([args.python, "-c", "import torch; print(torch.__version__, torch.get_num_threads())"],
                           capture_output=True, text=True, check=True).stdout.split()
  print(f"nanoGPT: torch {version[0]}, {version[1]} threads | ours: {sys.executable} | {os.cpu_count()} CPUs")
  rows = []
  for r in range(args.rounds):
    scratch = tempfile.mkdtemp(prefix="vs_nanogpt_")
    order = ["nanoGPT", "jaxformer"] if r % 2 == 0 else ["jaxformer", "nanoGPT"]
    for name in order:
      if name == "nanoGPT":
        result = run_nanogpt(args.nanogpt, args.python, os.path.join(scratch, "nanogpt"))
      else:
        result = run_ours(os.path.join(scratch, "ours"), args.overrides)
      rows.append((r + 1, name) + result)
      print(f"round {r + 1} {name:<9}  wall {result[0]:6.1f} s  median {result[1]:6.1f} ms/iter  "
            f"val loss @2000 {result[2]:.4f}", flush=True)
    shutil.rmtree(scratch, ignore_errors=True)

  print(f"\n{'trainer':<10} {'wall s (per round)':<22} {'ms/iter (per round)':<22} val loss @2000")
  for name in ("nanoGPT", "jaxformer"):
    mine = [row for row in rows if row[1] == name]
    print(f"{name:<10} {' '.join(f'{x[2]:.1f}' for x in mine):<22} {' '.join(f'{x[3]:.1f}' for x in mine):<22} "
          f"{' '.join(f'{x[4]:.4f}' for x in mine)}")


if __name__ == "__main__":
  main()
