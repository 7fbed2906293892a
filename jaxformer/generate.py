"""Sample from a trained decoder-only model.

    python -m jaxformer.generate --workdir DIR --prompt "ROMEO:" [--prompt "..."] \
        [--max-new-tokens 200] [--temperature 0.8] [--top-k 200] [--top-p 1.0] [--seed 0]

Prompts of different lengths are batched; the prompt is prefilled in one call and the
decode loop runs inside jit on the KV cache (`jaxformer.decode.generate`). A prefix
shared by all prompts (`--prefix`, e.g. a system prompt) is prefilled once and reused.
"""

import argparse

import jax
import numpy as np

from jaxformer import decode
from jaxformer import evaluate
from jaxformer import runtime
from jaxformer.errors import UserError, cli


def generate_text(model, params, tokenizer, cfg, prompts, max_new_tokens=200, temperature=0.8, top_k=0,
                  top_p=1.0, seed=0, prefix="", stop_at_eos=True):
  """Continues each prompt string; returns the generated continuations (prompt excluded)."""
  bos = [tokenizer.bos_id] if cfg.data.add_bos else []  # Llama's text starts with BOS: the prefix's, else each prompt's
  prefix_ids = bos + tokenizer.encode(prefix) if prefix else []
  ids = [([] if prefix else bos) + tokenizer.encode(p) or [tokenizer.bos_id] for p in prompts]
  longest = max(len(x) for x in ids) + len(prefix_ids)
  if cfg.model.position == "learned" and longest + max_new_tokens > cfg.model.max_len:
    raise UserError(f"prompt ({longest} tokens) + --max-new-tokens {max_new_tokens} exceeds the model's "
                    f"{cfg.model.max_len} learned positions; ask for at most {cfg.model.max_len - longest} tokens")
  cache = None
  if prefix_ids:
    cache = decode.prefill_prefix(model, params, prefix_ids, len(ids), len(prefix_ids) + longest + max_new_tokens)
  tokens = decode.generate(model, params, ids, max_new_tokens, jax.random.PRNGKey(seed), temperature=temperature,
                           top_k=top_k, top_p=top_p, eos_id=tokenizer.eos_id if stop_at_eos else None,
                           prefix_cache=cache)
  return [tokenizer.decode(np.asarray(row)) for row in tokens]


def parse_args(argv):
  parser = argparse.ArgumentParser(description="Sample from a trained decoder-only jaxformer model.")
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--prompt", action="append", default=None, help="repeat for a batch of prompts")
  parser.add_argument("--prefix", default="", help="shared prefix, prefilled once for all prompts")
  parser.add_argument("--max-new-tokens", type=int, default=None)
  parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
  parser.add_argument("--top-k", type=int, default=0)
  parser.add_argument("--top-p", type=float, default=1.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--step", type=int, default=None)
  parser.add_argument("overrides", nargs="*", help="decode.* overrides of the run's config, e.g. decode.max_new_tokens=500")
  return parser.parse_intermixed_args(argv)  # overrides before, between or after flags


@cli
def main(argv):
  """The `python -m jaxformer.generate` entry point."""
  args = parse_args(argv)
  runtime.keep_freed_memory()
  runtime.use_compilation_cache()
  cfg, model, params, tokenizer, _ = evaluate.load_run(args.workdir, step=args.step, log=lambda *_: None,
                                                     overrides=args.overrides)
  if cfg.model.arch != "decoder_only":
    raise UserError(f"{args.workdir} holds a translation model: use eval.py to translate")
  prompts = args.prompt or ["\n"]
  max_new = args.max_new_tokens
  if max_new is None:  # the default fits the learned-position table; an explicit value is checked
    max_new = cfg.decode.max_new_tokens
    if cfg.model.position == "learned":
      used = max(len(tokenizer.encode(p)) for p in prompts) + len(tokenizer.encode(args.prefix))
      max_new = min(max_new, cfg.model.max_len - used)
  outputs = generate_text(model, params, tokenizer, cfg, prompts, max_new, args.temperature, args.top_k,
                          args.top_p, args.seed, args.prefix)
  for prompt, out in zip(prompts, outputs):
    print(f"--- {args.prefix}{prompt!r}\n{args.prefix}{prompt}{out}")
  return outputs


if __name__ == "__main__":
  main()
