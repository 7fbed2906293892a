"""Sliding-window attention at 16k tokens against full causal attention at 16k and at 1k, per token.

    python benchmarks/sliding_window.py [--length 16384] [--window 1024] [--short 1024] [--rows 1]
        [--rounds 5] [--steps 3] [--full-steps 1] [--dense] [--out sliding_window.json]
        [--plot sliding_window.png] [--fast] [overrides ...]

One process, three train steps of the same small decoder-only LM (2 layers, d_model 128,
4 heads, d_ff 512, RoPE, RMSNorm, SwiGLU, no biases, vocab 68, float32,
model.attention_impl=tiled so all three run `jaxformer.attention`'s kernel), each on the
same number of tokens per step:

  window  --rows rows of --length tokens, model.sliding_window=--window
  full    --rows rows of --length tokens, full causal attention
  short   --rows x length/short rows of --short tokens, full causal attention

The step is the trainer's own `train.make_train_step` with `tasks.LMTask.loss` (forward,
backward, AdamW update, as train.py runs it: jitted with the state donated), on random
tokens put on the device beforehand. The steps are timed interleaved (window, full,
short, window, ...): --rounds rounds of --steps steps each (--full-steps for `full`, the
slow one), each step wall-clock to `block_until_ready`; the table shows the median step
and its process CPU time, and the paired ratio (each round's mean against the same round's
mean of the other configuration). Memory is XLA's `memory_analysis()` of the compiled step
(temporaries, arguments) and of one layer's attention alone (`dot_product_attention`,
forward + backward, tiled), which is also timed once a round ("attn s x layers": its median
times the layers, the attention's share of a step); peak RSS is the process's running maximum
after each configuration's compile and first step (so it only grows). --dense adds the attention alone
through the dense path (model.attention_impl=einsum, compiled only, not run: ~1 min more at
16k) for contrast. "key blocks" is what the kernel visits per query block, of the query blocks
(`attention.key_block_range`; 512-row blocks at 1k and 16k), and "keys/query" the keys a query
actually sees. GFLOP/s is model FLOPs (`inspect.flops_per_token`: 2 x matmul weights + 4 x
d_model per key seen per layer, x 3 for training) per second.
Writes the figures to --out (JSON) and draws step time and memory per configuration to
--plot. Asserts nothing about speed.
"""

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import flax.linen as nn  # pylint: disable=g-import-not-at-top
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import attention  # pylint: disable=g-import-not-at-top
from jaxformer import config as config_lib
from jaxformer import inspect as inspect_lib
from jaxformer import layers
from jaxformer import model as model_lib
from jaxformer import optim
from jaxformer import runtime
from jaxformer import sharding
from jaxformer import tasks
from jaxformer import train

MODEL = ["model.num_layers=2", "model.d_model=128", "model.num_heads=4", "model.d_ff=512",
         "model.activation=swiglu", "model.norm=rmsnorm", "model.norm_position=pre", "model.use_bias=false",
         "model.position=rope", "model.attention_impl=tiled", "model.dtype=float32", "model.dropout_rate=0.0",
         "mesh.data=1", "train.steps_per_call=1", "optim.warmup_steps=1"]
FAST_MODEL = ["model.d_model=32", "model.d_ff=64"]
MIB = 2 ** 20


def configurations(args):
  """[(name, rows, length, window)] of the three runs: the same tokens per step in each."""
  if args.length % args.short:
    raise SystemExit(f"error: --length {args.length} must be a multiple of --short {args.short}")
  return [("window", args.rows, args.length, args.window),
          ("full", args.rows, args.length, 0),
          ("short", args.rows * args.length // args.short, args.short, 0)]


def load(rows, length, window, overrides):
  return config_lib.load_config("shakespeare_char", MODEL + [
      f"model.max_len={length}", f"data.block_size={length}", f"data.batch_size={rows}",
      f"model.sliding_window={window}"] + overrides)


def random_batches(rows, length, vocab, count, seed=0):
  """Next-token batches of random ids (3 .. vocab - 1: no PAD/BOS/EOS), every slot real."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    tokens = rng.integers(3, vocab, (rows, length + 1), dtype=np.int32)
    out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
  return out


def key_blocks(length, window):
  """(mean, max, count of query blocks, block rows) of the key blocks the kernel visits per query block."""
  slots = np.arange(length)
  start, stop = attention.key_block_range(slots, slots, window=window)
  visited = np.asarray(stop) - np.asarray(start)
  return float(visited.mean()), int(visited.max()), len(visited), attention.block_size(length)


def keys_per_query(length, window):
  """Mean number of keys a query sees: (L + 1) / 2 causal, min(i + 1, window) with a window."""
  seen = np.arange(1, length + 1)
  return float(np.minimum(seen, window).mean() if window else seen.mean())


def attention_alone(cfg, rows, length, window, implementation="tiled"):
  """One layer's attention alone, forward + backward (the gradient of sum(out^2) wrt q, k, v), compiled:
  -> (XLA's temporaries in bytes, the compiled function, its arguments' shapes)."""
  m = cfg.model
  q = jax.ShapeDtypeStruct((rows, length, m.num_heads, m.dim_per_head), jnp.float32)
  kv = jax.ShapeDtypeStruct((rows, length, m.kv_heads, m.dim_per_head), jnp.float32)
  seg = jax.ShapeDtypeStruct((rows, length), jnp.int32)

  def loss(q, k, v, segment):
    slots = jnp.arange(length)
    out = layers.dot_product_attention(q, k, v, segment, segment, slots, slots, implementation=implementation,
                                       causal=True, window=window)
    return jnp.sum(out * out)

  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile()
  return compiled.memory_analysis().temp_size_in_bytes, compiled, (q, kv, kv, seg)


class Run:
  """One configuration: its jitted train step, compiled once, its state and its timings."""

  def __init__(self, name, rows, length, window, overrides, dense=False):
    self.name, self.rows, self.length, self.window = name, rows, length, window
    self.cfg = cfg = load(rows, length, window, overrides)
    mesh = sharding.make_mesh(cfg.mesh, jax.devices()[:1])
    model = model_lib.build_model(cfg.model)
    tx, schedule = optim.build_optimizer(cfg)
    init = functools.partial(train.init_state, model, tx, (jnp.ones((1, 4), jnp.int32),))
    abstract = jax.eval_shape(init, jax.random.key(cfg.train.seed))
    state_sharding = sharding.logical_sharding(abstract, mesh)
    batch_sharding = sharding.batch_sharding(mesh)
    self.state = jax.jit(lambda r: nn.unbox(init(r)), out_shardings=state_sharding)(jax.random.key(cfg.train.seed))
    self.batches = [sharding.global_batch(b, batch_sharding)
                    for b in random_batches(rows, length, cfg.model.vocab_size, 2)]
    # As train.py jits it (donated state, the mesh's shardings); task: LMTask's static loss.
    step = jax.jit(train.make_train_step(model, tasks.LMTask, cfg, tx, schedule),
                   in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, None),
                   donate_argnums=0)
    t = time.perf_counter()
    with sharding.use_mesh(mesh):
      self.compiled = step.lower(self.state, self.batches[0]).compile()
    self.compile_s = time.perf_counter() - t
    mem = self.compiled.memory_analysis()
    self.memory = dict(temp=mem.temp_size_in_bytes, argument=mem.argument_size_in_bytes,
                       output=mem.output_size_in_bytes, alias=mem.alias_size_in_bytes)
    self.memory["total"] = (self.memory["argument"] + self.memory["output"] - self.memory["alias"]
                            + self.memory["temp"])
    self.wall, self.cpu, self.losses, self.calls, self.rounds = [], [], [], 0, []
    self.step()  # the first call (page-faults its buffers in), not timed
    self.first_loss, self.first_s = self.losses[0], self.wall[0]
    self.wall, self.cpu = [], []
    self.rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    self.attention_temp, self.attention_fn, shapes = attention_alone(cfg, rows, length, window)
    keys = jax.random.split(jax.random.key(1), 3)
    self.attention_args = [jax.random.normal(k, a.shape, a.dtype) for k, a in zip(keys, shapes[:3])]
    self.attention_args.append(jnp.ones(shapes[3].shape, jnp.int32))
    self.attention_s = []
    self.time_attention()
    self.attention_s = []
    t = time.perf_counter()
    self.dense_temp = attention_alone(cfg, rows, length, window, "einsum")[0] if dense else None
    self.dense_compile_s = time.perf_counter() - t if dense else None
    self.blocks = key_blocks(length, window)
    self.keys = keys_per_query(length, window)
    # Model FLOPs per token as MFU counts them (a local layer's queries count the keys in their window).
    self.flops_per_token = inspect_lib.flops_per_token(cfg, length)["train"]

  def time_attention(self):
    t = time.perf_counter()
    jax.block_until_ready(self.attention_fn(*self.attention_args))
    self.attention_s.append(time.perf_counter() - t)

  @property
  def tokens(self):
    return self.rows * self.length

  def step(self):
    c, t = time.process_time(), time.perf_counter()
    self.state, metrics = self.compiled(self.state, self.batches[self.calls % 2])
    jax.block_until_ready(metrics)
    self.wall.append(time.perf_counter() - t)
    self.cpu.append(time.process_time() - c)
    self.calls += 1
    self.losses.append(float(metrics["loss_sum"]) / float(metrics["tokens"]))

  def summary(self):
    wall = statistics.median(self.wall)
    return dict(name=self.name, layers=self.cfg.model.num_layers, rows=self.rows, length=self.length,
                window=self.window, tokens_per_step=self.tokens,
                step_s=wall, step_s_all=self.wall, cpu_s=statistics.median(self.cpu), cpu_s_all=self.cpu,
                round_means=self.rounds, cores_busy=sum(self.cpu) / sum(self.wall), tokens_per_s=self.tokens / wall,
                us_per_token=wall / self.tokens * 1e6, compile_s=self.compile_s, memory=self.memory,
                attention_temp_bytes=self.attention_temp, attention_alone_s=statistics.median(self.attention_s),
                attention_alone_s_all=self.attention_s, dense_attention_temp_bytes=self.dense_temp,
                dense_attention_compile_s=self.dense_compile_s, peak_rss_mib=self.rss_mib,
                key_blocks_mean=self.blocks[0], key_blocks_max=self.blocks[1], query_blocks=self.blocks[2],
                block_rows=self.blocks[3], keys_per_query=self.keys, model_flops_per_token=self.flops_per_token,
                model_gflops_per_s=self.flops_per_token * self.tokens / wall / 1e9,
                loss_first=self.first_loss, loss_last=self.losses[-1], steps=self.calls)


def label(r):
  if r["window"]:
    return f"{r['rows']} x {r['length']:,}, window {r['window']:,}"
  return f"{r['rows']} x {r['length']:,}, full causal"


def tiles(r):
  """[query block, key block] tiles the kernel visits per layer per step (forward; the backward revisits them)."""
  return r["key_blocks_mean"] * r["query_blocks"] * r["rows"]


def print_table(results):
  by = {r["name"]: r for r in results}
  window, full, short = by["window"], by["full"], by["short"]
  dense = short["dense_attention_temp_bytes"] is not None
  print(f"\n{'configuration':<28} {'step s':>7} {'CPU s':>6} {'tokens/s':>8} {'x short':>7} {'temp MiB':>8} "
        f"{'arg MiB':>7} {'attn temp MiB':>13}" + (f" {'dense attn MiB':>14}" if dense else "") +
        f" {'RSS MiB':>7} {'key blocks':>10} {'keys/query':>10} {'GFLOP/s':>7} {'attn s x layers':>15} "
        f"{'compile s':>9} {'loss':>13}")
  for r in results:
    print(f"{label(r):<28} {r['step_s']:>7.3f} {r['cpu_s']:>6.2f} {r['tokens_per_s']:>8,.0f} "
          f"{r['step_s'] / short['step_s']:>7.2f} {r['memory']['temp'] / MIB:>8.1f} "
          f"{r['memory']['argument'] / MIB:>7.2f} {r['attention_temp_bytes'] / MIB:>13.1f}"
          + (f" {r['dense_attention_temp_bytes'] / MIB:>14.1f}" if dense else "") +
          f" {r['peak_rss_mib']:>7.0f} {r['key_blocks_mean']:>5.2f} / {r['query_blocks']:<2} "
          f"{r['keys_per_query']:>10,.0f} {r['model_gflops_per_s']:>7.1f} "
          f"{r['attention_alone_s'] * r['layers']:>15.3f} "
          f"{r['compile_s']:>9.1f} {r['loss_first']:>6.3f}->{r['loss_last']:<6.3f}")

  def paired(a, b):
    return statistics.median(x / y for x, y in zip(a["round_means"], b["round_means"]))

  def attn(a, b):
    return statistics.median(x / y for x, y in zip(a["attention_alone_s_all"], b["attention_alone_s_all"]))

  print(f"\nwindow / short, per token: {window['step_s'] / short['step_s']:.2f}x step time "
        f"(paired by round {paired(window, short):.2f}x; CPU s {window['cpu_s'] / short['cpu_s']:.2f}x), "
        f"attention alone {attn(window, short):.2f}x, {tiles(window) / tiles(short):.2f}x tiles visited, "
        f"{window['keys_per_query'] / short['keys_per_query']:.2f}x keys seen, "
        f"{window['memory']['temp'] / short['memory']['temp']:.2f}x step temporaries, "
        f"{window['attention_temp_bytes'] / short['attention_temp_bytes']:.2f}x attention temporaries")
  print(f"full / window: {full['step_s'] / window['step_s']:.2f}x step time (paired {paired(full, window):.2f}x), "
        f"attention alone {attn(full, window):.2f}x, {tiles(full) / tiles(window):.2f}x tiles visited, "
        f"{full['memory']['temp'] / window['memory']['temp']:.2f}x step temporaries, "
        f"{full['attention_temp_bytes'] / window['attention_temp_bytes']:.2f}x attention temporaries"
        + (f" (dense path: {full['dense_attention_temp_bytes'] / window['dense_attention_temp_bytes']:.2f}x)"
           if dense else ""))
  print("cores busy (CPU s / wall s): " + ", ".join(f"{r['name']} {r['cores_busy']:.2f}" for r in results))


def plot(results, path):
  """Step time and memory (temporaries, arguments, attention alone) per configuration."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  names = [label(r).replace(", ", "\n") for r in results]
  x = np.arange(len(results))
  fig, (time_ax, mem_ax) = plt.subplots(1, 2, figsize=(11, 5))
  time_ax.bar(x, [r["step_s"] for r in results], color=["tab:green", "tab:red", "tab:blue"])
  for i, r in enumerate(results):
    time_ax.text(i, r["step_s"], f"{r['step_s']:.2f} s\n{r['tokens_per_s']:,.0f} tok/s", ha="center", va="bottom",
                 fontsize=8)
  time_ax.set_ylabel("train step, median wall (s)")
  time_ax.set_ylim(0, max(r["step_s"] for r in results) * 1.25)
  bars = [("step temporaries", lambda r: r["memory"]["temp"]),
          ("step arguments", lambda r: r["memory"]["argument"]),
          ("attention alone (1 layer, fwd+bwd), tiled", lambda r: r["attention_temp_bytes"])]
  if results[0]["dense_attention_temp_bytes"] is not None:
    bars.append(("attention alone, dense path (compiled only)", lambda r: r["dense_attention_temp_bytes"]))
  width = 0.8 / len(bars)
  for k, (what, get) in enumerate(bars):
    mem_ax.bar(x + (k - (len(bars) - 1) / 2) * width, [get(r) / MIB for r in results], width, label=what)
  mem_ax.set_yscale("log")
  mem_ax.set_ylabel("XLA memory_analysis (MiB, log)")
  mem_ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
  for ax in (time_ax, mem_ax):
    ax.set_xticks(x, names, fontsize=8)
    ax.grid(axis="y", alpha=0.3)
  tokens = results[0]["tokens_per_step"]
  fig.suptitle(f"Train step, {tokens:,} tokens per step, tiled kernel (benchmarks/sliding_window.py)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  print(f"wrote {path}")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--length", type=int, default=16384, help="tokens per row of the long configurations")
  parser.add_argument("--window", type=int, default=1024, help="model.sliding_window of the window configuration")
  parser.add_argument("--short", type=int, default=1024, help="tokens per row of the short full-causal configuration")
  parser.add_argument("--rows", type=int, default=1, help="rows of --length tokens per step")
  parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
  parser.add_argument("--steps", type=int, default=3, help="timed steps per round (window and short)")
  parser.add_argument("--full-steps", type=int, default=1, help="timed steps per round of the full 16k configuration")
  parser.add_argument("--dense", action="store_true",
                      help="also compile (not run) the attention alone through the dense path, for its memory")
  parser.add_argument("--out", help="write the results to this JSON file")
  parser.add_argument("--plot", help="write step time and memory per configuration to this PNG")
  parser.add_argument("--fast", action="store_true",
                      help="smoke run: 2,048 tokens, window 256 vs 256-token rows, d_model 32, 1 round of 1 step")
  parser.add_argument("overrides", nargs="*", help="extra dotted overrides for all three, e.g. model.num_layers=4")
  args = parser.parse_intermixed_args(argv)
  overrides = list(args.overrides)
  if args.fast:
    args.length, args.window, args.short, args.rounds, args.steps, args.full_steps = 2048, 256, 256, 1, 1, 1
    overrides = FAST_MODEL + overrides
  runtime.keep_freed_memory()  # as train.py does
  layers.log_attention_choices(lambda line: print("  kernel:", line))
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind} ({os.cpu_count()} CPUs), "
        f"load {os.getloadavg()[0]:.1f}; shakespeare_char {' '.join(MODEL + overrides)}; "
        f"{args.rows * args.length:,} tokens per step", flush=True)
  runs = []
  for name, rows, length, window in configurations(args):
    t = time.perf_counter()
    runs.append(Run(name, rows, length, window, overrides, args.dense))
    r = runs[-1]
    print(f"{name}: {rows} x {length} window {window}: compiled in {r.compile_s:.1f} s, first step "
          f"{r.first_s:.2f} s, set up in {time.perf_counter() - t:.1f} s; "
          f"temp {r.memory['temp'] / MIB:.1f} MiB", flush=True)
  for i in range(args.rounds):
    for r in runs:
      n = args.full_steps if r.name == "full" else args.steps
      for _ in range(n):
        r.step()
      r.rounds.append(statistics.mean(r.wall[-n:]))
      r.time_attention()
    print(f"round {i + 1}/{args.rounds}: " + ", ".join(f"{r.name} {r.wall[-1]:.3f} s" for r in runs)
          + f"; load {os.getloadavg()[0]:.1f}", flush=True)
  results = [r.summary() for r in runs]
  print_table(results)
  meta = dict(jax=jax.__version__, device=jax.devices()[0].device_kind, cpus=os.cpu_count(),
              cpu_model=_cpu_model(), model=MODEL + overrides, rounds=args.rounds, steps=args.steps,
              full_steps=args.full_steps, load_end=os.getloadavg()[0],
              peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"meta": meta, "results": results}, f, indent=1)
    print(f"wrote {args.out}")
  if args.plot:
    plot(results, args.plot)
  return results


def _cpu_model():
  try:
    with open("/proc/cpuinfo") as f:
      return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
  except OSError:
    return ""


if __name__ == "__main__":
  main()
