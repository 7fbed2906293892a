"""The serving engine's KV memory: a pool of fixed-size blocks with reference counts and a prefix cache.

Host-side bookkeeping only (no arrays): which physical blocks are free, which hold a cached run of
prompt tokens, and how many requests read each one (vLLM's PagedAttention block manager with its
automatic prefix caching). A full block of prompt tokens is keyed by a chained hash of every token up
to its end, so equal keys mean equal prefixes; a block no request reads stays cached until the pool
runs short, then the least recently used goes first.

Block 0 is a scratch block nothing reads: padded rows of a step write there.
"""

import collections
import hashlib

import numpy as np

SCRATCH = 0


def block_hashes(tokens, block_size):
  """Chained keys of the full blocks of `tokens` (list of int): key i covers tokens[: (i + 1) * block_size]."""
  keys, parent = [], b""
  for start in range(0, len(tokens) - block_size + 1, block_size):
    block = np.asarray(tokens[start:start + block_size], np.int64).tobytes()
    parent = hashlib.blake2b(parent + block, digest_size=16).digest()
    keys.append(parent)
  return keys


class BlockPool:
  """`num_blocks` usable blocks (ids 1..num_blocks; 0 is the scratch block) of `block_size` tokens."""

  def __init__(self, num_blocks, block_size):
    self.num_blocks, self.block_size = num_blocks, block_size
    self.refs = np.zeros(num_blocks + 1, np.int32)
    self.key_of = {}                                  # block -> its prefix key, for cached blocks
    self.by_key = {}                                  # prefix key -> block
    self.free = collections.deque(range(1, num_blocks + 1))
    self.evictable = collections.OrderedDict()        # cached blocks no request reads, least recent first
    self.evictions = 0

  def available(self):
    """Blocks an allocation may take: free ones and cached ones no request reads."""
    return len(self.free) + len(self.evictable)

  def used(self):
    """Blocks read by at least one request."""
    return self.num_blocks - self.available()

  def lookup(self, keys):
    """The cached blocks of the longest leading run of `keys`, each now read once more (ref-counted)."""
    hits = []
    for key in keys:
      block = self.by_key.get(key)
      if block is None:
        break
      hits.append(block)
    for block in hits:
      self.evictable.pop(block, None)
      self.refs[block] += 1
    return hits

  def allocate(self, n):
    """n blocks for one request (ref 1 each), evicting least recently used cached blocks when the free
    list runs out; None (and nothing taken) when fewer than n are available."""
    if n > self.available():
      return None
    out = []
    for _ in range(n):
      if self.free:
        block = self.free.popleft()
      else:
        block, _ = self.evictable.popitem(last=False)
        del self.by_key[self.key_of.pop(block)]
        self.evictions += 1
      self.refs[block] = 1
      out.append(block)
    return out

  def register(self, block, key):
    """Marks `block` (fully written) as holding the prefix `key`; a key already cached keeps its block."""
    if key not in self.by_key and block not in self.key_of:
      self.by_key[key] = block
      self.key_of[block] = key

  def release(self, blocks):
    """One reader fewer for each block; an unread cached block becomes evictable (most recent last)."""
    for block in blocks:
      self.refs[block] -= 1
      assert self.refs[block] >= 0, block
      if self.refs[block] == 0:
        if block in self.key_of:
          self.evictable[block] = None
        else:
          self.free.append(block)
