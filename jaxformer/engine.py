"""The serving engine: continuous batching over a paged KV pool with a cross-request prefix cache (no HTTP).

    engine = Engine(model, params, max_batch=8, kv_blocks=256, block_size=16, max_seq_len=512)
    engine.warm_up()                                  # compiles every program it will ever run
    request = engine.submit(prompt_ids, SamplingParams(max_tokens=32))
    while engine.has_work(): engine.step()            # or engine.start(): a thread runs the steps

A fixed number of decode slots (`max_batch`) run together; requests wait in a FIFO queue and take a
free slot at the next step, and leave the moment they finish (a stop id, `max_tokens`, the length
limit, `cancel`), freeing their slot and blocks. Each step feeds at most `prefill_chunk` prompt tokens
(the oldest prompts' next pieces packed side by side in one row, each its own segment, padded to a few
static bucket sizes) and one token of every running request, so a long prompt never stalls the running
requests for more than a chunk. With the paged kernel both go in one call (the running requests' tokens
are pieces of the same row), so the weights are read once per step; otherwise a prefill call and a decode
call over all slots.

KV memory is a pool of `kv_blocks` blocks of `block_size` tokens (`kv_pool.BlockPool`); a request holds
a block table that grows a block at a time as it generates (admitted with its prompt's blocks, one spare
block per running request left over). When a running request needs a block and none is left, the newest
running request is preempted (vLLM's recompute preemption): its full blocks go to the prefix cache, its
blocks are released, and it waits at the head of the queue; readmitted, it reads those blocks back from
the cache (unless evicted meanwhile) and prefills the rest of its prompt and output, then goes on
sampling where it stopped (same seed and step index). Full blocks are cached by a chained hash of their
tokens, shared by later requests with the same prefix (which prefill only the rest) and evicted least
recently used.

The model is not forked: each call hands every layer its pool arrays and, per row, where its history lies
(`history_slots`: pool slots; `history_segment`: 0 for empty slots, pieces packed in a row told apart by their
segment ids as training's packed rows are; `history_position`); `layers.Attention` then attends over the pool
with `layers.paged_attention` (the C++ kernel of `jaxformer.paged` on CPU: no copy of the history; else one
gather and the model's attention) and hands back the new keys and values, which `_step` writes into the pool.
On one CPU device a float model's dense kernels are laid out output-major once (`qmatmul.output_major`), so
decode steps multiply through the float32 C++ kernel (`Engine.dense_fallback` says why not elsewhere).
The host makes every index array (`Engine._layout`). Sampling is `decode.sample_rows` (the filters
`decode.generate` uses, with per-row settings). A sliding-window layer masks by position (its keys outside the
window stay in the pool until the request ends).
"""

import collections
import contextlib
import dataclasses
import functools
import itertools
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import NamedSharding, PartitionSpec as P

from jaxformer import decode
from jaxformer import kv_pool
from jaxformer import model as model_lib
from jaxformer import paged
from jaxformer import qmatmul
from jaxformer import sharding
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
  request (the id is kept in the output); logprobs: how many alternatives to return per token (0: none);
  prompt_logprobs: also score every prompt token after the first (with `logprobs` alternatives each), as
  vLLM's prompt_logprobs and OpenAI's echo do; max_tokens 0 then only scores the prompt."""
  max_tokens: int = 16
  temperature: float = 0.0
  top_p: float = 1.0
  top_k: int = 0
  seed: int = 0
  stop_ids: tuple = ()
  logprobs: int = 0
  prompt_logprobs: bool = False


@dataclasses.dataclass(eq=False)
class Request:
  """One request's state; `output` grows by one token per step once prefilled."""
  id: int
  prompt: list
  params: SamplingParams
  on_event: object = None          # called (request) from the engine's thread after each new token / the end
  output: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)   # per token: (logprob, [(id, logprob), ...])
  prompt_logprobs: list = None     # per prompt token (params.prompt_logprobs): as `logprobs`; None for the first
  prompt_scored: bool = False      # every prompt token scored (until then the prefix cache is not read)
  finish_reason: str = None        # "stop", "length", "cancelled"
  slot: int = None
  blocks: list = dataclasses.field(default_factory=list)
  keys: list = dataclasses.field(default_factory=list)      # prefix-cache keys of its full prompt blocks
  computed: int = 0                # tokens whose keys and values are in the pool
  prefill_to: int = 0              # tokens to prefill: the prompt, + the output so far when resumed
  admitted: int = None             # admission order (the newest running request is preempted first)
  preemptions: int = 0
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
               prefill_chunk=256, max_waiting=256, min_chunk=16, mesh=None):
    """mesh: serve over these devices (`sharding.make_mesh`): the weights sharded by the training rule table,
    the KV pool over kv heads on `tensor`; None: one device."""
    cfg = model.cfg
    if cfg.arch != "decoder_only":
      raise UserError("the serving engine takes decoder-only models; a translation model is served by eval.py")
    max_seq_len = max_seq_len or cfg.max_len
    if cfg.position == "learned" and max_seq_len > cfg.max_len:
      raise UserError(f"--max-seq-len {max_seq_len} is past the model's {cfg.max_len}-position table")
    if max_batch < 1 or block_size < 1 or prefill_chunk < 1:
      raise UserError("--max-batch, the block size and --prefill-chunk must be at least 1")
    self.model, self.mesh = model, mesh
    self.params = params if mesh is None else _shard_params(model, params, mesh)
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
    # A row's history slot lists have a static width (blocks). The paged kernel reads only the slots a row
    # holds, so one width (a context) serves every step. The gather path copies the whole width: there
    # decode takes the smallest of a few widths that holds the longest row, 2x and 1.5x apart in turn (32,
    # 48, 64, 96, ... slots: a step pays for at most a third more than its longest row), and a prefill row,
    # holding its pieces' histories side by side (at most one context's worth: a piece that would pass it
    # waits a step), fewer widths (x4 apart); each (chunk, width) pair is a program.
    # None when the paged kernel runs, else why attention takes the gather path.
    self.paged_fallback = paged.why_not(self.kv_dtype(model), alibi=cfg.position == "alibi",
                                      matmul_dtype=cfg.matmul_dtype, scanned=cfg.scan_layers,
                                      devices=1 if mesh is None else mesh.size)
    # None when decode steps take JAX's Pallas TPU paged-attention kernel (prefill keeps the gather), else why not.
    self.pallas_fallback = paged.pallas_why_not(cfg, self.kv_dtype(model), devices=1 if mesh is None else mesh.size)
    doubling = sorted({min(self.blocks_per_seq, max(1, 32 // block_size) * 2 ** i)
                       for i in range(int(np.ceil(np.log2(max(self.blocks_per_seq, 1)))) + 1)})
    self.history_buckets = sorted(set(doubling) | {min(self.blocks_per_seq, w * 3 // 2) for w in doubling if w > 1})
    self.max_history = self.blocks_per_seq * block_size
    self.prefill_widths = sorted(set(doubling[::2]) | {self.blocks_per_seq})
    if self.paged_fallback is None:
      self.history_buckets = self.prefill_widths = [self.blocks_per_seq]
    # None when the dense products take the CPU kernel (the weights laid out output-major once, here), else why not.
    self.dense_fallback = _dense_why_not(model, self.params, self.paged_fallback)
    if self.dense_fallback is None:
      self.params = qmatmul.output_major(self.params, model_lib.quantizable(cfg))
    self.mixed_width = self.blocks_per_seq * (max_batch + 1)   # every running request's history + the prompts'
    self.max_pack = min(max_batch, 8)                  # prompts packed in one prefill call, at most
    self.kv = self._init_kv(kv_blocks + 1)            # + the scratch block
    self.slots = [None] * max_batch
    self.waiting = collections.deque()
    self._lock = threading.Lock()
    self._wake = threading.Condition(self._lock)
    self._ids = itertools.count()
    self._admissions = itertools.count()
    self._preempted_at = -1
    self._step_fn = _step_program(model, mesh, self._kv_shardings(self.kv))
    self._thread, self._stop = None, False
    self.stats = collections.Counter()                 # prompt/cached/generated tokens, steps, outcomes

  # --------------------------------------------------------------------------- memory

  def _cache_shapes(self, rows, length):
    return decode._cache_shapes(self.model, rows, length, 1)

  @staticmethod
  def kv_dtype(model):
    """The dtype of the model's cached keys and values (the pool's)."""
    return next(s.dtype for path, s in jax.tree_util.tree_leaves_with_path(decode._cache_shapes(model, 2, 2, 1))
                if _leaf_key(path) == "cached_key")

  def _init_kv(self, num_blocks):
    """The pool's arrays (`pool_shapes`), zeros on the device(s)."""
    kv = [jnp.zeros(s.shape, s.dtype) for s in pool_shapes(self.model, num_blocks, self.block_size)]
    # Committed to the device(s) as every step's output is, so the warm-up compiles what serving calls.
    return jax.device_put(kv, list(self._kv_shardings(kv)) if self.mesh else jax.devices()[0])

  def _kv_shardings(self, pools):
    """Per pool array, its sharding on the mesh (None without one): the kv-heads-major rows over `tensor`, so
    each device holds its heads' keys and values (replicated when `tensor` does not divide kv_heads)."""
    if self.mesh is None:
      return None
    tensor = "tensor" if self.model.cfg.kv_heads % self.mesh.shape["tensor"] == 0 else None
    return tuple(NamedSharding(self.mesh, P(*(None,) * (rank - 2), tensor, None)) for rank in (x.ndim for x in pools))

  def capacity_tokens(self):
    """Tokens the KV pool holds."""
    return self.pool.num_blocks * self.block_size

  # --------------------------------------------------------------------------- requests

  def check(self, prompt, params):
    """UserError (one line, naming the limit) when the request can never run here."""
    if not prompt:
      raise UserError("the prompt is empty: give at least one token")
    if params.max_tokens < (0 if params.prompt_logprobs else 1):
      raise UserError(f"max_tokens must be at least 1 (0 only to score the prompt), got {params.max_tokens}")
    total = len(prompt) + max(params.max_tokens - 1, 0)   # the last token is never fed back
    if total > self.max_seq_len:
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
      if params.prompt_logprobs:
        request.prompt_logprobs = [None] * len(prompt)
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
    """Moves waiting requests into free slots (FIFO) while the pool holds their prompt's blocks (a resumed
    request's: prompt and output) and one spare block per running request, for their next tokens."""
    with self._lock:
      for request in list(self.waiting):
        if request.cancel_reason:
          self.waiting.remove(request)
          self._finish(request, request.cancel_reason)
      while self.waiting and None in self.slots:
        request = self.waiting[0]
        tokens = request.prompt + request.output
        keys = kv_pool.block_hashes(tokens, self.block_size)
        keys = keys[:(len(tokens) - 1) // self.block_size]   # the last token is always run
        # A prompt to score is computed whole once: cached blocks hold keys and values, not log-probs.
        hits = [] if request.prompt_logprobs is not None and not request.prompt_scored else self.pool.lookup(keys)
        need = self._blocks_for(len(tokens)) - len(hits)
        spare = self.running() + 1 if self.running() else 0   # alone, a request may take every block
        fresh = self.pool.allocate(need) if self.pool.available() >= need + spare else None
        if fresh is None:                       # wait for running requests to free blocks
          self.pool.release(reversed(hits))
          return
        self.waiting.popleft()
        request.blocks, request.keys = hits + fresh, keys
        request.computed = request.cached_tokens = len(hits) * self.block_size
        request.prefill_to = len(tokens)
        request.admitted = next(self._admissions)
        request.slot = self.slots.index(None)
        self.slots[request.slot] = request
        if request.preemptions:
          self.stats["resumed_cached_tokens"] += request.cached_tokens
        else:
          self.stats["prompt_tokens"] += len(request.prompt)
          self.stats["cached_tokens"] += request.cached_tokens

  def _reserve(self, requests):
    """Gives each of `requests` (running, oldest first) the blocks its next token needs, preempting the newest
    running request while the pool has none -> those still running."""
    for r in sorted(requests, key=lambda r: r.admitted):
      while r.slot is not None and len(r.blocks) < self._blocks_for(r.computed + 1):
        fresh = self.pool.allocate(1)
        if fresh is not None:
          r.blocks += fresh
        else:
          self._preempt(max((x for x in self.slots if x is not None), key=lambda x: x.admitted))
    return [r for r in requests if r.slot is not None]

  def _preempt(self, request):
    """Frees a running request's slot and blocks (its full blocks kept in the prefix cache, so resuming
    recomputes little) and puts it at the head of the queue; its output so far stays."""
    tokens = (request.prompt + request.output)[:request.computed]
    for block, key in zip(request.blocks, kv_pool.block_hashes(tokens, self.block_size)):
      self.pool.register(block, key)
    self.pool.release(reversed(request.blocks))
    self.slots[request.slot] = None
    request.slot, request.blocks, request.computed = None, [], 0
    request.preemptions += 1
    self.stats["preemptions"] += 1
    self._preempted_at = self.stats["steps"]
    with self._lock:
      self.waiting.appendleft(request)

  def _sampling_rows(self, requests):
    p = [r.params if r else SamplingParams() for r in requests]
    return (np.array([x.temperature for x in p], np.float32), np.array([x.top_k for x in p], np.int32),
            np.array([x.top_p for x in p], np.float32), np.array([x.seed for x in p], np.int32),
            np.array([len(r.output) if r else 0 for r in requests], np.int32))

  def _width(self, slots, widths):
    """The smallest history width (blocks) in `widths` that holds `slots` tokens."""
    return next(w for w in widths if w * self.block_size >= slots)

  def _layout(self, parts, chunk, width, picks, pallas=False):
    """The index arrays of one call, made here on the host. parts: per row, the (request, n) pieces packed
    in it (a decode row: [(request, 1)]; an idle row: []): each piece feeds the request's next n tokens
    after its `computed` ones, under segment id = its place in the row + 1, so pieces never see each
    other's keys. A row holds its pieces' histories side by side in `width` blocks of slots, then its
    `chunk` new tokens (pads: segment 0, written to the scratch block). pallas (decode rows): also each row's
    block table [rows, width] and keys to read [rows] (its history + the new token; an idle row reads the
    scratch slot it writes). -> arrays of `_step`, its keyword arrays, the requests sampled ([rows * picks],
    None where there is no piece)."""
    rows, bs = len(parts), self.block_size
    slots = width * bs
    tokens, segment, position, dest, targets = (np.zeros((rows, chunk), np.int32) for _ in range(5))
    src, kv_segment, kv_position = (np.zeros((rows, slots), np.int32) for _ in range(3))
    pick = np.zeros((rows, picks), np.int32)
    sampled = [None] * (rows * picks)
    for b, row in enumerate(parts):
      h = c = 0
      for j, (r, n) in enumerate(row):
        table = np.asarray(r.blocks, np.int32)
        past, new = np.arange(r.computed), r.computed + np.arange(n)
        src[b, h:h + r.computed] = table[past // bs] * bs + past % bs
        kv_segment[b, h:h + r.computed], kv_position[b, h:h + r.computed] = j + 1, past
        h += r.computed
        tokens[b, c:c + n] = (r.prompt + r.output)[r.computed:r.computed + n]
        if r.prompt_logprobs is not None and not r.prompt_scored:   # each position's next prompt token
          nxt = r.prompt[r.computed + 1:r.computed + n + 1]
          targets[b, c:c + len(nxt)] = nxt
        segment[b, c:c + n], position[b, c:c + n] = j + 1, new
        dest[b, c:c + n] = table[new // bs] * bs + new % bs
        pick[b, j] = c + n - 1
        sampled[b * picks + j] = r
        c += n
    extra = {}
    if pallas:
      pages, lengths = np.zeros((rows, width), np.int32), np.ones(rows, np.int32)
      for b, row in enumerate(parts):
        for r, n in row:
          pages[b, :len(r.blocks[:width])] = r.blocks[:width]
          lengths[b] = r.computed + n
      extra = dict(pages=pages, lengths=lengths)
    return (tokens, segment, position, dest, src, kv_segment, kv_position, pick, targets), extra, sampled

  def _run(self, parts, chunk, width, picks, pallas=False):
    """One program call (see `_layout`) -> (per sampled row (token, logprob, top ids, top logprobs), per
    row and chunk position (log p(next prompt token), top ids, top logprobs): zeros unless a piece asks)."""
    arrays, extra, sampled = self._layout(parts, chunk, width, picks, pallas)
    want = np.bool_(any(r is not None and r.params.logprobs for r in sampled))
    scoring = np.bool_(any(r.prompt_logprobs is not None and not r.prompt_scored for row in parts for r, _ in row))
    with sharding.use_mesh(self.mesh) if self.mesh else contextlib.nullcontext():
      out, self.kv = self._step_fn(self.params, self.kv, *arrays, *self._sampling_rows(sampled), want, scoring,
                                   **extra)
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

  def _prefill_pieces(self):
    """This step's prompt pieces: up to `prefill_chunk` tokens of the requests still prefilling, oldest first
    -> (chunk bucket, [(request, n)]); (None, []) when none prefills."""
    pending = sorted((r for r in self.slots if r is not None and r.computed < r.prefill_to), key=lambda r: r.id)
    if not pending:
      return None, []
    budget = min(self.prefill_chunk, sum(r.prefill_to - r.computed for r in pending))
    # The largest bucket that fits takes a chunk without padding (80 tokens: 64 in this step, 16 in the
    # next); only a remainder below the smallest bucket is padded.
    chunk = max([b for b in self.buckets if b <= budget], default=self.buckets[0])
    take, history, row = min(chunk, budget), 0, []
    for r in pending:
      if take == 0 or len(row) == self.max_pack or history + r.computed > self.max_history:
        break
      n = min(r.prefill_to - r.computed, take)
      row.append((r, n))
      history, take = history + r.computed, take - n
    return chunk, row

  def _prefilled(self, row, out, first):
    """Books a call's prompt pieces (`row`, sampled at out[first:], fed from chunk position `first` on):
    their prompt tokens' log-probs where asked, blocks completed go to the prefix cache, a finished prompt
    emits its first token (a resumed request: its next one; max_tokens 0: it ends)."""
    (sampled, (target_logp, prompt_ids, prompt_logp)), c = out, first
    self.stats["prefill_calls"] += 1
    self.stats["prefill_pieces"] += len(row)
    for j, (r, n) in enumerate(row):
      if r.prompt_logprobs is not None and not r.prompt_scored:
        k = r.params.logprobs
        for i in range(min(n, len(r.prompt) - 1 - r.computed)):  # position p scores prompt token p + 1
          r.prompt_logprobs[r.computed + i + 1] = (float(target_logp[0, c + i]), list(zip(
              prompt_ids[0, c + i, :k].tolist(), prompt_logp[0, c + i, :k].tolist())))
      c += n
      r.computed += n
      r.prompt_scored = r.prompt_scored or r.computed >= len(r.prompt)
      self.stats["prefilled_tokens"] += n
      for i in range(r.cached_tokens // self.block_size, r.computed // self.block_size):
        if i < len(r.keys):
          self.pool.register(r.blocks[i], r.keys[i])
      if r.computed == r.prefill_to and r.params.max_tokens == 0:
        self._finish(r, "length")
      elif r.computed == r.prefill_to:
        self._emit(r, *(x[first + j] for x in sampled))

  def _prefill(self, chunk, row):
    """The prompt pieces packed side by side in one row of a bucket's length (several short prompts share a
    call, so the weights are read once)."""
    history = sum(r.computed for r, _ in row)
    self._prefilled(row, self._run([row], chunk, self._width(history, self.prefill_widths), self.max_pack), 0)

  def _decode_rows(self):
    return [r if r is not None and r.computed >= r.prefill_to and r.output else None for r in self.slots]

  def _decode(self):
    """One token for every slot past its prompt (idle rows ride along, writing the scratch block)."""
    self._reserve([r for r in self._decode_rows() if r is not None])
    rows = self._decode_rows()
    if not any(rows):
      return
    pallas = self.pallas_fallback is None    # its block table also holds the new token's block
    width = self._width(max(r.computed for r in rows if r) + pallas, self.history_buckets)
    out, _ = self._run([[(r, 1)] if r else [] for r in rows], 1, width, 1, pallas)
    for b, r in enumerate(rows):
      if r is not None:
        r.computed += 1
        self._emit(r, *(x[b] for x in out))

  def _mixed(self, decoding, chunk, row):
    """One call for both phases (the paged kernel only): the running requests' next tokens and the prompt
    pieces, all packed in one row, so the weights are read once per step, not twice (a 16-row decode call
    costs about what 16 more tokens of a 128-token prefill call do on CPU). The kernel visits only each
    piece's own history, so the row's long width costs index arrays, not attention."""
    out = self._run([[(r, 1) for r in decoding] + row], self.max_batch + chunk, self.mixed_width,
                    self.max_batch + self.max_pack)
    self.stats["mixed_calls"] += 1
    for j, r in enumerate(decoding):
      r.computed += 1
      self._emit(r, *(x[j] for x in out[0]))
    self._prefilled(row, out, len(decoding))

  def step(self):
    """One engine step: end cancelled requests, give the running ones their next token's blocks (preempting if
    short), admit waiting ones, then a prefill chunk and a decode step (in one call when the paged kernel runs)."""
    for r in list(self.slots):
      if r is not None and r.cancel_reason:
        self._finish(r, r.cancel_reason)
    decoding = self._reserve([r for r in self._decode_rows() if r is not None])
    if self._preempted_at != self.stats["steps"]:   # a request just preempted would only take blocks back
      self._admit()
    chunk, row = self._prefill_pieces()
    if row and decoding and self.paged_fallback is None:
      self._mixed(decoding, chunk, row)
    else:
      if row:
        self._prefill(chunk, row)
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
    programs = ([(1, b, w, self.max_pack, False) for b in self.buckets for w in self.prefill_widths]
                + [(self.max_batch, 1, w, 1, self.pallas_fallback is None) for w in self.history_buckets])
    if self.paged_fallback is None:
      programs += [(1, self.max_batch + b, self.mixed_width, self.max_batch + self.max_pack, False)
                   for b in self.buckets]
    for rows, chunk, width, picks, pallas in programs:
      self._run([[]] * rows, chunk, width, picks, pallas)
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


def pool_shapes(model, num_blocks, block_size):
  """The pool's arrays (ShapeDtypeStructs): for each layer's cached_key / cached_value, [(layers,) kv_heads *
  blocks * block_size, head_dim] (head h's slot i at row h * blocks * block_size + i: one gather makes either
  cache layout; a [kv_heads, blocks, block_size, head_dim] view is the Pallas kernel's pages)."""
  out = []
  for path, s in jax.tree_util.tree_leaves_with_path(decode._cache_shapes(model, 2, 2, 1)):
    if _leaf_key(path) in ("cached_key", "cached_value"):
      lead = s.shape[:1] if _is_scanned(path) else ()
      out.append(jax.ShapeDtypeStruct(lead + (model.cfg.kv_heads * num_blocks * block_size, s.shape[-1]), s.dtype))
  return out


def _dense_why_not(model, params, paged_fallback):
  """None when the engine lays a float model's dense kernels out output-major for the CPU kernel (`qmatmul`'s
  float32 format: each output's weights streamed once for all of a decode step's rows, 0.5x XLA's time at 16
  rows on GPT-2), else why not (a short phrase)."""
  if os.environ.get("JAXFORMER_DENSE", "").lower() == "xla":
    return "JAXFORMER_DENSE=xla"
  if paged_fallback is not None:  # not one CPU device (a mesh of several included), float32, the kernels built
    return paged_fallback
  if jnp.dtype(model.cfg.dtype) != jnp.float32:
    return f"activations are {model.cfg.dtype}"
  if any("qkernel" in str(path) for path, _ in jax.tree_util.tree_leaves_with_path(params)):
    return "a quantized run (its own kernels)"
  return None


@functools.lru_cache(maxsize=8)
def _step_program(model, mesh=None, kv_shardings=None):
  """The jitted `_step` for a model (on a mesh: samples replicated, the pool kept in `kv_shardings`), shared by
  the engines of a process (one compile per shape); the pool is donated, so the scatter updates it in place."""
  step = functools.partial(_step, model)
  if mesh is None:
    return jax.jit(step, donate_argnums=(1,))
  return jax.jit(step, donate_argnums=(1,), out_shardings=(NamedSharding(mesh, P()), list(kv_shardings)))


@functools.lru_cache(maxsize=8)
def _attention_paths(model):
  """The path of each self-attention module's cache, in the order of the pool's arrays (a key and a value each)."""
  return [tuple(k.key for k in path[:-1]) for path, _ in jax.tree_util.tree_leaves_with_path(
      decode._cache_shapes(model, 2, 2, 1)) if _leaf_key(path) == "cached_key"]


def _shard_params(model, params, mesh):
  """params placed on the mesh by the logical axis names of the model's parameters (`sharding.RULES`)."""
  boxed = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
  shardings = sharding.logical_sharding(boxed, mesh)
  if jax.tree.structure(shardings) != jax.tree.structure(params):
    raise UserError("sharded serving takes the model's own float weights (a quantized run is served on one "
                    "device): drop --tensor/--fsdp")
  return jax.device_put(params, shardings)


def _step(model, params, kv, tokens, segment, position, dest, src, kv_segment, kv_position, pick, targets,
          temperature, top_k, top_p, seed, index, want_logprobs, scoring, pages=None, lengths=None):
  """One engine program: rows of new tokens through the model over their history in the pool -> samples, new pool.

  tokens, segment, position, dest [rows, chunk]: the new tokens, their segment ids (0: a pad), positions
  and pool slots to write; src, kv_segment, kv_position [rows, slots]: each history slot's pool slot,
  segment id (0: empty) and position; pick [rows, k]: the chunk positions whose next token is sampled;
  targets [rows, chunk]: each position's next prompt token, scored (log-prob and top ids) when `scoring`.
  pages [rows, slots / block_size], lengths [rows]: a decode step's block tables and keys to read, for the
  Pallas TPU kernel (the layers write their new keys and values into the pool themselves then).
  Engine._layout makes them. Sample row i (rows * k of them) uses key fold_in(PRNGKey(seed[i]), index[i])
  (index: the tokens it generated so far), as `decode.generate` folds the step into its key.
  -> ((token, its logprob, top ids, top logprobs) [rows * k, ...], (log p(target), top ids, top logprobs)
  [rows, chunk, ...]), the new pool.
  """
  layers_of = lambda x: x.shape[:1] if x.ndim == 3 else ()            # a scanned pool [layers, rows, d]
  cache = {}
  for path, pool_k, pool_v in zip(_attention_paths(model), kv[0::2], kv[1::2]):
    node = functools.reduce(lambda n, name: n.setdefault(name, {}), path, cache)
    lead = layers_of(pool_k)
    node.update(pool_key=pool_k, pool_value=pool_v, history_slots=jnp.broadcast_to(src, lead + src.shape),
                history_segment=jnp.broadcast_to(kv_segment, lead + kv_segment.shape),
                history_position=jnp.broadcast_to(kv_position, lead + kv_position.shape))
    if pages is not None:   # never scanned (paged.pallas_why_not)
      node.update(history_pages=pages, history_length=lengths, new_slots=dest)
  hidden, variables = model.apply({"params": params, "cache": cache}, tokens, segment, position, decode=True,
                                  project=False, mutable=["cache"])   # [rows, chunk, d_model]
  cache = variables["cache"]
  project = functools.partial(model.apply, {"params": params}, method="project_hidden")
  logits = project(jnp.take_along_axis(hidden, pick[:, :, None], 1))  # only the sampled positions' logits
  logits = logits.reshape((-1,) + logits.shape[2:])                  # [rows * k, vocab]
  nodes = [functools.reduce(lambda n, name: n[name], path, cache) for path in _attention_paths(model)]
  if pages is not None:                  # the layers wrote the new keys and values: their pools are the new ones
    new_kv = [x for node in nodes for x in (node["pool_key"], node["pool_value"])]
  else:
    new_kv = _write_new(kv, nodes, dest, logits)
  keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.PRNGKey(s), i))(seed, index)
  token = decode.sample_rows(logits, keys, temperature, top_k, top_p)
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), -1)
  chosen = jnp.take_along_axis(logp, token[:, None], 1)[:, 0]
  k = min(TOP_LOGPROBS, logp.shape[-1])
  top_logp, top_ids = jax.lax.cond(  # a top-k over the vocabulary only when some row asks for logprobs
      want_logprobs, lambda: tuple(jax.lax.top_k(logp, k)),
      lambda: (jnp.zeros((logp.shape[0], k), logp.dtype), jnp.zeros((logp.shape[0], k), jnp.int32)))

  def prompt_scores():  # every chunk position through the vocabulary: only when a prompt is being scored
    all_logp = jax.nn.log_softmax(project(hidden).astype(jnp.float32), -1)   # [rows, chunk, vocab]
    top = jax.lax.top_k(all_logp, k)
    return jnp.take_along_axis(all_logp, targets[..., None], -1)[..., 0], top[1], top[0]

  scored = jax.lax.cond(scoring, prompt_scores, lambda: (
      jnp.zeros(targets.shape, jnp.float32), jnp.zeros(targets.shape + (k,), jnp.int32),
      jnp.zeros(targets.shape + (k,), jnp.float32)))
  return ((token, chosen, top_ids, top_logp), scored), new_kv


def _write_new(kv, nodes, dest, logits):
  """The pool with each layer's new keys and values [(layers,) rows, chunk, kv_heads, d] written at `dest`."""
  new = [x for node in nodes for x in (node["new_key"], node["new_value"])]
  # The written values depend on the logits (+ 0 * a logit), so on every layer's reads of its pool: without a
  # data dependence XLA:CPU cannot order the reads before the in-place writes and copies each pool twice per
  # call (GPT-2 with an 8,192-token pool: ~190 ms a step). An optimization barrier does not order them.
  after_reads = jnp.zeros((), logits.dtype) * logits[0, 0]
  return [paged.write(pool, x + after_reads.astype(x.dtype), dest) for pool, x in zip(kv, new)]
