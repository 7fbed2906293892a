"""Serving throughput: jaxformer's `engine.Engine` against Hugging Face transformers' own continuous batching.

    # The peer lives outside this repository (nothing of it is committed here):
    python -m venv /work/hfvenv && /work/hfvenv/bin/pip install torch==2.13.0 transformers psutil
    python benchmarks/serve_load.py make-workdir --out W        # gpt2_small shapes, random weights, float32
    python benchmarks/serve_vs_hf.py --workdir W --python /work/hfvenv/bin/python [--sides ours,hf]
        [--num-requests 32] [--prompt-len 64] [--output-len 48] [--spread 0.5] [--quantum 16] [--seed 0]
        [--max-batch 16] [--max-seq-len 640] [--prefill-chunk 128] [--kv-blocks 512]
        [--hf-page-size 256] [--hf-max-batch-tokens 0] [--hf-sequential 2]

Both sides run the same requests, `serve_load.requests` (token-id prompts and output lengths uniform within
+-spread of their means, multiples of --quantum, seeded), greedy, with no end-of-sequence stop, so every
request generates exactly its output length; both read the same float32 weights: W is exported to a
Hugging Face folder in a temporary directory with `python -m jaxformer.convert --to-hf W --out DIR` (the char
tokenizer has no Hugging Face form, so the CLI stops with an error after writing config.json and the weights;
prompts are ids on both sides, so nothing needs it).

Ours: `engine.Engine` in this process (`--max-batch` slots, `--max-seq-len`, `--prefill-chunk`, `--kv-blocks`
of 16 tokens, as `benchmarks/engine_profile.py` builds it), `warm_up()` (every program compiled) and two
short untimed requests first; then all requests are submitted at once into its FIFO queue, and the engine is
stepped until none waits or runs: at most `--max-batch` are in flight, a finished request's slot is taken by
the next waiting one at the next step (the same schedule as engine_profile's closed loop of `--max-batch`
clients). Each request: `SamplingParams(max_tokens=n, temperature=0)`, no stop ids.

HF (`--python`, its own venv): `AutoModelForCausalLM.from_pretrained(DIR, dtype=float32)` with its default
attention ("sdpa": the continuous-batching paged cache works with "sdpa", "paged|eager" or flash; flash needs
half precision and CUDA), torch on as many threads as cores, and the continuous-batching manager that
`generate_batch` wraps (`continuous_batching_context_manager`, with the same WorkloadHints `generate_batch`
would give it). `generate_batch` itself takes one `max_new_tokens` for all its inputs, so the requests are
added one by one with `manager.add_request(ids, max_new_tokens=n, eos_token_id=-1)` (what
`generate_batch`'s `add_requests` does, with each request's own length). `ContinuousBatchingConfig`:
`max_requests_per_batch=--max-batch` (the FIFO scheduler takes decoding requests first, so at most that many
are in flight), `page_size=--hf-page-size` (HF's default 256), `num_blocks` holding the same
`--kv-blocks x 16` tokens as ours, `max_batch_tokens=--hf-max-batch-tokens` (0: HF's default, 8192 tokens
per forward; ours prefills at most `--prefill-chunk` tokens per step); everything else HF's default for CPU
(no CUDA graphs, no compile, synchronous batching). Two short untimed requests go through the same manager
first; the clock runs from the first `add_request` to the last finished result. `--hf-sequential K` also
times plain `model.generate` (greedy, one request at a time, the generation config's EOS unset) on the first K
requests, after one untimed call.

The sides run one after the other (ours first), never at once. Printed: each side's wall time, requests/s
and output tokens/s, the ratio, and how many requests' greedy tokens are identical on both sides (random
weights in float32 may pick differently on near-ties; the first mismatching index is shown). Nothing is
asserted; the figures go to BENCHMARKS.md.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PEER = r'''
import json, os, sys, time
import torch, transformers
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

args = json.loads(sys.argv[1])
torch.set_num_threads(os.cpu_count())
model = AutoModelForCausalLM.from_pretrained(args["folder"], dtype=torch.float32)
reqs = args["requests"]
warm = args["warm"]
gen = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in reqs), eos_token_id=-1)
cb = ContinuousBatchingConfig(page_size=args["page_size"], num_blocks=-(-args["kv_tokens"] // args["page_size"]),
                              max_requests_per_batch=args["max_batch"],
                              max_batch_tokens=args["max_batch_tokens"] or None)
hints = WorkloadHints(max_prompt_length=max(len(p) for p, _ in reqs), max_generated_length=max(n for _, n in reqs),
                      num_requests=len(reqs))


def run(manager, batch):
    """Adds every (prompt, n) -> ({request id: generated ids}, seconds from the first add to the last result)."""
    start = time.perf_counter()
    ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1) for p, n in batch]
    done = {}
    while len(done) < len(ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"{result.request_id}: {result.error}")
            done[result.request_id] = list(result.generated_tokens)
        elif result is None and not manager.is_running():
            raise RuntimeError("the continuous-batching thread stopped")
    return [done[i] for i in ids], time.perf_counter() - start


with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                               workload_hints=hints) as manager:
    _, warm_seconds = run(manager, warm)
    tokens, seconds = run(manager, reqs)
    resolved = manager.continuous_batching_config
    settings = {k: getattr(resolved, k) for k in ("page_size", "num_blocks", "max_batch_tokens",
                                                  "max_requests_per_batch", "max_blocks_per_request",
                                                  "allow_block_sharing", "use_async_batching", "use_cuda_graph",
                                                  "scheduler_type")}
    settings["attn_implementation"] = model.config._attn_implementation
sequential = None
if args["sequential"]:
    model.generation_config.eos_token_id = None    # no EOS stop, as in the continuous batching above (id -1)
    def generate(p, n):
        cfg = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)
        return model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              generation_config=cfg)[0, len(p):].tolist()
    generate(*warm[0])
    start = time.perf_counter()
    seq_tokens = [generate(p, n) for p, n in reqs[:args["sequential"]]]
    sequential = {"seconds": time.perf_counter() - start, "tokens": seq_tokens}
print(json.dumps({"seconds": seconds, "warm_seconds": warm_seconds, "tokens": tokens, "settings": settings,
                  "sequential": sequential, "torch": torch.__version__, "transformers": transformers.__version__,
                  "threads": torch.get_num_threads()}, default=str))
'''


def export(workdir, out):
  """`python -m jaxformer.convert --to-hf workdir --out out`; the char tokenizer's error after the weights is expected."""
  proc = subprocess.run([sys.executable, "-m", "jaxformer.convert", "--to-hf", workdir, "--out", out],
                        capture_output=True, text=True, cwd=ROOT,
                        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
  if not all(os.path.exists(os.path.join(out, f)) for f in ("config.json", "model.safetensors")):
    sys.exit(f"jaxformer.convert --to-hf failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
  if proc.returncode and "has no Hugging Face form" not in proc.stdout + proc.stderr:
    sys.exit(f"jaxformer.convert --to-hf failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")


def run_ours(args, reqs, warm):
  from jaxformer import engine as engine_lib, evaluate  # pylint: disable=g-import-not-at-top
  _, model, params, _, _ = evaluate.load_run(args.workdir, log=lambda *a: None)
  eng = engine_lib.Engine(model, params, max_batch=args.max_batch, max_seq_len=args.max_seq_len,
                          prefill_chunk=args.prefill_chunk, kv_blocks=args.kv_blocks)
  compile_seconds = eng.warm_up()

  def run(batch):
    start = time.perf_counter()
    live = [eng.submit(p, engine_lib.SamplingParams(max_tokens=n, temperature=0.0)) for p, n in batch]
    steps = 0
    while eng.has_work():
      eng.step()
      steps += 1
    return [r.output for r in live], time.perf_counter() - start, steps
  _, warm_seconds, _ = run(warm)
  tokens, seconds, steps = run(reqs)
  return {"seconds": seconds, "warm_seconds": warm_seconds, "compile_seconds": compile_seconds, "tokens": tokens,
          "steps": steps}


def run_hf(args, reqs, warm, folder):
  payload = {"folder": folder, "requests": reqs, "warm": warm, "max_batch": args.max_batch,
             "kv_tokens": args.kv_blocks * 16, "page_size": args.hf_page_size,
             "max_batch_tokens": args.hf_max_batch_tokens, "sequential": args.hf_sequential}
  proc = subprocess.run([args.python, "-c", PEER, json.dumps(payload)], capture_output=True, text=True,
                        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
  if proc.returncode:
    sys.exit(f"the peer failed:\n{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def agreement(a, b):
  """(identical requests, [(request index, first mismatching token index)])."""
  same, first = 0, []
  for i, (x, y) in enumerate(zip(a, b)):
    if x == y:
      same += 1
    else:
      first.append((i, next((k for k, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))))
  return same, first


def main(argv=None):
  import serve_load  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="serve_load.py make-workdir's output (left unchanged)")
  parser.add_argument("--python", default="/work/hfvenv/bin/python", help="the peer's interpreter (torch, transformers)")
  parser.add_argument("--sides", default="ours,hf")
  parser.add_argument("--max-batch", type=int, default=16, help="ours: decode slots; hf: max_requests_per_batch")
  parser.add_argument("--max-seq-len", type=int, default=640)
  parser.add_argument("--prefill-chunk", type=int, default=128)
  parser.add_argument("--kv-blocks", type=int, default=512, help="ours: 16-token blocks; hf: the same tokens")
  parser.add_argument("--hf-page-size", type=int, default=256)
  parser.add_argument("--hf-max-batch-tokens", type=int, default=0, help="0: HF's default (8192)")
  parser.add_argument("--hf-sequential", type=int, default=2, help="also time HF generate() on this many requests")
  for flag, default in (("--num-requests", 32), ("--prompt-len", 64), ("--output-len", 48), ("--quantum", 16),
                        ("--seed", 0)):
    parser.add_argument(flag, type=int, default=default)
  parser.add_argument("--spread", type=float, default=0.5)
  parser.add_argument("--out", default=None, help="write the figures as JSON here")
  args = parser.parse_args(argv)
  sides = [s.strip() for s in args.sides.split(",") if s.strip()]
  if not set(sides) <= {"ours", "hf"}:
    sys.exit(f"--sides takes ours and/or hf, not {args.sides}")
  reqs = serve_load.requests(args)
  warm = [(reqs[0][0][:8], 4), (reqs[-1][0][:8], 4)]
  out_tokens = sum(n for _, n in reqs)
  print(f"{len(reqs)} requests: prompts {min(len(p) for p, _ in reqs)}-{max(len(p) for p, _ in reqs)} tokens "
        f"({sum(len(p) for p, _ in reqs)} in all), outputs {min(n for _, n in reqs)}-{max(n for _, n in reqs)} "
        f"({out_tokens} in all); greedy, no EOS stop; {os.cpu_count()} cores", flush=True)
  results = {}
  tmp = tempfile.mkdtemp(prefix="serve_vs_hf_")
  try:
    if "ours" in sides:
      import jax  # pylint: disable=g-import-not-at-top
      results["ours"] = r = run_ours(args, reqs, warm)
      print(f"ours (jaxformer engine.Engine, jax {jax.__version__}, max_batch {args.max_batch}, prefill_chunk "
            f"{args.prefill_chunk}, kv_blocks {args.kv_blocks}x16): warm-up {r['compile_seconds']:.1f}s compiling + "
            f"{r['warm_seconds']:.1f}s; {len(reqs)} requests in {r['seconds']:.2f}s: {len(reqs) / r['seconds']:.2f} req/s, "
            f"{out_tokens / r['seconds']:.1f} output tok/s ({r['steps']} steps)", flush=True)
    if "hf" in sides:
      folder = os.path.join(tmp, "hf")
      start = time.perf_counter()
      export(args.workdir, folder)
      print(f"exported {args.workdir} to {folder} in {time.perf_counter() - start:.1f}s", flush=True)
      results["hf"] = r = run_hf(args, reqs, warm, folder)
      s = r["settings"]
      print(f"hf (transformers {r['transformers']}, torch {r['torch']}, {r['threads']} threads, continuous batching: "
            f"attn {s['attn_implementation']}, max_requests_per_batch {s['max_requests_per_batch']}, page_size "
            f"{s['page_size']}, num_blocks {s['num_blocks']}, max_batch_tokens {s['max_batch_tokens']}, cuda graphs "
            f"{s['use_cuda_graph']}, async {s['use_async_batching']}, block sharing {s['allow_block_sharing']}): "
            f"warm-up {r['warm_seconds']:.1f}s; {len(reqs)} requests in {r['seconds']:.2f}s: "
            f"{len(reqs) / r['seconds']:.2f} req/s, {out_tokens / r['seconds']:.1f} output tok/s", flush=True)
      if r["sequential"]:
        q = r["sequential"]
        k = len(q["tokens"])
        n = sum(len(t) for t in q["tokens"])
        same, _ = agreement(q["tokens"], r["tokens"][:k])
        print(f"hf generate(), one request at a time: {k} requests ({n} output tokens) in {q['seconds']:.2f}s: "
              f"{n / q['seconds']:.1f} output tok/s; tokens identical to hf continuous batching on {same}/{k}",
              flush=True)
    for name, r in results.items():
      lengths = [len(t) for t in r["tokens"]]
      if lengths != [n for _, n in reqs]:
        print(f"note: {name} generated {sum(lengths)} tokens, not the {out_tokens} asked for", flush=True)
    if len(results) == 2:
      ours, hf = results["ours"], results["hf"]
      same, first = agreement(ours["tokens"], hf["tokens"])
      print(f"\n| side | seconds | requests/s | output tok/s |\n|---|---|---|---|\n"
            f"| jaxformer engine.Engine | {ours['seconds']:.2f} | {len(reqs) / ours['seconds']:.2f} | "
            f"{out_tokens / ours['seconds']:.1f} |\n"
            f"| transformers continuous batching | {hf['seconds']:.2f} | {len(reqs) / hf['seconds']:.2f} | "
            f"{out_tokens / hf['seconds']:.1f} |")
      print(f"\nours / hf throughput: {hf['seconds'] / ours['seconds']:.2f}x; greedy tokens identical on {same}/"
            f"{len(reqs)} requests" + (f"; first mismatch (request, token index): {first[:8]}" if first else ""),
            flush=True)
    if args.out:
      with open(args.out, "w") as f:
        json.dump({"requests": [[len(p), n] for p, n in reqs],
                   **{name: {k: v for k, v in r.items() if k != "tokens"} for name, r in results.items()}},
                  f, indent=1, default=str)
    return results
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
  main()
