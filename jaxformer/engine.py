"""The serving engine: continuous batching over a paged KV pool with a cross-request prefix cache (no HTTP).

    engine = Engine(model, params, max_batch=8, kv_blocks=256, block_size=16, max_seq_len=512)
    engine.warm_up()                                  # compiles every program it will ever run
    request = engine.submit(prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_work(): engine.step()            # or engine.start(): a thread runs the steps

A fixed number of decode slots (`max_batch`) run together; requests wait in a FIFO queue and take a
free slot at the next step, and leave the moment they finish (a stop id, `max_tokens`, the length
limit, `cancel`), freeing their slot and blocks. Each step prefills at most `prefill_chunk` prompt
tokens (one request's chunk at a time, padded to a few static bucket sizes) and then runs one decode
step over all slots, so a long prompt never stalls the running requests for more than a chunk.

KV memory is a pool of `kv_blocks` blocks of `block_size` tokens (`kv_pool.BlockPool`); a request holds
a block table. Full prompt blocks are cached by a chained hash of their tokens, shared by later
requests with the same prefix (which prefill only the rest) and evicted least recently used.

The model is not forked: each step gathers every row's blocks into the per-row cache layout that
`layers.Attention`'s decode path reads (history right-aligned so that all rows write at one shared
`cache_index`, left padding invisible as segment 0, exactly as `decode.generate` lays out left-padded
prompts), calls `decode._lm_step`, and scatters the new keys and values back into the pool. Sampling
is `decode.sample_rows` (the filters `decode.generate` uses, with per-row settings). The gather costs a
copy of each row's history per step; an attention that reads the block table directly would not.
"""

import collections
import dataclasses
import functools
import itertools
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import decode
from jaxformer import kv_pool
from jaxformer import layers
from jaxformer.errors import UserError

TOP_LOGPROBS = 20  # the most alternatives a token's logprobs may list (OpenAI's limit)
_COMPILES = [0]


def _count_compile(event, *args, **kwargs):
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compilations():
  """XLA programs compiled (or loaded from the persistent cache) in this process so far."""
  return _COMPILES[0]


@dataclasses.dataclass
class SamplingParams:
  """How one request samples: temperature 0 is greedy; top_k 0 and top_p 1 are off; stop_ids end the
  request (the id is kept in the output); logprobs: how many alternatives to return per token (0: none)."""
  max_tokens: int = 16
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  stop_ids: tuple = ()
  logprobs: int = 0


@dataclasses.dataclass(eq=False)
class Request:
  """One request's state; `output` grows by one token per step once prefilled."""
  id: int
  prompt: list
  params: SamplingParams
  on_event: object = None          # called (request) from the engine's thread after each new token / the end
  output: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)   # per token: (logprob, [(id, logprob), ...])
  finish_reason: str = None        # "stop", "length", "cancelled"
  slot: int = None
  blocks: list = dataclasses.field(default_factory=list)
  keys: list = dataclasses.field(default_factory=list)      # prefix-cache keys of its full prompt blocks
  computed: int = 0                # tokens whose keys and values are in the pool
  cached_tokens: int = 0           # of them, read from the prefix cache
  cancel_reason: str = None
  arrival: float = 0.0
  first_token_time: float = None
  finish_time: float = None

  @property
  def finished(self):
    """Whether it has ended (finish_reason set)."""
    return self.finish_reason is not None


class QueueFull(Exception):
  """The waiting queue holds `max_waiting` requests already."""


def _leaf_key(path):
  return path[-1].key


def _is_scanned(path):
  return any(getattr(k, "key", None) == "layers" for k in path)


class Engine:
  """Continuous batching of one decoder-only model; see the module docstring. Not thread-safe except
  `submit` and `cancel`, which may be called from any thread while `start()`'s thread runs the steps."""

  def __init__(self, model, params, max_batch=8, kv_blocks=None, block_size=16, max_seq_len=None,
               prefill_chunk=256, max_waiting=256, min_chunk=16):
    cfg = model.cfg
    if cfg.arch != "decoder_only":
      raise UserError("the serving engine takes decoder-only models; a translation model is served by eval.py")
    if cfg.sliding_window:
      raise UserError("the serving engine does not handle sliding-window (local) attention layers yet "
                      f"(model.sliding_window={cfg.sliding_window}); use python -m jaxformer.generate")
    max_seq_len = max_seq_len or cfg.max_len
    if cfg.position == "learned" and max_seq_len > cfg.max_len:
      raise UserError(f"--max-seq-len {max_seq_len} is past the model's {cfg.max_len}-position table")
    if max_batch < 1 or block_size < 1 or prefill_chunk < 1:
      raise UserError("--max-batch, the block size and --prefill-chunk must be at least 1")
    self.model, self.params = model, params
    self.block_size = block_size
    self.blocks_per_seq = -(-max_seq_len // block_size)
    self.max_seq_len = max_seq_len
    self.max_batch, self.max_waiting = max_batch, max_waiting
    kv_blocks = kv_blocks or max_batch * self.blocks_per_seq
    self.pool = kv_pool.BlockPool(kv_blocks, block_size)
    # Chunk buckets: powers of two from min_chunk up to prefill_chunk (a few static shapes).
    self.prefill_chunk = prefill_chunk
    self.buckets = sorted({min(prefill_chunk, min_chunk * 2 ** i)
                           for i in range(max(1, int(np.ceil(np.log2(max(prefill_chunk / min_chunk, 1)))) + 1))})
    # Decode gathers each row's history into one of a few widths (blocks): the smallest that holds the
    # longest row, so a batch of short requests does not copy max_seq_len slots per row per layer.
    self.history_buckets = sorted({min(self.blocks_per_seq, max(1, 32 // block_size) * 2 ** i)
                                   for i in range(int(np.ceil(np.log2(max(self.blocks_per_seq, 1)))) + 1)})
    self.kv = self._init_kv(kv_blocks + 1)            # + the scratch block
    self.slots = [None] * max_batch
    self.waiting = collections.deque()
    self._lock = threading.Lock()
    self._wake = threading.Condition(self._lock)
    self._ids = itertools.count()
    self._step_fn = _step_program(model, block_size)
    self._thread, self._stop = None, False
    self.stats = collections.Counter()                 # prompt/cached/generated tokens, steps, outcomes

  # --------------------------------------------------------------------------- memory

  def _cache_shapes(self, rows, length):
    return decode._cache_shapes(self.model, rows, length, 1)

  def _init_kv(self, num_blocks):
    """The pool's arrays: for each layer's cached_key / cached_value, [(layers,) blocks * block_size, kv_heads, head_dim]."""
    kv = []
    for path, s in jax.tree_util.tree_leaves_with_path(self._cache_shapes(2, 2)):
      if _leaf_key(path) in ("cached_key", "cached_value"):
        lead = s.shape[:1] if _is_scanned(path) else ()
        kv.append(jnp.zeros(lead + (num_blocks * self.block_size, s.shape[-3], s.shape[-1]), s.dtype))
    # Committed to the device as every step's output is, so the warm-up compiles what serving calls.
    return jax.device_put(kv, jax.devices()[0])

  def capacity_tokens(self):
    """Tokens the KV pool holds."""
    return self.pool.num_blocks * self.block_size

  # --------------------------------------------------------------------------- requests

  def check(self, prompt, params):
    """UserError (one line, naming the limit) when the request can never run here."""
    if not prompt:
      raise UserError("the prompt is empty: give at least one token")
    if params.max_tokens < 1:
      raise UserError(f"max_tokens must be at least 1, got {params.max_tokens}")
    total = len(prompt) + params.max_tokens - 1   # the last token is never fed back
    if len(prompt) >= self.max_seq_len or total > self.max_seq_len:
      raise UserError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) is past the "
                      f"context of {self.max_seq_len} tokens (--max-seq-len): shorten the prompt or ask for fewer tokens")
    if self._blocks_for(total) > self.pool.num_blocks:
      raise UserError(f"this request needs {self._blocks_for(total)} KV blocks, the pool has {self.pool.num_blocks} "
                      "(--kv-blocks): shorten it")

  def _blocks_for(self, tokens):
    return -(-tokens // self.block_size)

  def submit(self, prompt, params=None, on_event=None):
    """Queues a request (prompt: list of token ids) -> Request. QueueFull when `max_waiting` wait already."""
    params = params or SamplingParams()
    prompt = [int(t) for t in prompt]
    self.check(prompt, params)
    with self._lock:
      if len(self.waiting) >= self.max_waiting:
        raise QueueFull(f"{len(self.waiting)} requests are waiting (--max-waiting {self.max_waiting})")
      request = Request(next(self._ids), prompt, params, on_event, arrival=time.perf_counter())
      self.waiting.append(request)
      self._wake.notify()
    return request

  def cancel(self, request, reason="cancelled"):
    """Ends a request at the next step (a client that went away, a stop string); its slot and blocks are freed then."""
    with self._lock:
      request.cancel_reason = reason
      self._wake.notify()

  def has_work(self):
    """Whether a request waits or runs."""
    return bool(self.waiting) or any(s is not None for s in self.slots)

  def running(self):
    """Requests in a slot."""
    return sum(s is not None for s in self.slots)

  # --------------------------------------------------------------------------- scheduling

  def _finish(self, request, reason):
    request.finish_reason = reason
    request.finish_time = time.perf_counter()
    if request.slot is not None:
      self.slots[request.slot] = None
      request.slot = None
    self.pool.release(reversed(request.blocks))   # a prefix's tail is evicted before its head
    request.blocks = []
    self.stats[f"finished_{reason}"] += 1
    if request.on_event:
      request.on_event(request)

  def _admit(self):
    """Moves waiting requests into free slots (FIFO) while the pool can hold their whole length."""
    with self._lock:
      for request in list(self.waiting):
        if request.cancel_reason:
          self.waiting.remove(request)
          self._finish(request, request.cancel_reason)
      while self.waiting and None in self.slots:
        request = self.waiting[0]
        keys = kv_pool.block_hashes(request.prompt, self.block_size)
        keys = keys[:(len(request.prompt) - 1) // self.block_size]   # the last prompt token is always run
        hits = self.pool.lookup(keys)
        need = self._blocks_for(len(request.prompt) + request.params.max_tokens - 1) - len(hits)
        fresh = self.pool.allocate(need)
        if fresh is None:                       # wait for running requests to free blocks
          self.pool.release(reversed(hits))
          return
        self.waiting.popleft()
        request.blocks, request.keys = hits + fresh, keys
        request.computed = request.cached_tokens = len(hits) * self.block_size
        request.slot = self.slots.index(None)
        self.slots[request.slot] = request
        self.stats["prompt_tokens"] += len(request.prompt)
        self.stats["cached_tokens"] += request.cached_tokens

  def _table(self, request):
    table = np.zeros(self.blocks_per_seq, np.int32)
    table[:len(request.blocks)] = request.blocks
    return table

  def _sampling_rows(self, requests):
    p = [r.params if r else SamplingParams() for r in requests]
    return (np.array([x.temperature for x in p], np.float32), np.array([x.top_k for x in p], np.int32),
            np.array([x.top_p for x in p], np.float32), np.array([x.seed for x in p], np.int32),
            np.array([len(r.output) if r else 0 for r in requests], np.int32))

  def _run(self, requests, tokens, n_real, history, width=None):
    """One program call over rows `requests` (None: an idle row), their histories gathered into `width`
    blocks (default: all) -> per row (token, logprob, top ids, top logprobs)."""
    tables = np.stack([self._table(r) if r else np.zeros(self.blocks_per_seq, np.int32) for r in requests])
    tables = tables[:, :width or self.blocks_per_seq]
    want = np.bool_(any(r is not None and r.params.logprobs for r in requests))
    out, self.kv = self._step_fn(self.params, self.kv, tokens, n_real, history, tables,
                                 *self._sampling_rows(requests), want)
    return jax.device_get(out)

  def _emit(self, request, token, logprob, top_ids, top_logprobs):
    now = time.perf_counter()
    if request.first_token_time is None:
      request.first_token_time = now
    request.output.append(int(token))
    if request.params.logprobs:
      k = request.params.logprobs
      request.logprobs.append((float(logprob), list(zip(top_ids[:k].tolist(), top_logprobs[:k].tolist()))))
    self.stats["generated_tokens"] += 1
    if request.cancel_reason:
      self._finish(request, request.cancel_reason)
    elif int(token) in request.params.stop_ids:
      self._finish(request, "stop")
    elif len(request.output) >= request.params.max_tokens:
      self._finish(request, "length")
    elif request.on_event:
      request.on_event(request)

  def _prefill(self):
    """Runs up to `prefill_chunk` prompt tokens of the requests still prefilling, in bucket-sized calls."""
    budget = self.prefill_chunk
    for request in [r for r in self.slots if r is not None and r.computed < len(r.prompt)]:
      while budget > 0 and request.computed < len(request.prompt):
        n = min(len(request.prompt) - request.computed, budget)
        # The largest bucket that fits takes a chunk without padding (80 tokens: 64, then 16 in this step);
        # only a remainder below the smallest bucket is padded.
        bucket = max([b for b in self.buckets if b <= n], default=self.buckets[0])
        n = min(n, bucket)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, bucket - n:] = request.prompt[request.computed:request.computed + n]   # left-padded
        out = self._run([request], tokens, np.array([n], np.int32), np.array([request.computed], np.int32))
        request.computed += n
        budget -= n
        self.stats["prefilled_tokens"] += n
        for i in range(request.cached_tokens // self.block_size, request.computed // self.block_size):
          if i < len(request.keys):
            self.pool.register(request.blocks[i], request.keys[i])
      if request.computed == len(request.prompt):
        self._emit(request, *(x[0] for x in out))

  def _decode(self):
    """One token for every slot past its prompt (idle rows ride along, writing the scratch block)."""
    rows = [r if r is not None and r.computed >= len(r.prompt) and r.output else None for r in self.slots]
    if not any(rows):
      return
    tokens = np.array([[r.output[-1] if r else 0] for r in rows], np.int32)
    n_real = np.array([1 if r else 0 for r in rows], np.int32)
    history = np.array([r.computed if r else 0 for r in rows], np.int32)
    width = next(w for w in self.history_buckets if w * self.block_size > history.max())
    out = self._run(rows, tokens, n_real, history, width)
    for b, r in enumerate(rows):
      if r is not None:
        r.computed += 1
        self._emit(r, *(x[b] for x in out))

  def step(self):
    """One engine step: end cancelled requests, admit waiting ones, a prefill chunk, a decode step."""
    for r in list(self.slots):
      if r is not None and r.cancel_reason:
        self._finish(r, r.cancel_reason)
    self._admit()
    self._prefill()
    self._decode()
    self.stats["steps"] += 1

  def run_until_done(self):
    """Steps until no request waits or runs (tests, scripts)."""
    while self.has_work():
      self.step()

  # --------------------------------------------------------------------------- warm-up and thread

  def warm_up(self):
    """Compiles every program the engine runs (each prefill bucket; the decode step at each history width)
    -> seconds taken.
    The rows write only the scratch block (n_real 0), so the pool is left as it was."""
    start = time.perf_counter()
    programs = [(1, b, None) for b in self.buckets] + [(self.max_batch, 1, w) for w in self.history_buckets]
    for rows, chunk, width in programs:
      idle = [None] * rows
      self._run(idle, np.zeros((rows, chunk), np.int32), np.zeros(rows, np.int32), np.zeros(rows, np.int32), width)
    return time.perf_counter() - start

  def start(self):
    """Runs the steps in a thread of their own until `stop()`."""
    self._stop = False
    self._thread = threading.Thread(target=self._loop, name="jaxformer-engine", daemon=True)
    self._thread.start()

  def _loop(self):
    while True:
      with self._lock:
        while not self._stop and not self.has_work():
          self._wake.wait()
        if self._stop:
          return
      self.step()

  def stop(self):
    """Ends `start()`'s thread after its current step (requests still running stay as they are)."""
    with self._lock:
      self._stop = True
      self._wake.notify()
    if self._thread:
      self._thread.join()


@functools.lru_cache(maxsize=8)
def _step_program(model, block_size):
  """The jitted `_step` for a model and block size, shared by the engines of a process (one compile per shape);
  the pool is donated, so the scatter updates it in place."""
  return jax.jit(functools.partial(_step, model, block_size), donate_argnums=(1,))


def _step(model, block_size, params, kv, tokens, n_real, history, tables, temperature, top_k, top_p, seed, index,
          want_logprobs):
  """One engine program: rows' chunks through the model over their gathered blocks -> samples, new pool.

  tokens [rows, chunk] (each row's n_real [rows] real tokens at the end, left-padded), history [rows]
  tokens already in the pool before them, tables [rows, blocks_per_seq] block ids. The sample of row b
  uses key fold_in(PRNGKey(seed[b]), index[b]) (index: the tokens it generated so far), as
  `decode.generate` folds the step into its key.
  """
  rows, chunk = tokens.shape
  shapes = decode._cache_shapes(model, rows, 1, 1)  # the tree's structure, layer axes and dtypes
  hist_slots = tables.shape[1] * block_size          # a row's whole history fits (max_seq_len)
  slot = jnp.arange(hist_slots)[None]                                 # [1, hist_slots]
  p = slot - (hist_slots - history[:, None])                          # token index of each history slot
  valid = p >= 0
  pc = jnp.maximum(p, 0)
  src = jnp.take_along_axis(tables, pc // block_size, 1) * block_size + pc % block_size   # [rows, hist_slots]
  src = jnp.where(valid, src, 0)
  c = jnp.arange(chunk)[None]
  real = c >= chunk - n_real[:, None]
  q_pos = history[:, None] + c - (chunk - n_real[:, None])           # [rows, chunk]
  dest = jnp.take_along_axis(tables, jnp.maximum(q_pos, 0) // block_size, 1) * block_size + jnp.maximum(q_pos, 0) % block_size
  dest = jnp.where(real, dest, 0)                                     # pads write the scratch block
  segment = jnp.concatenate([valid, jnp.zeros((rows, chunk), bool)], 1).astype(jnp.int32)
  position = jnp.concatenate([jnp.where(valid, p, 0), jnp.zeros((rows, chunk), jnp.int32)], 1)
  head_major = layers.kv_slots_axis(rows) == 2

  kv_iter = iter(kv)

  def gathered(path, s):
    name, scanned = _leaf_key(path), _is_scanned(path)
    lead = s.shape[:1] if scanned else ()
    if name in ("cached_key", "cached_value"):
      pool = next(kv_iter)
      x = jnp.take(pool, src, axis=1 if scanned else 0)              # [(layers,) rows, hist, kv_heads, d]
      x = jnp.concatenate([x, jnp.zeros(x.shape[:-3] + (chunk,) + x.shape[-2:], x.dtype)], -3)
      return jnp.swapaxes(x, -3, -2) if head_major else x
    if name == "cached_segment":
      return jnp.broadcast_to(segment, lead + segment.shape)
    if name == "cached_position":
      return jnp.broadcast_to(position, lead + position.shape)
    if name == "cache_index":
      return jnp.full(s.shape, hist_slots, s.dtype)
    raise ValueError(f"the serving engine cannot lay out the cache entry {path}")

  cache = jax.tree_util.tree_map_with_path(gathered, shapes)
  logits, cache = decode._lm_step(model, params, cache, tokens, real.astype(jnp.int32), jnp.maximum(q_pos, 0))
  logits = logits[:, -1]
  new_kv = []
  flat_dest = dest.reshape(-1)
  for (path, x), pool in zip([(pa, x) for pa, x in jax.tree_util.tree_leaves_with_path(cache)
                              if _leaf_key(pa) in ("cached_key", "cached_value")], kv):
    scanned = _is_scanned(path)
    if head_major:
      x = jnp.swapaxes(x, -3, -2)
    x = x[..., hist_slots:, :, :]                                     # [(layers,) rows, chunk, kv_heads, d]
    x = x.reshape(x.shape[:-4] + (rows * chunk,) + x.shape[-2:])
    new_kv.append(pool.at[:, flat_dest].set(x) if scanned else pool.at[flat_dest].set(x))
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seed, index)
  token = decode.sample_rows(logits, keys, temperature, top_k, top_p)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  chosen = jnp.take_along_axis(logp, token[:, None], 1)[:, 0]
  k = min(TOP_LOGPROBS, logp.shape[-1])
  top_logp, top_ids = jax.lax.cond(  # a top-k over the vocabulary only when some row asks for logprobs
      want_logprobs, lambda: tuple(jax.lax.top_k(logp, k)),
      lambda: (jnp.zeros((rows, k), logp.dtype), jnp.zeros((rows, k), jnp.int32)))
  return (token, chosen, top_ids, top_logp), new_kv
