"""Load test of `python -m jaxformer.serve` over HTTP, in the style of vLLM's benchmark_serving.py.

    python benchmarks/serve_load.py make-workdir --out /tmp/gpt2_small_random    # gpt2_small shapes, random weights
    python benchmarks/serve_load.py load --url http://127.0.0.1:8000/v1 [--num-requests 32] [--concurrency 16 |
        --rate 4] [--prompt-len 64] [--output-len 48] [--spread 0.5] [--seed 0]
    python benchmarks/serve_load.py sequential --workdir W [same request flags]    # jaxformer.generate, one by one
    python benchmarks/serve_load.py prefix --url URL [--system-len 512] [--user-len 32] [--rounds 8]
    python benchmarks/serve_load.py sweep --url URL --rates 1,2,4,8 [--num-requests 64]  # throughput per rate
    python benchmarks/serve_load.py soak --url URL --rate R [--duration 300]            # minute by minute

`load` sends `--num-requests` streamed completions (token-id prompts, `ignore_eos`, so every request
generates exactly its output length) either from `--concurrency` closed-loop clients or as Poisson
arrivals at `--rate` requests/s; prompt and output lengths are uniform within +-spread of their means
(seeded) and rounded to multiples of `--quantum`. It prints requests/s, output tokens/s, time to first token (TTFT) and time per output token
after the first (TPOT) at p50 and p99. `sequential` runs the same requests one after another through
`jaxformer.generate.generate_ids` (each shape compiled before the clock starts) and prints the same
throughput. `prefix` measures TTFT with a shared `--system-len`-token system prompt: a miss (a new
system prompt each round) against a hit (the same one, cached by an earlier request). `sweep` runs
`load` at each of `--rates` (Poisson, `--num-requests` each): the rate where output tokens/s stops rising
is the server's saturating rate. `soak` sends Poisson arrivals at `--rate` for `--duration` seconds (fresh
requests from the same length distribution), reads the server's /metrics every 10 s (resident memory,
XLA compilations since the ready line) and prints, per minute: requests finished and failed, output
tokens/s, TTFT p50, the server's resident memory; then failures, compilations, and the last minute's
memory against the first's.
"""

import argparse
import asyncio
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def make_workdir(args):
  """A decoder-only workdir with gpt2_small's shapes, random N(0, 0.02) weights, and a char tokenizer of
  exactly its 50257 ids (one character each, so every id decodes); prompts are sent as ids."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from jaxformer import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  from jaxformer import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxformer import model as model_lib  # pylint: disable=g-import-not-at-top
  from jaxformer import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top
  os.makedirs(args.out, exist_ok=True)
  tok = tokenizer_lib.CharTokenizer("".join(chr(0x10000 + i) for i in range(50257 - tokenizer_lib.NUM_SPECIALS)))
  cfg = config_lib.load_config("gpt2_small", ["data.tokenizer=char", "model.dtype=float32"])
  assert tok.vocab_size == cfg.model.vocab_size, (tok.vocab_size, cfg.model.vocab_size)
  tok.save(os.path.join(args.out, "tokenizer.json"))
  model = model_lib.build_model(cfg.model)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda path, s: np.ones(s.shape, s.dtype) if path[-1].key == "scale" else np.asarray(
          rng.normal(0.0, 0.02, s.shape), s.dtype), nn.unbox(shapes))
  checkpoint_lib.save_params(args.out, params, step=1)
  with open(os.path.join(args.out, "config.json"), "w") as f:
    f.write(config_lib.to_json(cfg))
  print(f"wrote {args.out}: gpt2_small shapes, random weights")


def requests(args, vocab=50257):
  """[(prompt ids, output length)] drawn with --seed."""
  rng = np.random.default_rng(args.seed)
  def lengths(mean, n):  # rounded to multiples of --quantum: fewer shapes for `sequential` to compile
    drawn = rng.integers(int(mean * (1 - args.spread)), int(mean * (1 + args.spread)) + 1, n)
    return np.maximum(args.quantum, np.round(drawn / args.quantum).astype(int) * args.quantum)
  prompt_lens, output_lens = lengths(args.prompt_len, args.num_requests), lengths(args.output_len, args.num_requests)
  return [(rng.integers(3, vocab, p).tolist(), int(o)) for p, o in zip(prompt_lens, output_lens)]


async def _one(client, url, prompt, n, model):
  """One streamed completion -> (TTFT, total seconds, output tokens)."""
  start = time.perf_counter()
  first, tokens = None, 0
  body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True, "ignore_eos": True,
          "stream_options": {"include_usage": True}}
  async with client.stream("POST", url + "/completions", json=body, timeout=None) as r:
    if r.status_code != 200:
      raise RuntimeError(f"HTTP {r.status_code}: {await r.aread()}")
    async for line in r.aiter_lines():
      if not line.startswith("data: ") or line == "data: [DONE]":
        continue
      chunk = json.loads(line[6:])
      if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
        first = time.perf_counter() - start
      if chunk.get("usage"):
        tokens = chunk["usage"]["completion_tokens"]
  return first, time.perf_counter() - start, tokens


def _report(name, results, wall):
  ttft = np.array([r[0] for r in results])
  tpot = np.array([(r[1] - r[0]) / (r[2] - 1) for r in results if r[2] > 1])
  out = sum(r[2] for r in results)
  print(f"{name}: {len(results)} requests in {wall:.1f}s: {len(results) / wall:.2f} req/s, {out / wall:.1f} output tok/s; "
        f"TTFT p50 {np.percentile(ttft, 50) * 1e3:.0f} ms p99 {np.percentile(ttft, 99) * 1e3:.0f} ms; "
        f"TPOT p50 {np.percentile(tpot, 50) * 1e3:.1f} ms p99 {np.percentile(tpot, 99) * 1e3:.1f} ms", flush=True)


async def load(args):
  import httpx  # pylint: disable=g-import-not-at-top
  reqs = requests(args)
  async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1000)) as client:
    model = (await client.get(args.url + "/models")).json()["data"][0]["id"]
    await _one(client, args.url, reqs[0][0][:8], 2, model)      # connection and first-request costs
    start = time.perf_counter()
    if args.rate:
      rng = np.random.default_rng(args.seed + 1)

      async def delayed(delay, prompt, n):
        await asyncio.sleep(delay)
        return await _one(client, args.url, prompt, n, model)
      delays = np.cumsum(rng.exponential(1.0 / args.rate, len(reqs)))
      results = await asyncio.gather(*[delayed(d, p, n) for d, (p, n) in zip(delays, reqs)])
      name = f"poisson {args.rate} req/s"
    else:
      queue = list(reqs)
      results = []

      async def worker():
        while queue:
          prompt, n = queue.pop(0)
          results.append(await _one(client, args.url, prompt, n, model))
      await asyncio.gather(*[worker() for _ in range(args.concurrency)])
      name = f"{args.concurrency} concurrent clients"
    _report(name, results, time.perf_counter() - start)


async def sweep(args):
  """`load` with Poisson arrivals at each of --rates."""
  for rate in [float(r) for r in args.rates.split(",")]:
    args.rate = rate
    await load(args)


def _metrics(text):
  """{name: value} of the unlabelled samples in a Prometheus text page."""
  from prometheus_client.parser import text_string_to_metric_families  # pylint: disable=g-import-not-at-top
  return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}


async def soak(args):
  """Poisson arrivals at --rate for --duration seconds; per-minute throughput, failures and server memory."""
  import httpx  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(args.seed + 2)
  args.num_requests = int(args.rate * args.duration * 2) + 16      # more than the run can draw
  reqs = iter(requests(args))
  base = args.url[:-3] if args.url.endswith("/v1") else args.url
  done, failed, samples = [], [], []                              # (finish time, ttft, tokens); times; (t, metrics)
  async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1000)) as client:
    model = (await client.get(args.url + "/models")).json()["data"][0]["id"]
    start = time.perf_counter()

    async def one(prompt, n):
      try:
        first, _, tokens = await _one(client, args.url, prompt, n, model)
        done.append((time.perf_counter() - start, first, tokens))
      except Exception as e:  # pylint: disable=broad-except
        failed.append((time.perf_counter() - start, repr(e)[:200]))

    async def sample():
      while True:
        page = (await client.get(base + "/metrics")).text
        samples.append((time.perf_counter() - start, _metrics(page)))
        await asyncio.sleep(10)

    sampler = asyncio.ensure_future(sample())
    tasks, t = [], 0.0
    while True:
      t += rng.exponential(1.0 / args.rate)
      if t >= args.duration:
        break
      await asyncio.sleep(max(0.0, t - (time.perf_counter() - start)))
      tasks.append(asyncio.ensure_future(one(*next(reqs))))
    await asyncio.gather(*tasks)
    sampler.cancel()
    samples.append((time.perf_counter() - start, _metrics((await client.get(base + "/metrics")).text)))
  wall = time.perf_counter() - start
  minutes = int(np.ceil(args.duration / 60))
  rss = lambda m: [x["process_resident_memory_bytes"] / 2**20 for t, x in samples if m * 60 <= t < (m + 1) * 60]
  print(f"soak: Poisson {args.rate} req/s for {args.duration:.0f}s ({len(tasks)} requests sent), all done in {wall:.0f}s")
  for m in range(minutes):
    fin = [d for d in done if m * 60 <= d[0] < (m + 1) * 60]
    bad = sum(m * 60 <= f[0] < (m + 1) * 60 for f in failed)
    ttft = np.median([d[1] for d in fin]) * 1e3 if fin else float("nan")
    mem = np.median(rss(m)) if rss(m) else float("nan")
    print(f"  minute {m + 1}: {len(fin)} finished, {bad} failed, {sum(d[2] for d in fin) / 60:.1f} output tok/s, "
          f"TTFT p50 {ttft:.0f} ms, server RSS {mem:.0f} MiB", flush=True)
  first, last = np.median(rss(0)), np.median(rss(minutes - 1))
  print(f"soak: {len(done)} finished, {len(failed)} failed; XLA compilations since the ready line "
        f"{samples[0][1]['jaxformer_xla_compilations_since_start']:.0f} at the start, "
        f"{samples[-1][1]['jaxformer_xla_compilations_since_start']:.0f} at the end; server RSS last minute / first "
        f"{last / first:.3f} ({first:.0f} -> {last:.0f} MiB)", flush=True)
  for f in failed[:5]:
    print("  failed:", f)


def sequential(args):
  """The same requests one after another through jaxformer.generate (greedy, no EOS stop)."""
  import jax  # pylint: disable=g-import-not-at-top
  from jaxformer import evaluate, generate  # pylint: disable=g-import-not-at-top
  cfg, model, params, _, _ = evaluate.load_run(args.workdir, log=lambda *a: None)
  reqs = requests(args)
  run = lambda p, n: jax.block_until_ready(generate.generate_ids(model, params, cfg, [p], [], n, 0.0, 0, 1.0, 0, None,
                                                                 print))
  for shape in {(len(p), n) for p, n in reqs}:                     # compile every shape first
    run([5] * shape[0], shape[1])
  results = []
  start = time.perf_counter()
  for p, n in reqs:
    t = time.perf_counter()
    run(p, n)
    results.append((float("nan"), time.perf_counter() - t, n))
  wall = time.perf_counter() - start
  out = sum(r[2] for r in results)
  print(f"sequential jaxformer.generate: {len(results)} requests in {wall:.1f}s: {len(results) / wall:.2f} req/s, "
        f"{out / wall:.1f} output tok/s", flush=True)


async def prefix(args):
  """TTFT of a request whose 512-token system prompt is cached (hit) against one whose is not (miss)."""
  import httpx  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(args.seed)
  ids = lambda n: rng.integers(3, 50257, n).tolist()
  async with httpx.AsyncClient() as client:
    model = (await client.get(args.url + "/models")).json()["data"][0]["id"]
    shared = ids(args.system_len)
    await _one(client, args.url, shared + ids(args.user_len), 2, model)      # caches the shared system prompt
    miss, hit = [], []
    for _ in range(args.rounds):
      miss.append((await _one(client, args.url, ids(args.system_len) + ids(args.user_len), 2, model))[0])
      hit.append((await _one(client, args.url, shared + ids(args.user_len), 2, model))[0])
  m, h = np.median(miss), np.median(hit)
  print(f"prefix cache, {args.system_len}-token system prompt + {args.user_len}-token user turn, {args.rounds} rounds: "
        f"TTFT miss p50 {m * 1e3:.0f} ms, hit p50 {h * 1e3:.0f} ms: hit/miss {h / m:.2f}", flush=True)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("mode", choices=["make-workdir", "load", "sequential", "prefix", "sweep", "soak"])
  parser.add_argument("--out", default="/tmp/gpt2_small_random")
  parser.add_argument("--url", default="http://127.0.0.1:8000/v1")
  parser.add_argument("--workdir", default="/tmp/gpt2_small_random")
  parser.add_argument("--num-requests", type=int, default=32)
  parser.add_argument("--concurrency", type=int, default=16)
  parser.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: closed loop)")
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--output-len", type=int, default=48)
  parser.add_argument("--spread", type=float, default=0.5, help="lengths uniform in mean x (1 +- spread)")
  parser.add_argument("--quantum", type=int, default=16, help="lengths are multiples of this")
  parser.add_argument("--system-len", type=int, default=512)
  parser.add_argument("--user-len", type=int, default=32)
  parser.add_argument("--rounds", type=int, default=8)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--rates", default="1,2,4,8", help="sweep: Poisson rates, comma-separated")
  parser.add_argument("--duration", type=float, default=300.0, help="soak: seconds of arrivals")
  args = parser.parse_args()
  if args.mode == "make-workdir":
    make_workdir(args)
  elif args.mode == "sequential":
    sequential(args)
  else:
    asyncio.run({"load": load, "prefix": prefix, "sweep": sweep, "soak": soak}[args.mode](args))


if __name__ == "__main__":
  main()
