"""Long context on this CPU: a small LM trains at 16k tokens per sequence with the tiled kernel.

    nice python benchmarks/long_context.py [--length 16384] [--steps 50] [--workdir DIR] [overrides ...]

Trains `shakespeare_char` at gpt2_tiny's widths (2 layers, d_model 32, 4 heads, d_ff 128)
with RoPE, one sequence of --length characters per step, model.attention_impl=auto (which
picks the tiled kernel at this length: the run's log says so), logging the loss every 5
steps, then prints the curve, the peak RSS and XLA's temporaries of the train step. At 16k
the dense path's [heads, q, kv] float32 scores alone are 4 GiB per layer.
"""

import argparse
import math
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import jax  # pylint: disable=g-import-not-at-top
from jaxformer import config, metrics, train  # pylint: disable=g-import-not-at-top


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--length", type=int, default=16384)
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--workdir", help="default: a fresh temporary directory")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args(argv)
  workdir = args.workdir or tempfile.mkdtemp(prefix="long_context_")
  cfg = config.load_config("shakespeare_char", [
      "model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.d_ff=128", "model.position=rope",
      f"model.max_len={args.length}", f"data.block_size={args.length}", "data.batch_size=1",
      f"train.num_steps={args.steps}", "train.log_every=5", f"train.eval_every={args.steps}", "train.eval_batches=1",
      f"train.checkpoint_every={args.steps}", "train.steps_per_call=1", "train.sample_every_eval=false",
      "optim.warmup_steps=5", "mesh.data=1", *args.overrides])
  print(f"jax {jax.__version__}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; {args.length} tokens per "
        f"sequence, {args.steps} steps, workdir {workdir}", flush=True)
  start = time.time()
  result = train.train_and_evaluate(cfg, workdir)
  print(f"\n{time.time() - start:.0f} s; peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB; "
        f"load {os.getloadavg()[0]:.1f}")
  records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  curve = [(r["step"], r["loss"]) for r in records if "loss" in r]
  print("train loss (step: loss):", ", ".join(f"{s}: {loss:.4f}" for s, loss in curve))
  print(f"finite: {all(math.isfinite(loss) for _, loss in curve)}; falling: {curve[-1][1] < curve[0][1]}; "
        f"step ms at the end {records[-1].get('step_ms', float('nan')):.0f}" if curve else "no loss logged")
  print({k: v for k, v in result.items() if not isinstance(v, dict)})


if __name__ == "__main__":
  main()
