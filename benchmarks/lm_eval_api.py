"""lm-evaluation-harness's API client (`local-completions`) against `python -m jaxformer.serve`, and its `hf` model.

    # The peer lives outside this repository (nothing of it is committed here):
    python -m venv ~/peer/hf && ~/peer/hf/bin/pip install torch==2.13.0 transformers accelerate "lm-eval[api]==0.4.13"
    python benchmarks/lm_eval_api.py --python ~/peer/hf/bin/python [--docs 100] [--tokenizer-backend huggingface]
    # the server of another checkout (before a change): git worktree add /tmp/old OLD && ... --server-checkout /tmp/old

The multiple-choice task and the weights are benchmarks/harness_vs_hf.py's (WikiText-2 sentences, gpt2_small
shapes with random weights written as a Hugging Face folder and imported with `convert --from-hf`). The server
runs on the imported workdir; in the peer's interpreter lm-eval runs `local-completions` against it (what a user
runs: `tokenizer_backend=huggingface,tokenizer=HF_DIR` by default, or `remote`: our /tokenize), then its `hf`
model on the same folder. Per request, the two log-likelihoods are compared (max |difference|, requests off by
more than 1e-3) and so are acc / acc_norm. Nothing is asserted; the figures go to BENCHMARKS.md.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

PEER = r'''
import json, sys, time, torch, lm_eval
from lm_eval.tasks import TaskManager
kind, folder, tasks, batch, threads, model_args = sys.argv[1:7]
torch.set_num_threads(int(threads))
manager = TaskManager(include_path=tasks)
if kind == "hf":
  from lm_eval.models.huggingface import HFLM
  model, model_args = HFLM(pretrained=folder, dtype="float32", batch_size=int(batch), device="cpu"), None
else:
  model = "local-completions"
start = time.time()
out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["wiki_choice"], task_manager=manager,
                              log_samples=True, bootstrap_iters=0)
print(json.dumps({"seconds": time.time() - start, "results": out["results"]["wiki_choice"],
                  "lls": [[r[0][0] for r in s["resps"]] for s in sorted(out["samples"]["wiki_choice"],
                                                                      key=lambda s: s["doc_id"])]}, default=str))
'''


def _peer(python, kind, folder, tasks, batch, model_args=""):
  proc = subprocess.run([python, "-c", PEER, kind, folder, tasks, str(batch), str(os.cpu_count()), model_args],
                        capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
  if proc.returncode:
    sys.exit(f"the peer ({kind}) failed:\n{proc.stderr[-3000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--python", required=True, help="the peer's interpreter (torch, transformers, lm-eval[api])")
  parser.add_argument("--docs", type=int, default=100)
  parser.add_argument("--batch", type=int, default=8, help="the hf model's batch; requests per API call")
  parser.add_argument("--tokenizer-backend", default="huggingface", choices=["huggingface", "remote"])
  parser.add_argument("--server-checkout", default=ROOT, help="run the server of this checkout (default: this one)")
  parser.add_argument("--out", default=None, help="write the figures as JSON here")
  args = parser.parse_args(argv)
  from harness_vs_hf import WIKI, gpt2_small_folder, make_task  # pylint: disable=g-import-not-at-top
  if not os.path.exists(WIKI):
    sys.exit(f"{WIKI} is missing: this benchmark reads WikiText-2's test text from ../shared/data")
  tmp = tempfile.mkdtemp(prefix="lm_eval_api_")
  server = None
  try:
    rows = make_task(os.path.join(tmp, "tasks"), args.docs)
    folder, workdir = gpt2_small_folder(tmp, "served")
    server = subprocess.Popen([sys.executable, "-m", "jaxformer.serve", "--workdir", workdir, "--port", "0",
                               "--max-batch", str(args.batch)], cwd=os.path.abspath(args.server_checkout),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    match = re.search(r"ready at (http://\S+/v1)", line)
    if not match:
      sys.exit(f"the server did not start: {line!r} {server.stderr.read()[-2000:]}")
    threading.Thread(target=server.stderr.read, daemon=True).start()
    print(f"task: {len(rows)} documents x 4 choices; gpt2_small shapes, float32; server: {args.server_checkout} "
          f"(git {subprocess.run(['git', '-C', args.server_checkout, 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}); "
          f"tokenizer_backend={args.tokenizer_backend}; {os.cpu_count()} cores", flush=True)
    backend = (f"tokenizer_backend=huggingface,tokenizer={folder}" if args.tokenizer_backend == "huggingface"
               else "tokenizer_backend=remote")
    model_args = (f"model=served,base_url={match.group(1)}/completions,{backend},num_concurrent=1,max_retries=1,"
                  f"batch_size={args.batch},max_length=1024")
    api = _peer(args.python, "api", folder, os.path.join(tmp, "tasks"), args.batch, model_args)
    print(f"local-completions: {api['seconds']:.1f} s", flush=True)
    server.terminate()
    server.wait(timeout=60)
    hf = _peer(args.python, "hf", folder, os.path.join(tmp, "tasks"), args.batch)
    print(f"hf: {hf['seconds']:.1f} s", flush=True)
    diffs = [abs(a - b) for x, y in zip(api["lls"], hf["lls"]) for a, b in zip(x, y)]
    figures = {"docs": len(rows), "requests": len(diffs), "tokenizer_backend": args.tokenizer_backend,
               "max_abs_loglik_diff": max(diffs), "requests_off_by_1e-3": sum(d > 1e-3 for d in diffs),
               "acc": [api["results"]["acc,none"], hf["results"]["acc,none"]],
               "acc_norm": [api["results"]["acc_norm,none"], hf["results"]["acc_norm,none"]],
               "seconds": [api["seconds"], hf["seconds"]]}
    print(f"\n| client | seconds | acc | acc_norm |\n|---|---|---|---|\n"
          f"| local-completions -> jaxformer.serve | {api['seconds']:.1f} | {figures['acc'][0]:.4f} | "
          f"{figures['acc_norm'][0]:.4f} |\n| lm-eval hf (torch) | {hf['seconds']:.1f} | {figures['acc'][1]:.4f} | "
          f"{figures['acc_norm'][1]:.4f} |")
    print(f"\nmax |log-likelihood difference| {figures['max_abs_loglik_diff']:.2e} over {len(diffs)} requests, "
          f"{figures['requests_off_by_1e-3']} off by more than 1e-3")
    if args.out:
      with open(args.out, "w") as f:
        json.dump(figures, f, indent=1)
    return figures
  finally:
    if server is not None and server.poll() is None:
      server.kill()
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
  main()
