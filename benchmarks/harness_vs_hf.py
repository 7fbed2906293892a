"""lm-evaluation-harness on GPT-2 124M shapes: our `jaxformer` model against the harness's own `hf` model.

    # The peer lives outside this repository (nothing of it is committed here):
    python -m venv ~/peer/hf && ~/peer/hf/bin/pip install torch==2.13.0 transformers accelerate lm-eval==0.4.13
    python benchmarks/harness_vs_hf.py --python ~/peer/hf/bin/python [--docs 200] [--batch 8] [--rounds 2]

Both sides run the same local multiple-choice task, a HellaSwag-like one made here from WikiText-2's test
text (../shared/data/wikitext2/wiki.test.raw): a context of two sentences, the true next sentence and three
sentences from elsewhere as the choices (`acc`, `acc_norm`). The weights are `gpt2_small`'s shapes, random
(N(0, 0.02), the final norm x4), written as a Hugging Face folder through `jaxformer.convert`'s tables and
imported back with `convert --from-hf`, so both read the same float32 numbers. The tokenizer is the GPT-2
test fixture's small BPE (381 pieces, the model's vocabulary stays 50,257): the hub's GPT-2 tokenizer
cannot be fetched here, so texts are more tokens than with GPT-2's own, for both sides alike.

The sides alternate within each round (ours, hf, ours, hf); each reports the harness's own wall time of
`simple_evaluate` (task loading included), ours also the XLA programs it compiled. The first round of ours
includes compilation (a persistent cache is not used). Torch runs on as many threads as cores. The
per-request log-likelihoods of the two are compared (max |difference|) and the accuracies must agree.
Nothing is asserted; the figures go to BENCHMARKS.md.
"""

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
WIKI = os.path.join(ROOT, "..", "shared", "data", "wikitext2", "wiki.test.raw")
TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "hf", "gpt2")

PEER = r'''
import json, sys, time, torch, lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
torch.set_num_threads(int(sys.argv[4]))
lm = HFLM(pretrained=sys.argv[1], dtype="float32", batch_size=int(sys.argv[3]), device="cpu")
manager = TaskManager(include_path=sys.argv[2])
start = time.time()
out = lm_eval.simple_evaluate(model=lm, tasks=["wiki_choice"], task_manager=manager, log_samples=True, bootstrap_iters=0)
seconds = time.time() - start
print(json.dumps({"seconds": seconds, "results": out["results"]["wiki_choice"],
                  "lls": [[r[0][0] for r in s["resps"]] for s in sorted(out["samples"]["wiki_choice"], key=lambda s: s["doc_id"])]},
                 default=str))
'''


def make_task(folder, docs, seed=0):
  """A HellaSwag-like task YAML + JSONL in `folder` from WikiText-2's test text."""
  text = open(WIKI, encoding="utf-8").read()
  sentences = [s.strip() + " ." for s in re.split(r" \. ", text) if 12 <= len(s.split()) <= 40 and "=" not in s]
  rng = random.Random(seed)
  rows = []
  for i in range(docs):
    k = rng.randrange(2, len(sentences) - 1)
    others = rng.sample(range(len(sentences)), 3)
    choices = [sentences[k]] + [sentences[j] for j in others]
    order = list(range(4))
    rng.shuffle(order)
    rows.append({"context": sentences[k - 2] + " " + sentences[k - 1], "choices": [choices[j] for j in order],
                 "label": order.index(0)})
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "wiki_choice.jsonl"), "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in rows)
  with open(os.path.join(folder, "wiki_choice.yaml"), "w", encoding="utf-8") as f:
    f.write(f"""task: wiki_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {os.path.join(folder, "wiki_choice.jsonl")}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
  return rows


def gpt2_small_folder(tmp, workdir_name):
  """gpt2_small shapes with random weights (float32) written as a Hugging Face folder (with the GPT-2 fixture's
  tokenizer) in `tmp`/hf, and imported with `convert --from-hf` into `tmp`/`workdir_name` -> (folder, workdir)."""
  from decode_vs_hf import build, write_hf  # pylint: disable=g-import-not-at-top
  from jaxformer import convert  # pylint: disable=g-import-not-at-top
  cfg, _, params = build("gpt2_small", ["model.dtype=float32"])
  folder = write_hf(cfg, params, "gpt2", os.path.join(tmp, "hf"))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(os.path.join(TOKENIZER, name), folder)
  workdir = os.path.join(tmp, workdir_name)
  convert.from_hf(folder, workdir, log=lambda *a, **k: None)
  return folder, workdir


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--python", required=True, help="the peer's interpreter (torch, transformers, lm-eval)")
  parser.add_argument("--docs", type=int, default=200)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--out", default=None, help="write the figures as JSON here")
  args = parser.parse_args(argv)
  if not os.path.exists(WIKI):
    sys.exit(f"{WIKI} is missing: this benchmark reads WikiText-2's test text from ../shared/data")
  from jaxformer import harness  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  tmp = tempfile.mkdtemp(prefix="harness_vs_hf_")
  try:
    rows = make_task(os.path.join(tmp, "tasks"), args.docs)
    folder, workdir = gpt2_small_folder(tmp, "ours")
    lm = harness.JaxformerLM(workdir, batch_size=args.batch)
    print(f"task: {len(rows)} documents x 4 choices from WikiText-2 test; gpt2_small shapes "
          f"({sum(x.size for x in jax.tree.leaves(lm.params)):,} parameters), float32, batch {args.batch}; "
          f"{os.cpu_count()} cores; jax {jax.__version__}", flush=True)
    ours, peer = [], []
    for r in range(args.rounds):
      result = harness.run_tasks(lm, ["wiki_choice"], include_path=os.path.join(tmp, "tasks"), log_samples=True,
                                 bootstrap_iters=0, log=lambda *a: None)
      samples = sorted(result["samples"]["wiki_choice"], key=lambda s: s["doc_id"])
      ours.append({"seconds": result["jaxformer"]["seconds"], "compilations": result["jaxformer"]["compilations"],
                   "results": result["results"]["wiki_choice"], "lls": [[x[0][0] for x in s["resps"]] for s in samples]})
      print(f"round {r}: ours {ours[-1]['seconds']:.1f} s ({ours[-1]['compilations']} XLA programs compiled)", flush=True)
      proc = subprocess.run([args.python, "-c", PEER, folder, os.path.join(tmp, "tasks"), str(args.batch),
                             str(os.cpu_count())], capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
      if proc.returncode:
        sys.exit(f"the peer failed:\n{proc.stderr[-3000:]}")
      peer.append(json.loads(proc.stdout.strip().splitlines()[-1]))
      print(f"round {r}: hf   {peer[-1]['seconds']:.1f} s", flush=True)
    diff = max(abs(a - b) for x, y in zip(ours[-1]["lls"], peer[-1]["lls"]) for a, b in zip(x, y))
    requests = sum(len(x) for x in ours[-1]["lls"])
    best_ours, best_hf = min(o["seconds"] for o in ours), min(p["seconds"] for p in peer)
    figures = {"docs": len(rows), "requests": requests, "batch": args.batch,
               "ours_seconds": [o["seconds"] for o in ours], "hf_seconds": [p["seconds"] for p in peer],
               "ours_compilations": [o["compilations"] for o in ours], "max_abs_loglik_diff": diff,
               "acc": [ours[-1]["results"]["acc,none"], peer[-1]["results"]["acc,none"]],
               "acc_norm": [ours[-1]["results"]["acc_norm,none"], peer[-1]["results"]["acc_norm,none"]],
               "speedup_best": best_hf / best_ours, "speedup_first_round": peer[0]["seconds"] / ours[0]["seconds"]}
    print(f"\n| side | seconds per round | requests/s (best) | acc | acc_norm |\n|---|---|---|---|---|\n"
          f"| jaxformer | {', '.join(f'{s:.1f}' for s in figures['ours_seconds'])} | {requests / best_ours:.1f} | "
          f"{figures['acc'][0]:.4f} | {figures['acc_norm'][0]:.4f} |\n"
          f"| lm-eval hf (torch) | {', '.join(f'{s:.1f}' for s in figures['hf_seconds'])} | {requests / best_hf:.1f} | "
          f"{figures['acc'][1]:.4f} | {figures['acc_norm'][1]:.4f} |")
    print(f"\nspeed-up: {figures['speedup_best']:.2f}x (best rounds), {figures['speedup_first_round']:.2f}x (first round, "
          f"ours compiling {figures['ours_compilations'][0]} programs); max |log-likelihood difference| {diff:.2e} "
          f"over {requests} requests")
    if args.out:
      with open(args.out, "w") as f:
        json.dump(figures, f, indent=1)
    return figures
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
  main()
