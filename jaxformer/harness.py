"""Downstream tasks through EleutherAI's lm-evaluation-harness: a jaxformer run as lm-eval's `jaxformer` model.

    python eval.py --workdir DIR --tasks hellaswag,arc_easy [--num-fewshot K] [--limit N] \
        [--include-path DIR] [--batch-size B] [--apply-chat-template] [--log-samples]

The harness asks a model three things; each is answered on our own forward pass and KV cache:
- `loglikelihood(context, continuation)`: the summed log-prob of the continuation and whether it is
  the greedy one (`evaluate.hidden_states`, then `evaluate.target_logprobs` projecting only the
  continuation's positions), requests sorted longest first as the harness's `hf` model sorts them,
  padded to a short ladder of widths (`_width`) and a fixed batch, so a task compiles a handful of
  programs; requests that feed the same input row (one-token answers to one question) share its forward;
- `loglikelihood_rolling(text)`: the harness's own disjoint windows over the model's context
  (`lm_eval.utils.get_rolling_token_windows`), the windows of `evaluate.perplexity` with the
  prefix token first;
- `generate_until(context, gen_kwargs)`: `decode.generate` (greedy, or sampled with the request's
  temperature / top_p / top_k), cut at the first stop string.

Tokenization follows the `hf` model's for the same tokenizer: BOS first where the tokenizer adds one
(`data.add_bos`, unless the text starts with it), a context and continuation encoded together and
split at the context's length, the prefix token (BOS, else EOS) before an empty context. lm-eval is
an optional extra (`pip install -e ".[eval]"`); nothing else in jaxformer imports this module at the top.
"""

import argparse
import datetime
import json
import os
import sys
import time

import jax
import numpy as np

from jaxformer import chat
from jaxformer import decode
from jaxformer import evaluate
from jaxformer import runtime
from jaxformer import tasks as tasks_lib
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.errors import UserError, cli

try:
  from lm_eval import utils as lm_utils
  from lm_eval.api.model import TemplateLM
  from lm_eval.api.registry import register_model
  from lm_eval.models import utils as model_utils
  _MISSING = None
except ImportError as e:  # the optional extra is not installed: say so when a task is asked for
  TemplateLM, _MISSING = object, e
  register_model = lambda *names: (lambda cls: cls)  # noqa: E731

_INSTALL = 'pip install -e ".[eval]"'
_SPANS = (4, 16, 64)  # padded continuation lengths (then multiples of 64)


def _width(n, cap):
  """n tokens padded to a width from a short ladder (32 up to 128, 64 up to 512, 128 up to 2048, then 256),
  at most `cap` (the model's context): a task's lengths share a handful of programs, wasting at most
  ~25% of a row on padding past 128 tokens."""
  step = 32 if n <= 128 else 64 if n <= 512 else 128 if n <= 2048 else 256
  return min(-(-n // step) * step, max(cap, n))


def require_lm_eval():
  """Raises a one-line UserError when the optional `lm-eval` package is missing."""
  if _MISSING is not None:
    raise UserError(f"downstream tasks need EleutherAI's lm-evaluation-harness (import failed: {_MISSING}): "
                    f"{_INSTALL}")


def _span(n):
  """Continuation tokens scored per request, padded: 4, 16, 64, then multiples of 64."""
  return next((s for s in _SPANS if s >= n), -(-n // 64) * 64)


@register_model("jaxformer")
class JaxformerLM(TemplateLM):
  """A decoder-only jaxformer run as an lm-eval model.

  workdir: a training workdir (trained, fine-tuned, LoRA, MoE, imported with convert), read with
  `evaluate.load_run`; or run=(cfg, model, params, tokenizer) of a model in memory (the training loop).
  batch_size: rows per forward (loglikelihood) and per generation batch; max_length: the context in
  tokens (default: the model's position table, model.max_len, as the `hf` model reads
  max_position_embeddings); template: the chat template for --apply-chat-template (default: the run's
  data.chat_template, loaded only when asked for); add_bos_token: BOS first in encoded text (default: the
  run's data.add_bos, what training did; the `hf` model's argument of the same name); seed: of sampled
  generations.
  """

  def __init__(self, workdir=None, batch_size=8, max_length=None, step=None, seed=0, run=None, template=None,
               add_bos_token=None, **unused):  # lm-eval's CLI passes device / max_batch_size: one CPU/accelerator set-up here
    require_lm_eval()
    super().__init__()
    if run is None:
      if not workdir:
        raise UserError("the jaxformer lm-eval model needs workdir=DIR (a training run)")
      run = evaluate.load_run(workdir, step=None if step is None else int(step), log=lambda *_: None)[:4]
    self.cfg, self.model, self.params, self.tok = run
    if self.cfg.model.arch != "decoder_only":
      raise UserError(f"{workdir or 'the run'} holds a translation model: lm-eval tasks need a decoder-only model "
                      "(translation is scored with eval.py's BLEU)")
    self.workdir = workdir
    self.batch = 8 if str(batch_size).startswith("auto") else int(batch_size)
    if self.batch < 1:
      raise UserError(f"--batch-size must be at least 1, got {batch_size}")
    self._max_length = int(max_length) if max_length else int(self.cfg.model.max_len)
    self.seed = int(seed)
    self.add_bos = self.cfg.data.add_bos if add_bos_token is None else str(add_bos_token).lower() in ("true", "1")
    self._template = template
    self._hf = isinstance(self.tok, tokenizer_lib.HFTokenizer)
    self.tokenizer = None  # lm-eval reads HF tokenizer attributes from `tokenizer`; ours is `tok`

  # ------------------------------------------------------------------ what the harness reads

  @property
  def eot_token_id(self):
    return self.tok.eos_id

  @property
  def prefix_token_id(self):
    """What an empty context (and a rolling window's first token) is conditioned on: BOS, else EOS (as `hf`)."""
    return self.tok.bos_id if self.tok.bos_id is not None else self.tok.eos_id

  @property
  def max_length(self):
    return self._max_length

  @property
  def max_gen_toks(self):
    return 256  # the `hf` model's default

  @property
  def tokenizer_name(self):
    return os.path.basename(str(getattr(self.tok, "path", type(self.tok).__name__)))

  def _token_text(self, token_id):
    """The text of a special id (BOS), as the tokenizer writes it (`<|endoftext|>`, `<s>`), or None."""
    return tokenizer_lib.special_text(self.tok, token_id)

  def tok_encode(self, string, add_special_tokens=None, **kwargs):
    """Token ids of `string`, as `jaxformer.chat` encodes text (a tokenizer.json matches its special tokens
    in the text, as transformers' does); BOS first where the run adds one (data.add_bos), unless
    add_special_tokens is False or the text already starts with it (the `hf` model's has_bos_prefix)."""
    ids = chat.encode_pieces(self.tok, [(string, False)], self._hf)[0].tolist()
    add = self.add_bos if add_special_tokens is None else add_special_tokens and self.add_bos
    bos_text = self._token_text(self.tok.bos_id) if self.tok.bos_id is not None else None
    if add_special_tokens is None and bos_text and string.startswith(bos_text):
      add = False
    if add and (not ids or ids[0] != self.tok.bos_id):
      ids = [self.tok.bos_id] + ids
    return ids

  # ------------------------------------------------------------------ loglikelihood

  def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
    """[(log p(continuation | context), is greedy)] of requests ((strings), context ids, continuation ids).

    As the `hf` model: the model reads (context + continuation)[-(max_length + 1):][:-1], and the
    continuation's log-probs are the last len(continuation) positions. Sorted longest first; a batch
    holds `batch_size` distinct input rows and up to 4x as many requests reading them.
    """
    cap = self.max_length
    feeds = []
    for _, context, continuation in requests:
      if not context or not continuation:
        raise ValueError("lm-eval gave an empty context or continuation")  # TemplateLM.loglikelihood never does
      whole = (list(context) + list(continuation))[-(cap + 1):]
      feeds.append((tuple(whole[:-1]), list(continuation)[-cap:]))
    # The `hf` model's order: longest first, then by tokens (so requests sharing an input are adjacent).
    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i][1]) - len(requests[i][2]),
                                                       tuple(requests[i][1]) + tuple(requests[i][2])))
    results = [None] * len(requests)
    most = 4 * self.batch
    start = 0
    while start < len(order):
      rows, members = {}, []
      for i in order[start:]:
        inp = feeds[i][0]
        if inp not in rows:
          if len(rows) == self.batch:
            break
          rows[inp] = len(rows)
        members.append(i)
        if len(members) == most:
          break
      start += len(members)
      width = _width(max(len(inp) for inp in rows), cap)
      inputs = np.zeros((self.batch, width), np.int32)
      for inp, r in rows.items():
        inputs[r, :len(inp)] = inp
      requests_padded = self.batch if len(members) <= self.batch else most
      span = _span(max(len(feeds[i][1]) for i in members))
      row_of = np.zeros(requests_padded, np.int32)
      positions = np.zeros((requests_padded, span), np.int32)
      targets = np.zeros((requests_padded, span), np.int32)
      for k, i in enumerate(members):
        inp, cont = feeds[i]
        row_of[k] = rows[inp]
        positions[k, :len(cont)] = np.arange(len(inp) - len(cont), len(inp))  # logits there predict cont
        targets[k, :len(cont)] = cont
      hidden = evaluate.hidden_states(self.model, self.params, inputs)
      logp, greedy = jax.device_get(evaluate.target_logprobs(self.model, self.params, hidden, row_of, positions,
                                                             targets))
      for k, i in enumerate(members):
        n = len(feeds[i][1])
        results[i] = (float(np.sum(logp[k, :n], dtype=np.float64)), bool(np.all(greedy[k, :n])))
        if requests[i][0] is not None:
          self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
    return results

  def loglikelihood_rolling(self, requests, disable_tqdm=False):
    """Summed log-prob of each whole text: the harness's disjoint windows of max_length predicted tokens,
    the first conditioned on the prefix token (BOS, else EOS), as the `hf` model scores them."""
    windows, owner = [], []
    for n, (text,) in enumerate(req.args for req in requests):
      for context, predicted in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
          token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
          context_len=1)):
        windows.append((None, context, predicted))
        owner.append(n)
    totals = [0.0] * len(requests)
    for n, (logp, _) in zip(owner, self._loglikelihood_tokens(windows)):
      totals[n] += logp
    for req, total in zip(requests, totals):
      self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return totals

  # ------------------------------------------------------------------ generation

  def generate_until(self, requests, disable_tqdm=False):
    """Continuations of each context (`decode.generate`), cut at the first of the request's stop strings.

    Grouped by generation settings and sorted longest first (the `hf` model's batches); contexts keep
    their last max_length - max_gen_toks tokens; prompts are padded to a few widths and a fixed batch.
    """
    results = []
    collator = model_utils.Collator([req.args for req in requests], sort_fn=lambda x: (-len(self.tok_encode(x[0])), x[0]),
                                    group_by="gen_kwargs", group_fn=lambda x: x[1])
    seed = self.seed
    for chunk in collator.get_batched(n=self.batch):
      contexts, settings = zip(*chunk)
      kwargs = model_utils.normalize_gen_kwargs(settings[0], self.max_gen_toks)
      until = model_utils.handle_stop_sequences(kwargs.pop("until", None), eos=None)
      new = int(kwargs.pop("max_gen_toks"))
      room = self.max_length - new
      if room < 1:
        raise UserError(f"a task asks for {new} new tokens, as many as the model's {self.max_length}-token context")
      prompts = [self.tok_encode(c)[-room:] or [self.prefix_token_id] for c in contexts]
      width = _width(max(len(p) for p in prompts), room)
      tokens = np.zeros((self.batch, width), np.int32)
      lengths = np.ones(self.batch, np.int32)  # unused rows: one PAD token each
      for r, p in enumerate(prompts):
        tokens[r, :len(p)], lengths[r] = p, len(p)
      sampled = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 1.0) or 0.0) > 0
      out = decode.generate(self.model, self.params, tokens, new, jax.random.PRNGKey(seed),
                            temperature=float(kwargs.get("temperature", 1.0)) if sampled else 0.0,
                            top_k=int(kwargs.get("top_k") or 0), top_p=float(kwargs.get("top_p") or 1.0),
                            eos_id=self.tok.eos_id, lengths=lengths, max_cache_len=self.cfg.decode.max_cache_len)
      seed += 1
      for r, (context, setting) in enumerate(chunk):
        text = model_utils.postprocess_generated_text(self.tok.decode(np.asarray(out[r])), until, None)
        results.append(text)
        self.cache_hook.add_partial("generate_until", (context, setting), text)
    return collator.get_original(results)

  # ------------------------------------------------------------------ chat

  def _chat(self):
    if self._template is None:
      self._template = chat.load_template(self.cfg.data.chat_template, tasks_lib.tokenizer_path(self.cfg, self.workdir),
                                          self._hf)
    return self._template

  def chat_template(self, chat_template=False):
    """The template's text when --apply-chat-template is on (the harness records it), else None."""
    return self._chat().text if chat_template not in (False, None) else None

  def apply_chat_template(self, chat_history, add_generation_prompt=True):
    """The conversation rendered with the run's chat template (`jaxformer.chat`), as training rendered it.
    Without the generation prompt the last (assistant) message is left open, as transformers'
    continue_final_message does: the text ends with that message's content."""
    text = self._chat().render(chat_history, add_generation_prompt=add_generation_prompt)
    if not add_generation_prompt and chat_history:
      last = str(chat_history[-1].get("content", "")).strip()
      at = text.rfind(last) if last else -1
      if at >= 0:
        text = text[:at + len(last)]
    return text


# ---------------------------------------------------------------------------- running tasks


def _task_manager(include_path):
  from lm_eval.tasks import TaskManager  # pylint: disable=g-import-not-at-top
  if include_path and not os.path.isdir(include_path):
    raise UserError(f"--include-path {include_path}: no such folder (it holds task YAML files)")
  return TaskManager(include_path=include_path or None)


def _check_tasks(names, manager):
  """Unknown names are one line, before any model is loaded."""
  unknown = [n for n in names if n not in manager.all_tasks and not os.path.isfile(n)]
  if unknown:
    raise UserError(f"unknown lm-eval task {', '.join(unknown)}: lm-eval knows {len(manager.all_tasks):,} tasks, "
                    "groups and tags (`lm-eval ls tasks`); a task of your own: its YAML in --include-path DIR")


def _data_error(error, names, manager):
  """The one-line UserError for a task whose data set could not be loaded (no network, not cached)."""
  where = []
  for name in names:
    entry = manager.task_index.get(name)
    cfg = (entry.cfg or {}) if entry is not None else {}
    if cfg.get("dataset_path"):
      where.append(f"{name}: {cfg['dataset_path']}" + (f" ({cfg['dataset_name']})" if cfg.get("dataset_name") else ""))
  first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
  return UserError(f"a task's data set could not be loaded ({first}; {'; '.join(where) or 'see the task YAML'}): "
                   "without network access a task reads the Hugging Face datasets cache (HF_DATASETS_CACHE): fill it "
                   "on a machine with access, or give a task YAML whose dataset_kwargs.data_files are local files "
                   "with --include-path DIR")


def run_tasks(lm, names, num_fewshot=None, limit=None, include_path=None, apply_chat_template=False,
              fewshot_as_multiturn=None, log_samples=False, bootstrap_iters=100000, manager=None, log=print):
  """lm-eval's `simple_evaluate` of `lm` on task names -> its results dict (with "samples" when log_samples),
  plus "jaxformer": {"compilations": XLA programs compiled, "seconds": wall time}. The harness's own seeds
  and few-shot sampling; `manager`: a TaskManager to reuse (indexing lm-eval's tasks takes seconds)."""
  require_lm_eval()
  import lm_eval  # pylint: disable=g-import-not-at-top
  if manager is None:
    manager = _task_manager(include_path)
    _check_tasks(names, manager)
  compiled, start = len(runtime.COMPILES), time.time()
  try:
    results = lm_eval.simple_evaluate(
        model=lm, tasks=list(names), num_fewshot=num_fewshot, limit=limit, task_manager=manager,
        apply_chat_template=apply_chat_template,
        fewshot_as_multiturn=bool(apply_chat_template) if fewshot_as_multiturn is None else fewshot_as_multiturn,
        log_samples=log_samples,
        bootstrap_iters=bootstrap_iters)
  except (ConnectionError, FileNotFoundError) as e:
    raise _data_error(e, names, manager) from None
  except Exception as e:  # datasets' own errors (DatasetNotFoundError, ...) without importing datasets here
    if type(e).__module__.split(".")[0] in ("datasets", "huggingface_hub", "fsspec"):
      raise _data_error(e, names, manager) from None
    raise
  results["jaxformer"] = {"compilations": len(runtime.COMPILES) - compiled, "seconds": time.time() - start}
  log(f"lm-eval: {', '.join(names)} in {results['jaxformer']['seconds']:.1f} s, "
      f"{results['jaxformer']['compilations']} XLA programs compiled")
  return results


def main_metrics(results):
  """{"harness/<task>/<metric>": value} of each task's first metric (acc, word_perplexity, exact_match...)."""
  out = {}
  for task, metrics in results.get("results", {}).items():
    for key, value in metrics.items():
      metric = "," in key and "_stderr" not in key  # "acc,none": a metric and its filter
      if metric and isinstance(value, (int, float)) and not isinstance(value, bool):
        out[f"harness/{task}/{key.split(',')[0]}"] = float(value)
        break
  return out


def write_results(results, folder):
  """Writes lm-eval's results as JSON (samples, when logged, as one JSONL per task) -> the results path."""
  os.makedirs(folder, exist_ok=True)
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S")
  samples = results.pop("samples", None)
  path = os.path.join(folder, f"results_{stamp}.json")
  with open(path, "w", encoding="utf-8") as f:
    json.dump(results, f, indent=1, default=lm_utils.handle_non_serializable, ensure_ascii=False)
  for task, rows in (samples or {}).items():
    with open(os.path.join(folder, f"samples_{task}_{stamp}.jsonl"), "w", encoding="utf-8") as f:
      for row in rows:
        f.write(json.dumps(row, default=lm_utils.handle_non_serializable, ensure_ascii=False) + "\n")
  if samples is not None:
    results["samples"] = samples
  return path


def parse_args(argv):
  parser = argparse.ArgumentParser(description="Run lm-evaluation-harness tasks on a decoder-only jaxformer run.")
  parser.add_argument("--workdir", required=True, help="training workdir (config.json, tokenizer, checkpoints)")
  parser.add_argument("--tasks", required=True, help="comma-separated lm-eval task, group or tag names")
  parser.add_argument("--num-fewshot", type=int, default=None, help="default: each task's own")
  parser.add_argument("--limit", type=float, default=None, help="only the first N documents of each task (< 1: a fraction)")
  parser.add_argument("--include-path", default=None, help="a folder of task YAML files of your own (local data files)")
  parser.add_argument("--batch-size", default="8", help="rows per forward and per generation batch")
  parser.add_argument("--max-length", type=int, default=None, help="context in tokens (default: model.max_len)")
  parser.add_argument("--apply-chat-template", action="store_true", help="render prompts with the run's chat template")
  parser.add_argument("--fewshot-as-multiturn", action="store_true", default=None,
                      help="few-shot examples as chat turns (the default with --apply-chat-template)")
  parser.add_argument("--log-samples", action="store_true", help="also write every request and response (JSONL)")
  parser.add_argument("--output", default=None, help="results folder (default: WORKDIR/lm_eval)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
  parser.add_argument("--seed", type=int, default=0, help="seed of sampled generations (the harness keeps its own)")
  return parser.parse_args(argv)


@cli
def main(argv):
  """`eval.py --tasks ...` (and `python -m jaxformer.harness`): lm-eval's table, its JSON in the workdir."""
  args = parse_args(argv)
  require_lm_eval()
  names = [n.strip() for n in args.tasks.split(",") if n.strip()]
  if not names:
    raise UserError("--tasks needs at least one task name, e.g. --tasks hellaswag,arc_easy")
  if args.limit is not None and args.limit <= 0:
    raise UserError(f"--limit must be positive, got {args.limit:g}")
  limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
  manager = _task_manager(args.include_path)
  _check_tasks(names, manager)  # before the model is loaded
  runtime.keep_freed_memory()
  runtime.use_compilation_cache()
  lm = JaxformerLM(args.workdir, batch_size=args.batch_size, max_length=args.max_length, step=args.step, seed=args.seed)
  results = run_tasks(lm, names, args.num_fewshot, limit, args.include_path, args.apply_chat_template,
                      args.fewshot_as_multiturn, args.log_samples, manager=manager, log=lambda m: print(m, file=sys.stderr))
  print(lm_utils.make_table(results))
  if "groups" in results:
    print(lm_utils.make_table(results, "groups"))
  path = write_results(results, args.output or os.path.join(args.workdir, "lm_eval"))
  print(f"results: {path}")
  return results


if __name__ == "__main__":
  main()
