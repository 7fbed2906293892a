"""Tokenizers. Ours share one id convention: PAD=0, BOS=1, EOS=2 (UNK=3 for spm).

Three implementations of ours share the `Tokenizer` interface:

* `SentencePieceTokenizer`: a joint (source + target) BPE/unigram `.model`.
* `CharTokenizer`: the sorted distinct characters of the training text, stored
  as a small JSON file. The three specials come *first* (ids 0..2) and
  character i of the sorted vocabulary gets id i + 3, so Tiny Shakespeare's 65
  characters give `vocab_size == 68`. Keeping PAD=0 for every tokenizer lets
  the model and the batchers treat id 0 as padding without special cases; the
  three extra logits cost nothing measurable (they are never targets when
  `lm_token_stream(..., add_eos=False)`, so losses stay comparable to
  nanoGPT's 65-way char model).
* `ByteTokenizer`: UTF-8 bytes, byte b -> id b + 3 (vocab 259); no training.

Imported models (`jaxformer.convert`) bring their own ids, which the model config
records (`model.pad_id`, `bos_id`, `eos_id`) and `Tokenizer.use_model_ids` checks:

* Llama-1/2 sentencepiece models load as `SentencePieceTokenizer` (unk 0, bos 1,
  eos 2, no pad).
* `HFTokenizer`: a Hugging Face `tokenizer.json` (GPT-2's and Llama 3's byte-level
  BPE) through the `tokenizers` package, plus the special tokens that a tokenizer_config.json /
  special_tokens_map.json beside it names, added as transformers adds them.
* `MarianTokenizer`: OPUS-MT's source.spm / target.spm / vocab.json, packed into
  one JSON file; pieces from the source model (targets: the target model), ids
  from the vocabulary, as transformers' MarianTokenizer does.
"""

import base64
import json
import functools
import os
import tempfile

import numpy as np

from jaxformer.errors import UserError, closest

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
NUM_SPECIALS = 3  # PAD, BOS, EOS; char/byte ids start after them.


class Tokenizer:
  """Text <-> ids. Subclasses implement `encode` and `_decode_clean`.

  pad_id / bos_id / eos_id: None where the tokenizer file defines none (Llama has no
  pad; a tokenizer.json names no ids); `use_model_ids` then fills them in.
  """

  pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID
  vocab_size: int

  def encode(self, text):
    """Returns the ids of `text` (list[int]) without BOS/EOS."""
    raise NotImplementedError

  def encode_target(self, text):
    """The ids of target-side text (translation); only Marian's differ from `encode`."""
    return self.encode(text)

  def encode_batch(self, texts, num_threads=1):
    """Returns `[encode(t) for t in texts]`; subclasses may do it faster."""
    del num_threads  # Pure-Python tokenizers would only contend for the GIL.
    return [self.encode(t) for t in texts]

  def decode(self, ids):
    """Returns the text of ids [len]: stops at the first EOS, drops PAD/BOS."""
    ids = [int(i) for i in ids]
    if self.eos_id in ids:
      ids = ids[:ids.index(self.eos_id)]
    return self._decode_clean([i for i in ids if i not in (self.pad_id, self.bos_id)])

  def _decode_clean(self, ids):
    raise NotImplementedError

  def use_model_ids(self, pad_id, bos_id, eos_id, where="the model"):
    """Adopts the model's special ids where the tokenizer has none; a different one is a UserError."""
    for name, want in (("pad_id", pad_id), ("bos_id", bos_id), ("eos_id", eos_id)):
      have = getattr(self, name)
      if have is None:
        setattr(self, name, want)
      elif have != want:
        raise UserError(f"the tokenizer's {name} is {have} but {where} has model.{name}={want}: "
                        f"wrong tokenizer for this model (or set model.{name}={have})")
    return self


class SentencePieceTokenizer(Tokenizer):
  """A sentencepiece `.model`: ours (see `train_sentencepiece`) or Llama-1/2's.

  The special ids are the model's own (ours: pad 0, bos 1, eos 2; Llama: unk 0, bos 1,
  eos 2 and no pad, so pad_id is None until `use_model_ids`).
  """

  def __init__(self, model_path):
    import sentencepiece as spm  # Lazy: only spm users need the extension.
    model_path = os.fspath(model_path)
    if not os.path.isfile(model_path):
      raise UserError(f"sentencepiece model {model_path} not found")
    self.path = model_path
    self.sp = spm.SentencePieceProcessor(model_file=model_path)
    self.pad_id, self.bos_id, self.eos_id = (None if i < 0 else i for i in
                                             (self.sp.pad_id(), self.sp.bos_id(), self.sp.eos_id()))
    self.vocab_size = self.sp.vocab_size()

  def encode(self, text):
    return self.sp.encode(text)

  @functools.cached_property
  def control_pieces(self):
    """{piece: id} of the model's control symbols other than BOS/EOS/pad (Mistral's [INST], [/INST]):
    sentencepiece never produces them from text, so chat templates that write them need this map."""
    skip = {self.bos_id, self.eos_id, self.pad_id}
    return {self.sp.id_to_piece(i): i for i in range(self.vocab_size) if self.sp.is_control(i) and i not in skip}

  def encode_batch(self, texts, num_threads=-1):
    # sentencepiece encodes a list on C++ threads (-1 = all cores).
    return self.sp.encode(list(texts), num_threads=num_threads)

  def _decode_clean(self, ids):
    return self.sp.decode(ids)

  def requested_vocab_size(self):
    """The vocab size asked for at training time (may exceed `vocab_size`)."""
    try:
      from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # protobuf missing: the actual size is the best guess.
      return self.vocab_size
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(self.sp.serialized_model_proto())
    return proto.trainer_spec.vocab_size or self.vocab_size


class CharTokenizer(Tokenizer):
  """Characters of a fixed sorted vocabulary; char i has id i + 3."""

  def __init__(self, chars):
    self.chars = "".join(sorted(set(chars)))
    self.vocab_size = NUM_SPECIALS + len(self.chars)
    self._ids = {c: i + NUM_SPECIALS for i, c in enumerate(self.chars)}
    # Code point -> id table so whole books encode with one numpy gather.
    self._table = np.full(max(map(ord, self.chars), default=0) + 1, -1,
                          np.int32)
    for c, i in self._ids.items():
      self._table[ord(c)] = i

  @classmethod
  def train(cls, texts):
    """Builds the vocabulary from an iterable of strings."""
    chars = set()
    for t in texts:
      chars.update(t)
    return cls(chars)

  @classmethod
  def load(cls, path):
    """Loads a vocabulary written by `save`."""
    with open(path, encoding="utf-8") as f:
      spec = json.load(f)
    if spec.get("type") != "char":
      raise UserError(f"{path} is not a char tokenizer file")
    return cls(spec["chars"])

  def save(self, path):
    """Writes `{"type": "char", "chars": ...}` as JSON."""
    _atomic_write(path, json.dumps(
        {"type": "char", "chars": self.chars}, ensure_ascii=False).encode())

  def encode(self, text):
    return self.encode_array(text).tolist()

  def encode_array(self, text):
    """Returns the ids of `text` as an int32 array [len(text)]."""
    codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    ids = np.where(codes < len(self._table),
                   self._table[np.minimum(codes, len(self._table) - 1)], -1)
    if (ids < 0).any():
      bad = sorted({text[i] for i in np.flatnonzero(ids < 0)[:100]})
      raise UserError(f"characters {bad!r} are not in the char vocabulary; "
                      "rebuild the tokenizer on text that contains them")
    return ids.astype(np.int32)

  def _decode_clean(self, ids):
    return "".join(self.chars[i - NUM_SPECIALS] for i in ids
                   if NUM_SPECIALS <= i < self.vocab_size)


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes: byte b has id b + 3; invalid UTF-8 decodes to U+FFFD."""

  vocab_size = NUM_SPECIALS + 256
  path = "byte"

  def encode(self, text):
    return [b + NUM_SPECIALS for b in text.encode("utf-8")]

  def encode_array(self, text):
    """Returns the ids of `text` as an int32 array [bytes] (numpy, for whole corpora)."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32) + NUM_SPECIALS

  def _decode_clean(self, ids):
    return bytes(i - NUM_SPECIALS for i in ids if i >= NUM_SPECIALS).decode(
        "utf-8", errors="replace")


# The files beside a tokenizer.json that convert and train.init_from copy with it: special tokens that
# `HFTokenizer` adds (tokenizer_config.json, special_tokens_map.json), the chat template (jaxformer.chat).
HF_TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# transformers' PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES (5.x), in its order.
HF_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _read_json_object(path):
  """The JSON object in `path`, or None when there is no such file."""
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise UserError(f"{path} is not valid JSON: {e}") from e
  if not isinstance(value, dict):
    raise UserError(f"{path} holds a JSON {type(value).__name__}, not an object: fix or remove it")
  return value


def _added_token(value, special=None):
  """tokenizers.AddedToken(content, **the flags the dict names) as transformers' `AddedToken(**dict)` (flags it
  leaves out keep tokenizers' defaults, e.g. normalized = not special); `special` overrides the dict's."""
  from tokenizers import AddedToken
  flags = {k: bool(value[k]) for k in _ADDED_TOKEN_FLAGS if k in value}
  if special is not None:
    flags["special"] = special
  return AddedToken(value["content"], **flags)


def _is_token_dict(value, typed):
  """A saved AddedToken: a dict with a content string (typed: with transformers' "__type": "AddedToken")."""
  return (isinstance(value, dict) and isinstance(value.get("content"), str) and
          (not typed or value.get("__type") == "AddedToken"))


def _loose_token(value):
  """A named / extra special token: transformers refuses a dict without "__type" there; read it as a token."""
  return _added_token(value, special=bool(value.get("special", True))) if _is_token_dict(value, False) else value


def hf_config_special_tokens(folder, added=()):
  """The tokens that `AutoTokenizer.from_pretrained(folder)` (transformers 5: PreTrainedTokenizerBase's
  _from_pretrained and __init__, TokenizersBackend.__init__) adds to tokenizer.json's from `folder`'s
  tokenizer_config.json and special_tokens_map.json, as the `add_tokens` call it makes.

  added: the contents of tokenizer.json's added tokens (a named token among them is not added again).
  Returns (tokens, source, split): the tokenizers.AddedTokens in transformers' order; {content: the file
  that names it}; tokenizer_config.json's split_special_tokens (special tokens encoded as plain text).
  Added are: the config's added_tokens_decoder, the named special tokens (bos_token ... mask_token, then
  other `*_token` keys, e.g. image_token), then extra_special_tokens (= additional_special_tokens);
  special_tokens_map.json counts only where the config has no added_tokens_decoder, and overrides it.
  """
  from tokenizers import AddedToken
  config_path = os.path.join(folder, "tokenizer_config.json")
  map_path = os.path.join(folder, "special_tokens_map.json")
  kwargs = _read_json_object(config_path) or {}
  source = {}

  def note(values, path):
    for value in values:
      if isinstance(value, (list, dict)) and not _is_token_dict(value, False):  # a token list, added_tokens_decoder
        note(value.values() if isinstance(value, dict) else value, path)
      else:
        text = value.get("content") if isinstance(value, dict) else value
        if isinstance(text, str):
          source.setdefault(text, path)

  note(kwargs.values(), config_path)
  split = bool(kwargs.get("split_special_tokens"))
  if "additional_special_tokens" in kwargs and not kwargs.get("extra_special_tokens"):
    kwargs["extra_special_tokens"] = kwargs.pop("additional_special_tokens")
  explicit = {k: kwargs.pop(k) for k in list(kwargs)
              if k not in HF_SPECIAL_TOKEN_KEYS and k.endswith("_token") and isinstance(kwargs[k], str)}
  if isinstance(kwargs.get("extra_special_tokens"), dict):
    explicit.update(kwargs.pop("extra_special_tokens"))
  decoder = {}
  if "added_tokens_decoder" in kwargs:
    entries = kwargs["added_tokens_decoder"]
    if not isinstance(entries, dict):
      raise UserError(f"{config_path}: added_tokens_decoder is not an object {{id: token dict}}")
    for index, value in entries.items():
      if not _is_token_dict(value, False) or not str(index).isdigit():
        raise UserError(f"{config_path}: added_tokens_decoder[{index!r}] is not a token dict with a content string")
      decoder[int(index)] = _added_token(value)
  else:  # the legacy file, read only then
    smap = _read_json_object(map_path) or {}
    note(smap.values(), map_path)
    for key, value in smap.items():
      if _is_token_dict(value, False) and key != "extra_special_tokens":
        value = _added_token(value, special=True)
      elif key == "extra_special_tokens" and isinstance(value, list):
        existing = list(kwargs.get("extra_special_tokens") or [])
        value = existing + [t for t in (_added_token(t, special=True) if _is_token_dict(t, False) else t
                                        for t in value) if t not in existing]
      kwargs[key] = value
    if isinstance(kwargs.get("extra_special_tokens"), dict):
      explicit.update(kwargs.pop("extra_special_tokens"))
  saved = lambda v: _added_token(v) if _is_token_dict(v, True) else v  # transformers' convert_added_tokens
  kwargs = {k: [saved(t) for t in v] if isinstance(v, list) else saved(v) for k, v in kwargs.items()}
  if "additional_special_tokens" in kwargs and "extra_special_tokens" not in kwargs:
    kwargs["extra_special_tokens"] = kwargs.pop("additional_special_tokens")
  named = {}
  for key in HF_SPECIAL_TOKEN_KEYS:
    value = _loose_token(kwargs.get(key))
    if value is not None and not isinstance(value, (str, AddedToken)):
      raise UserError(f"{config_path}: {key} is {value!r}, not a token string or dict")
    if value is not None:
      named[key] = value
  auto = {k: v for k, v in kwargs.items()
          if k not in HF_SPECIAL_TOKEN_KEYS and k.endswith("_token") and isinstance(v, AddedToken)}
  named.update({**auto, **{k: v for k, v in explicit.items() if isinstance(v, (str, AddedToken))}})
  extra = kwargs.get("extra_special_tokens")
  extra = [t for t in map(_loose_token, extra) if isinstance(t, (str, AddedToken))] if isinstance(extra, list) else []
  # transformers re-adds every added_tokens_decoder entry (its "already there" check compares their reprs
  # with the backend's ids: never equal), then each named / extra token whose string is not added yet.
  to_add = [t for _, t in sorted(decoder.items())]
  have = set(added) | {str(t) for t in to_add}
  for value in list(named.values()) + extra:
    if str(value) not in have and value not in to_add:  # `in`: equal strings, the same AddedToken
      to_add.append(value)
  named_text = {str(t) for t in named.values()}
  tokens = []
  for token in to_add:
    if isinstance(token, str):
      token = AddedToken(token, special=True)
    elif not token.special and token.content in named_text:
      token.special = True
    tokens.append(token)
  return tokens, source, split


class HFTokenizer(Tokenizer):
  """A Hugging Face `tokenizer.json` (e.g. GPT-2's and Llama 3's byte-level BPE), run by `tokenizers`.

  encode = `encode(text, add_special_tokens=False).ids`, decode = `decode(ids)`, as
  transformers' fast tokenizers do. The file names no special ids: `use_model_ids` sets them.
  Special tokens that only a tokenizer_config.json / special_tokens_map.json beside the file names
  (bos_token, eos_token, ..., additional_special_tokens, added_tokens_decoder) are added as
  transformers adds them (`hf_config_special_tokens`): matched in text before pre-tokenization, with
  the vocabulary's id, or, for a string the vocabulary lacks, a new id after the last
  (`new_tokens`: {content: the file naming it}).
  """

  pad_id = bos_id = eos_id = None

  def __init__(self, path):
    from tokenizers import Tokenizer as _Tokenizer  # Lazy: only imported models need it.
    self.path = os.fspath(path)
    try:
      self.tok = _Tokenizer.from_file(self.path)
    except Exception as e:  # the Rust side raises a plain Exception on a bad file
      raise UserError(f"{self.path} is not a Hugging Face tokenizer.json: {str(e).splitlines()[0]}") from e
    folder = os.path.dirname(os.path.abspath(self.path))
    added = [t.content for t in self.tok.get_added_tokens_decoder().values()]
    tokens, source, split = hf_config_special_tokens(folder, added)
    self.new_tokens = {t.content: source.get(t.content, os.path.join(folder, "tokenizer_config.json"))
                       for t in tokens if self.tok.token_to_id(t.content) is None}
    before = {i: repr(t) for i, t in self.tok.get_added_tokens_decoder().items()}
    if tokens:
      self.tok.add_tokens(tokens)
    # {id: AddedToken} the file alone lacks or flags otherwise: `convert --to-hf` writes them into tokenizer.json.
    self.config_tokens = {i: t for i, t in self.tok.get_added_tokens_decoder().items() if repr(t) != before.get(i)}
    self.tok.encode_special_tokens = split
    self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

  def encode(self, text):
    return self.tok.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts, num_threads=-1):
    del num_threads  # tokenizers uses its own Rust thread pool
    return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

  def _decode_clean(self, ids):
    return self.tok.decode(ids, skip_special_tokens=False)


class MarianTokenizer(Tokenizer):
  """OPUS-MT's tokenizer: sentencepiece pieces looked up in a vocabulary (transformers' MarianTokenizer).

  Sources are split by source.spm, targets (`encode_target`) by target.spm; unknown pieces
  get <unk>'s id. A leading language code such as `>>de<<` is one token. Decoding maps ids
  to pieces, drops the special ones (<unk> too, as `decode(ids, skip_special_tokens=True)`)
  and joins them with target.spm. pad = decoder start; eos ends every source.
  Stored as one JSON file {"type": "marian", "vocab", "source_spm", "target_spm"} (the
  models base64-encoded), so a workdir's tokenizer is one file like every other kind.
  """

  def __init__(self, vocab, source_spm, target_spm, path=None):
    import sentencepiece as spm
    self.path = path
    self.vocab = dict(vocab)
    self.pieces = {i: p for p, i in self.vocab.items()}
    self.source_spm_bytes, self.target_spm_bytes = source_spm, target_spm
    self.source = spm.SentencePieceProcessor(model_proto=source_spm)
    self.target = spm.SentencePieceProcessor(model_proto=target_spm)
    for token in ("<pad>", "</s>", "<unk>"):
      if token not in self.vocab:
        raise UserError(f"the Marian vocabulary {path or ''} has no {token} entry")
    self.pad_id, self.eos_id, self.unk_id = self.vocab["<pad>"], self.vocab["</s>"], self.vocab["<unk>"]
    self.bos_id = self.pad_id  # Marian has no BOS: the decoder starts with the pad token
    self.specials = {"<pad>", "</s>", "<unk>"}
    self.vocab_size = len(self.vocab)

  @classmethod
  def from_hf_dir(cls, directory):
    """Reads a Hugging Face Marian folder: source.spm, target.spm, vocab.json."""
    files = [os.path.join(directory, f) for f in ("source.spm", "target.spm", "vocab.json")]
    missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
    if missing:
      raise UserError(f"{directory} lacks the Marian tokenizer file(s) {', '.join(missing)}")
    if os.path.isfile(os.path.join(directory, "target_vocab.json")):
      raise UserError(f"{directory} has separate source and target vocabularies (target_vocab.json): "
                      "not supported")
    with open(files[0], "rb") as f:
      source = f.read()
    with open(files[1], "rb") as f:
      target = f.read()
    with open(files[2], encoding="utf-8") as f:
      vocab = json.load(f)
    return cls(vocab, source, target)

  @classmethod
  def load(cls, path, spec=None):
    """Loads a file written by `save`."""
    if spec is None:
      with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    return cls(spec["vocab"], base64.b64decode(spec["source_spm"]), base64.b64decode(spec["target_spm"]), path)

  def save(self, path):
    """Writes the packed JSON file."""
    spec = {"type": "marian", "vocab": self.vocab,
            "source_spm": base64.b64encode(self.source_spm_bytes).decode(),
            "target_spm": base64.b64encode(self.target_spm_bytes).decode()}
    _atomic_write(path, json.dumps(spec, ensure_ascii=False).encode())

  def save_hf(self, directory):
    """Writes source.spm, target.spm and vocab.json (the Hugging Face layout)."""
    _atomic_write(os.path.join(directory, "source.spm"), self.source_spm_bytes)
    _atomic_write(os.path.join(directory, "target.spm"), self.target_spm_bytes)
    _atomic_write(os.path.join(directory, "vocab.json"), json.dumps(self.vocab, ensure_ascii=False, indent=2).encode())

  def _encode(self, text, sp):
    code = []
    if text.startswith(">>") and (end := text.find("<<")) != -1:  # a target-language token, e.g. >>de<<
      code, text = [text[:end + 2]], text[end + 2:]
    return [self.vocab.get(p, self.unk_id) for p in code + sp.encode(text, out_type=str)]

  def encode(self, text):
    return self._encode(text, self.source)

  def encode_target(self, text):
    return self._encode(text, self.target)

  def _decode_clean(self, ids):
    # As transformers' decode(ids, skip_special_tokens=True): specials (<unk> too) are dropped,
    # the pieces joined by sentencepiece, then "\u2581" -> " " and stripped.
    pieces = [self.pieces.get(i, "<unk>") for i in ids]
    text = self.target.decode_pieces([p for p in pieces if p not in self.specials])
    return text.replace("\u2581", " ").strip()


def special_text(tokenizer, token_id):
  """The text a special id is written as (`<|endoftext|>`, `<s>`): a tokenizer.json's or a sentencepiece
  model's piece; None for None or a tokenizer without one (char, byte)."""
  if token_id is None:
    return None
  if isinstance(tokenizer, HFTokenizer):
    return tokenizer.tok.id_to_token(token_id)
  sp = getattr(tokenizer, "sp", None)
  return sp.id_to_piece(token_id) if sp is not None else None


def load_tokenizer(path):
  """Loads a tokenizer from `path`: `*.model` (spm), `*.json` (ours: char, marian; else a HF tokenizer.json), "byte"."""
  path = os.fspath(path)
  if path == "byte":
    return ByteTokenizer()
  if not os.path.isfile(path):
    raise UserError(f"tokenizer file {path} not found")
  if path.endswith(".json"):
    with open(path, encoding="utf-8") as f:
      try:
        spec = json.load(f)
      except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from e
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "char":
      return CharTokenizer.load(path)
    if kind == "marian":
      return MarianTokenizer.load(path, spec)
    if isinstance(spec, dict) and "model" in spec:
      return HFTokenizer(path)
    raise UserError(f"{path} is neither a jaxformer tokenizer (char, marian) nor a Hugging Face tokenizer.json")
  return SentencePieceTokenizer(path)


def _is_file_list(texts):
  return (isinstance(texts, (list, tuple)) and texts and
          all(isinstance(t, os.PathLike) or
              (isinstance(t, str) and "\n" not in t and os.path.isfile(t))
              for t in texts))


def _iter_chunks(texts):
  """Yields whole strings: file contents for paths, else the items."""
  if _is_file_list(texts):
    for p in texts:
      with open(p, encoding="utf-8") as f:
        yield f.read()
  else:
    yield from texts


def _atomic_write(path, data):
  # Write-then-rename so an interrupted run never leaves a truncated file
  # that a later run would happily "reuse".
  d = os.path.dirname(os.path.abspath(path))
  os.makedirs(d, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-")
  with os.fdopen(fd, "wb") as f:
    f.write(data)
  os.replace(tmp, path)


# sentencepiece's trainer skips lines longer than max_sentence_length bytes (default 4,192, its log
# switched off here): a corpus of long paragraphs lost most of its text from tokenizer training
# without a word. Raised to 1 MiB; lines longer still are counted and reported.
MAX_SENTENCE_BYTES = 1 << 20


def _utf8_len(line):
  return len(line) if 4 * len(line) <= MAX_SENTENCE_BYTES else len(line.encode("utf-8"))


def _count_long_lines(paths):
  """Lines of the files at `paths` longer than MAX_SENTENCE_BYTES (what sentencepiece would skip)."""
  long = 0
  for path in paths:
    with open(path, "rb") as f:
      long += sum(len(line.rstrip(b"\r\n")) > MAX_SENTENCE_BYTES for line in f)
  return long


def train_sentencepiece(text_iter_or_files, vocab_size, model_path,
                        model_type="bpe", input_sentence_size=2_000_000,
                        character_coverage=1.0, num_threads=None, log=print):
  """Trains a joint sentencepiece model and writes it to `model_path`.

  Args:
    text_iter_or_files: a list of text file paths (one sentence per line;
      pass both languages for a joint model) or an iterable of strings
      (strings containing newlines are split into lines).
    vocab_size: the requested vocabulary size, ids 0..3 = PAD/BOS/EOS/UNK.
      Small corpora may yield fewer pieces (`hard_vocab_limit=False`).
    model_path: where the `.model` goes (a `.vocab` is written beside it).
    model_type: "bpe" or "unigram" (also "char", "word").
    input_sentence_size: at most this many shuffled sentences are used, which
      keeps training to minutes on WMT-sized corpora.
    character_coverage: 1.0 keeps every character (fine for en/de).
    num_threads: trainer threads (default: all CPUs).
    log: gets one warning if lines longer than MAX_SENTENCE_BYTES were left out.
  Returns:
    The trained `SentencePieceTokenizer`.
  """
  import sentencepiece as spm
  model_path = os.fspath(model_path)
  if not model_path.endswith(".model"):
    raise UserError(f"sentencepiece model path {model_path} must end in .model")
  kwargs = {}
  too_long = [0]
  if _is_file_list(text_iter_or_files):
    kwargs["input"] = [os.fspath(p) for p in text_iter_or_files]
    too_long[0] = _count_long_lines(kwargs["input"])
  else:
    def lines():
      for chunk in text_iter_or_files:
        for line in chunk.split("\n"):
          if line.strip():
            if _utf8_len(line) > MAX_SENTENCE_BYTES:
              too_long[0] += 1  # counted here, skipped by the trainer
            yield line
    kwargs["sentence_iterator"] = lines()
  os.makedirs(os.path.dirname(os.path.abspath(model_path)), exist_ok=True)
  prefix = os.path.join(os.path.dirname(os.path.abspath(model_path)),
                        f".tmp-spm-{os.getpid()}")
  try:
    spm.SentencePieceTrainer.train(
        model_prefix=prefix, vocab_size=vocab_size, model_type=model_type,
        pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
        input_sentence_size=input_sentence_size, shuffle_input_sentence=True,
        character_coverage=character_coverage, hard_vocab_limit=False,
        num_threads=num_threads or os.cpu_count() or 1, minloglevel=2,
        max_sentence_length=MAX_SENTENCE_BYTES, **kwargs)
  except RuntimeError as e:
    raise UserError(f"sentencepiece training failed: {e}") from e
  with open(prefix + ".model", "rb") as f:
    model = f.read()
  try:  # Record the *requested* size so a reload can check it (see below).
    from sentencepiece import sentencepiece_model_pb2
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model)
    proto.trainer_spec.vocab_size = vocab_size
    model = proto.SerializeToString()
  except ImportError:
    pass
  if too_long[0]:
    log(f"warning: {too_long[0]:,} lines longer than {MAX_SENTENCE_BYTES:,} bytes were left out of sentencepiece "
        "training (its max_sentence_length); split them (e.g. data.doc_per=line) to use them")
  os.replace(prefix + ".vocab", model_path[:-len(".model")] + ".vocab")
  os.remove(prefix + ".model")
  _atomic_write(model_path, model)
  return SentencePieceTokenizer(model_path)


def load_or_train_tokenizer(kind, path, texts, vocab_size=None):
  """Loads the tokenizer at `path`, training it on `texts` on first use.

  Args:
    kind: "sentencepiece" (= "bpe"), "unigram", "char", "byte", or "hf" / "marian"
      (load only: a converted model's tokenizer.json).
    path: the `.model` (spm) or `.json` (char) file; ignored for "byte".
    texts: file paths or strings to train on (only read when training).
    vocab_size: requested size; required for spm, whose cached model must
      have been trained with exactly this size. Char/byte sizes follow from
      the data, so for them it is the model's capacity: only a tokenizer with
      more ids is an error. None skips the check.
  Returns:
    A `Tokenizer`.
  """
  path = None if path is None else os.fspath(path)
  if kind == "byte":
    tok = ByteTokenizer()
  elif kind == "char":
    if os.path.isfile(path):
      tok = CharTokenizer.load(path)
    else:
      tok = CharTokenizer.train(_iter_chunks(texts))
      tok.save(path)
  elif kind in ("hf", "marian"):  # imported with a model (jaxformer.convert): never trained here
    if not os.path.isfile(path):
      raise UserError(f"{kind} tokenizer {path} not found: it comes with a converted model "
                      "(python -m jaxformer.convert; train.init_from=WORKDIR copies it)")
    tok = load_tokenizer(path)
  elif kind in ("sentencepiece", "bpe", "unigram"):
    if not vocab_size:
      raise UserError("a sentencepiece tokenizer needs vocab_size")
    if not os.path.isfile(path):
      return train_sentencepiece(
          texts, vocab_size, path,
          model_type="unigram" if kind == "unigram" else "bpe")
    tok = SentencePieceTokenizer(path)
    if tok.requested_vocab_size() != vocab_size:
      raise UserError(
          f"tokenizer {path} has vocab size {tok.requested_vocab_size()} but "
          f"{vocab_size} was requested; delete it to retrain or fix vocab_size")
    return tok
  else:
    kinds = ("sentencepiece", "unigram", "char", "byte", "hf", "marian")
    raise UserError(f"unknown tokenizer kind '{kind}'{closest(kind, kinds)}; "
                    f"use one of {', '.join(kinds)}")
  if vocab_size is not None and tok.vocab_size > vocab_size:
    raise UserError(
        f"the {kind} tokenizer has {tok.vocab_size} ids but vocab_size is "
        f"{vocab_size}; set vocab_size >= {tok.vocab_size}")
  return tok
