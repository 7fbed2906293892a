"""Does MoE pay on this CPU? An 8-expert top-2 LM against the dense LM with the same active parameters.

    python benchmarks/moe_vs_dense.py [--steps 600] [--rounds 5] [--out /tmp/moe_vs_dense] [overrides ...]

Overrides (e.g. data.batch_size=96) apply to the training runs and the timed steps alike.

Tiny Shakespeare, `shakespeare_char` (dense, d_ff 512) against `moe_shakespeare` (8 experts of
d_ff 256, top 2: the same FFN weights per token), same data, steps, tokens and schedule:
1. training: each variant trains --steps steps through `train.train_and_evaluate`; prints the
   validation loss at the end (20 fixed batches), and the tokens-per-expert fractions with the
   load-balancing loss (optim.moe_aux_loss=0.01) and without it (0);
2. step time: the jitted train steps of dense, MoE dropless (`ragged_dot`, on CPU the block layout), MoE capacity 1.25,
   and MoE with every expert run on every token (the all-experts dense loop, combined by the
   router weights: `moe.dense_reference`), timed in interleaved rounds in one process, from the
   same state and batch; prints the medians and each one's ratio to dense.
Writes <out>/results.json and <out>/moe_vs_dense.png (validation loss curves).
"""

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402

from jaxformer import config as config_lib, moe, train  # noqa: E402

VARIANTS = {"dense": ("shakespeare_char", []), "moe": ("moe_shakespeare", []),
            "moe_no_aux": ("moe_shakespeare", ["optim.moe_aux_loss=0"])}


class AllExperts(moe.MoEFeedForward):
  """The same parameters, every expert on every token (`moe.dense_reference`): the dense loop."""

  @nn.compact
  def __call__(self, x, deterministic=True):
    params = self.variables["params"]  # the dropless model's
    logits = x.reshape(-1, x.shape[-1]) @ params["router"]["kernel"]
    _, top_e, probs = moe.route(logits, self.cfg.moe_top_k)
    moe.sow_router_statistics(self, logits, top_e, probs)
    return moe.dense_reference(params, self.cfg, x)


def train_variants(steps, out, overrides=(), names=tuple(VARIANTS)):
  """{variant: dict(val_nll curve, fractions)} from train.train_and_evaluate runs."""
  results = {}
  for name in names:
    recipe, extra = VARIANTS[name]
    every = max(steps // 6, 1)
    cfg = config_lib.load_config(recipe, [f"train.num_steps={steps}", f"train.eval_every={every}",
                                          f"train.log_every={every}", "train.checkpoint_every=100000",
                                          "train.sample_every_eval=false", *overrides, *extra])
    workdir = os.path.join(out, name)
    t0 = time.time()
    train.train_and_evaluate(cfg, workdir, log=lambda *a: None)
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    evals = [(r["step"], r["val_nll"]) for r in rows if "val_nll" in r]
    logged = [r for r in rows if "moe_fraction_0" in r]
    fractions = [logged[-1][f"moe_fraction_{e}"] for e in range(cfg.model.moe_experts)] if logged else None
    results[name] = {"val_nll": evals, "fractions": fractions, "seconds": time.time() - t0,
                     "train_loss": [(r["step"], r["nll"]) for r in rows if "nll" in r]}
    print(f"{name:<11} val nll at {steps}: {evals[-1][1]:.4f}  ({time.time() - t0:.0f} s)"
          + (f"  fractions per expert {np.round(fractions, 3).tolist()}" if fractions else ""), flush=True)
  return results


def time_steps(rounds, steps_per_round, out, overrides=()):
  """Median ms per train step of each kind, interleaved rounds from one state and batch."""
  kinds = {"dense": ("shakespeare_char", []), "moe_dropless": ("moe_shakespeare", []),
           "moe_capacity_1.25": ("moe_shakespeare", ["model.moe_capacity_factor=1.25"]),
           "moe_all_experts": ("moe_shakespeare", [])}
  fns = {}
  for kind, (recipe, extra) in kinds.items():
    cfg = config_lib.load_config(recipe, [*overrides, *extra])
    _, task, model, tx, schedule, init_fn, rng, _, _ = train.setup(cfg, os.path.join(out, "timing"), lambda *a: None)
    state = jax.jit(lambda r: nn.unbox(init_fn(r)))(rng)
    batch = jax.device_put(task.train_batch(0))
    step = jax.jit(train.make_train_step(model, task, cfg, tx, schedule))
    if kind == "moe_all_experts":
      original, moe.MoEFeedForward = moe.MoEFeedForward, AllExperts  # the model looks it up when traced
    try:
      jax.block_until_ready(step(state, batch))  # traced and compiled while the class is swapped
    finally:
      if kind == "moe_all_experts":
        moe.MoEFeedForward = original
    fns[kind] = (step, state, batch)
  times = {k: [] for k in kinds}
  for _ in range(rounds):
    for kind, (step, state, batch) in fns.items():
      t0 = time.perf_counter()
      s = state
      for _ in range(steps_per_round):
        s, metrics = step(s, batch)
      jax.block_until_ready(metrics)
      times[kind].append(1e3 * (time.perf_counter() - t0) / steps_per_round)
  med = {k: float(np.median(v)) for k, v in times.items()}
  for k, v in med.items():
    print(f"  {k:<18} {v:8.2f} ms/step  ({v / med['dense']:.2f}x dense)  rounds {np.round(times[k], 1).tolist()}")
  return {"median_ms": med, "rounds": times}


def plot(results, path, overrides=()):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, r in results.items():
    steps, nll = zip(*r["val_nll"])
    ax.plot(steps, nll, marker="o", label=name)
  ax.set_xlabel("step")
  ax.set_ylabel("validation NLL (nats/char)")
  ax.set_title("Tiny Shakespeare: dense d_ff 512 vs 8 experts x d_ff 256, top 2"
               + (f"\n{' '.join(overrides)}" if overrides else ""), fontsize=10)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=600)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--steps-per-round", type=int, default=10)
  parser.add_argument("--out", default="/tmp/moe_vs_dense")
  parser.add_argument("--skip-training", action="store_true")
  parser.add_argument("--variants", default=",".join(VARIANTS), help="which training runs (comma-separated)")
  parser.add_argument("--skip-timing", action="store_true")
  parser.add_argument("overrides", nargs="*", help="for every variant's training run and timed step, e.g. data.batch_size=96")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  print(f"load average {os.getloadavg()}", flush=True)
  results = {} if args.skip_training else train_variants(args.steps, args.out, args.overrides,
                                                            args.variants.split(","))
  timing = {}
  if not args.skip_timing:
    print("step time (one process, interleaved rounds):", flush=True)
    timing = time_steps(args.rounds, args.steps_per_round, args.out, args.overrides)
  print(f"load average {os.getloadavg()}", flush=True)
  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump({"training": results, "timing": timing, "steps": args.steps, "overrides": args.overrides}, f, indent=1)
  if results:
    plot(results, os.path.join(args.out, "moe_vs_dense.png"), args.overrides)


if __name__ == "__main__":
  main()
