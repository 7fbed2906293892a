"""SFT and DPO learn: a tiny decoder fine-tuned on a generated chat task ("reverse these words").

    python benchmarks/sft_dpo.py --dir /tmp/jaxformer_sft [--steps 800] [--dpo-steps 100] [--dpo-lr 1e-4]

--dir (outside the repository) gets the generated JSON lines and the run directories. In one run:

1. SFT: `jaxformer.synthetic.reverse_words_records` (4,000 training conversations, 3-5 words of
   16, `data.chat_template=plain`, byte tokenizer, packed rows of 128 tokens) trains a 3-layer,
   d_model 128 model from scratch with data.loss_on=assistant, then the same run with
   data.loss_on=all. Each is scored by exact-match greedy answers (temperature 0, up to the
   EOS) on 200 held-out prompts that are not in the training set.
2. DPO: `reverse_words_preferences` (chosen: the reversal, rejected: a copy of the words),
   train.objective=dpo from the loss_on=all SFT model, with its params as the frozen
   reference. Reported: the logged rewards/accuracy and rewards/margin, and on 200 held-out
   pairs the mean log p(chosen) - log p(rejected) before and after, and the fraction of pairs
   whose chosen answer gained against the rejected one relative to the reference.

Prints one line per figure and the load average; BENCHMARKS.md quotes them. A second run on the
same --dir finds the SFT runs complete (they resume at their last step and only re-score);
delete DIR/dpo to rerun DPO, e.g. with another --dpo-lr.
"""

import argparse
import json
import os
import sys
import time

import jax
import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from jaxformer import chat  # pylint: disable=g-import-not-at-top
from jaxformer import decode
from jaxformer import synthetic
from jaxformer import train
from jaxformer.config import load_config


def write_jsonl(path, records):
  """Writes the records, unless the file already holds exactly them (a rewrite is new data to prepare)."""
  text = "".join(json.dumps(r) + "\n" for r in records)
  if os.path.isfile(path) and open(path).read() == text:
    return
  with open(path, "w") as f:
    f.write(text)


def config(args, chat_path, *overrides):
  return load_config("gpt2_tiny", [
      "data.tokenizer=byte", "model.vocab_size=259", "data.chat_template=plain", f"data.chat_path={chat_path}",
      "model.d_model=128", "model.num_heads=4", "model.num_layers=3", "model.d_ff=512", "model.max_len=256",
      "model.dropout_rate=0", "data.block_size=128", "data.batch_size=16", "data.packing=packed",
      "data.train_fraction=1.0", "optim.label_smoothing=0", "optim.learning_rate=2e-3", "optim.warmup_steps=100",
      "optim.schedule=cosine", "optim.min_learning_rate=1e-4", "train.log_every=50", "train.checkpoint_every=100000",
      "train.keep_checkpoints=1", "train.sample_every_eval=false", "train.steps_per_call=25", *overrides])


def exact_match(result, held_out, template):
  """Fraction of held-out prompts whose greedy answer (up to EOS) is exactly the reversal."""
  model, params, tok = result["model"], result["state"]["params"], result["task"].tokenizer
  prompts, answers = [], []
  for record in held_out:
    user, answer = record["messages"]
    pieces = [(template.render([user], add_generation_prompt=True), False)]
    prompts.append(chat.encode_pieces(tok, pieces, False)[0].tolist())
    answers.append(answer["content"])
  right = 0
  for i in range(0, len(prompts), 50):
    out = decode.generate(model, params, prompts[i:i + 50], 32, jax.random.PRNGKey(0), temperature=0.0,
                          eos_id=tok.eos_id)
    for row, answer in zip(np.asarray(out), answers[i:i + 50]):
      row = row.tolist()
      row = row[:row.index(tok.eos_id)] if tok.eos_id in row else None  # no EOS: not an answer
      right += row is not None and tok.decode(row) == answer
  return right / len(prompts)


def held_out_preferences(task, model, params, reference):
  """Mean log p(chosen) - log p(rejected) under params, and the fraction of pairs whose chosen gained."""
  logps, refs = [], []
  for batch in task.eval_batches():
    real = batch["weights"][:, 0].sum(-1) > 0
    logps.append(np.asarray(task.sequence_log_probs(model, params, batch, {}, True))[real])
    refs.append(np.asarray(task.sequence_log_probs(model, reference, batch, {}, True))[real])
  logp, ref = np.concatenate(logps), np.concatenate(refs)
  gap = logp[:, 0] - logp[:, 1]
  return float(gap.mean()), float(((logp[:, 0] - ref[:, 0]) > (logp[:, 1] - ref[:, 1])).mean()), len(gap)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--dir", required=True)
  parser.add_argument("--steps", type=int, default=800)
  parser.add_argument("--dpo-steps", type=int, default=100)
  parser.add_argument("--dpo-lr", type=float, default=1e-4)
  args = parser.parse_args()
  os.makedirs(args.dir, exist_ok=True)
  train_records = synthetic.reverse_words_records(4000, seed=0)
  seen = {r["messages"][0]["content"] for r in train_records}
  held_out = [r for r in synthetic.reverse_words_records(1000, seed=1) if r["messages"][0]["content"] not in seen][:200]
  sft_path = os.path.join(args.dir, "sft.jsonl")
  write_jsonl(sft_path, train_records)
  template = chat.load_template("plain", "byte", False)
  print(f"load average at start: {os.getloadavg()}")
  results = {}
  for loss_on in ("assistant", "all"):
    workdir = os.path.join(args.dir, f"sft_{loss_on}")
    cfg = config(args, sft_path, f"data.loss_on={loss_on}", f"train.num_steps={args.steps}",
                 f"train.eval_every={args.steps}")
    t = time.time()
    result = train.train_and_evaluate(cfg, workdir, log=lambda *a: None)
    seconds = time.time() - t
    score = exact_match(result, held_out, template)
    results[loss_on] = result
    print(f"SFT data.loss_on={loss_on}: {args.steps} steps in {seconds:.0f} s, final train nll {result.get('nll', float('nan')):.4f}, "
          f"exact-match greedy answers on {len(held_out)} held-out prompts: {100 * score:.1f}% "
          f"(load {os.getloadavg()[0]:.1f})", flush=True)
  # DPO from the loss_on=all model.
  prefs = synthetic.reverse_words_preferences(2000, seed=2)
  dpo_train, dpo_val = prefs[:-200], prefs[-200:]
  dpo_path, dpo_val_path = os.path.join(args.dir, "dpo.jsonl"), os.path.join(args.dir, "dpo_val.jsonl")
  write_jsonl(dpo_path, dpo_train)
  write_jsonl(dpo_val_path, dpo_val)
  cfg = config(args, dpo_path, "train.objective=dpo", f"data.chat_val_path={dpo_val_path}",
               f"train.num_steps={args.dpo_steps}", "train.log_every=10", "train.steps_per_call=1",
               f"optim.learning_rate={args.dpo_lr}", "optim.warmup_steps=10", "optim.schedule=constant", "data.batch_size=8",
               f"train.init_from={os.path.join(args.dir, 'sft_all')}")
  t = time.time()
  result = train.train_and_evaluate(cfg, os.path.join(args.dir, "dpo"), log=lambda *a: None)
  seconds = time.time() - t
  rows = [json.loads(line) for line in open(os.path.join(args.dir, "dpo", "metrics.jsonl"))]
  rows = [r for r in rows if "rewards/accuracy" in r]
  print("DPO logged (step, rewards/accuracy, rewards/margin): "
        + ", ".join(f"({r['step']}, {r['rewards/accuracy']:.3f}, {r['rewards/margin']:.3f})" for r in rows))
  task, model, state = result["task"], result["model"], result["state"]
  before = held_out_preferences(task, model, state["ref_params"], state["ref_params"])
  after = held_out_preferences(task, model, state["params"], state["ref_params"])
  print(f"DPO: {args.dpo_steps} steps in {seconds:.0f} s; held-out {after[2]} pairs: mean log p(chosen) - log "
        f"p(rejected) {before[0]:.2f} (reference) -> {after[0]:.2f}; chosen gained relative to rejected on "
        f"{100 * after[1]:.1f}% (load {os.getloadavg()[0]:.1f})")
  sft_all_score = exact_match({"model": model, "state": {"params": state["params"]}, "task": task},
                              held_out, template)
  print(f"exact-match greedy answers after DPO (from the loss_on=all model): {100 * sft_all_score:.1f}% "
        f"(optim.learning_rate={args.dpo_lr})")


if __name__ == "__main__":
  main()
