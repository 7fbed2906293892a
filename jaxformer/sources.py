"""Where documents come from: local text and Hugging Face datasets, as streams of records.

Local text: a document per file or per line (`data.doc_per`), globs and comma-separated
lists, gzip, `.jsonl` lines with a `data.text_field`; parallel files line by line.
Hugging Face: `datasets` with `streaming=True` (rows as they are consumed, no full download),
which reads local files too through its "text" and "json" builders (`data.hub_data_files`).
A `Source` routes each record to its split (`train`/`val`, or `train`/`dev`/`test`) by a rule
that depends only on the record's index, so preparing can stop and resume anywhere.
"""

import glob
import gzip
import itertools
import json
import os

import numpy as np

from jaxformer import data as data_lib
from jaxformer import hub
from jaxformer import synthetic
from jaxformer.errors import UserError

SEED = 0  # the document split and the tokenizer sample; not train.seed: prepared data outlives runs
PIECE_BYTES = 1 << 20  # a one-file document is read, tokenized and written a piece of about this size at a time


def local_file(key, path):
  """`path` (the value of config field `key`) if it is a file, else a one-line error saying how to set it."""
  if not os.path.isfile(path):
    raise UserError(f"{key}={path}: file not found; set {key}=FILE (recipes that read the small corpora "
                    "beside a checkout, ../shared/data, find them elsewhere through JAXFORMER_DATA=DIR)")
  return path


def local_files(key, patterns):
  """The files that `patterns` (comma-separated paths or globs, config field `key`) name, in order."""
  files = []
  for pattern in filter(None, (p.strip() for p in patterns.split(","))):
    matches = sorted(glob.glob(os.path.expanduser(pattern)))
    if not matches:
      local_file(key, pattern)  # the one-line error for a missing file
    files += [m for m in matches if os.path.isfile(m)]
  if not files:
    raise UserError(f"{key} names no files; set {key}=FILE (or a glob, or several, comma-separated)")
  return files


def load_translation_splits(cfg, need_train=True, names=None):
  """{"train": (src, tgt), "dev": ..., "test": ...} as lists of str (only `names`), held in memory.

  For the dev/test text that BLEU needs; training reads the prepared shards instead.
  need_train=False (evaluation, e.g. of a converted model): train is neither read nor required,
  so a local source may give only dev/test files. `names` overrides which splits are read
  (train is required when it is among them).
  """
  if names is None:
    names = ("train", "dev", "test") if need_train else ("dev", "test")
  d = cfg.data
  if d.source == "synthetic":
    en, de = synthetic.numbers_corpus(d.synthetic_size, seed=0)
    (train_en, train_de), (test_en, test_de) = synthetic.split_train_test(en, de, 0.1, seed=0)
    half = len(test_en) // 2
    splits = {"train": (train_en, train_de), "dev": (test_en[:half], test_de[:half]),
              "test": (test_en[half:], test_de[half:])}
    return {n: splits[n] for n in names}
  if d.source == "hub":
    name = f"hf:{d.hub_name}"
    hub_split = {"train": "train", "dev": "validation", "test": "test"}
    return {n: data_lib.load_translation(name, hub_split[n], d.src_lang, d.tgt_lang, d.hub_config) for n in names}
  if d.source == "local":
    splits = {}
    for split in names:
      src, tgt = getattr(d, f"{split}_src"), getattr(d, f"{split}_tgt")
      if src or tgt:
        splits[split] = data_lib.read_parallel(local_file(f"data.{split}_src", src),
                                               local_file(f"data.{split}_tgt", tgt))
    if "train" in names and "train" not in splits:
      raise UserError("data.source=local needs data.train_src and data.train_tgt")
    return splits
  raise UserError(f"data.source={d.source!r}: choose local, hub or synthetic")


def _open_binary(path):
  return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _decode(raw, path, first_line):
  """`raw` as UTF-8, or a one-line error naming the line (`first_line` is raw's first line's number)."""
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    line = first_line + raw.count(b"\n", 0, e.start)
    raise UserError(f"{path}:{line}: not valid UTF-8 (byte {e.start}); convert the file to UTF-8") from None


def line_blocks(path, block_size=1 << 20, strip_bom=True):
  """Yields (text, number of its first line) of a text file, decoded a block of whole lines at a time
  (each block but the last ends in "\n"; the BOM dropped). Linear in the file whatever its line
  lengths: a line longer than a block is gathered in a list and joined once."""
  with _open_binary(path) as f:
    number, pending, first = 1, [], strip_bom
    while True:
      block = f.read(block_size)
      if block:
        cut = block.rfind(b"\n") + 1  # only the new block is searched
        if not cut:
          pending.append(block)
          continue
        data = b"".join([*pending, block[:cut]])
        pending = [block[cut:]] if cut < len(block) else []
      else:
        data = b"".join(pending)
        if not data:
          return
      text = _decode(data, path, number)
      if first:
        text, first = text.removeprefix("\ufeff"), False
      yield text, number
      if not block:
        return
      number += text.count("\n")


def lines(path, block_size=1 << 20):
  """Yields the lines of a text file as `data.read_lines` splits them (on "\n" only, a final
  "\r" dropped, no BOM), reading and decoding a block of lines at a time."""
  for text, _ in line_blocks(path, block_size):
    parts = text.split("\n")
    if parts[-1] == "":
      parts.pop()
    yield from (p.removesuffix("\r") for p in parts) if "\r" in text else parts


def _normalize_lines(text):
  """Whole lines as `normalize_document` writes them: each ends in "\n", CRLF as LF (no BOM step)."""
  parts = text.split("\n")
  if parts[-1] == "":
    parts.pop()
  return "".join(p.removesuffix("\r") + "\n" for p in parts) if "\r" in text else "\n".join(parts) + "\n"


def document_blocks(path, block_size=1 << 20):
  """Yields a whole file as `normalize_document` gives it, a block of whole lines at a time: the
  concatenation is the normalized document, and memory stays one block whatever the file's size."""
  for text, _ in line_blocks(path, block_size):
    if text:
      yield _normalize_lines(text)


def check_not_empty(path):
  """A one-line error for a file of whitespace only (reads up to its first non-blank block)."""
  with _open_binary(path) as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      if block.strip():
        return path
  raise UserError(f"{path}: file is empty")


def normalize_document(text):
  """A whole file as one document, as LM training has always read it: lines joined by newlines,
  a final newline, no BOM, CRLF as LF (`"\\n".join(data.read_lines(path)) + "\\n"`)."""
  lines = text.removeprefix("\ufeff").split("\n")
  if lines[-1] == "":
    lines.pop()
  return "".join(line.removesuffix("\r") + "\n" for line in lines)


def _is_jsonl(path):
  return path.removesuffix(".gz").endswith((".jsonl", ".json"))


def file_documents(path, doc_per, text_field):
  """Yields the documents of one local file."""
  if _is_jsonl(path):
    for n, line in enumerate(lines(path), 1):
      if line.strip():
        yield _field(json.loads(line), text_field, f"{path}:{n}")
  elif doc_per == "line":
    yield from lines(path)
  else:  # joined once from blocks: no copy of the raw bytes, the decoded text and its lines at once
    yield "".join(document_blocks(path))


def _field(row, name, where):
  try:
    value = row[name]
  except (KeyError, TypeError):
    have = ", ".join(row) if isinstance(row, dict) else type(row).__name__
    raise UserError(f"{where} has no field {name!r} (it has {have}); set data.text_field") from None
  if not isinstance(value, str):
    raise UserError(f"{where}: field {name!r} is {type(value).__name__}, not text; set data.text_field")
  return value


def _stat(paths):
  """A cheap fingerprint of files: absolute path, size and mtime (not the contents: O(1) for TBs)."""
  out = []
  for p in paths:
    st = os.stat(p)
    out.append([os.path.abspath(p), st.st_size, st.st_mtime_ns])
  return out


class Source:
  """A corpus as named input streams of records (tuples of str, one per field), routed to splits.

  Attributes: fields (("text",) or ("src", "tgt")); eos (LM documents end in EOS);
  fingerprint (JSON-able, no I/O beyond stat); description (for messages).
  `open()` returns [(stream name, records(start) -> iterator)], the only network access.
  `route(stream, index, record)` returns [(split, record)].
  """

  def __init__(self, fields, fingerprint, description, open_fn, route, eos, feeds):
    self.fields, self.fingerprint, self.description = fields, fingerprint, description
    self.open, self.route, self.eos, self.feeds = open_fn, route, eos, feeds
    self.one_document = False  # True: each split's records are consecutive pieces of one document


def val_draws(train_fraction):
  """route helper: a document goes to val with probability 1 - train_fraction, seeded by its index."""
  block = {"index": -1, "u": None}

  def is_val(i):
    b = i >> 16
    if block["index"] != b:  # one draw per document, 65,536 at a time
      block["index"], block["u"] = b, np.random.default_rng([SEED, b]).random(1 << 16)
    return block["u"][i & 0xFFFF] >= train_fraction
  return is_val


def make_source(cfg):
  """The `Source` that the config's data section describes."""
  d = cfg.data
  if d.task == "translation":
    return _translation_source(cfg)
  if d.source == "local":
    if not d.text_path:
      raise UserError("data.source=local needs data.text_path for a language model")
    files = local_files("data.text_path", d.text_path)
    single = d.doc_per == "file" and len(files) == 1 and not _is_jsonl(files[0])
    state = {"has_val": False}

    def open_fn():
      for path in files:
        check_not_empty(path)

      def records(start):
        if single:  # one document, streamed as pieces (see `single_document_pieces`)
          pieces = single_document_pieces(files[0], d.train_fraction, state, PIECE_BYTES)
          return itertools.islice(pieces, start, None)
        docs = (doc for f in files for doc in file_documents(f, d.doc_per, d.text_field))
        return itertools.islice(((doc,) for doc in docs), start, None)
      return [("train", records)]
    what = files[0] if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"
    return _lm_source(cfg, {"local": _stat(files)}, what, open_fn, single, state, pieces=single)
  if d.source == "hub":
    data_files = local_files("data.hub_data_files", d.hub_data_files) if d.hub_data_files else None
    single = d.hub_name == "text" and d.doc_per == "file" and data_files is not None and len(data_files) == 1
    kwargs = {"sample_by": "document"} if d.hub_name == "text" and d.doc_per == "file" else {}
    hint = "to use local text files set data.source=local data.text_path=FILE"
    fingerprint = {"hub": [d.hub_name, d.hub_config], "data_files": _stat(data_files or [])}
    state = {"has_val": False}  # known once open() has seen the splits

    def open_fn():
      dd = hub.load_streaming(d.hub_name, d.hub_config or None, data_files=data_files, streaming=d.streaming,
                              local_hint=hint, **kwargs)
      if "train" not in dd:
        raise UserError(f"{d.hub_name}/{d.hub_config} has no train split (it has {', '.join(dd)})")
      names = ["train"] + (["validation"] if "validation" in dd else [])
      state["has_val"] = len(names) > 1

      def reader(name):
        def records(start):
          rows = itertools.islice(iter(dd[name]), start, None)
          for i, row in enumerate(rows, start):
            text = _field(row, d.text_field, f"{d.hub_name} {name} row {i}")
            yield (normalize_document(text) if kwargs else text,)
        return records
      return [(n, reader(n)) for n in names]
    return _lm_source(cfg, fingerprint, f"{d.hub_name}/{d.hub_config}", open_fn, single, state)
  raise UserError(f"data.source={d.source!r}: a language model reads local or hub text")


def single_document_pieces(path, train_fraction, state, block_size=1 << 20):
  """Yields a one-file document (`normalize_document` of the file) as records of whole-line pieces of
  about `block_size` bytes, cut also at the train/validation split point: character
  int(total * train_fraction), as when the document was read whole. A first pass counts the
  characters; memory stays one block whatever the file's size. Sets state["train_pieces"], the
  number of pieces before the split point, which the source's route reads."""
  total = sum(len(block) for block in document_blocks(path, block_size))
  split, pos, count = int(total * train_fraction), 0, 0
  state["train_pieces"] = None  # unknown until the split point: every piece before it trains
  for block in document_blocks(path, block_size):
    end = pos + len(block)
    for part in [block[:split - pos], block[split - pos:]] if pos < split < end else [block]:
      if state["train_pieces"] is None and pos >= split:
        state["train_pieces"] = count
      count, pos = count + 1, pos + len(part)
      yield (part,)


def _lm_source(cfg, fingerprint, description, open_fn, single, state, pieces=False):
  """A language-model Source: one document is split by characters (nanoGPT's Tiny Shakespeare:
  the first train_fraction of its characters train, the rest validate, no EOS); many documents
  each end in EOS and go to val with probability 1 - train_fraction, unless the source has a
  validation split of its own. `pieces`: the one document comes as consecutive pieces, split
  already (`single_document_pieces`), which the shards join into one document per split."""
  fraction = cfg.data.train_fraction
  is_val = val_draws(fraction)

  def route(stream, i, record):
    if stream == "validation":
      return [("val", record)]
    if pieces:
      known = state["train_pieces"]
      return [("train" if known is None or i < known else "val", record)]
    if single:
      n = int(len(record[0]) * fraction)
      return [("train", (record[0][:n],)), ("val", (record[0][n:],))]
    return [("val" if not state["has_val"] and is_val(i) else "train", record)]
  feeds = {"train": ("train", "val"), "validation": ("val",)}
  source = Source(("text",), fingerprint, description, open_fn, route, eos=not single, feeds=feeds)
  source.one_document = pieces
  return source


def _translation_source(cfg):
  d = cfg.data
  names = {"train": "train", "validation": "dev", "dev": "dev", "test": "test"}
  route = lambda stream, i, record: [(names[stream], record)]
  feeds = {"train": ("train",), "validation": ("dev",), "dev": ("dev",), "test": ("test",)}
  if d.source == "local":
    pairs = {}
    for split in ("train", "dev", "test"):
      src, tgt = getattr(d, f"{split}_src"), getattr(d, f"{split}_tgt")
      if src or tgt:
        pairs[split] = (local_file(f"data.{split}_src", src), local_file(f"data.{split}_tgt", tgt))
    if "train" not in pairs:
      raise UserError("data.source=local needs data.train_src and data.train_tgt")

    def open_fn():
      for path in (p for paths in pairs.values() for p in paths):
        check_not_empty(path)
      return [(split, _parallel_reader(*paths)) for split, paths in pairs.items()]
    fingerprint = {"local": {s: _stat(p) for s, p in pairs.items()}}
    return Source(("src", "tgt"), fingerprint, f"{pairs['train'][0]} ...", open_fn, route, False, feeds)
  if d.source == "synthetic":
    def open_fn():
      splits = load_translation_splits(cfg)
      return [(n, lambda start, n=n: itertools.islice(zip(*splits[n]), start, None)) for n in splits]
    return Source(("src", "tgt"), {"synthetic": d.synthetic_size}, f"synthetic ({d.synthetic_size} pairs)",
                  open_fn, route, False, feeds)
  if d.source == "hub":
    hint = (f"to use local text files set data.source=local data.train_src=FILE.{d.src_lang} "
            f"data.train_tgt=FILE.{d.tgt_lang} (and data.dev_src/dev_tgt, data.test_src/test_tgt)")

    def open_fn():
      dd = hub.load_streaming(d.hub_name, d.hub_config, streaming=d.streaming, local_hint=hint)

      def reader(name):
        def records(start):
          for i, row in enumerate(itertools.islice(iter(dd[name]), start, None), start):
            pair = row.get("translation")
            if not isinstance(pair, dict) or d.src_lang not in pair or d.tgt_lang not in pair:
              raise UserError(f"{d.hub_name}/{d.hub_config} {name} row {i} has no translation "
                              f"{d.src_lang}-{d.tgt_lang} pair")
            yield pair[d.src_lang], pair[d.tgt_lang]
        return records
      return [(n, reader(n)) for n in ("train", "validation", "test") if n in dd]
    return Source(("src", "tgt"), {"hub": [d.hub_name, d.hub_config]}, f"{d.hub_name}/{d.hub_config}", open_fn,
                  route, False, feeds)
  raise UserError(f"data.source={d.source!r}: choose local, hub or synthetic")


def _parallel_reader(src_path, tgt_path):
  """records(start): aligned lines of two files, streamed; a length mismatch is an error at the end."""
  def records(start):
    src, tgt = lines(src_path), lines(tgt_path)
    for n, pair in enumerate(itertools.zip_longest(src, tgt), 1):
      if pair[0] is None or pair[1] is None:
        ns = n - 1 + (pair[0] is not None) + sum(1 for _ in src)
        nt = n - 1 + (pair[1] is not None) + sum(1 for _ in tgt)
        raise UserError(f"parallel files differ in length: {src_path} has {ns} lines, {tgt_path} has {nt}; "
                        "they must be line-aligned")
      if n > start:
        yield pair
  return records
