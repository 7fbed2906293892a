"""Chat and instruction data: chat templates rendered as transformers renders them, and loss masks.

A record is a JSON line with `messages` (the OpenAI layout: [{"role", "content"}, ...]) or
`prompt`/`completion` (plain text, or message lists as TRL's conversational form), or, for
DPO, `prompt`/`chosen`/`rejected`. It becomes token ids and a loss mask of the same length
(1 = a token the loss is on). Where each assistant turn lies in the rendered text is found
TRL-style, from the template itself: turn i's text is what `render(messages[:i + 1])` adds
to `render(messages[:i], add_generation_prompt=True)`, so the end-of-turn / EOS token the
template writes after the turn is in the loss. The pieces are tokenized one after the other
(for templates whose turns meet at special tokens this equals tokenizing the whole text,
which `tests/test_chat.py` checks against transformers on the fixture templates).
"""

import contextvars
import functools
import hashlib
import json
import os
import re

import jinja2
import jinja2.ext
import jinja2.sandbox
import numpy as np

from jaxformer.errors import UserError

# Our own tokenizers (char, byte, sentencepiece) have no special-token strings: a template
# writes these, and `encode_pieces` turns them into the model's BOS / EOS ids.
BOS_TEXT, EOS_TEXT = "<|bos|>", "<|eos|>"

# Built-in templates for models without a tokenizer_config.json (gpt2_small, char models).
# chatml: OpenAI's ChatML layout, where an assistant turn ends in the model's EOS (so
# generation stops there) instead of <|im_end|>.
BUILTIN_TEMPLATES = {
    "chatml": ("{% for message in messages %}"
               "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] }}"
               "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '<|im_end|>\n' }}{% endif %}"
               "{% endfor %}"
               "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"),
    # The shortest layout, for tiny char/byte models: "User: ...\nAssistant: ...<eos>".
    "plain": ("{% for message in messages %}"
              "{% if message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
              "{% else %}{{ message['role'] | capitalize + ': ' + message['content'] + '\n' }}{% endif %}"
              "{% endfor %}"
              "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"),
}

LOSS_ON = ("assistant", "completion", "all")


_TRACKING = contextvars.ContextVar("generation_spans", default=None)
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class _Generation(jinja2.ext.Extension):
  """`{% generation %}...{% endgeneration %}`: renders its body and, while `ChatTemplate.render_spans`
  runs, records where the body lies in the output (transformers' AssistantTracker, which its
  `return_assistant_tokens_mask` reads)."""

  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
    return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

  def _body(self, caller):
    text = caller()
    tracking = _TRACKING.get()
    if tracking is not None:
      blocks, spans = tracking
      start = len("".join(blocks))
      spans.append((start, start + len(text)))
    return text


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # transformers replaces jinja's tojson (which escapes HTML characters) with plain json.dumps
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(text, name="the chat template"):
  """A jinja2 template in transformers' environment (transformers 5.x `_compile_jinja_template`):
  sandboxed, trim_blocks and lstrip_blocks, loop controls, `raise_exception`, a json `tojson`.
  name: where the text came from (a file path, or a built-in's name), for the one-line syntax error."""
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                     extensions=[_Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  try:
    return env.from_string(text)
  except jinja2.TemplateSyntaxError as e:
    raise UserError(f"chat template {name} does not parse (line {e.lineno} of the template): {e.message}") from None


class ChatTemplate:
  """A compiled chat template with its special-token strings (`bos_token`, `eos_token`, ...)."""

  def __init__(self, text, special, name):
    self.text, self.special, self.name = text, dict(special), name
    self.template = compile_template(text, name)

  def _failed(self, e, where):
    """The one-line error of a failed rendering: the record (`where`, its file:line), the template, the cause.
    `raise_exception(...)` in the template is a TemplateError carrying the template's own message."""
    cause = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
    return UserError(f"{where + ': ' if where else ''}chat template {self.name}: {cause}")

  def render(self, messages, add_generation_prompt=False, where=""):
    """The conversation as text, as transformers' `apply_chat_template(..., tokenize=False)` gives it.
    where: the record's "file:line", named by any error the template raises."""
    try:
      return self.template.render(messages=messages, tools=None, documents=None,
                                  add_generation_prompt=add_generation_prompt, **self.special)
    except Exception as e:  # the template is the user's code: whatever it raises is one line, never a traceback
      raise self._failed(e, where) from None

  @property
  def sha256(self):
    """The identity of what this template renders: its text and its special-token strings (the
    prepared data records it; an export checks it against that)."""
    return hashlib.sha256(json.dumps([self.text, self.special], sort_keys=True).encode()).hexdigest()

  @property
  def marks_generation(self):
    """Whether the template marks the assistant's text with {% generation %} blocks."""
    return bool(_GENERATION_TAG.search(self.text))

  def render_spans(self, messages, where=""):
    """(text, [(start, end)] character spans of its {% generation %} blocks), as transformers finds them."""
    blocks, spans = [], []
    token = _TRACKING.set((blocks, spans))
    try:
      for block in self.template.generate(messages=messages, tools=None, documents=None,
                                          add_generation_prompt=False, **self.special):
        blocks.append(block)
    except Exception as e:
      raise self._failed(e, where) from None
    finally:
      _TRACKING.reset(token)
    return "".join(blocks), spans


def _token_text(value):
  """A tokenizer_config.json special token: a string, or a dict with its `content`."""
  return value.get("content") if isinstance(value, dict) else value


def load_template(spec, tokenizer_path, hf_tokenizer):
  """The ChatTemplate named by `data.chat_template`.

  spec: a built-in name (`chatml`, `plain`), a path to a tokenizer_config.json (its
  `chat_template`, and its bos/eos/pad/unk token strings) or to a Jinja file; "" -> the
  tokenizer_config.json beside the tokenizer (jaxformer.convert copies it there).
  hf_tokenizer: the run's tokenizer is a tokenizer.json, whose special tokens are text the
  tokenizer recognises; otherwise the template's `bos_token`/`eos_token` are BOS_TEXT/EOS_TEXT.
  """
  ours = {"bos_token": BOS_TEXT, "eos_token": EOS_TEXT}
  if spec in BUILTIN_TEMPLATES:
    return ChatTemplate(BUILTIN_TEMPLATES[spec], ours, spec)
  path = spec
  if not spec:
    folder = os.path.dirname(os.path.abspath(tokenizer_path)) if tokenizer_path != "byte" else ""
    path = os.path.join(folder, "tokenizer_config.json")
    if not folder or not os.path.isfile(path):
      raise UserError(f"no chat template: {folder if folder else 'the byte tokenizer'} has no tokenizer_config.json; "
                      f"set data.chat_template to one of {', '.join(BUILTIN_TEMPLATES)} or to a tokenizer_config.json")
  if not os.path.isfile(path):
    raise UserError(f"data.chat_template={spec}: not a built-in template ({', '.join(BUILTIN_TEMPLATES)}) "
                    "and no such file")
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if not path.endswith(".json"):
    return ChatTemplate(text, ours, path)
  try:
    config = json.loads(text)
  except json.JSONDecodeError as e:
    raise UserError(f"{path}: not valid JSON ({e.msg}, line {e.lineno})") from None
  template = config.get("chat_template")
  if isinstance(template, list):  # several named templates: transformers uses "default"
    template = {t.get("name"): t.get("template") for t in template}.get("default")
  if not template and os.path.isfile(os.path.join(os.path.dirname(path), "chat_template.jinja")):
    with open(os.path.join(os.path.dirname(path), "chat_template.jinja"), encoding="utf-8") as f:
      template = f.read()  # transformers >= 4.43 may save it beside the config
  if not template:
    raise UserError(f"{path} has no chat_template; set data.chat_template to one of {', '.join(BUILTIN_TEMPLATES)}")
  special = {k: _token_text(config[k]) for k in ("bos_token", "eos_token", "pad_token", "unk_token")
             if config.get(k) is not None}
  if not hf_tokenizer:
    special.update(ours)
  return ChatTemplate(template, special, path)


def _shown(value, limit=60):
  """A record's value as JSON, cut to `limit` characters, for an error line."""
  text = json.dumps(value, ensure_ascii=False)
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_messages(messages, where, key="messages"):
  """A one-line error (naming `where`, the record's file:line, and the record's `key`) unless `messages`
  is a non-empty list of {"role": str, "content": str} objects: what every template may assume."""
  if isinstance(messages, list) and not messages:
    raise UserError(f"{where}: `{key}` is empty; it needs at least one {{\"role\", \"content\"}} message")
  if not isinstance(messages, list):
    raise UserError(f"{where}: `{key}` must be a list of {{\"role\", \"content\"}} messages, got {_shown(messages)}")
  for i, m in enumerate(messages):
    if not isinstance(m, dict):
      raise UserError(f"{where}: `{key}[{i}]` must be a {{\"role\", \"content\"}} object, got {_shown(m)}")
    for field in ("role", "content"):
      if not isinstance(m.get(field), str):
        got = f"got {_shown(m[field])}" if field in m else "it has none"
        raise UserError(f"{where}: `{key}[{i}]` needs a string `{field}`, {got}")


def conversation_pieces(template, messages, loss_on, where=""):
  """[(text, in the loss)] whose concatenation is `template.render(messages)`.

  loss_on: assistant (every assistant turn), completion (the last one), all (every token).
  where: the record's "file:line", named by every error about it.
  """
  _check_messages(messages, where)
  full = template.render(messages, where=where)
  if loss_on == "all":
    return [(full, True)]
  turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
  if loss_on == "completion":
    turns = turns[-1:]
  spans = []
  if template.marks_generation:  # the template says where the assistant's text is (TRL's assistant_only_loss)
    text, spans = template.render_spans(messages, where)
    spans = spans[-1:] if loss_on == "completion" else spans
    turns = []
  for i in turns:
    start = template.render(messages[:i], add_generation_prompt=True, where=where) if i else ""
    upto = template.render(messages[:i + 1], where=where)
    if not (upto.startswith(start) and full.startswith(upto)):
      raise UserError(f"{where}: chat template {template.name} does not render the conversation's prefixes as "
                      f"prefixes of it (turn {i}), so the assistant's tokens cannot be located; "
                      "use data.loss_on=all or another template")
    spans.append((len(start), len(upto)))
  pieces, at = [], 0
  for a, b in spans:
    a = max(a, at)
    if a > at:
      pieces.append((full[at:a], False))
    if b > a:
      pieces.append((full[a:b], True))
    at = max(at, b)
  if at < len(full):
    pieces.append((full[at:], False))
  return pieces


def record_pieces(template, record, loss_on, eos_id, where=""):
  """[(text or token id, in the loss)] of one SFT record (`messages`, or `prompt` + `completion`).

  A template with {% generation %} blocks marks the assistant's text itself (transformers'
  `return_assistant_tokens_mask`); for others the spans come from rendering prefixes.
  Plain-text prompt/completion is not templated (TRL's "standard" form): prompt + completion
  + EOS, the loss on the completion and its EOS (or on everything with loss_on=all).
  where: the record's "file:line"; every malformed record is a one-line error naming it.
  """
  if not isinstance(record, dict):
    raise UserError(f"{where}: expected a JSON object with `messages` or `prompt`/`completion`, got {_shown(record)}")
  if "messages" in record:
    return conversation_pieces(template, record["messages"], loss_on, where)
  if "prompt" in record and "completion" in record:
    prompt, completion = record["prompt"], record["completion"]
    if isinstance(prompt, list) and isinstance(completion, list):  # conversational prompt-completion
      _check_messages(prompt, where, "prompt")
      _check_messages(completion, where, "completion")
      full = template.render(prompt + completion, where=where)
      head = template.render(prompt, add_generation_prompt=True, where=where)
      if not full.startswith(head):
        raise UserError(f"{where}: chat template {template.name} does not render the prompt as a prefix of "
                        "the conversation; use data.loss_on=all or another template")
      return [(head, loss_on == "all"), (full[len(head):], True)]
    if not isinstance(prompt, str) or not isinstance(completion, str):
      raise UserError(f"{where}: `prompt` and `completion` must both be strings or both message lists "
                      f"(got {type(prompt).__name__} and {type(completion).__name__})")
    return [(prompt, loss_on == "all"), (completion, True), (eos_id, True)]
  raise UserError(f"{where}: a record needs `messages` or `prompt` and `completion` (keys: {', '.join(record)})")


def encode_pieces(tokenizer, pieces, hf_tokenizer):
  """Token ids [n] int32 and loss mask [n] uint8 of `pieces` (see `record_pieces`).

  A tokenizer.json recognises its special tokens in text itself (as transformers does);
  BOS_TEXT/EOS_TEXT (built-in templates, our tokenizers) become the model's BOS/EOS ids.
  hf_tokenizer: kept for callers; the rule is the same for every tokenizer.
  """
  ids, mask = [], []
  for piece, on in pieces:
    if isinstance(piece, (int, np.integer)):
      parts = [[int(piece)]]
    else:  # BOS_TEXT / EOS_TEXT appear only where a built-in template (or our tokenizer) put them
      parts = []
      for k, chunk in enumerate(piece.split(EOS_TEXT)):
        if k:
          parts.append([tokenizer.eos_id])
        for j, sub in enumerate(chunk.split(BOS_TEXT)):
          if j:
            parts.append([tokenizer.bos_id])
          if sub:
            parts.extend(_encode_text(tokenizer, sub))
    for p in parts:
      ids.extend(p)
      mask.extend([int(on)] * len(p))
  return np.asarray(ids, np.int32), np.asarray(mask, np.uint8)


def _encode_text(tokenizer, text):
  """[ids, ...] of text, where a sentencepiece model's control symbols written by the template (Mistral's
  [INST]) are their ids, as transformers' tokenizer matches them, and the text between is encoded alone."""
  controls = getattr(tokenizer, "control_pieces", None)
  if not controls:
    return [list(tokenizer.encode(text))]
  parts = []
  for chunk in _control_splitter(tuple(controls)).split(text):
    if chunk in controls:
      parts.append([controls[chunk]])
    elif chunk:
      parts.append(list(tokenizer.encode(chunk)))
  return parts


@functools.lru_cache(maxsize=8)
def _control_splitter(pieces):
  """A regex that splits text around any of `pieces` (longest first) and keeps them."""
  return re.compile("(" + "|".join(re.escape(c) for c in sorted(pieces, key=len, reverse=True)) + ")")


def preference_pieces(template, record, eos_id, where=""):
  """(chosen pieces, rejected pieces), each the whole sequence, of a DPO record: `prompt` (text or
  messages) and `chosen`/`rejected` (text, or assistant message lists; text after a message-list
  prompt is one assistant message). where: the record's "file:line", named by every error about it."""
  if not isinstance(record, dict) or not all(k in record for k in ("prompt", "chosen", "rejected")):
    keys = f"keys: {', '.join(record)}" if isinstance(record, dict) else f"got {_shown(record)}"
    raise UserError(f"{where}: a preference record needs `prompt`, `chosen` and `rejected` ({keys})")
  prompt = record["prompt"]
  out = []
  for key in ("chosen", "rejected"):
    answer = record[key]
    if isinstance(prompt, list):  # conversational: the template renders prompt + answer
      _check_messages(prompt, where, "prompt")
      if isinstance(answer, str):
        answer = [{"role": "assistant", "content": answer}]
      elif not isinstance(answer, list):
        raise UserError(f"{where}: `{key}` must be a string or a list of messages, got {_shown(answer)}")
      _check_messages(answer, where, key)
      pieces = record_pieces(template, {"prompt": prompt, "completion": answer}, "completion", eos_id, where)
    elif isinstance(prompt, str) and isinstance(answer, str):
      pieces = [(prompt, False), (answer, True), (eos_id, True)]
    elif isinstance(prompt, str):
      raise UserError(f"{where}: `prompt` is a string, so `{key}` must be one too, got {_shown(answer)}")
    else:
      raise UserError(f"{where}: `prompt` must be a string or a list of messages, got {_shown(prompt)}")
    out.append(pieces)
  return tuple(out)


def read_jsonl(path, key="data.chat_path"):
  """Yields (where, record) for each non-blank line of a JSON-lines file, where = "path:line";
  bad JSON is a one-line error, and so is a missing file, named by the setting `key` that gave it."""
  if not os.path.isfile(path):
    raise UserError(f"{key}={path}: file not found")
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        yield f"{path}:{n}", json.loads(line)
      except json.JSONDecodeError as e:
        raise UserError(f"{path}:{n}: not valid JSON ({e.msg})") from None


# ----------------------------------------------------------------------------
# Preparing once: records -> token and loss-mask shards (`jaxformer.shards`, fields side by side).


def fields(cfg):
  """The shard fields of the run's fine-tuning data: tokens and their loss mask, per side for DPO."""
  if cfg.train.objective == "dpo":
    return ("chosen", "chosen_mask", "rejected", "rejected_mask")
  return ("text", "mask")


class _LazyTemplate:
  """The run's ChatTemplate, or the one-line error loading it gave, raised when a record first needs
  a template (plain-text prompt/completion data needs none, so a run without one can still prepare it)."""

  def __init__(self, template, error):
    self._template, self._error = template, error

  def __getattr__(self, name):
    if self._template is None:
      raise self._error
    return getattr(self._template, name)


# The version of what `_settings` records: data prepared under another version is not reused.
# chat-2: input files by content (sha256), the template's special tokens, data.shard_tokens.
SETTINGS_FORMAT = "chat-2"


def _content(path):
  """An input file's identity for the settings: its size and sha256 (its content, whatever its name or date)."""
  from jaxformer import prepare
  return {"bytes": os.path.getsize(path), "sha256": prepare.file_sha256(path)}


def _settings(cfg, tok_path, tokenizer, template):
  """What the shards depend on, by override name; a complete manifest with others is refused in one line,
  an incomplete one is prepared again (`ensure_prepared`). template: a ChatTemplate, or None (none loads)."""
  from jaxformer import prepare, sources
  d = cfg.data
  for key in ("data.chat_path", "data.chat_val_path"):  # a missing file is named by the setting that gave it
    path = getattr(d, key.split(".")[1])
    if path and not os.path.isfile(path):
      raise UserError(f"{key}={path}: file not found")
  return {"format": SETTINGS_FORMAT, "train.objective": cfg.train.objective, "data.loss_on": d.loss_on,
          "data.chat_path": _content(d.chat_path), "data.chat_val_path": _content(d.chat_val_path) if d.chat_val_path
          else None, "data.train_fraction": d.train_fraction, "data.add_bos": d.add_bos,
          "data.shard_tokens": d.shard_tokens, "data.chat_template": d.chat_template,
          # the text and special-token strings the template renders with, wherever they came from
          "template_sha256": template.sha256 if template is not None else None,
          "tokenizer": {"sha256": prepare.file_sha256(tok_path), "vocab_size": tokenizer.vocab_size},
          "model.pad_id/bos_id/eos_id": [cfg.model.pad_id, cfg.model.bos_id, cfg.model.eos_id],
          "split_seed": sources.SEED}


def encode_record(cfg, tokenizer, template, record, where, hf):
  """Per field (ids [n], mask [n]) of one record: (text, mask) for SFT, both sides for DPO."""
  d = cfg.data
  if cfg.train.objective == "dpo":
    sides = preference_pieces(template, record, tokenizer.eos_id, where)
  else:
    sides = (record_pieces(template, record, d.loss_on, tokenizer.eos_id, where),)
  out = []
  for pieces in sides:
    ids, mask = encode_pieces(tokenizer, pieces, hf)
    if d.add_bos and (not len(ids) or ids[0] != tokenizer.bos_id):  # Llama's convention, unless the template wrote it
      ids, mask = np.concatenate([[tokenizer.bos_id], ids]), np.concatenate([[int(d.loss_on == "all")], mask])
    out += [ids, mask]
  return out


def _shown_setting(value):
  if isinstance(value, dict) and "sha256" in value:
    return "sha256 " + value["sha256"][:12]
  return _shown(value, 40)


def _check(manifest, settings, ddir):
  """A one-line error unless the complete `manifest` was prepared with `settings`."""
  old = manifest.get("chat", {}).get("settings")
  if old is None:
    raise UserError(f"{ddir} holds data prepared for pretraining, not fine-tuning data: set data.data_dir to "
                    "another folder")
  for key, value in settings.items():
    if old.get(key) != value:
      raise UserError(f"{ddir} was prepared with other fine-tuning data or settings ({key}: "
                      f"{_shown_setting(old.get(key))}, now {_shown_setting(value)}): delete {ddir} to prepare it "
                      "again, or set data.data_dir to another folder")


def _split_records(cfg):
  """{"train": [(where, record)], "val": [...]}: the held-out records are data.chat_val_path's, or a seeded
  1 - data.train_fraction of data.chat_path's."""
  from jaxformer import sources
  d = cfg.data
  records = {"train": [], "val": []}
  rng = np.random.default_rng(sources.SEED)
  for where, record in read_jsonl(d.chat_path, "data.chat_path"):
    held_out = not d.chat_val_path and rng.random() >= d.train_fraction
    records["val" if held_out else "train"].append((where, record))
  if d.chat_val_path:
    records["val"] = list(read_jsonl(d.chat_val_path, "data.chat_val_path"))
  return records


def ensure_prepared(cfg, workdir, log=print):
  """The manifest of the run's fine-tuning shards (`data.chat_path`), preparing them first if needed.

  Splits: train, and val (data.chat_val_path, or a seeded 1 - data.train_fraction of the
  records). Each record is one document of every field; an example with no loss token is
  kept on disk, counted and reported (the batchers drop it); a split with none is an error.

  As `prepare.prepare` does, the manifest is written first with `complete: false` and the
  settings, then the shards, then the manifest again, complete. A complete manifest with other
  settings (input files' content, template, data.loss_on, tokenizer, ...) is a one-line error;
  anything less than complete (a failed or interrupted run's folder) is prepared again from
  scratch, never resumed. Every record of both splits is validated and rendered before any
  shard is written, under the lock pretraining takes, so two runs preparing one data.data_dir
  at once prepare it once.
  """
  from jaxformer import prepare, shards, tokenizer as tokenizer_lib
  d = cfg.data
  ddir, tok_path = prepare.data_dir(cfg, workdir), prepare.tokenizer_path(cfg, workdir)
  if tok_path != "byte" and not os.path.isfile(tok_path):
    raise UserError(f"fine-tuning needs the model's tokenizer, and {tok_path} does not exist: set train.init_from="
                    "WORKDIR (its tokenizer is copied), data.tokenizer_path=FILE or data.tokenizer=byte")
  tokenizer = prepare.load_run_tokenizer(cfg, tok_path)
  hf = isinstance(tokenizer, tokenizer_lib.HFTokenizer)
  try:
    loaded, error = load_template(d.chat_template, tok_path, hf), None
  except UserError as e:
    loaded, error = None, e
  settings = _settings(cfg, tok_path, tokenizer, loaded)
  manifest = shards.read_manifest(ddir)
  if manifest and manifest.get("complete"):  # prepared: checked without waiting for the lock
    _check(manifest, settings, ddir)
    return manifest
  os.makedirs(ddir, exist_ok=True)
  with prepare.locked(ddir):  # another run preparing this folder finishes first
    manifest = shards.read_manifest(ddir)
    if manifest is not None and manifest.get("complete"):
      _check(manifest, settings, ddir)
      return manifest
    if manifest is not None and "chat" not in manifest:  # pretraining's unfinished shards: not ours to delete
      raise UserError(f"{ddir} holds pretraining data not yet fully prepared: finish it with python -m "
                      "jaxformer.prepare, or set data.data_dir to another folder")
    return _prepare(cfg, ddir, tok_path, tokenizer, _LazyTemplate(loaded, error), settings, hf, log)


def _prepare(cfg, ddir, tok_path, tokenizer, template, settings, hf, log):
  """Writes the shards of `ensure_prepared` into `ddir` (held under its lock) from scratch."""
  import shutil
  from jaxformer import prepare, shards
  d = cfg.data
  names = fields(cfg)
  dtype = shards.token_dtype(tokenizer.vocab_size)
  header = {"format": shards.FORMAT, "complete": False, "dtype": dtype.name, "fields": list(names),
            "tokenizer": {"path": os.path.abspath(tok_path) if tok_path != "byte" else "byte",
                          "sha256": settings["tokenizer"]["sha256"], "vocab_size": tokenizer.vocab_size},
            "chat": {"settings": settings}}
  # First: a run stopped from here on leaves a folder known to be incomplete, so the next one prepares it again.
  prepare._atomic_json(os.path.join(ddir, shards.MANIFEST), header)
  encoded, counts = {}, {}
  for split, items in _split_records(cfg).items():  # every record, both splits, before anything is written
    if not items:
      continue
    columns = [[] for _ in names]
    for where, record in items:
      for f, array in enumerate(encode_record(cfg, tokenizer, template, record, where, hf)):
        columns[f].append(array)
    n = len(items)
    mask_columns = [c for name, c in zip(names, columns) if name.endswith("mask")]
    empty = sum(1 for k in range(n) if not any(c[k][1:].any() for c in mask_columns))
    counts[split] = {"examples": n, "empty_mask": empty, "tokens": int(sum(len(a) for a in columns[0])),
                     "loss_tokens": int(sum(int(m.sum()) for c in mask_columns for m in c))}
    encoded[split] = columns
  if "train" not in counts or counts["train"]["empty_mask"] == counts["train"]["examples"]:
    raise UserError(f"{d.chat_path}: no training example has a token to train on (data.loss_on={d.loss_on}"
                    + (": no record has an assistant turn" if "train" in counts else ": no records") + ")")
  summary = {}
  for split in ("train", "val"):
    # From scratch: `_Writer` keeps the complete shards it finds, which here are another preparation's.
    shutil.rmtree(os.path.join(ddir, split), ignore_errors=True)
    if split not in encoded:
      continue
    columns, n = encoded[split], counts[split]["examples"]
    writer = prepare._Writer(ddir, split, names, dtype, d.shard_tokens, keep_text=False)
    writer.add(np.arange(n, dtype=np.int64),
               [(np.concatenate(c).astype(dtype), np.fromiter(map(len, c), np.int64, n)) for c in columns])
    writer.close()
    summary[split] = writer.summary()
  for split, c in counts.items():
    log(f"{split}: {c['examples']:,} examples, {c['tokens']:,} tokens, {c['loss_tokens']:,} in the loss "
        f"(data.loss_on={d.loss_on}); {c['empty_mask']:,} with no loss token (no assistant turn) skipped")
  manifest = {**header, "complete": True, "splits": summary, "chat": {"settings": settings, "counts": counts}}
  prepare._atomic_json(os.path.join(ddir, shards.MANIFEST), manifest)
  return manifest


# ----------------------------------------------------------------------------
# Chatting with a fine-tuned model (`python -m jaxformer.generate --chat`).

_PROBE = "jaxformer-probe-answer"  # an assistant answer no template changes (no edge spaces for `| trim`)


def _render_probe(template):
  """A user question and the probe answer rendered (with a system message first if the template needs
  one), or None where the template refuses both."""
  for head in ([], [{"role": "system", "content": "."}]):
    try:
      return template.render(head + [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}])
    except UserError:
      continue
  return None


def prompt_ids(template, tokenizer, messages, add_bos, hf_tokenizer, where="--chat"):
  """Token ids (list of int) of `messages` rendered with the generation prompt, encoded as training
  encodes a record (`encode_pieces`: the template's special strings become their ids, e.g. our
  `<|eos|>` the model's EOS; a tokenizer.json's own special tokens are matched in the text), with
  BOS first under data.add_bos unless the template wrote it."""
  _check_messages(messages, where)
  ids, _ = encode_pieces(tokenizer, [(template.render(messages, add_generation_prompt=True), False)], hf_tokenizer)
  ids = ids.tolist()
  if add_bos and (not ids or ids[0] != tokenizer.bos_id):
    ids = [tokenizer.bos_id] + ids
  return ids


def end_of_turn_ids(template, tokenizer, hf_tokenizer):
  """The ids that end an assistant turn (sorted list): the model's EOS, and the token the template writes
  right after the assistant's text when that is one special token (Llama 3's `<|eot_id|>`, ChatML's
  `<|im_end|>`; the built-in templates write `eos_token`, the EOS). Found by rendering a probe answer."""
  stops = {int(tokenizer.eos_id)}
  text = _render_probe(template)
  if text is None:  # a template that renders no probe conversation: EOS alone
    return sorted(stops)
  at = text.rfind(_PROBE)
  tail = text[at + len(_PROBE):].lstrip() if at >= 0 else ""
  if tail:
    first = int(encode_pieces(tokenizer, [(tail, False)], hf_tokenizer)[0][0])
    added = tokenizer.tok.get_added_tokens_decoder() if hf_tokenizer and hasattr(tokenizer, "tok") else {}
    if first in (tokenizer.eos_id, tokenizer.bos_id) or first in added:  # one token, not the first byte of text
      stops.add(first)
  return sorted(stops)


def read_conversations(specs, system=""):
  """The conversations that `--chat` values give: a text is one user message; a path to a .json file
  holds a messages list (one conversation, e.g. with history) or a list of them. `system`: a system
  message put first in each conversation that has none. A bad file is a one-line error."""
  conversations = []
  for spec in specs:
    if spec.endswith(".json") and os.path.isfile(spec):
      try:
        with open(spec, encoding="utf-8") as f:
          value = json.load(f)
      except json.JSONDecodeError as e:
        raise UserError(f"{spec}:{e.lineno}: not valid JSON ({e.msg})") from None
      value = value.get("messages", value) if isinstance(value, dict) else value
      many = isinstance(value, list) and value and all(isinstance(v, list) for v in value)
      for k, messages in enumerate(value if many else [value]):
        _check_messages(messages, spec + (f" (conversation {k})" if many else ""))
        conversations.append(list(messages))
    else:
      conversations.append([{"role": "user", "content": spec}])
  if system:
    conversations = [c if c[0]["role"] == "system" else [{"role": "system", "content": system}] + c
                     for c in conversations]
  return conversations


# ----------------------------------------------------------------------------
# Exporting the template (`python -m jaxformer.convert --to-hf`).


def _starts_with_bos(template, tokenizer, hf_tokenizer):
  """Whether the template writes BOS first (then training added none under data.add_bos); None: unknown."""
  text = _render_probe(template)
  if text is None:
    return None
  ids, _ = encode_pieces(tokenizer, [(text, False)], hf_tokenizer)
  return bool(len(ids)) and int(ids[0]) == tokenizer.bos_id


def hf_template(template, tokenizer, hf_tokenizer, add_bos, token_text):
  """(template text, {"bos_token": str, ...}) for a Hugging Face tokenizer_config.json, so that
  transformers' `apply_chat_template` (tokenize=True: the text tokenized with no special tokens added)
  gives the ids training encoded (`encode_pieces`).

  Our BOS_TEXT/EOS_TEXT placeholders (built-in templates, our tokenizers) become the strings of the
  model's BOS/EOS ids (`token_text(id)`, e.g. GPT-2's `<|endoftext|>`, Llama's `</s>`), which HF's
  tokenizer reads back as those ids; a tokenizer_config.json's own strings stay. With data.add_bos,
  training put BOS before a record whose template wrote none: the template then starts with
  `{{ bos_token }}` to do the same.
  """
  real = {BOS_TEXT: token_text(tokenizer.bos_id), EOS_TEXT: token_text(tokenizer.eos_id)}
  text = template.text
  for placeholder, string in real.items():  # also where a template writes the placeholder literally
    text = text.replace(placeholder, string)
  special = {k: real.get(v, v) for k, v in template.special.items()}
  if add_bos and not _starts_with_bos(template, tokenizer, hf_tokenizer):
    text = "{{ bos_token }}" + text
  return text, special
