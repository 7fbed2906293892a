"""Where the serving engine's time goes, without HTTP: each program timed alone, then a closed-loop run.

    python benchmarks/engine_profile.py --workdir W [--max-batch 16] [--max-seq-len 640] [--prefill-chunk 128]
        [--kv-blocks 512] [same request flags as serve_load.py: --num-requests 32 --concurrency 16 ...]

W: `python benchmarks/serve_load.py make-workdir --out W`. Prints the decode step's time at each history
width (all slots idle, median of 5 calls), a prefill call's at each chunk bucket and history width, the model's own
decode step (`decode._lm_step` over a contiguous cache: no gather) at 1 and --max-batch rows, then the same requests
as `serve_load.py load` sent straight to `engine.Engine` (`--concurrency` in flight) with the seconds spent
in prefill and in decode calls.
"""

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _median_ms(f, repeats=5):
  f()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    f()
    times.append(time.perf_counter() - start)
  return float(np.median(times)) * 1e3


def main():
  import serve_load  # pylint: disable=g-import-not-at-top
  from jaxformer import engine as engine_lib, evaluate  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--max-batch", type=int, default=16)
  parser.add_argument("--max-seq-len", type=int, default=640)
  parser.add_argument("--prefill-chunk", type=int, default=128)
  parser.add_argument("--kv-blocks", type=int, default=512)
  for flag, default in (("--num-requests", 32), ("--concurrency", 16), ("--prompt-len", 64), ("--output-len", 48),
                        ("--quantum", 16), ("--seed", 0)):
    parser.add_argument(flag, type=int, default=default)
  parser.add_argument("--spread", type=float, default=0.5)
  args = parser.parse_args()
  _, model, params, _, _ = evaluate.load_run(args.workdir, log=lambda *a: None)
  eng = engine_lib.Engine(model, params, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                          prefill_chunk=args.prefill_chunk, kv_blocks=args.kv_blocks)
  print(f"warm-up {eng.warm_up():.1f}s", flush=True)
  rows = args.max_batch
  for w in eng.history_buckets:
    ms = _median_ms(lambda: eng._run([[]] * rows, 1, w, 1))
    print(f"decode step, {rows} rows, history width {w * eng.block_size} slots: {ms:.1f} ms", flush=True)
  for b in eng.buckets:
    for w in eng.prefill_widths:
      ms = _median_ms(lambda: eng._run([[]], b, w, eng.max_pack))
      print(f"prefill call, 1 row, {b} tokens, {w * eng.block_size} history slots: {ms:.1f} ms", flush=True)

  # The floor under the engine's decode call: the model's own step over a contiguous cache (decode.generate's
  # layout; no gather, no scatter, no sampling) at the same rows.
  import functools  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jaxformer import decode  # pylint: disable=g-import-not-at-top
  lm_step = jax.jit(functools.partial(decode._lm_step, model), donate_argnums=(1,))
  for rows_, slots in ((1, 32), (1, 256), (rows, 32), (rows, 256)):
    cache = [jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), decode._cache_shapes(model, rows_, slots, 1))]
    ones = jnp.ones((rows_, 1), jnp.int32)

    def model_step():
      logits, cache[0] = lm_step(params, cache[0], ones, ones, ones)
      jax.block_until_ready(logits)
    print(f"the model's own decode step (decode._lm_step), {rows_} rows, {slots}-slot cache: "
          f"{_median_ms(model_step):.1f} ms", flush=True)

  spent = collections.Counter()
  for name in ("_prefill", "_decode", "_mixed"):
    def timed(*a, f=getattr(eng, name), name=name):
      start = time.perf_counter()
      f(*a)
      spent[name] += time.perf_counter() - start
    setattr(eng, name, timed)
  reqs = serve_load.requests(args)
  queue, live = list(reqs), []

  def submit():
    prompt, n = queue.pop(0)
    live.append(eng.submit(prompt, engine_lib.SamplingParams(max_tokens=n, temperature=0.0)))
  start = time.perf_counter()
  for _ in range(min(args.concurrency, len(queue))):
    submit()
  peak = 0
  while live:
    eng.step()
    spent["steps"] += 1
    peak = max(peak, eng.running())
    for r in [r for r in live if r.finished]:
      live.remove(r)
      if queue:
        submit()
  wall = time.perf_counter() - start
  print(f"engine, {args.concurrency} in flight: {len(reqs)} requests in {wall:.1f}s, "
        f"{sum(n for _, n in reqs) / wall:.1f} output tok/s; {spent['steps']} steps, "
        f"{eng.stats['prefill_calls']} prompt chunks ({eng.stats['prefill_pieces']} pieces), {eng.stats['mixed_calls']} of "
        f"them in the decode call; time in prefill-only calls {spent['_prefill']:.1f}s, decode-only "
        f"{spent['_decode']:.1f}s, both in one call {spent['_mixed']:.1f}s; at most {peak} running at once, "
        f"{eng.stats['preemptions']} preemptions", flush=True)


if __name__ == "__main__":
  main()
