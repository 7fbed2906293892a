"""Sample from a trained decoder-only model.

    python -m jaxformer.generate --workdir DIR --prompt "ROMEO:" [--prompt "..."] \
        [--max-new-tokens 200] [--temperature 0.8] [--top-k 200] [--top-p 1.0] [--seed 0] [decode.*=...]
    python -m jaxformer.generate --workdir SFT_DIR --chat "Hello!" [--chat chat.json] [--system "..."]

How to sample comes from the run's `decode` config (`decode.temperature`, `top_k`, `top_p`,
`max_new_tokens`), which `decode.*` overrides change; a flag, when given, overrides both.

Prompts of different lengths are batched; the prompt is prefilled in one call and the
decode loop runs inside jit on the KV cache (`jaxformer.decode.generate`). A prefix
shared by all prompts (`--prefix`, e.g. a system prompt) is prefilled once and reused.
With learned positions a sample may run past the position table: each new token then
sees the last `model.max_len` tokens (nanoGPT's crop). Other positions keep every token
in the KV cache, up to `decode.max_cache_len` slots.

`--chat` talks to a fine-tuned model: the conversation is rendered with the run's chat template
(`data.chat_template`) and its generation prompt, encoded as training encoded its records, and the
answer sampled until the end of the assistant's turn; only the answer is printed.
"""

import argparse
import sys

import jax
import numpy as np

from jaxformer import chat
from jaxformer import config as config_lib
from jaxformer import decode
from jaxformer import evaluate
from jaxformer import runtime
from jaxformer import tasks
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.errors import UserError, cli


def generate_text(model, params, tokenizer, cfg, prompts, max_new_tokens=None, temperature=None, top_k=None,
                  top_p=None, seed=0, prefix="", stop_at_eos=True, log=print):
  """Continues each prompt string; returns the generated continuations (prompt excluded).

  `max_new_tokens`, `temperature`, `top_k`, `top_p`: None takes the value of `cfg.decode`.

  Past a learned-position table `log` gets one note: the context slides (nanoGPT's crop).
  """
  d = cfg.decode
  max_new_tokens = d.max_new_tokens if max_new_tokens is None else max_new_tokens
  temperature = d.temperature if temperature is None else temperature
  top_k = d.top_k if top_k is None else top_k
  top_p = d.top_p if top_p is None else top_p
  # Llama's text starts with BOS: the prefix's, else each prompt's
  prefix_ids = encode_prompt(tokenizer, cfg, prefix) if prefix else []
  ids = [encode_prompt(tokenizer, cfg, p, bos=not prefix) for p in prompts]
  tokens = generate_ids(model, params, cfg, ids, prefix_ids, max_new_tokens, temperature, top_k, top_p, seed,
                        tokenizer.eos_id if stop_at_eos else None, log)
  return [tokenizer.decode(np.asarray(row)) for row in tokens]


def encode_prompt(tokenizer, cfg, text, bos=True):
  """The ids (list of int) of a raw-text prompt: BOS first under data.add_bos (unless bos=False: it follows
  a prefix), and BOS alone for an empty text."""
  return ([tokenizer.bos_id] if bos and cfg.data.add_bos else []) + tokenizer.encode(text) or [tokenizer.bos_id]


def generate_ids(model, params, cfg, ids, prefix_ids, max_new_tokens, temperature, top_k, top_p, seed, stop_ids, log):
  """New tokens [len(ids), max_new_tokens] continuing `prefix_ids` + each row of `ids` (lists of int); a row
  stops after any of `stop_ids` (an id, a list of them, or None), then PAD (`decode.generate`)."""
  fed = len(prefix_ids) + max(len(x) for x in ids) + max_new_tokens - 1   # the last token is never fed back
  window = decode.sliding_window(model, fed, cfg.decode.max_cache_len)   # before any cache is allocated
  if window:
    log(f"note: sampling past the {window}-position table: each new token sees the last {window} tokens "
        f"(nanoGPT's crop)")
    # The crop moves the prefix's positions: no cache of it stays valid, so it joins each prompt.
    ids, prefix_ids = [prefix_ids + x for x in ids], []
  cache = None
  if prefix_ids:
    cache = decode.prefill_prefix(model, params, prefix_ids, len(ids), fed)
  return np.asarray(decode.generate(model, params, ids, max_new_tokens, jax.random.PRNGKey(seed),
                                    temperature=temperature, top_k=top_k, top_p=top_p, eos_id=stop_ids,
                                    prefix_cache=cache, max_cache_len=cfg.decode.max_cache_len))


def chat_template(cfg, workdir, tokenizer):
  """(the ChatTemplate of the run in `workdir`, whether its tokenizer is a tokenizer.json): `data.chat_template`
  loaded as training loaded it (`chat.load_template`)."""
  hf = isinstance(tokenizer, tokenizer_lib.HFTokenizer)
  return chat.load_template(cfg.data.chat_template, tasks.tokenizer_path(cfg, workdir), hf), hf


def chat_replies(model, params, tokenizer, cfg, workdir, conversations, max_new_tokens=None, temperature=None,
                 top_k=None, top_p=None, seed=0, log=print):
  """The assistant's answer (str) to each conversation (a messages list, its last turn the user's).

  Each is rendered with the run's chat template and its generation prompt, encoded as training encoded
  its records (`chat.prompt_ids`: special strings become their ids), and sampled until the end of the
  assistant's turn (`chat.end_of_turn_ids`: the template's end-of-turn token, or EOS) or max_new_tokens;
  the answer is the text before that token. Sampling settings: as `generate_text`.
  """
  d = cfg.decode
  template, hf = chat_template(cfg, workdir, tokenizer)
  ids = [chat.prompt_ids(template, tokenizer, c, cfg.data.add_bos, hf) for c in conversations]
  stops = chat.end_of_turn_ids(template, tokenizer, hf)
  tokens = generate_ids(model, params, cfg, ids, [], d.max_new_tokens if max_new_tokens is None else max_new_tokens,
                        d.temperature if temperature is None else temperature, d.top_k if top_k is None else top_k,
                        d.top_p if top_p is None else top_p, seed, stops, log)
  answers = []
  for row in tokens.tolist():
    end = next((k for k, t in enumerate(row) if t in stops), len(row))
    answers.append(tokenizer.decode(row[:end]))
  return answers


def parse_args(argv):
  parser = argparse.ArgumentParser(description="Sample from a trained decoder-only jaxformer model.")
  parser.add_argument("--workdir", required=True)
  parser.add_argument("--prompt", action="append", default=None, help="repeat for a batch of prompts")
  parser.add_argument("--prefix", default="", help="shared prefix, prefilled once for all prompts")
  parser.add_argument("--chat", action="append", default=None, metavar="MESSAGE_OR_JSON",
                      help="a user message to a fine-tuned (chat) model, answered with its chat template; repeat for "
                      "a batch of conversations; a .json file: a messages list (with history), or a list of them")
  parser.add_argument("--system", default="", help="with --chat: a system message first in each conversation")
  # None: the run's decode.* (after decode.* overrides); a flag given wins over both.
  parser.add_argument("--max-new-tokens", type=int, default=None, help="default: decode.max_new_tokens")
  parser.add_argument("--temperature", type=float, default=None, help="0 = greedy; default: decode.temperature")
  parser.add_argument("--top-k", type=int, default=None, help="0 = off; default: decode.top_k")
  parser.add_argument("--top-p", type=float, default=None, help="default: decode.top_p")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--step", type=int, default=None)
  parser.add_argument("overrides", nargs="*", help="decode.* overrides of the run's config, e.g. decode.max_new_tokens=500")
  return parser.parse_intermixed_args(argv)  # overrides before, between or after flags


@cli
def main(argv):
  """The `python -m jaxformer.generate` entry point."""
  args = parse_args(argv)
  if args.chat and (args.prompt or args.prefix):
    raise UserError("--chat takes the conversation's messages; --prompt and --prefix are raw text: give one or the other")
  if args.system and not args.chat:
    raise UserError("--system is the system message of --chat conversations: give --chat MESSAGE too")
  runtime.keep_freed_memory()
  runtime.use_compilation_cache()
  cfg, model, params, tokenizer, _ = evaluate.load_run(args.workdir, step=args.step, log=lambda *_: None,
                                                     overrides=args.overrides)
  if cfg.model.arch != "decoder_only":
    raise UserError(f"{args.workdir} holds a translation model: use eval.py to translate")
  prompts = args.prompt or ["\n"]
  flags = {"max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_k": args.top_k,
           "top_p": args.top_p}
  cfg = config_lib.replace(cfg, **{f"decode.{k}": v for k, v in flags.items() if v is not None})
  # A flag's value gets the range check of its decode.* field (the run's other sections were checked
  # by load_run, which lets a setting of an older run through with a warning).
  config_lib._validate(config_lib.Config(decode=cfg.decode))
  if args.chat:
    conversations = chat.read_conversations(args.chat, args.system)
    answers = chat_replies(model, params, tokenizer, cfg, args.workdir, conversations, seed=args.seed,
                           log=lambda line: print(line, file=sys.stderr))  # stdout: the answers alone
    for k, answer in enumerate(answers):  # the answer alone; several are headed by the message they answer
      if len(answers) > 1:
        print(f"--- {conversations[k][-1]['content']!r}")
      print(answer)
    return answers
  outputs = generate_text(model, params, tokenizer, cfg, prompts, seed=args.seed, prefix=args.prefix)
  for prompt, out in zip(prompts, outputs):
    print(f"--- {args.prefix}{prompt!r}\n{args.prefix}{prompt}{out}")
  return outputs


if __name__ == "__main__":
  main()
