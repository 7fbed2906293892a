"""Prepare once: a corpus of any size -> tokenizer -> token shards on disk, in parallel, resumable.

    python -m jaxformer.prepare --config NAME [--workdir DIR] [data.num_proc=8 ...]
    python -m jaxformer.prepare --config NAME [--workdir DIR] --verify   # sha256 of every shard file

`train.py` calls `ensure_prepared` itself when the data is missing, so this command is only
needed to prepare ahead of time (e.g. on a CPU machine before a long accelerator run).

Documents are read as a stream: local text (a document per file or per line; globs, gzip,
`.jsonl` with a `data.text_field`), or Hugging Face `datasets` with `streaming=True` (which
also reads local files through its "text"/"json" builders and `data.hub_data_files`).
The tokenizer is trained once, on a seeded random sample of `data.tokenizer_sample_docs`
training documents (reservoir sampling, so memory is bounded by the sample; a char vocabulary
takes every character of the training text), and reused; a converted model's tokenizer
(`data.tokenizer=hf|marian`, from `jaxformer.convert` or `train.init_from`) is only loaded. Ids
follow the model (`model.pad_id/bos_id/eos_id`): each LM document of a multi-document corpus ends
in its EOS (and starts with its BOS under `data.add_bos`), and a tokenizer with a target side of
its own (Marian) splits translation targets with it. `data.num_proc` worker processes
tokenize chunks of documents; the main process writes them, in input order, as the shards
`jaxformer.shards` describes. Memory is bounded by the chunks in flight (about 2 x num_proc x
1 MiB of text), the sample, and the open shard's write buffers, whatever the corpus size.

Crash safety: a shard is written under a temporary name and renamed when complete, then its
marker (counts, sha256, input position) is written; a rerun keeps the complete shards,
removes the rest and resumes after the last complete shard's input position. Shard
boundaries depend only on the token counts (a shard closes at the first document boundary
past `data.shard_tokens`), never on timing or num_proc, so an interrupted and resumed run
writes byte-identical files. The manifest records the tokenizer's sha256, a fingerprint of
the source and the settings; data prepared otherwise is refused with one line saying which.

Workers are fresh interpreters (`python -m jaxformer.prepare --worker ...` through
`subprocess`), fed pickled chunks over pipes. They are never forked from the caller, so when
train.py prepares on first use they inherit none of JAX's threads (fork after JAX has started
its thread pools can deadlock), and unlike multiprocessing's spawn they do not re-import the
caller's `__main__` (train.py's would load JAX into every worker; an unguarded script would
run again).
"""

import argparse
import collections
import contextlib
import fcntl
import hashlib
import itertools
import json
import os
import pickle
import queue
import random
import subprocess
import sys
import threading
import time

import numpy as np

from jaxformer import config as config_lib
from jaxformer import shards
from jaxformer import sources
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.errors import UserError, cli

CHUNK_CHARS = 1 << 20  # text per work unit sent to a worker
_STREAM_BITS = 40  # an input position is (stream index << 40) | record index within the stream


# ----------------------------------------------------------------------------
# Where things live.


def data_dir(cfg, workdir):
  """The prepared data of a run: `data.data_dir`, or `<workdir>/data`."""
  return cfg.data.data_dir or os.path.join(workdir, "data")


def tokenizer_path(cfg, workdir):
  """Where the run's tokenizer lives: `data.tokenizer_path`, else inside `data.data_dir` when that is
  set (data shared between runs carries its tokenizer), else inside the workdir."""
  d = cfg.data
  if d.tokenizer_path:
    return d.tokenizer_path
  if d.tokenizer == "byte":
    return "byte"
  json_kinds = ("char", "hf", "marian")  # ours (char), or a converted model's (see jaxformer.convert)
  return os.path.join(d.data_dir or workdir, "tokenizer.json" if d.tokenizer in json_kinds else "tokenizer.model")


def with_model_ids(cfg, tokenizer):
  """`tokenizer` with the model's special ids (`Tokenizer.use_model_ids`: a tokenizer.json names none,
  so it takes the config's; ids the tokenizer does define must equal the config's)."""
  m = cfg.model
  return tokenizer.use_model_ids(m.pad_id, m.bos_id, m.eos_id, "the config")


def load_run_tokenizer(cfg, path):
  """The tokenizer at `path`, with the model's special ids."""
  return with_model_ids(cfg, tokenizer_lib.load_tokenizer(path))


@contextlib.contextmanager
def locked(ddir):
  """Holds the exclusive lock on the prepared-data folder `ddir` (an flock on `ddir/.lock`, which must
  exist as a folder): pretraining (`prepare`) and fine-tuning (`chat.ensure_prepared`) take it to
  prepare, so another run preparing the same folder waits for it, then finds the data prepared."""
  with open(os.path.join(ddir, ".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
    yield


# ----------------------------------------------------------------------------
# The tokenizer: trained once on a bounded sample.


def reservoir_sample(items, k, seed=sources.SEED):
  """A uniform random sample of k items of an iterable of unknown length, in O(k) memory
  (Algorithm R); all of them, in order, when there are at most k."""
  rng, sample = random.Random(seed), []
  for i, item in enumerate(items):
    if i < k:
      sample.append(item)
    else:
      j = rng.randrange(i + 1)
      if j < k:
        sample[j] = item
  return sample


def _records(source, streams, split=None):
  """The records of one split (None: of every split, each stream read once), in input order."""
  for name, records in streams:
    if split is None or split in source.feeds.get(name, ()):
      for i, record in enumerate(records(0)):
        for s, r in source.route(name, i, record):
          if split is None or s == split:
            yield r


# Tokenizers that come with a converted model (jaxformer.convert, or data.tokenizer_path): loaded, never trained.
LOAD_ONLY = ("hf", "marian")


def existing_tokenizer(cfg, path):
  """Loads the run's tokenizer when nothing needs training (byte, a file already at `path`, or a
  converted model's hf/marian one, whose absence is a one-line error); None when it must be trained.
  Checks a cached sentencepiece model's vocabulary size and every tokenizer's size against the model."""
  d = cfg.data
  if d.tokenizer == "byte" or d.tokenizer in LOAD_ONLY or os.path.isfile(path):
    vocab = cfg.model.vocab_size if d.tokenizer not in ("char", "byte") else None
    return tokenizer_lib.load_or_train_tokenizer(d.tokenizer, path, None, vocab)
  return None


def train_tokenizer(cfg, source, streams, path, log=print):
  """Trains the configured tokenizer if `path` does not exist yet.

  sentencepiece sees a seeded random sample of `data.tokenizer_sample_docs` training documents
  (all fields of each record: source and target for translation); a char vocabulary is every
  character of every split (a sample could miss one, and so could the training split alone).
  Byte needs nothing; hf and marian tokenizers are only loaded (`existing_tokenizer`). Returns
  the tokenizer.
  """
  d = cfg.data
  vocab = cfg.model.vocab_size if d.tokenizer not in ("char", "byte") else None
  tok = existing_tokenizer(cfg, path)
  if tok is not None:
    return tok
  t = time.perf_counter()
  if d.tokenizer == "char":  # every split's characters, as nanoGPT's char vocabulary: a held-out character
    # absent from training (the file's last newline, when a one-line text is cut into train and val) is an id too
    texts = (text for record in _records(source, streams) for text in record)
    what = "every character of the text (training and held-out splits)"
  else:
    sample = reservoir_sample(_records(source, streams, "train"), d.tokenizer_sample_docs)
    texts = [record[f] for f in range(len(source.fields)) for record in sample]  # all sources, then all targets
    what = f"a sample of {len(sample):,} training documents"
  tok = tokenizer_lib.load_or_train_tokenizer(d.tokenizer, path, texts, vocab)
  log(f"trained a {d.tokenizer} tokenizer ({tok.vocab_size} ids) on {what} in {time.perf_counter() - t:.1f} s "
      f"-> {path}")
  return tok


def file_sha256(path):
  """sha256 of a file ("byte" for the byte tokenizer, which has none)."""
  if path == "byte":
    return hashlib.sha256(b"byte").hexdigest()
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()


# ----------------------------------------------------------------------------
# Tokenizing: in this process or in worker processes.


def encoding(cfg, tokenizer, tok_path, source):
  """How records become ids, as a JSON-able dict (the worker processes get it as an argument).

  tokenizer: `tok_path`, where `tokenizer` (with the model's ids) was loaded from; ids: the model's
  (pad, bos, eos), which `Tokenizer.use_model_ids` gives a tokenizer that names none (a converted
  tokenizer.json); eos / bos: the id that ends / starts each LM document, or None (one document:
  nanoGPT's stream has neither; BOS only with data.add_bos, Llama's convention); targets: the
  fields encoded with `encode_target` (a translation tokenizer with a target side of its own:
  Marian's target.spm); dtype: the shards' token dtype.
  """
  m, lm = cfg.model, cfg.data.task == "lm"
  own_target = type(tokenizer).encode_target is not tokenizer_lib.Tokenizer.encode_target
  return {"tokenizer": tok_path, "ids": [m.pad_id, m.bos_id, m.eos_id],
          "eos": tokenizer.eos_id if source.eos else None,
          "bos": tokenizer.bos_id if lm and cfg.data.add_bos else None,
          "targets": [f for f, name in enumerate(source.fields) if name == "tgt"] if own_target else [],
          "dtype": shards.token_dtype(tokenizer.vocab_size).str}


def load_encoder(spec):
  """The tokenizer an `encoding` spec names, with its model ids."""
  return tokenizer_lib.load_tokenizer(spec["tokenizer"]).use_model_ids(*spec["ids"], "the config")


def encode_texts(tokenizer, texts, dtype, eos=None, bos=None, target=False):
  """Token ids of `texts` concatenated ([total] `dtype`) and their lengths ([len(texts)] int64):
  id `bos` before and id `eos` after each text when given; `target`: `encode_target`."""
  if target:  # Marian's target side: sentencepiece pieces looked up one text at a time
    parts = [tokenizer.encode_target(t) for t in texts]
    ids = np.fromiter(itertools.chain.from_iterable(parts), np.int64, sum(map(len, parts)))
  elif hasattr(tokenizer, "encode_array"):  # char, byte: numpy per text
    parts = [tokenizer.encode_array(t) for t in texts]
    ids = np.concatenate(parts) if parts else np.zeros(0, np.int32)
  else:
    parts = tokenizer.encode_batch(texts, num_threads=1)
    ids = np.fromiter(itertools.chain.from_iterable(parts), np.int64, sum(map(len, parts)))
  lengths = np.fromiter(map(len, parts), np.int64, len(parts))
  if eos is None and bos is None:
    return ids.astype(dtype), lengths
  lengths += (eos is not None) + (bos is not None)
  flat = np.empty(int(lengths.sum()), dtype)
  text = np.ones(len(flat), bool)
  ends = np.cumsum(lengths)
  if bos is not None:  # each text's first slot holds its BOS
    flat[ends - lengths] = bos
    text[ends - lengths] = False
  if eos is not None:  # and its last slot its EOS
    flat[ends - 1] = eos
    text[ends - 1] = False
  flat[text] = ids
  return flat, lengths


def _encode_chunk(tokenizer, columns, spec):
  dtype = np.dtype(spec["dtype"])
  return [encode_texts(tokenizer, texts, dtype, spec["eos"], spec["bos"], f in spec["targets"])
          for f, texts in enumerate(columns)]


def _columns(chunk, num_fields):
  """The texts of a chunk's records, field by field."""
  return [[record[f] for _, _, record in chunk] for f in range(num_fields)]


class _Workers:
  """num_proc tokenizer processes; `map` returns encoded chunks in input order.

  Chunk k goes to worker k % n; at most 2 chunks per worker are in flight. A feeder thread
  per worker writes its requests, so the main thread only ever blocks reading the oldest
  result, which its worker produces next: no pipe can deadlock.
  """

  def __init__(self, spec, num_fields, n):
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's jaxformer, not another
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "jaxformer.prepare", "--worker", json.dumps(spec)]
    self.num_fields = num_fields
    self.procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env) for _ in range(n)]
    self.queues = [queue.SimpleQueue() for _ in range(n)]
    self.threads = [threading.Thread(target=self._feed, args=(p, q), daemon=True)
                    for p, q in zip(self.procs, self.queues)]
    for t in self.threads:
      t.start()

  @staticmethod
  def _feed(proc, q):
    while (item := q.get()) is not None:
      try:
        pickle.dump(item, proc.stdin, pickle.HIGHEST_PROTOCOL)
        proc.stdin.flush()
      except OSError:  # the worker died; the reader reports it
        return
    proc.stdin.close()

  def map(self, chunks):
    pending, n = collections.deque(), len(self.procs)
    for k, chunk in enumerate(chunks):
      while len(pending) >= 2 * n:
        yield self._receive(*pending.popleft())
      self.queues[k % n].put(_columns(chunk, self.num_fields))
      pending.append((k % n, chunk))
    while pending:
      yield self._receive(*pending.popleft())

  def _receive(self, w, chunk):
    try:
      status, value = pickle.load(self.procs[w].stdout)
    except (EOFError, pickle.UnpicklingError):
      raise RuntimeError(f"tokenizer worker {w} exited with code {self.procs[w].wait()} (its error is above)") from None
    if status == "error":
      raise UserError(value)
    return chunk, value

  def close(self, kill=False):
    for q in self.queues:
      q.put(None)
    for p in self.procs:
      if kill:
        p.kill()
      try:
        p.wait(timeout=30)
      except subprocess.TimeoutExpired:
        p.kill()
        p.wait()
      p.stdout.close()


def _worker_main(spec):
  """A worker: pickled columns of texts in on stdin, ("ok", [(ids, lengths)]) out on stdout, until EOF.

  `spec`: an `encoding` as JSON. Any tokenizer kind loads here (hf needs only the `tokenizers`
  package, marian sentencepiece), and a load error is sent back like an encoding error.
  """
  out, sys.stdout = sys.stdout.buffer, sys.stderr  # a stray print must not corrupt the pipe
  spec = json.loads(spec)
  try:
    tokenizer = load_encoder(spec)
  except UserError as e:
    tokenizer, error = None, str(e)
  while True:
    try:
      columns = pickle.load(sys.stdin.buffer)
    except EOFError:
      return
    try:
      if tokenizer is None:
        raise UserError(error)
      result = ("ok", _encode_chunk(tokenizer, columns, spec))
    except UserError as e:
      result = ("error", str(e))
    pickle.dump(result, out, pickle.HIGHEST_PROTOCOL)
    out.flush()


def _encoded(chunks, spec, num_fields, num_proc):
  """Yields (chunk, per-field (ids, lengths)) in order; workers only when there is more than one chunk."""
  chunks = iter(chunks)
  head = list(itertools.islice(chunks, 2))
  if num_proc <= 1 or len(head) < 2:
    tokenizer = load_encoder(spec)
    for chunk in itertools.chain(head, chunks):
      yield chunk, _encode_chunk(tokenizer, _columns(chunk, num_fields), spec)
    return
  workers = _Workers(spec, num_fields, num_proc)
  ok = False
  try:
    yield from workers.map(itertools.chain(head, chunks))
    ok = True
  finally:
    workers.close(kill=not ok)


def _chunks(items, chunk_chars=None):
  """Groups (split, position, record) items into lists of about CHUNK_CHARS characters."""
  chunk_chars = chunk_chars or CHUNK_CHARS
  chunk, size = [], 0
  for item in items:
    chunk.append(item)
    size += sum(map(len, item[2]))
    if size >= chunk_chars:
      yield chunk
      chunk, size = [], 0
  if chunk:
    yield chunk


# ----------------------------------------------------------------------------
# Writing shards.


def _atomic_json(path, obj):
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=1, sort_keys=True)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


class _Writer:
  """One split's shards: tokens stream into temporary files, renamed when the shard is complete.

  On creation it keeps the complete shards already on disk (those with a marker and files of
  the marked sizes), deletes everything else in the split's folder, and `skip_below` says
  from which input position the split still needs documents.
  """

  def __init__(self, data_dir, split, fields, dtype, shard_tokens, keep_text, one_document=False, bos=None):
    self.data_dir, self.split, self.fields = data_dir, split, fields
    self.dtype, self.shard_tokens, self.keep_text = np.dtype(dtype), shard_tokens, keep_text
    # one_document: the records are consecutive pieces of one document (a one-file corpus read in
    # blocks), joined into one document of one shard; `bos` (data.add_bos) then starts it.
    self.one_document, self.bos = one_document, bos
    os.makedirs(os.path.join(data_dir, split), exist_ok=True)
    self.markers = self._complete_shards()
    self.skip_below = self.markers[-1]["end"] if self.markers else 0
    self.files = None

  def _shard_files(self, stem):
    names = [p(stem, f) for f in self.fields for p in (shards.token_path, shards.offsets_path)]
    return names + ([shards.text_path(stem)] if self.keep_text else [])

  def _complete_shards(self):
    markers = []
    while True:
      stem = shards.shard_stem(self.data_dir, self.split, len(markers))
      try:
        with open(shards.marker_path(stem), encoding="utf-8") as f:
          marker = json.load(f)
        sizes = {os.path.basename(p): os.path.getsize(p) for p in self._shard_files(stem)}
      except (OSError, ValueError):
        break
      if sizes != marker["bytes"]:
        break
      markers.append(marker)
    keep = set()
    for k in range(len(markers)):
      stem = shards.shard_stem(self.data_dir, self.split, k)
      keep.update([shards.marker_path(stem), *self._shard_files(stem)])
    folder = os.path.join(self.data_dir, self.split)
    for name in os.listdir(folder):  # partial shards and temporary files of an interrupted run
      if os.path.join(folder, name) not in keep:
        os.remove(os.path.join(folder, name))
    return markers

  def _open(self):
    stem = shards.shard_stem(self.data_dir, self.split, len(self.markers))
    self.files = {}
    for path in self._shard_files(stem):
      self.files[path] = [open(path + ".tmp", "wb"), hashlib.sha256()]
    self.counts = {f: 0 for f in self.fields}
    self.docs, self.stem = 0, stem
    for f in self.fields:
      self._write(shards.offsets_path(stem, f), np.zeros(1, np.int64).tobytes())
    if self.one_document:
      self.docs = 1
      if self.bos is not None:
        for f in self.fields:
          self._write(shards.token_path(stem, f), np.array([self.bos], self.dtype).tobytes())
          self.counts[f] += 1

  def _write(self, path, data):
    f, h = self.files[path]
    f.write(data)
    h.update(data)

  def add(self, positions, columns, texts=None):
    """Appends documents: positions [n] (ascending input positions), per field (ids, lengths [n])
    as `encode_texts` returns them, and their texts when the split keeps them."""
    keep = positions >= self.skip_below
    if not keep.all():
      columns = [(ids[np.repeat(keep, lengths)], lengths[keep]) for ids, lengths in columns]
      positions = positions[keep]
      texts = [t for t, k in zip(texts, keep) if k] if texts is not None else None
    starts = [np.concatenate([[0], np.cumsum(lengths)]) for _, lengths in columns]
    sizes = sum(lengths for _, lengths in columns)
    i, n = 0, len(positions)
    if self.one_document and n:  # pieces of the one document: tokens only, its offsets at close
      if self.files is None:
        self._open()
      for f, (ids, _) in zip(self.fields, columns):
        self._write(shards.token_path(self.stem, f), ids.tobytes())
        self.counts[f] += len(ids)
      if texts is not None:
        self._write(shards.text_path(self.stem), "".join(texts).encode("utf-8"))
      self.end = int(positions[-1]) + 1
      return
    while i < n:
      if self.files is None:
        self._open()
      # The shard closes after the first document that brings it to shard_tokens.
      cum = sum(self.counts.values()) + np.cumsum(sizes[i:])
      full = int(np.searchsorted(cum, self.shard_tokens, "left"))
      j = min(n, i + full + 1)
      for f, (ids, lengths), s in zip(self.fields, columns, starts):
        self._write(shards.token_path(self.stem, f), ids[s[i]:s[j]].tobytes())
        self._write(shards.offsets_path(self.stem, f), (self.counts[f] + np.cumsum(lengths[i:j])).tobytes())
        self.counts[f] += int(s[j] - s[i])
      if texts is not None:
        sep = "\n" if self.docs else ""
        self._write(shards.text_path(self.stem), (sep + "\n".join(texts[i:j])).encode("utf-8"))
      self.docs += j - i
      self.end = int(positions[j - 1]) + 1
      if full < n - i:
        self.close()
      i = j

  def close(self):
    """Completes the open shard, if any: flush, rename, then its marker."""
    if self.files is None:
      return
    if self.one_document:
      for f in self.fields:
        self._write(shards.offsets_path(self.stem, f), np.array([self.counts[f]], np.int64).tobytes())
    sizes, hashes = {}, {}
    for path, (f, h) in self.files.items():
      f.flush()
      os.fsync(f.fileno())
      f.close()
      os.replace(path + ".tmp", path)
      sizes[os.path.basename(path)], hashes[os.path.basename(path)] = os.path.getsize(path), h.hexdigest()
    marker = {"tokens": dict(self.counts), "docs": self.docs, "end": self.end, "bytes": sizes, "sha256": hashes}
    _atomic_json(shards.marker_path(self.stem), marker)
    self.markers.append(marker)
    self.files = None

  def summary(self):
    tokens = {f: sum(m["tokens"][f] for m in self.markers) for f in self.fields}
    return {"tokens": tokens, "docs": sum(m["docs"] for m in self.markers), "shards": self.markers}


# ----------------------------------------------------------------------------
# The whole job.


def _settings(cfg):
  """The config fields the shards depend on (besides tokenizer and source), by their override names."""
  d = cfg.data
  keys = ["data.task", "data.tokenizer", "data.shard_tokens"]
  # An LM's shards hold the model's EOS after each document (BOS before, with data.add_bos).
  keys += (["data.doc_per", "data.text_field", "data.train_fraction", "data.add_bos", "model.bos_id", "model.eos_id"]
           if d.task == "lm" else ["data.src_lang", "data.tgt_lang"])
  keys += ["model.vocab_size"] if d.tokenizer not in ("char", "byte") else []
  settings = {k: getattr(getattr(cfg, k.split(".")[0]), k.split(".")[1]) for k in keys}
  return {**settings, "split_seed": sources.SEED}


def _check(manifest, cfg, source, tok_path, ddir):
  """A one-line error when `manifest` was prepared with another tokenizer, source or settings."""
  fix = f"delete {ddir} to prepare it again, or set data.data_dir to another folder"
  if "chat" in manifest:  # chat.ensure_prepared's shards (no text source): a run of other data
    chats = manifest["chat"].get("settings", {}).get("chat_path")
    chats = chats[0] if isinstance(chats, list) else chats  # (path, size, mtime)
    raise UserError(f"{ddir} holds the fine-tuning shards of data.chat_path={chats}, not {source.description}'s "
                    f"text: {fix}")
  sha = file_sha256(tok_path)
  if manifest["tokenizer"]["sha256"] != sha:
    raise UserError(f"{ddir} was prepared with another tokenizer (sha256 {manifest['tokenizer']['sha256'][:12]}, "
                    f"{tok_path} is {sha[:12]}): {fix}")
  if manifest["source"] != source.fingerprint:
    raise UserError(f"{ddir} was prepared from another source than {source.description} (files or their "
                    f"sizes/dates differ): {fix}")
  for key, value in _settings(cfg).items():
    if manifest["settings"].get(key) != value:
      raise UserError(f"{ddir} was prepared with {key}={manifest['settings'].get(key)} (now {value}): {fix}")


def ensure_prepared(cfg, workdir, log=print):
  """The manifest of the run's prepared data, preparing it first if it is missing or incomplete.

  A complete manifest is checked (tokenizer sha256, source fingerprint, settings) without
  reading the source, so a prepared run starts without touching the network.
  """
  ddir = data_dir(cfg, workdir)
  source = sources.make_source(cfg)
  manifest = shards.read_manifest(ddir)
  if manifest and manifest.get("complete"):
    tok_path = tokenizer_path(cfg, workdir)
    if tok_path != "byte" and not os.path.isfile(tok_path):
      raise UserError(f"the tokenizer {tok_path} that {ddir} was prepared with is missing: restore it, or "
                      f"delete {ddir} to prepare it again")
    _check(manifest, cfg, source, tok_path, ddir)
    return manifest
  return prepare(cfg, workdir, log, source)


def prepare(cfg, workdir, log=print, source=None):
  """Trains the tokenizer if needed and writes (or completes) the token shards. Returns the manifest."""
  d = cfg.data
  ddir, tok_path = data_dir(cfg, workdir), tokenizer_path(cfg, workdir)
  source = source or sources.make_source(cfg)
  # A tokenizer that needs no training is loaded first: a converted model's missing one is one line, at once.
  tokenizer = existing_tokenizer(cfg, tok_path)
  streams = source.open()  # before anything is written: a source that cannot be read leaves no trace
  if tokenizer is None:
    tokenizer = train_tokenizer(cfg, source, streams, tok_path, log)
  spec = encoding(cfg, with_model_ids(cfg, tokenizer), tok_path, source)
  os.makedirs(ddir, exist_ok=True)
  with locked(ddir):  # another run preparing the same folder finishes first
    header = {"format": shards.FORMAT, "tokenizer": {"kind": d.tokenizer, "path": os.path.abspath(tok_path)
                                                     if tok_path != "byte" else "byte",
                                                     "sha256": file_sha256(tok_path),
                                                     "vocab_size": tokenizer.vocab_size},
              "source": source.fingerprint, "description": source.description, "settings": _settings(cfg),
              "dtype": shards.token_dtype(tokenizer.vocab_size).name, "eos": source.eos,
              "special_ids": {"eos": spec["eos"], "bos": spec["bos"]},
              "target_side": [source.fields[f] for f in spec["targets"]], "fields": list(source.fields)}
    manifest = shards.read_manifest(ddir)
    if manifest is not None:
      _check(manifest, cfg, source, tok_path, ddir)
      if manifest.get("complete"):
        return manifest
    else:
      _atomic_json(os.path.join(ddir, shards.MANIFEST), {**header, "complete": False})
    splits = sorted({s for name, _ in streams for s in source.feeds[name]})
    one = getattr(source, "one_document", False)
    writers = {s: _Writer(ddir, s, source.fields, header["dtype"], d.shard_tokens,
                          keep_text=d.task == "lm" and s == "val", one_document=one, bos=spec["bos"] if one else None)
               for s in splits}
    if one:  # the writer starts the one document with BOS; its pieces get none
      spec = {**spec, "bos": None}
    if any(w.markers for w in writers.values()):
      log(f"prepare: resuming {ddir} after {sum(len(w.markers) for w in writers.values())} complete shards")
    t, stats = time.perf_counter(), {"chars": 0, "tokens": 0, "logged": time.perf_counter()}
    items = _items(source, streams, writers)
    for chunk, columns in _encoded(_chunks(items), spec, len(source.fields), d.num_proc):
      _dispatch(chunk, columns, writers)
      stats["chars"] += sum(len(text) for _, _, record in chunk for text in record)
      stats["tokens"] += sum(len(ids) for ids, _ in columns)
      if time.perf_counter() - stats["logged"] > 30:
        dt = time.perf_counter() - t
        log(f"prepare: {stats['chars'] / 1e6:,.0f}M characters, {stats['tokens'] / 1e6:,.0f}M tokens in "
            f"{dt:.0f} s ({stats['tokens'] / dt / 1e6:.2f}M tokens/s)")
        stats["logged"] = time.perf_counter()
    for w in writers.values():
      w.close()
    manifest = {**header, "complete": True, "splits": {s: w.summary() for s, w in writers.items()}}
    for s in (("train", "val") if d.task == "lm" else ("train",)):
      if not sum(manifest["splits"].get(s, {"tokens": {"": 0}})["tokens"].values()):
        raise UserError(f"the {s} split of {source.description} is empty"
                        + (f"; set data.train_fraction below {d.train_fraction}" if s == "val" else ""))
    _atomic_json(os.path.join(ddir, shards.MANIFEST), manifest)
    log(f"prepared {ddir} in {time.perf_counter() - t:.1f} s: {describe(manifest)}")
    return manifest


def _items(source, streams, writers):
  """(split, input position, record) of every record a split still needs, in input order."""
  for s, (name, records) in enumerate(streams):
    base = s << _STREAM_BITS
    fed = [writers[split] for split in source.feeds[name]]
    start = min(max(w.skip_below - base, 0) for w in fed)
    if start >= 1 << _STREAM_BITS:
      continue  # every split this stream feeds is complete past it
    for i, record in enumerate(records(start), start):
      pos = base | i
      for split, r in source.route(name, i, record):
        if pos >= writers[split].skip_below:
          yield split, pos, r


def _dispatch(chunk, columns, writers):
  """Hands a chunk's encoded records to their splits' writers, consecutive runs at a time."""
  splits = [split for split, _, _ in chunk]
  positions = np.fromiter((pos for _, pos, _ in chunk), np.int64, len(chunk))
  starts = [np.concatenate([[0], np.cumsum(lengths)]) for _, lengths in columns]
  a = 0
  for split, run in itertools.groupby(splits):
    b = a + sum(1 for _ in run)
    w = writers[split]
    texts = [chunk[i][2][0] for i in range(a, b)] if w.keep_text else None
    w.add(positions[a:b], [(ids[s[a]:s[b]], lengths[a:b]) for (ids, lengths), s in zip(columns, starts)], texts)
    a = b


def describe(manifest):
  """One line: tokens, documents and shards per split."""
  parts = []
  for split, info in manifest["splits"].items():
    tokens = sum(info["tokens"].values())
    parts.append(f"{split} {tokens:,} tokens, {info['docs']:,} documents, {len(info['shards'])} shards")
  return f"{'; '.join(parts)} ({manifest['dtype']})"


def parse_args(argv):
  parser = argparse.ArgumentParser(description="Prepare a recipe's data once: tokenizer and token shards.")
  parser.add_argument("--config", default="default", help="recipe name in configs/ or a path to a .py file")
  parser.add_argument("--workdir", default=None,
                      help="run directory (default: runs/<config>); the shards go to data.data_dir, default WORKDIR/data")
  parser.add_argument("--verify", action="store_true",
                      help="check the sha256 of every prepared shard file against the manifest (prepares nothing)")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.num_proc=8")
  return parser.parse_intermixed_args(argv)  # overrides before, between or after flags


@cli
def main(argv):
  """`python -m jaxformer.prepare --config NAME [--workdir DIR] [key=value ...]`."""
  args = parse_args(argv)
  cfg = config_lib.load_config(args.config, args.overrides)
  workdir = args.workdir or os.path.join("runs", cfg.name)
  if args.verify:
    ddir = data_dir(cfg, workdir)
    checked = shards.verify(ddir, log=lambda line: print(f"{ddir}: {line}"))
    print(f"{ddir}: the sha256 of all {checked} shard files match the manifest")
    return shards.read_manifest(ddir)
  manifest = ensure_prepared(cfg, workdir)
  print(f"{data_dir(cfg, workdir)}: {describe(manifest)}")
  return manifest


if __name__ == "__main__":
  if sys.argv[1:2] == ["--worker"]:
    _worker_main(sys.argv[2])
  else:
    main()
