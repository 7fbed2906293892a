"""Data pipeline: parallel text, tokenization, static-shape batches.

Translation batches follow the paper: pairs are grouped by length into a few
fixed bucket lengths and each batch holds about `tokens_per_batch` source and
as many target tokens. Shapes are static per bucket, so a jitted train step
compiles once per bucket. Batches are a pure function of (seed, epoch), so a
run resumes at any step with the same data order and no iterator state.

Language-model batches are nanoGPT-style random windows of one token stream,
seeded by (seed, step) for the same reason, or packed rows (consecutive
windows in a seeded shuffled order per epoch). Streams and ragged arrays may be
memory-mapped shards (`jaxformer.shards`): a batch reads only its rows, and
only this process's rows (`row_range`).
"""

import functools
import hashlib
import itertools
import os
import tempfile

import numpy as np

from jaxformer import hub
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.errors import UserError

PAD_ID, BOS_ID, EOS_ID = (tokenizer_lib.PAD_ID, tokenizer_lib.BOS_ID,
                          tokenizer_lib.EOS_ID)
DEFAULT_BUCKETS = (8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512,
                   768, 1024)
_CACHE_VERSION = "1"  # Bump when the cache layout or tokenization changes.


# ----------------------------------------------------------------------------
# Reading text.


def read_lines(path):
  """Returns the lines of a UTF-8 text file (list[str], newline stripped)."""
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise UserError(f"{path}: file not found")
  with open(path, "rb") as f:
    data = f.read()
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    line = data.count(b"\n", 0, e.start) + 1
    raise UserError(f"{path}:{line}: not valid UTF-8 (byte {e.start}); "
                    "convert the file to UTF-8") from None
  if not text.strip():
    raise UserError(f"{path}: file is empty")
  # split("\n"), not splitlines(): the latter also splits on U+2028, U+0085
  # etc., which occur inside real sentences and would misalign the pairs.
  lines = text.removeprefix("\ufeff").split("\n")
  if lines[-1] == "":
    lines.pop()
  return [l.removesuffix("\r") for l in lines]


def read_parallel(src_path, tgt_path):
  """Reads aligned files (line i of one translates line i of the other).

  Returns:
    (src_lines, tgt_lines), two lists of str of equal length.
  """
  src, tgt = read_lines(src_path), read_lines(tgt_path)
  if len(src) != len(tgt):
    raise UserError(
        f"parallel files differ in length: {src_path} has {len(src)} lines, "
        f"{tgt_path} has {len(tgt)}; they must be line-aligned")
  return src, tgt


def load_translation(source, split="train", src_lang="en", tgt_lang="de",
                     hub_config=None, max_examples=None):
  """Loads a translation split as (src_lines, tgt_lines).

  Args:
    source: "hf:<name>" for a Hugging Face dataset with a `translation`
      column (e.g. "hf:wmt14"), a directory with `{split}.{lang}` files
      (e.g. shared/data/multi30k), or a prefix with `{source}.{lang}` files.
    split: hub split ("train", "validation", "test") or local file stem.
    src_lang, tgt_lang: language codes, e.g. "en", "de".
    hub_config: hub config; default "<xx>-en" for pairs with English
      (wmt14 names them "de-en", "fr-en", ...), else "<src>-<tgt>".
    max_examples: keep only the first this many pairs.
  Returns:
    (src_lines, tgt_lines), two lists of str.
  """
  source = os.fspath(source)
  if source.startswith("hf:"):
    return _load_hub(source[3:], split, src_lang, tgt_lang, hub_config,
                     max_examples)
  if os.path.isdir(source):
    stem = os.path.join(source, split)
  else:
    stem = source
  src, tgt = read_parallel(f"{stem}.{src_lang}", f"{stem}.{tgt_lang}")
  if max_examples is not None:
    src, tgt = src[:max_examples], tgt[:max_examples]
  return src, tgt


def _load_hub(name, split, src_lang, tgt_lang, config, max_examples):
  if config is None:
    pair = {src_lang, tgt_lang}
    config = (f"{(pair - {'en'}).pop()}-en" if "en" in pair and len(pair) == 2
              else f"{src_lang}-{tgt_lang}")
  spec = split if max_examples is None else f"{split}[:{max_examples}]"
  ds = hub.load_dataset(name, config, spec, local_hint=(
      f"to use local text files set data.source=local data.train_src=FILE.{src_lang} "
      f"data.train_tgt=FILE.{tgt_lang} (and data.dev_src/dev_tgt, data.test_src/test_tgt)"))
  pairs = ds["translation"]
  if pairs and (src_lang not in pairs[0] or tgt_lang not in pairs[0]):
    raise UserError(f"{name}/{config} has languages {sorted(pairs[0])}, not "
                    f"{src_lang} and {tgt_lang}")
  return [p[src_lang] for p in pairs], [p[tgt_lang] for p in pairs]


# ----------------------------------------------------------------------------
# Token ids: ragged arrays, filtering, cached parallel tokenization.


class Ragged:
  """Variable-length int32 sequences as one flat array + offsets [n + 1]."""

  def __init__(self, flat, offsets):
    self.flat = np.asarray(flat, np.int32)
    self.offsets = np.asarray(offsets, np.int64)
    self.lengths = np.diff(self.offsets)

  @classmethod
  def from_lists(cls, seqs):
    """Builds from a sequence of int sequences (a `Ragged` or
    `shards.RaggedShards` is returned as it is)."""
    if isinstance(seqs, Ragged) or hasattr(seqs, "gather"):
      return seqs
    lengths = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    flat = np.fromiter(itertools.chain.from_iterable(seqs), np.int32,
                       int(offsets[-1]))
    return cls(flat, offsets)

  def __len__(self):
    return len(self.lengths)

  def __getitem__(self, i):
    return self.flat[self.offsets[i]:self.offsets[i + 1]]

  def gather(self, idx, length):
    """Returns rows `idx` [B] as [B, length] int32, zero-padded on the right."""
    pos = np.arange(length)
    lens = self.lengths[idx]
    if not len(self.flat):
      return np.zeros((len(idx), length), np.int32)
    where = np.minimum(self.offsets[idx][:, None] + pos, len(self.flat) - 1)
    return np.where(pos < lens[:, None], self.flat[where], 0).astype(np.int32)


def filter_pairs(src_ids, tgt_ids, max_len):
  """Drops pairs with an empty side or a side longer than `max_len` - 1.

  The -1 leaves room for EOS (and the BOS shift), as in the batcher.
  Args:
    src_ids, tgt_ids: `Ragged` or sequences of id sequences, same length n.
    max_len: the longest allowed padded length.
  Returns:
    (kept [k] int64 indices, {"kept": k, "empty": ..., "too_long": ...}).
  """
  ls = Ragged.from_lists(src_ids).lengths
  lt = Ragged.from_lists(tgt_ids).lengths
  empty = (ls == 0) | (lt == 0)
  too_long = ~empty & (np.maximum(ls, lt) + 1 > max_len)
  kept = np.flatnonzero(~empty & ~too_long)
  return kept, {"kept": len(kept), "empty": int(empty.sum()),
                "too_long": int(too_long.sum())}


def _cache_key(tokenizer_path, texts, targets=()):
  h = hashlib.sha256(_CACHE_VERSION.encode())
  if targets:  # only tokenizers with a target side of their own (Marian) pass them
    h.update(f"targets:{sorted(targets)}".encode())
  tokenizer_path = os.fspath(tokenizer_path)
  if tokenizer_path == "byte":
    h.update(b"byte")
  else:
    with open(tokenizer_path, "rb") as f:
      h.update(f.read())
  for t in texts:
    if isinstance(t, (str, os.PathLike)):
      # Path + size + mtime instead of contents: O(1) for multi-GB corpora.
      st = os.stat(t)
      h.update(f"\0file:{os.path.abspath(t)}:{st.st_size}:{st.st_mtime_ns}"
               .encode())
    else:
      h.update(f"\0lines:{len(t)}".encode())
      for i in range(0, len(t), 100_000):
        h.update("\n".join(t[i:i + 100_000]).encode("utf-8", "surrogatepass"))
  return h.hexdigest()


def tokenize_corpus(tokenizer_path, texts, cache_path=None, num_proc=-1,
                    chunk_size=100_000, targets=()):
  """Tokenizes several line lists in parallel, cached on disk.

  The cache is an `.npz` (flat ids + offsets per input) keyed by a hash of
  the tokenizer file's contents and of the inputs (path, size and mtime for
  files; contents for in-memory lists); a hit loads without touching the
  tokenizer.
  Parallelism uses sentencepiece's C++ threads rather than processes: fork
  after JAX has started its threads can deadlock, and spawn re-runs the
  caller's unguarded `__main__`. (Char/byte tokenizers are cheap and run
  on one thread.)
  Args:
    tokenizer_path: a file for `tokenizer.load_tokenizer` (or "byte").
    texts: list of inputs, each a text file path (one sentence per line) or
      a list of str.
    cache_path: an `.npz` file (rewritten when the key changes), a directory
      (holds `tokens-<key>.npz`), or None for no cache.
    num_proc: encoder threads, -1 = all cores.
    chunk_size: lines encoded at a time; bounds the Python-list memory.
    targets: indices of the inputs that are target-side text, encoded with
      `encode_target` (Marian splits targets with its target model).
  Returns:
    A list of `Ragged`, one per input, without BOS/EOS.
  """
  key = _cache_key(tokenizer_path, texts, targets)
  if cache_path is not None:
    cache_path = os.fspath(cache_path)
    if not cache_path.endswith(".npz"):
      cache_path = os.path.join(cache_path, f"tokens-{key[:16]}.npz")
    if os.path.isfile(cache_path):
      with np.load(cache_path) as z:
        if str(z["key"]) == key:
          return [Ragged(z[f"flat{i}"], z[f"offsets{i}"])
                  for i in range(int(z["n"]))]

  tok = tokenizer_lib.load_tokenizer(tokenizer_path)
  out = []
  for n, t in enumerate(texts):
    lines = read_lines(t) if isinstance(t, (str, os.PathLike)) else list(t)
    if n in targets:
      parts = [Ragged.from_lists([tok.encode_target(x) for x in lines])]
    else:
      parts = [Ragged.from_lists(tok.encode_batch(lines[i:i + chunk_size],
                                                  num_threads=num_proc))
               for i in range(0, len(lines), chunk_size)]
    flat = np.concatenate([r.flat for r in parts] or [np.zeros(0, np.int32)])
    lengths = np.concatenate([r.lengths for r in parts] or [np.zeros(0, int)])
    out.append(Ragged(flat, np.concatenate([[0], np.cumsum(lengths)])))

  if cache_path is not None:
    arrays = {"key": np.array(key), "n": np.array(len(out))}
    for i, r in enumerate(out):
      arrays[f"flat{i}"], arrays[f"offsets{i}"] = r.flat, r.offsets
    d = os.path.dirname(os.path.abspath(cache_path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".npz")
    with os.fdopen(fd, "wb") as f:
      np.savez(f, **arrays)  # Uncompressed: loading is then just a read.
    os.replace(tmp, cache_path)
  return out


# ----------------------------------------------------------------------------
# Translation batches: token budget, length buckets, static shapes.


def bucket_lengths(max_len, buckets=DEFAULT_BUCKETS):
  """Returns the sorted bucket lengths below `max_len`, then `max_len`."""
  return tuple(b for b in buckets if b < max_len) + (max_len,)


class Batcher:
  """Token-budget batches of translation pairs, a pure function of the step.

  Each pair goes to the smallest bucket length L >= max(len(src)+1,
  len(tgt)+1) (+1 for EOS, and for BOS in the shifted decoder input). A
  bucket's batch size is tokens_per_batch // L rounded down to a multiple of
  `batch_multiple` (use the device count so batches shard evenly), so a batch
  never exceeds the budget on either side. The last batch of a bucket is
  filled up with all-padding rows (index -1, segmentation 0): every pair is
  seen exactly once per epoch and the shape stays static; weight the loss by
  `targets_segmentation` so filler rows count for nothing.
  """

  def __init__(self, src_ids, tgt_ids, tokens_per_batch, max_len, seed=0,
               batch_multiple=1, indices=None, shuffle=True,
               buckets=DEFAULT_BUCKETS, pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, part=None):
    """Args:

      src_ids, tgt_ids: `Ragged`, `shards.RaggedShards` (memory-mapped) or
        sequences of id sequences (no BOS/EOS).
      tokens_per_batch: token budget per side (paper: ~25000).
      max_len: longest padded length; pairs must fit (see `filter_pairs`).
      seed: data-order seed.
      batch_multiple: every batch size is a multiple of this.
      indices: the pairs to use (e.g. `filter_pairs`' kept); default all.
      shuffle: False gives a fixed order (bucket by bucket), for evaluation.
      buckets: candidate bucket lengths.
      pad_id, bos_id, eos_id: the model's special ids (Marian: 58100, 58100, 0).
      part: this process's part of each batch (see `row_range`): only those
        rows' tokens are read; lengths, masks and positions cover all rows.
    """
    self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
    self.src = Ragged.from_lists(src_ids)
    self.tgt = Ragged.from_lists(tgt_ids)
    if len(self.src) != len(self.tgt):
      raise ValueError(f"{len(self.src)} sources but {len(self.tgt)} targets")
    self.seed, self.shuffle, self.part = seed, shuffle, part
    idx = (np.arange(len(self.src)) if indices is None
           else np.asarray(indices, np.int64))
    need = np.maximum(self.src.lengths[idx], self.tgt.lengths[idx]) + 1
    if len(idx) and need.max() > max_len:
      raise ValueError(f"a pair needs length {need.max()} > max_len={max_len};"
                       " drop long pairs with filter_pairs first")
    self.bucket_lens = np.array(bucket_lengths(max_len, buckets))
    self.batch_sizes = (tokens_per_batch // self.bucket_lens
                        // batch_multiple * batch_multiple)
    bucket = np.searchsorted(self.bucket_lens, need)
    self._members = [np.sort(idx[bucket == k])
                     for k in range(len(self.bucket_lens))]
    for k, members in enumerate(self._members):
      if len(members) and self.batch_sizes[k] == 0:
        length = int(self.bucket_lens[k])
        raise UserError(
            f"tokens_per_batch={tokens_per_batch} is too small for length "
            f"{length} with batch_multiple={batch_multiple}; use at least "
            f"{length * batch_multiple} or a smaller max_len")
    self._num_batches = [-(-len(m) // max(int(bs), 1))
                         for m, bs in zip(self._members, self.batch_sizes)]
    self.steps_per_epoch = sum(self._num_batches)
    self.num_pairs = len(idx)
    self._epoch_cache = (None, None)

  def __len__(self):
    return self.steps_per_epoch

  def epoch_batches(self, epoch):
    """Returns the epoch's batches: a list of int64 index arrays [batch].

    Index -1 marks a filler row. Shuffles within buckets, chunks, then
    shuffles the batch order, all seeded by (seed, epoch).
    """
    rng = np.random.default_rng([self.seed, epoch])
    batches = []
    for members, bs in zip(self._members, self.batch_sizes):
      if not len(members):
        continue
      m = rng.permutation(members) if self.shuffle else members
      m = np.concatenate([m, np.full(-len(m) % bs, -1, np.int64)])
      batches.extend(m.reshape(-1, bs))
    if self.shuffle:
      batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches

  def batch_at(self, step):
    """Returns the batch of global `step` (see `make_batch`)."""
    epoch, i = divmod(step, self.steps_per_epoch)
    if self._epoch_cache[0] != epoch:  # One epoch cached: steps go in order.
      self._epoch_cache = (epoch, self.epoch_batches(epoch))
    return self.make_batch(self._epoch_cache[1][i])

  def make_batch(self, indices):
    """Builds a batch from pair indices [B] (-1 = filler row).

    Returns:
      dict of [B, L] int32 arrays, L the bucket length:
      inputs: source + EOS; targets: target + EOS; decoder_inputs: BOS +
      target (targets shifted right, teacher forcing); *_segmentation: 1 on
      real tokens, 0 on padding; *_position: 0..len-1 on real tokens, else 0.
    """
    indices = np.asarray(indices)
    real = indices >= 0
    idx = np.where(real, indices, 0)
    n_src = np.where(real, self.src.lengths[idx] + 1, 0)
    n_tgt = np.where(real, self.tgt.lengths[idx] + 1, 0)
    length = int(self.bucket_lens[np.searchsorted(
        self.bucket_lens, max(n_src.max(), n_tgt.max()))])
    pos = np.arange(length)[None, :]
    src_mask, tgt_mask = pos < n_src[:, None], pos < n_tgt[:, None]
    src_eos, tgt_eos = pos == n_src[:, None] - 1, pos == n_tgt[:, None] - 1
    gather = lambda ragged: _own_rows(lambda lo, hi: ragged.gather(idx[lo:hi], length),
                                      len(idx), self.part, (length,))
    inputs = np.where(src_eos, self.eos_id, np.where(src_mask, gather(self.src), self.pad_id))
    targets = np.where(tgt_eos, self.eos_id, np.where(tgt_mask, gather(self.tgt), self.pad_id))
    shifted = np.concatenate(
        [np.full((len(idx), 1), self.bos_id), targets[:, :-1]], axis=1)
    return {
        "inputs": inputs.astype(np.int32),
        "targets": targets.astype(np.int32),
        "decoder_inputs": np.where(tgt_mask, shifted, self.pad_id).astype(np.int32),
        "inputs_segmentation": src_mask.astype(np.int32),
        "targets_segmentation": tgt_mask.astype(np.int32),
        "inputs_position": np.where(src_mask, pos, 0).astype(np.int32),
        "targets_position": np.where(tgt_mask, pos, 0).astype(np.int32),
    }

  def shapes(self):
    """Returns the sorted (batch, length) shapes this corpus produces."""
    return sorted((int(bs), int(length)) for m, bs, length in zip(
        self._members, self.batch_sizes, self.bucket_lens) if len(m))

  def padding_fraction(self):
    """Fraction of padded positions (both sides) over an epoch.

    The same for every epoch: the bucket contents never change.
    """
    total = sum(n * int(bs) * int(length) * 2 for n, bs, length in zip(
        self._num_batches, self.batch_sizes, self.bucket_lens))
    members = np.concatenate(self._members)
    real = (self.src.lengths[members] + self.tgt.lengths[members]).sum() + (
        2 * len(members))
    return 1.0 - real / total if total else 0.0


# ----------------------------------------------------------------------------
# Language modelling: one token stream, random windows.


def nanogpt_split(text, train_fraction=0.9):
  """Splits text like nanoGPT: first 90% of characters train, rest val."""
  n = int(len(text) * train_fraction)
  return text[:n], text[n:]


def lm_token_stream(texts, tokenizer, add_eos=True, add_bos=False):
  """Concatenates tokenized documents into one stream.

  Args:
    texts: iterable of documents (str).
    tokenizer: a `Tokenizer` (its eos_id / bos_id are used).
    add_eos: append EOS after each document; False matches nanoGPT.
    add_bos: put BOS before each document (Llama's convention).
  Returns:
    int32 array [total_tokens].
  """
  parts = []
  for t in texts:
    ids = (tokenizer.encode_array(t) if hasattr(tokenizer, "encode_array")
           else np.asarray(tokenizer.encode(t), np.int32))
    if add_bos:
      parts.append(np.array([tokenizer.bos_id], np.int32))
    parts.append(ids)
    if add_eos:
      parts.append(np.array([tokenizer.eos_id], np.int32))
  return np.concatenate(parts or [np.zeros(0, np.int32)]).astype(np.int32)


def row_range(batch_size, part=None):
  """The rows [lo, hi) of a global batch that one process reads.

  `part` = (first, stop, parts): this process holds parts [first, stop) of `parts` equal
  parts along the batch axis (`sharding.batch_part`); None = every row (one process).
  """
  if part is None:
    return 0, batch_size
  first, stop, parts = part
  if batch_size % parts:
    raise ValueError(f"batch size {batch_size} is not a multiple of the {parts} batch shards")
  return batch_size * first // parts, batch_size * stop // parts


def _own_rows(read, batch_size, part, shape_tail, dtype=np.int32):
  """[batch_size, *shape_tail] with rows `row_range(batch_size, part)` from `read(lo, hi)`, the rest zero.

  A process reads only its own rows; the others stay zero (untouched pages of np.zeros), and
  `sharding.global_batch` copies only this process's rows to its devices. Everything that
  sizes the batch (shapes, segmentation, token counts) is computed for all rows, so every
  process agrees on them.
  """
  lo, hi = row_range(batch_size, part)
  if (lo, hi) == (0, batch_size):
    return read(lo, hi)
  out = np.zeros((batch_size, *shape_tail), dtype)
  out[lo:hi] = read(lo, hi)
  return out


def _segments_after_eos(inputs, eos_id):
  """Segment ids (from 1) and positions (from 0) that restart on the token after each EOS."""
  new = np.zeros(inputs.shape, bool)
  new[:, 1:] = inputs[:, :-1] == eos_id
  idx = np.broadcast_to(np.arange(inputs.shape[1]), inputs.shape)
  start = np.maximum.accumulate(np.where(new, idx, 0), axis=1)
  return (1 + np.cumsum(new, axis=1)).astype(np.int32), (idx - start).astype(np.int32)


class LMBatcher:
  """nanoGPT-style random windows; batch `step` is seeded by (seed, step).

  Segments: `segment_ids` starts a new segment on the token after each EOS and
  `positions` restart at 0 there. A model that masks attention to equal
  segment ids (and uses these positions) never attends across a document
  boundary; one that ignores them attends over the whole window, as nanoGPT
  does. Either way the target after an EOS is the next document's first token.
  The stream is an in-memory array or a `shards.TokenStream` (memory-mapped
  shards): the same windows either way.
  """

  def __init__(self, stream, block_size, batch_size, seed=0, eos_id=EOS_ID,
               part=None):
    """Args: stream [N] int ids (array or `shards.TokenStream`), window length,
    windows per batch, seed, and this process's `part` (see `row_range`)."""
    self.stream = (stream if hasattr(stream, "take")
                   else np.asarray(stream, np.int32))
    if len(self.stream) < block_size + 1:
      raise UserError(f"the token stream has {len(self.stream)} tokens, fewer "
                      f"than block_size + 1 = {block_size + 1}; use a smaller "
                      "block_size or more text")
    self.block_size, self.batch_size = block_size, batch_size
    self.seed, self.eos_id, self.part = seed, eos_id, part

  def _take(self, starts):
    if isinstance(self.stream, np.ndarray):
      return self.stream[starts[:, None] + np.arange(self.block_size + 1)]
    return self.stream.take(starts, self.block_size + 1)

  def batch_at(self, step):
    """Returns the batch for `step`.

    Returns:
      dict of [batch_size, block_size] int32 arrays: inputs, targets (inputs
      shifted left by one), segment_ids (from 1), positions.
    """
    rng = np.random.default_rng([self.seed, step])
    starts = rng.integers(0, len(self.stream) - self.block_size,
                          self.batch_size)
    w = _own_rows(lambda lo, hi: self._take(starts[lo:hi]), self.batch_size,
                  self.part, (self.block_size + 1,))
    inputs, targets = w[:, :-1], w[:, 1:]
    segment_ids, positions = _segments_after_eos(inputs, self.eos_id)
    return {
        "inputs": inputs,
        "targets": targets,
        "segment_ids": segment_ids,
        "positions": positions,
    }


def whole_stream_batches(stream, block_size, batch_size, eos_id=EOS_ID):
  """Every token of `stream` predicted once: consecutive windows of `block_size` targets, batched.

  The last window slides back to end at the stream's end, its already-counted targets weighted 0;
  rows that pad the last batch repeat window 0 at weight 0. Yields dicts of [batch_size, block_size]
  arrays: inputs, targets, segment_ids and positions (as `LMBatcher`), and float32 `weights`
  (they sum to len(stream) - 1 over all batches).
  """
  n = len(stream)
  if n < block_size + 1:
    raise UserError(f"the token stream has {n} tokens, fewer than block_size + 1 = {block_size + 1}; use a smaller "
                    "block_size or more text")
  starts = np.arange(0, n - 1, block_size)
  taken = np.minimum(starts, n - 1 - block_size)
  weights = np.ones((len(starts), block_size), np.float32)
  weights[-1, :starts[-1] - taken[-1]] = 0.0
  rows = -(-len(starts) // batch_size) * batch_size
  taken = np.concatenate([taken, np.zeros(rows - len(starts), taken.dtype)])
  weights = np.concatenate([weights, np.zeros((rows - len(starts), block_size), np.float32)])
  read = (lambda s: stream.take(s, block_size + 1)) if hasattr(stream, "take") else (
      lambda s: np.asarray(stream)[s[:, None] + np.arange(block_size + 1)])
  for r in range(0, rows, batch_size):
    w = np.asarray(read(taken[r:r + batch_size]), np.int32)
    inputs, targets = w[:, :-1], w[:, 1:]
    segment_ids, positions = _segments_after_eos(inputs, eos_id)
    yield {"inputs": inputs, "targets": targets, "segment_ids": segment_ids, "positions": positions,
           "weights": weights[r:r + batch_size]}


_MIX = tuple(np.uint64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                    0x94D049BB133111EB))


@functools.lru_cache(maxsize=64)
def _round_keys(key):
  return tuple(np.random.default_rng(list(key)).integers(0, 1 << 62, 4, np.uint64))


def permute(index, n, key):
  """Images of `index` [k] under a pseudo-random permutation of [0, n) keyed by `key`.

  A 4-round Feistel network (splitmix64 rounds) on the next even power of two
  >= n, walking the cycle back into [0, n): a bijection computed per index, so
  shuffling the rows of a corpus of any size costs no memory.
  Args:
    index: int array of values in [0, n).
    n: the permutation's size.
    key: a tuple of ints (e.g. (seed, epoch)).
  Returns:
    int64 array like `index`.
  """
  bits = max(2, int(n - 1).bit_length())
  bits += bits & 1
  half, mask = np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
  keys = _round_keys(tuple(key))

  def rounds(x):
    left, right = x >> half, x & mask
    for k in keys:
      z = (right ^ k) + _MIX[0]
      z = (z ^ (z >> np.uint64(30))) * _MIX[1]
      z = (z ^ (z >> np.uint64(27))) * _MIX[2]
      left, right = right, left ^ ((z ^ (z >> np.uint64(31))) & mask)
    return (left << half) | right

  x = rounds(np.asarray(index, np.uint64))
  out = x.copy()
  walk = np.flatnonzero(out >= n)
  while len(walk):  # expected < 4 more rounds: the domain is < 4n
    out[walk] = rounds(out[walk])
    walk = walk[out[walk] >= n]
  return out.astype(np.int64)


class PackedLMBatcher:
  """Packed rows: consecutive, non-overlapping windows of a document stream,
  in a seeded pseudo-random order per epoch.

  Row r holds inputs tokens[r L : (r + 1) L] and targets one token further, so
  every token is a target once per epoch (L = block_size). Segment ids and
  positions restart at every document start (from the stored document
  offsets; a document's EOS is its last token) and at the row start, so a
  model that masks attention by segment never attends across a document
  boundary. Epoch e's row order is `permute(., rows, (seed, e))`; batch
  `step` is the next batch_size rows of it (the remainder is dropped): a pure
  function of (seed, step) that holds no per-row array.
  """

  def __init__(self, stream, block_size, batch_size, seed=0, part=None):
    """Args: stream: a `shards.TokenStream`; the rest as for `LMBatcher`."""
    self.stream, self.block_size, self.batch_size = stream, block_size, batch_size
    self.seed, self.part = seed, part
    self.rows = (len(stream) - 1) // block_size
    if self.rows < batch_size:
      raise UserError(f"the token stream has {len(stream)} tokens: {self.rows} "
                      f"rows of block_size {block_size}, fewer than batch_size "
                      f"{batch_size}; use smaller batches or more text")
    self.steps_per_epoch = self.rows // batch_size
    # The row order and this process's segment ids of the next steps, computed together
    # (~64k tokens at a time): a memo of the pure function, which training calls in order.
    self._block = max(1, (1 << 16) // (batch_size * block_size))
    self._memo = (None,)

  def _plan(self, step):
    """(rows [batch_size], segment_ids, positions [own rows, block_size]) of `step`."""
    epoch, i = divmod(step, self.steps_per_epoch)
    first = i - i % self._block
    if self._memo[0] != (epoch, first, self.part):
      last = min(first + self._block, self.steps_per_epoch)
      rows = permute(np.arange(first * self.batch_size, last * self.batch_size),
                     self.rows, (self.seed, epoch)).reshape(-1, self.batch_size)
      lo, hi = row_range(self.batch_size, self.part)
      segment_ids, positions = self.stream.segments(
          rows[:, lo:hi].ravel() * self.block_size, self.block_size)
      shape = (len(rows), hi - lo, self.block_size)
      self._memo = ((epoch, first, self.part), rows, segment_ids.reshape(shape),
                    positions.reshape(shape))
    j = i - first
    return self._memo[1][j], self._memo[2][j], self._memo[3][j]

  def batch_at(self, step):
    """The batch of `step`: dict of [batch_size, block_size] int32 arrays
    inputs, targets, segment_ids (from 1), positions (from 0)."""
    rows, segment_ids, positions = self._plan(step)
    starts, length = rows * self.block_size, self.block_size

    def read(lo, hi):
      w = self.stream.take(starts[lo:hi], length + 1)
      return np.stack([w[:, :-1], w[:, 1:], segment_ids, positions], axis=1)

    out = _own_rows(read, self.batch_size, self.part, (4, length))
    names = ("inputs", "targets", "segment_ids", "positions")
    return {k: np.ascontiguousarray(out[:, j]) for j, k in enumerate(names)}


# ----------------------------------------------------------------------------
# Fine-tuning: rows of whole examples with a loss mask (SFT), pairs of them (DPO).


def example_spans(stream):
  """(starts, lengths) [docs] int64 of every document (example) of a `shards.TokenStream`."""
  starts = [offs[:-1] + base for offs, base in zip(stream.offsets, stream.token_starts[:-1])]
  lengths = [np.diff(offs) for offs in stream.offsets]
  return (np.concatenate(starts or [np.zeros(0, np.int64)]).astype(np.int64),
          np.concatenate(lengths or [np.zeros(0, np.int64)]).astype(np.int64))


def trained_tokens(mask_stream, starts, lengths, limit):
  """Loss tokens [docs] each example keeps as targets of a row of `limit` tokens (its first token is never
  a target; tokens past `limit` are cut)."""
  if not len(starts):
    return np.zeros(0, np.int64)
  cum = np.concatenate([[0], np.cumsum(mask_stream.read(0, len(mask_stream)) != 0, dtype=np.int64)])
  n = np.minimum(lengths, limit)
  return cum[starts + n] - cum[np.minimum(starts + 1, starts + n)]


def example_rows(tokens, mask, spans, block_size, pad_id=PAD_ID):
  """Rows of whole examples: spans[r] = [(start, n), ...] of row r, their n summing to at most
  block_size + 1. Returns dict of [rows, block_size] int32 arrays: inputs, targets (one further),
  segment_ids (1, 2, ... per example; 0 = padding), positions (from 0 per example) and weights
  (the target's loss mask, 0 where the target is another example's or padding: labels never cross).
  """
  width = block_size + 1
  seq = np.full((len(spans), width), pad_id, np.int32)
  loss = np.zeros((len(spans), width), np.int32)
  seg = np.zeros((len(spans), width), np.int32)
  pos = np.zeros((len(spans), width), np.int32)
  for r, row in enumerate(spans):
    at = 0
    for k, (start, n) in enumerate(row, 1):
      seq[r, at:at + n] = tokens.read(start, start + n)
      loss[r, at:at + n] = mask.read(start, start + n)
      seg[r, at:at + n] = k
      pos[r, at:at + n] = np.arange(n)
      at += n
  same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
  return {"inputs": seq[:, :-1], "targets": seq[:, 1:], "segment_ids": seg[:, :-1], "positions": pos[:, :-1],
          "weights": np.where(same, loss[:, 1:] != 0, 0).astype(np.int32)}


class ExampleBatcher:
  """SFT batches: rows of whole examples, each row a pure function of (seed, step).

  Examples (documents of a token stream, with a loss-mask stream beside it) keep their first
  block_size + 1 tokens; one whose loss mask is then empty is dropped (counted in `empty`).
  packed: consecutive examples share a row while they fit (next-fit, in stored order), with
  segment ids and positions restarting per example; else one example per row. Epoch e's row
  order is `permute(., rows, (seed, e))` (shuffle=False: stored order, the last batch filled
  with empty rows). `part`: only this process's rows are read (see `row_range`).
  """

  def __init__(self, tokens, mask, block_size, batch_size, seed=0, packed=True, shuffle=True, pad_id=PAD_ID,
               part=None):
    self.tokens, self.mask, self.block_size, self.batch_size = tokens, mask, block_size, batch_size
    self.seed, self.shuffle, self.pad_id, self.part = seed, shuffle, pad_id, part
    starts, lengths = example_spans(tokens)
    keep = trained_tokens(mask, starts, lengths, block_size + 1) > 0
    self.examples, self.empty = int(keep.sum()), int((~keep).sum())
    self.truncated = int((lengths[keep] > block_size + 1).sum())
    starts, lengths = starts[keep], np.minimum(lengths[keep], block_size + 1)
    self.rows, row, used = [], [], 0
    for s, n in zip(starts.tolist(), lengths.tolist()):
      if row and (not packed or used + n > block_size + 1):
        self.rows.append(row)
        row, used = [], 0
      row.append((s, n))
      used += n
    if row:
      self.rows.append(row)
    self.steps_per_epoch = max(1, len(self.rows) // batch_size) if shuffle else -(-len(self.rows) // batch_size)
    self.real_tokens = int(lengths.sum())

  def batch_at(self, step):
    """The batch of `step`: `example_rows` of batch_size rows."""
    epoch, i = divmod(step, self.steps_per_epoch)
    index = np.arange(i * self.batch_size, (i + 1) * self.batch_size)
    if self.shuffle:
      index = permute(index % len(self.rows), len(self.rows), (self.seed, epoch))
    spans = [self.rows[j] if j < len(self.rows) else [] for j in index.tolist()]
    lo, hi = row_range(self.batch_size, self.part)
    spans = [s if lo <= r < hi else [] for r, s in enumerate(spans)]  # others' rows stay padding
    return example_rows(self.tokens, self.mask, spans, self.block_size, self.pad_id)


class PairBatcher:
  """DPO batches: each row a (chosen, rejected) pair of whole sequences, [batch, 2, block_size] arrays
  (`example_rows` fields, one sequence per row). Pairs either of whose masks is empty within
  block_size + 1 tokens are dropped (counted in `empty`). Order as `ExampleBatcher`'s."""

  def __init__(self, chosen, chosen_mask, rejected, rejected_mask, block_size, batch_size, seed=0, shuffle=True,
               pad_id=PAD_ID, part=None):
    self.sides = ((chosen, chosen_mask), (rejected, rejected_mask))
    self.block_size, self.batch_size, self.seed, self.shuffle = block_size, batch_size, seed, shuffle
    self.pad_id, self.part = pad_id, part
    self.spans, keep = [], None
    for tokens, mask in self.sides:
      starts, lengths = example_spans(tokens)
      ok = trained_tokens(mask, starts, lengths, block_size + 1) > 0
      keep = ok if keep is None else keep & ok
      self.spans.append((starts, np.minimum(lengths, block_size + 1)))
    self.index = np.flatnonzero(keep)
    self.examples, self.empty = len(self.index), int((~keep).sum())
    if not shuffle:
      self.steps_per_epoch = -(-len(self.index) // batch_size)
    else:
      self.steps_per_epoch = max(1, len(self.index) // batch_size)

  def batch_at(self, step):
    epoch, i = divmod(step, self.steps_per_epoch)
    index = np.arange(i * self.batch_size, (i + 1) * self.batch_size)
    if self.shuffle:
      index = permute(index % len(self.index), len(self.index), (self.seed, epoch))
    lo, hi = row_range(self.batch_size, self.part)
    pairs = [int(self.index[j]) if j < len(self.index) and lo <= r < hi else -1 for r, j in enumerate(index.tolist())]
    out = []
    for (tokens, mask), (starts, lengths) in zip(self.sides, self.spans):
      spans = [[(int(starts[j]), int(lengths[j]))] if j >= 0 else [] for j in pairs]
      out.append(example_rows(tokens, mask, spans, self.block_size, self.pad_id))
    return {k: np.stack([out[0][k], out[1][k]], axis=1) for k in out[0]}
