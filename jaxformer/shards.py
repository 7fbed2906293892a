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
"""

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


class _Shards:
  """The shards of one field of one split: token files read by position, offsets memory-mapped.

  Why not map the tokens too: a read through a memory map maps the page-cache folio around it
  into the process (hundreds of KiB per random window with large folios), so random windows
  grow the process's RSS towards the size of the corpus (measured: +800 MiB after 3,000
  windows of a 2 GB corpus, and 12 us per window against 6 us for a positional read;
  nanoGPT re-creates its np.memmap every batch for the same reason).
  """

  def __init__(self, data_dir, split, field, manifest=None):
    manifest = manifest or read_manifest(data_dir)
    if manifest is None or not manifest.get("complete"):
      raise UserError(f"{data_dir} holds no prepared data: run python -m jaxformer.prepare --config NAME")
    if split not in manifest["splits"]:
      raise UserError(f"{data_dir} has no {split} split (it has {', '.join(manifest['splits'])})")
    self.dtype = np.dtype(manifest["dtype"])
    self.paths, self.offsets, self._offset_maps, self._fds = [], [], [], []
    token_counts, doc_counts = [], []
    for index, info in enumerate(manifest["splits"][split]["shards"]):
      stem = shard_stem(data_dir, split, index)
      self.paths.append(token_path(stem, field))
      self._fds.append(os.open(self.paths[-1], os.O_RDONLY))
      self._offset_maps.append(np.memmap(offsets_path(stem, field), np.int64, "r", shape=(info["docs"] + 1,)))
      self.offsets.append(self._offset_maps[-1].view(np.ndarray))  # plain views: no subclass cost per slice
      token_counts.append(info["tokens"][field])
      doc_counts.append(info["docs"])
    self.token_counts = token_counts
    self.token_starts = np.concatenate([[0], np.cumsum(token_counts, dtype=np.int64)])
    self.doc_starts = np.concatenate([[0], np.cumsum(doc_counts, dtype=np.int64)])
    self.num_tokens = int(self.token_starts[-1])
    self.num_docs = int(self.doc_starts[-1])
    self._touched, self._rows_read = set(), 0

  def __del__(self):
    for fd in getattr(self, "_fds", ()):
      os.close(fd)

  def _pread(self, k, start, stop):
    """Tokens [start, stop) of shard k (within it), in the file's dtype."""
    size = self.dtype.itemsize
    return np.frombuffer(os.pread(self._fds[k], (stop - start) * size, start * size), self.dtype)

  def _release(self, shards, rows):
    """Counts `rows` read from `shards`; every RELEASE_ROWS rows, drops this process's mappings of
    the offset pages read (madvise MADV_DONTNEED: they stay in the page cache), so binary searches
    do not map the whole index over a long run."""
    self._touched.update(shards)
    self._rows_read += rows
    if self._rows_read >= RELEASE_ROWS:
      for k in self._touched:
        self._offset_maps[k]._mmap.madvise(mmap.MADV_DONTNEED)  # np.memmap keeps its mmap.mmap there
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
