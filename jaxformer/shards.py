"""Prepared token shards on disk (what `jaxformer.prepare` writes) and their readers.

A data directory holds `manifest.json` and one folder per split (`train`, `val` for a
language model; `train`, `dev`, `test` for translation). A split is a sequence of shards;
shard k of a split stores, for each field (`text`, or `src` and `tgt`):

    shard-0000k.<field>.bin   the token ids of its documents, concatenated (uint16 when the
                              vocabulary fits, else uint32); the model's EOS ends each LM
                              document of a multi-document corpus (its BOS starts it
                              with data.add_bos)
    shard-0000k.<field>.idx   int64 document offsets into the .bin [docs + 1], from 0
    shard-0000k.json          its marker: token and document counts, sha256 of each file,
                              and where in the input it ends (written last: a shard
                              without it is incomplete)

Documents never straddle shards. Readers present a split as one virtual array and read only
what a batch needs: token rows with positional reads (`os.pread`), document offsets through
memory maps (binary searches touch a few pages). Memory does not grow with the corpus.
A reader checks every file's size against the manifest when it is made (`check_sizes`), opens a
shard's files on first use (at most MAX_OPEN shards at a time) and closes them with `close()`;
`verify` checks the sha256 of every file (`python -m jaxformer.prepare --verify`).
"""

import hashlib
import json
import mmap
import os

import numpy as np

from jaxformer.errors import UserError

MANIFEST = "manifest.json"
FORMAT = 1


def shard_stem(data_dir, split, index):
  """The common path prefix of shard `index` of `split`."""
  return os.path.join(data_dir, split, f"shard-{index:05d}")


def token_path(stem, field):
  return f"{stem}.{field}.bin"


def offsets_path(stem, field):
  return f"{stem}.{field}.idx"


def marker_path(stem):
  return f"{stem}.json"


def text_path(stem):
  """Raw text of a validation shard's documents, joined by newlines (for eval.py's perplexity)."""
  return f"{stem}.txt"


def token_dtype(vocab_size):
  """uint16 when every id fits, else uint32."""
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def read_manifest(data_dir):
  """The manifest of `data_dir` as a dict, or None when there is none."""
  path = os.path.join(data_dir, MANIFEST)
  if not os.path.isfile(path):
    return None
  with open(path, encoding="utf-8") as f:
    return json.load(f)


# Rows read between releases of the mapped offset pages (see `_Shards._release`).
RELEASE_ROWS = 256
# Shards of one reader open at a time (a file descriptor for the tokens, one inside the offsets'
# memory map): the least recently opened closes first, so a corpus of thousands of shards stays
# far below the open-file limit (`ulimit -n`, often 1,024).
MAX_OPEN = 64

PREPARE_AGAIN = "run python -m jaxformer.prepare --config NAME again"


def _damaged(data_dir, split, index, what):
  """The one-line error for a damaged shard: what is wrong and how to prepare it again."""
  stem = shard_stem(data_dir, split, index)
  return UserError(f"{what}: the prepared data in {data_dir} is damaged; delete {marker_path(stem)} and "
                   f"{os.path.join(data_dir, MANIFEST)}, then {PREPARE_AGAIN} (it keeps the shards before "
                   f"shard {index} of {split} and writes the rest anew)")


def check_sizes(data_dir, manifest, split):
  """A one-line error when a file of a shard of `split` is missing or not the size its marker
  recorded (one stat per file: a truncated or deleted shard fails here, not deep inside training)."""
  for index, info in enumerate(manifest["splits"][split]["shards"]):
    for name, size in info.get("bytes", {}).items():
      path = os.path.join(data_dir, split, name)
      try:
        actual = os.stat(path).st_size
      except FileNotFoundError:
        raise _damaged(data_dir, split, index, f"{path} is missing") from None
      if actual != size:
        raise _damaged(data_dir, split, index, f"{path} has {actual:,} bytes, its manifest says {size:,}")


def verify(data_dir, log=print):
  """Checks the sha256 of every shard file against the manifest (reads all of them: `prepare --verify`).
  Returns the number of files checked; a mismatch is a one-line error naming the first damaged shard."""
  manifest = read_manifest(data_dir)
  if manifest is None or not manifest.get("complete"):
    raise UserError(f"{data_dir} holds no complete prepared data: {PREPARE_AGAIN}")
  checked = 0
  for split in manifest["splits"]:
    check_sizes(data_dir, manifest, split)
    for index, info in enumerate(manifest["splits"][split]["shards"]):
      for name, digest in info["sha256"].items():
        h = hashlib.sha256()
        with open(os.path.join(data_dir, split, name), "rb") as f:
          for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        if h.hexdigest() != digest:
          raise _damaged(data_dir, split, index, f"{os.path.join(data_dir, split, name)} has sha256 "
                         f"{h.hexdigest()[:12]}, its manifest says {digest[:12]}")
        checked += 1
    log(f"{split}: {len(manifest['splits'][split]['shards'])} shards verified")
  return checked


class _Offsets:
  """The document offsets of a reader's shards as a list-like: `offsets[k]` maps shard k's on use."""

  def __init__(self, shards):
    self._shards = shards

  def __len__(self):
    return len(self._shards.paths)

  def __getitem__(self, k):
    return self._shards._open(k)[1]

  def __iter__(self):
    return (self[k] for k in range(len(self)))


class _Shards:
  """The shards of one field of one split: token files read by position, offsets memory-mapped.

  Why not map the tokens too: a read through a memory map maps the page-cache folio around it
  into the process (hundreds of KiB per random window with large folios), so random windows
  grow the process's RSS towards the size of the corpus (measured: +800 MiB after 3,000
  windows of a 2 GB corpus, and 12 us per window against 6 us for a positional read;
  nanoGPT re-creates its np.memmap every batch for the same reason).

  A shard's files open on first use, at most MAX_OPEN shards at a time; `close()` (or `with`)
  closes them all, and a closed reader reopens on the next read.
  """

  def __init__(self, data_dir, split, field, manifest=None):
    manifest = manifest or read_manifest(data_dir)
    if manifest is None or not manifest.get("complete"):
      raise UserError(f"{data_dir} holds no prepared data: run python -m jaxformer.prepare --config NAME")
    if split not in manifest["splits"]:
      raise UserError(f"{data_dir} has no {split} split (it has {', '.join(manifest['splits'])})")
    check_sizes(data_dir, manifest, split)
    self.dtype = np.dtype(manifest["dtype"])
    self.paths, self._offset_paths, self._docs = [], [], []
    self._open_shards = {}  # shard -> (fd, plain view of the offsets, np.memmap), in the order opened
    self.offsets = _Offsets(self)
    token_counts, doc_counts = [], []
    for index, info in enumerate(manifest["splits"][split]["shards"]):
      stem = shard_stem(data_dir, split, index)
      self.paths.append(token_path(stem, field))
      self._offset_paths.append(offsets_path(stem, field))
      token_counts.append(info["tokens"][field])
      doc_counts.append(info["docs"])
    self.token_counts = token_counts
    self.token_starts = np.concatenate([[0], np.cumsum(token_counts, dtype=np.int64)])
    self.doc_starts = np.concatenate([[0], np.cumsum(doc_counts, dtype=np.int64)])
    self.num_tokens = int(self.token_starts[-1])
    self.num_docs = int(self.doc_starts[-1])
    self._touched, self._rows_read = set(), 0

  def _open(self, k):
    """(fd, offsets [docs + 1] int64, memmap) of shard k, opening it (and closing the oldest) if needed."""
    entry = self._open_shards.get(k)
    if entry is None:
      while len(self._open_shards) >= MAX_OPEN:
        self._close_shard(next(iter(self._open_shards)))
      offsets = np.memmap(self._offset_paths[k], np.int64, "r", shape=(int(self.doc_starts[k + 1] -
                                                                            self.doc_starts[k]) + 1,))
      fd = os.open(self.paths[k], os.O_RDONLY)
      # A plain view: no subclass cost per slice.
      entry = self._open_shards[k] = (fd, offsets.view(np.ndarray), offsets)
    return entry

  def _close_shard(self, k, _close=os.close):
    fd, _, _ = self._open_shards.pop(k)
    _close(fd)  # the map closes (and its descriptor with it) once no view of it is left
    self._touched.discard(k)

  def close(self):
    """Closes every open shard file (a later read opens them again)."""
    for k in list(getattr(self, "_open_shards", ())):
      self._close_shard(k)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __del__(self):
    # At interpreter exit module globals may already be None: `_close_shard` holds os.close itself.
    try:
      self.close()
    except Exception:  # pylint: disable=broad-except  (a finalizer must not raise)
      pass

  def _pread(self, k, start, stop):
    """Tokens [start, stop) of shard k (within it), in the file's dtype."""
    size = self.dtype.itemsize
    return np.frombuffer(os.pread(self._open(k)[0], (stop - start) * size, start * size), self.dtype)

  def _release(self, shards, rows):
    """Counts `rows` read from `shards`; every RELEASE_ROWS rows, drops this process's mappings of
    the offset pages read (madvise MADV_DONTNEED: they stay in the page cache), so binary searches
    do not map the whole index over a long run."""
    self._touched.update(shards)
    self._rows_read += rows
    if self._rows_read >= RELEASE_ROWS:
      for k in self._touched:
        if k in self._open_shards:
          self._open_shards[k][2]._mmap.madvise(mmap.MADV_DONTNEED)  # np.memmap keeps its mmap.mmap there
      self._touched, self._rows_read = set(), 0

  def read(self, start, stop):
    """Tokens [start, stop) of the split as int32, across shard boundaries."""
    out = np.empty(stop - start, np.int32)
    k = int(np.searchsorted(self.token_starts, start, "right")) - 1
    pos = start
    while pos < stop:
      end = min(stop, int(self.token_starts[k + 1]))
      base = int(self.token_starts[k])
      out[pos - start:end - start] = self._pread(k, pos - base, end - base)
      pos, k = end, k + 1
    return out


class TokenStream(_Shards):
  """A split as one token stream [num_tokens] (documents end in EOS), for LM windows."""

  def __len__(self):
    return self.num_tokens

  def _locate(self, starts):
    """(shard, start within the shard) of global positions, as Python ints."""
    starts = np.asarray(starts, np.int64)
    k = np.searchsorted(self.token_starts, starts, "right") - 1
    return zip(k.tolist(), (starts - self.token_starts[k]).tolist())

  def take(self, starts, length):
    """Rows of `length` consecutive tokens from each start: [len(starts), length] int32.

    A row is one positional read of its shard file: a batch reads only its rows.
    """
    out = np.empty((len(starts), length), np.int32)
    for i, (k, a) in enumerate(self._locate(starts)):
      if a + length <= self.token_counts[k]:
        out[i] = self._pread(k, a, a + length)
      else:  # a row across a shard boundary
        base = int(self.token_starts[k])
        out[i] = self.read(base + a, base + a + length)
    return out

  def document_starts(self, start, stop):
    """Global positions in (start, stop) where a document begins, ascending [n] int64."""
    found = []
    k = int(np.searchsorted(self.token_starts, start, "right")) - 1
    while k < len(self.offsets) and self.token_starts[k] < stop:
      base = int(self.token_starts[k])
      offs = self.offsets[k]
      lo, hi = offs.searchsorted(start - base, "right"), offs.searchsorted(stop - base, "left")
      found.append(offs[lo:hi] + base)
      k += 1
    return np.concatenate(found) if len(found) > 1 else found[0] if found else np.zeros(0, np.int64)

  def segments(self, starts, length):
    """Segment ids (from 1) and positions (from 0) of rows `take(starts, length)`: both restart
    at the row start and at every document start. Returns two [len(starts), length] int32.

    Vectorized per shard: one binary search of all its rows' ends in its document offsets.
    """
    starts = np.asarray(starts, np.int64)
    new = np.zeros((len(starts), length), bool)
    k = np.searchsorted(self.token_starts, starts, "right") - 1
    local = starts - self.token_starts[k]
    inside = local + length <= np.asarray(self.token_counts, np.int64)[k]
    for shard in np.unique(k[inside]).tolist():
      rows = np.flatnonzero(inside & (k == shard))
      offs, a = self.offsets[shard], local[rows]
      lo, hi = offs.searchsorted(a + 1), offs.searchsorted(a + length)  # documents starting inside
      count = hi - lo
      row = np.repeat(np.arange(len(rows)), count)
      doc = np.repeat(lo - np.cumsum(count) + count, count) + np.arange(count.sum())
      new[rows[row], offs[doc] - a[row]] = True
    for r in np.flatnonzero(~inside).tolist():  # rows across a shard boundary
      new[r, self.document_starts(int(starts[r]), int(starts[r]) + length) - starts[r]] = True
    self._release(np.unique(k).tolist(), len(starts))
    new[:, 0] = False
    idx = np.broadcast_to(np.arange(length), new.shape)
    begin = np.maximum.accumulate(np.where(new, idx, 0), axis=1)
    return (1 + np.cumsum(new, axis=1)).astype(np.int32), (idx - begin).astype(np.int32)

  def documents(self):
    """Yields every document as an int32 array (EOS included), in order."""
    for k, offs in enumerate(self.offsets):
      tokens = self._pread(k, 0, self.token_counts[k])
      for a, b in zip(offs[:-1], offs[1:]):
        yield tokens[a:b].astype(np.int32)


class RaggedShards(_Shards):
  """A split as variable-length sequences (translation sentences): the `data.Ragged`
  interface (`lengths`, `gather`, `len`), reading only the rows asked for.

  `lengths` [num_docs] int64 is the one array held in memory (8 bytes per sentence):
  length buckets are built from it alone.
  """

  def __init__(self, data_dir, split, field, manifest=None):
    super().__init__(data_dir, split, field, manifest)
    self.lengths = np.concatenate([np.diff(np.asarray(o)) for o in self.offsets] or [np.zeros(0, np.int64)])

  def __len__(self):
    return self.num_docs

  def __getitem__(self, i):
    k = int(np.searchsorted(self.doc_starts, i, "right")) - 1
    j = i - int(self.doc_starts[k])
    return self._pread(k, int(self.offsets[k][j]), int(self.offsets[k][j + 1])).astype(np.int32)

  def gather(self, idx, length):
    """Rows `idx` [B] as [B, length] int32, zero-padded on the right (truncated past `length`)."""
    idx = np.asarray(idx, np.int64)
    out = np.zeros((len(idx), length), np.int32)
    k = np.searchsorted(self.doc_starts, idx, "right") - 1
    j = idx - self.doc_starts[k]
    for row, (kk, jj) in enumerate(zip(k.tolist(), j.tolist())):
      offs = self.offsets[kk]
      begin = int(offs[jj])
      seq = self._pread(kk, begin, min(int(offs[jj + 1]), begin + length))
      out[row, :len(seq)] = seq
    self._release(set(k.tolist()), len(idx))
    return out
