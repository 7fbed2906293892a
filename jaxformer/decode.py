"""Decoding on the KV cache: beam search for translation, sampling for language models.

Every decoder runs in one `jit` as a `lax.while_loop` over steps and always goes
through the model itself (`decode=True`; past a learned-position table, sampling
runs full forwards over the cropped context as nanoGPT does), so there is one
attention implementation.
The cache is the model's "cache" collection (see `layers.Attention`): static-size,
written at a shared `cache_index`, with segment-0 slots invisible.

Conventions: PAD=0, BOS=1, EOS=2 by default; a model's own ids are `model.cfg.pad_id`,
`bos_id` (the decoder start token) and `eos_id` (Marian: 58100, 58100, 0). Translation
inputs are right-padded with PAD.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import layers
from jaxformer.errors import UserError
from jaxformer.model import EncoderDecoder

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2  # the defaults of ModelConfig.pad_id / bos_id / eos_id

# XLA:CPU's YNNPACK fuses the output projection with the log-softmax's reductions into one
# kernel that runs 2.2x slower than the two apart ([256, 512] x [512, 37000] rows of a beam
# search: 131 ms against 57 + 13 ms). Letting YNNPACK take single matmuls only makes a wmt_base
# beam step 20% faster, same tokens (BENCHMARKS.md, "Decode against Hugging Face").
_CPU_OPTIONS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}


def _translation_jit(**jit_args):
  """jax.jit for the translation decoders, with `_CPU_OPTIONS` when the default backend is a CPU
  (chosen at the first call, so importing this module initialises no backend)."""
  def wrap(fn):
    jitted = {}

    @functools.wraps(fn)
    def call(*args, **kwargs):
      cpu = jax.default_backend() == "cpu"
      if cpu not in jitted:
        jitted[cpu] = jax.jit(fn, compiler_options=_CPU_OPTIONS if cpu else None, **jit_args)
      return jitted[cpu](*args, **kwargs)
    return call
  return wrap


def init_cache(model, batch, max_len, source_len=1):
  """A zeroed KV cache with `max_len` slots per row (and, for an encoder-decoder, room for the
  cross-attention keys and values of `source_len` source tokens); only shapes are traced."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _cache_shapes(model, batch, max_len, source_len))


@functools.lru_cache(maxsize=64)
def _cache_shapes(model, batch, max_len, source_len):
  """The cache's shapes, traced once per (model, size): tracing model.init takes ~0.1 s."""
  def init():
    dummy = jnp.ones((batch, max_len), jnp.int32)
    if isinstance(model, EncoderDecoder):
      return model.init(jax.random.key(0), jnp.ones((batch, source_len), jnp.int32), dummy, decode=True)
    return model.init(jax.random.key(0), dummy, decode=True)
  return jax.eval_shape(init)["cache"]


def _is_scanned(path):
  """Whether a cache entry belongs to a `model.scan_layers` stack (stacked on a leading layer axis)."""
  return any(getattr(k, "key", None) == "layers" for k in path)


def _cache_entries(cache, name):
  return [(path, x) for path, x in jax.tree_util.tree_leaves_with_path(cache) if path[-1].key == name]


def _cache_index(cache):
  """The slots already written (every layer's `cache_index` holds the same count)."""
  return jnp.ravel(_cache_entries(cache, "cache_index")[0][1])[0]


def _cache_size(cache):
  """Slots per row of the global layers (a local layer's ring holds its window only; see layers.Attention)."""
  def size(path, key):  # [(layers,) batch, kv_heads, slots, head_dim]
    batch_axis = 1 if _is_scanned(path) else 0
    return key.shape[batch_axis + layers.kv_slots_axis(key.shape[batch_axis])]
  return max(size(path, key) for path, key in _cache_entries(cache, "cached_key"))


def _map_rows(fn, cache, skip=()):
  """fn(x, axis) on each per-row cache array, `axis` its batch axis (1 when stacked over layers);
  the `cache_index` counters, shared by all rows, and the entries named in `skip` stay as they are."""
  keep = ("cache_index", *skip)
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x if path[-1].key in keep else fn(x, 1 if _is_scanned(path) else 0), cache)


def length_penalty(length, alpha, kind="gnmt"):
  """Scores are log-prob / penalty. gnmt: ((5 + length) / 6)^alpha (Wu et al. 2016, the
  paper's); hf: length^alpha (Hugging Face's `length_penalty`). length counts the generated
  tokens including EOS, not BOS / the decoder start token (in both)."""
  if kind == "hf":
    return jnp.asarray(length, jnp.float32) ** alpha
  return ((5.0 + length) / 6.0) ** alpha


# ----------------------------------------------------------------------------- translation


def _encode(model, params, inputs):
  """inputs [batch, src] (right-padded) -> encoded, source segments, source lengths."""
  segment = (inputs != model.cfg.pad_id).astype(jnp.int32)
  encoded = model.apply({"params": params}, inputs, segment, method="encode")
  return encoded, segment, segment.sum(-1)


def _translate_step(model, params, cache, encoded, src_segment, ids, index, suppress_pad=False):
  """Feeds ids [rows] at decoder position `index` -> log-probs [rows, vocab], new cache.

  encoded [rows, src, d_model] on a sentence's first step puts the source's cross-attention
  keys and values in the cache; None on later steps reads them from there.

  suppress_pad: the pad id's log-prob becomes -inf *after* the softmax, as HF's bad-words
  processor does (the other log-probs are not renormalised).
  """
  ids = ids[:, None]
  logits, variables = model.apply(
      {"params": params, "cache": cache}, encoded, src_segment, ids,
      targets_segmentation=jnp.ones_like(ids),  # a generated PAD is still a real token
      targets_position=jnp.full_like(ids, index), decode=True, method="decode", mutable=["cache"])
  logp = jax.nn.log_softmax(logits[:, -1])
  if suppress_pad:
    logp = logp.at[:, model.cfg.pad_id].set(-jnp.inf)
  return logp, variables["cache"]


@_translation_jit(static_argnames=("model", "max_extra_len", "suppress_pad"))
def greedy_translate(model, params, inputs, max_extra_len=50, eos_id=None, suppress_pad=False):
  """Greedy decoding. inputs [batch, src] -> tokens [batch, src + max_extra_len] (no BOS; PAD after EOS).

  Row b stops at EOS (default `model.cfg.eos_id`) or after its own source length +
  max_extra_len tokens. suppress_pad: never emit the pad id.
  """
  pad_id, bos_id = model.cfg.pad_id, model.cfg.bos_id
  eos_id = model.cfg.eos_id if eos_id is None else eos_id
  batch, width = inputs.shape
  max_len = width + max_extra_len
  encoded, src_segment, src_len = _encode(model, params, inputs)
  row_max = src_len + max_extra_len
  seqs = jnp.full((batch, max_len + 1), pad_id, jnp.int32).at[:, 0].set(bos_id)

  def body(state, source=None):
    i, seqs, done, cache = state
    logp, cache = _translate_step(model, params, cache, source, src_segment, seqs[:, i], i, suppress_pad)
    token = jnp.where(done, pad_id, jnp.argmax(logp, -1))
    done = done | (token == eos_id) | (i + 1 >= row_max)
    return i + 1, seqs.at[:, i + 1].set(token), done, cache

  def cond(state):
    return (state[0] < max_len) & ~jnp.all(state[2])

  # The first step (the loop's condition holds before it) also caches the source's keys and values.
  state = body((0, seqs, jnp.zeros(batch, bool), init_cache(model, batch, max_len, width)), encoded)
  return jax.lax.while_loop(cond, body, state)[1][:, 1:]


def _gather_beams(cache, parent):
  """Row (b, k) of the cache's flattened [batch * beam, ...] rows takes row (b, parent[b, k]).

  The cross-attention keys and values stay: all beams of a sentence hold the same ones.
  """
  batch, beam = parent.shape
  rows = (jnp.arange(batch)[:, None] * beam + parent).reshape(-1)
  # mode="clip": jnp.take's default fills out-of-range rows with NaN, a select over the whole cache per step.
  return _map_rows(lambda x, axis: jnp.take(x, rows, axis=axis, mode="clip"), cache, skip=("cross_key", "cross_value"))


def _take(x, index):
  """x [batch, n, ...] indexed by index [batch, m] along axis 1."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


@_translation_jit(static_argnames=("model", "beam_size", "alpha", "max_extra_len", "length_penalty_kind",
                                   "early_stopping", "suppress_pad"))
def beam_search(model, params, inputs, beam_size=4, alpha=0.6, max_extra_len=50, eos_id=None,
                length_penalty_kind="gnmt", early_stopping="false", suppress_pad=False):
  """Beam search as in tensor2tensor / the Flax WMT example, batched on the KV cache.

  inputs [batch, src] (right-padded) -> tokens [batch, beam, src + max_extra_len] (no
  BOS; PAD after EOS), scores [batch, beam], best first.

  Scores are log-prob / length_penalty(len, alpha, length_penalty_kind), where len counts
  the generated tokens *including* EOS (not BOS). Each step ranks 2 * beam_size
  candidates; those that end (EOS, or reaching row b's limit of source length +
  max_extra_len tokens, where they finish as they are) and rank in the top beam_size
  join a finished set of the beam_size best; the alive set keeps the best beam_size
  that did not end. Slots with no hypothesis (tiny vocabularies) score -inf.

  When a row stops: with gnmt (the paper's), once no alive hypothesis can beat its worst
  finished one (an exact bound). With hf, by Hugging Face's rules (`generate(num_beams=k)`,
  transformers' `_beam_search`) and its `early_stopping`: "false" (HF's default) stops a
  row for good once all beam_size slots are finished and the best alive log-prob divided
  by the *current* length's penalty cannot beat the worst of them; "never" uses the
  longest allowed length there; "true" also stops a row as soon as its slots are full.
  suppress_pad: never emit the pad id (Marian's generation_config bans it).
  """
  eos_id = model.cfg.eos_id if eos_id is None else eos_id
  lp = functools.partial(length_penalty, alpha=alpha, kind=length_penalty_kind)
  hf = length_penalty_kind == "hf"
  batch, width = inputs.shape
  k, max_len = beam_size, width + max_extra_len
  encoded, src_segment, src_len = _encode(model, params, inputs)
  row_max = src_len + max_extra_len                                    # [batch]
  # The encoder ran once; each beam is a row of its own, [batch * beam, ...], beam fastest.
  encoded, src_segment = jnp.repeat(encoded, k, 0), jnp.repeat(src_segment, k, 0)

  def body(s, source=None):
    i = s["i"]
    logp, cache = _translate_step(model, params, s["cache"], source, src_segment,
                                  s["alive_seqs"][:, :, i].reshape(-1), i, suppress_pad)
    logp = logp.reshape(batch, k, -1) + s["alive_logp"][:, :, None]
    vocab = logp.shape[-1]
    # 2k candidates, so k survive even if k of them end here.
    cand_logp, cand = jax.lax.top_k(logp.reshape(batch, k * vocab), 2 * k)
    parent = cand // vocab
    seqs = _take(s["alive_seqs"], parent).at[:, :, i + 1].set(cand % vocab)
    length = i + 1
    ends = (cand % vocab == eos_id) | (length >= row_max[:, None])
    # At its limit a row's alive set empties (all -inf), so nothing past the limit can finish.
    alive_logp, keep = jax.lax.top_k(jnp.where(ends, -jnp.inf, cand_logp), k)
    # Only candidates ranked in the top k may finish (as in Hugging Face; t2t lets all 2k):
    # then beam 1 is exactly greedy when alpha = 0.
    finishes = ends & (jnp.arange(2 * k) < k)
    if hf:  # HF adds nothing more to a row it has stopped (or, early_stopping=true, whose slots are full)
      open_row = s["improvable"]
      if early_stopping == "true":
        open_row = open_row & ~jnp.all(jnp.isfinite(s["fin_score"]), -1)
      finishes = finishes & open_row[:, None]
    score = jnp.where(finishes, cand_logp / lp(length), -jnp.inf)
    fin_score, fin = jax.lax.top_k(jnp.concatenate([s["fin_score"], score], 1), k)
    new = {"i": length, "alive_logp": alive_logp, "alive_seqs": _take(seqs, keep),
           "fin_score": fin_score, "fin_seqs": _take(jnp.concatenate([s["fin_seqs"], seqs], 1), fin),
           "cache": _gather_beams(cache, _take(parent, keep))}
    if hf:  # transformers' _check_early_stop_heuristic: the best alive log-prob at today's length
      best_length = row_max if early_stopping == "never" and alpha > 0 else length
      full = jnp.all(jnp.isfinite(fin_score), -1)
      new["improvable"] = s["improvable"] & (~full | (alive_logp[:, 0] / lp(best_length) > fin_score[:, -1]))
    return new

  def cond(s):
    if hf:
      row_done = ~s["improvable"] | (s["i"] >= row_max)
      if early_stopping == "true":
        row_done = row_done | jnp.all(jnp.isfinite(s["fin_score"]), -1)
      return (s["i"] < max_len) & ~jnp.all(row_done)
    # Log-probs only fall and the penalty is at most lp(row_max), so this bounds every
    # alive hypothesis's final score (alive_logp is sorted best first).
    bound = s["alive_logp"][:, 0] / lp(row_max)
    row_done = (s["fin_score"][:, -1] > bound) | (s["i"] >= row_max)
    return (s["i"] < max_len) & ~jnp.all(row_done)

  seqs = jnp.full((batch, k, max_len + 1), model.cfg.pad_id, jnp.int32).at[:, :, 0].set(model.cfg.bos_id)
  state = {"i": jnp.array(0), "alive_seqs": seqs, "fin_seqs": seqs,
           # Only beam 0 is real at first; the others would duplicate it.
           "alive_logp": jnp.tile(jnp.array([0.0] + [-jnp.inf] * (k - 1)), (batch, 1)),
           "fin_score": jnp.full((batch, k), -jnp.inf), "cache": init_cache(model, batch * k, max_len, width)}
  if hf:
    state["improvable"] = jnp.ones(batch, bool)
  # The first step (the loop's condition holds before it) also caches the source's keys and values.
  state = jax.lax.while_loop(cond, body, body(state, encoded))
  return state["fin_seqs"][:, :, 1:], state["fin_score"]


# ----------------------------------------------------------------------------- language models


def top_k_filter(logits, k):
  """Keeps the k largest logits [..., vocab] (and ties with the k-th); the rest -> -inf. k <= 0: all.

  k: an int, or an int array [..., 1] (one k per row: the serving engine's rows sample differently)."""
  if not isinstance(k, int):
    kth = jnp.take_along_axis(-jnp.sort(-logits, axis=-1), jnp.clip(k - 1, 0, logits.shape[-1] - 1), -1)
    return jnp.where((k > 0) & (logits < kth), -jnp.inf, logits)
  if k <= 0 or k >= logits.shape[-1]:
    return logits
  kth = jax.lax.top_k(logits, k)[0][..., -1:]
  return jnp.where(logits < kth, -jnp.inf, logits)


def top_p_filter(logits, p):
  """Nucleus filtering: keeps the smallest set of most likely tokens whose mass reaches p; rest -> -inf."""
  if isinstance(p, (int, float)) and p >= 1.0:
    return logits
  sorted_logits = -jnp.sort(-logits, axis=-1)
  mass = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
  # A token is needed while the mass before it is still short of p (so the top one always is).
  before = jnp.concatenate([jnp.zeros_like(mass[..., :1]), mass[..., :-1]], axis=-1)
  threshold = jnp.min(jnp.where(before < p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits < threshold, -jnp.inf, logits)


def _sample(logits, rng, temperature, top_k, top_p, greedy, nucleus):
  """logits [batch, vocab] -> tokens [batch]. greedy, top_k and nucleus are static."""
  if greedy:
    return jnp.argmax(logits, -1).astype(jnp.int32)
  logits = top_k_filter(logits / temperature, top_k)
  if nucleus:  # a sort per step: only when asked for
    logits = top_p_filter(logits, top_p)
  return jax.random.categorical(rng, logits).astype(jnp.int32)


def sample_rows(logits, keys, temperature, top_k, top_p):
  """`_sample` with settings per row (the serving engine): logits [rows, vocab], keys [rows] (one PRNG key
  each), temperature / top_k / top_p [rows] -> tokens [rows]. A row at temperature 0 is greedy; otherwise
  it draws as `_sample` draws for a batch of one row with that key, so its samples follow its seed only."""
  greedy = jnp.argmax(logits, -1).astype(jnp.int32)

  def sample():
    # Each filter sorts the vocabulary (slow on CPU: [16, 50257] takes longer than GPT-2's step), so each
    # runs only when some row asks for it; a row that does not keeps its logits.
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    filtered = jax.lax.cond(jnp.any(top_k > 0), lambda: top_k_filter(scaled, top_k[:, None]), lambda: scaled)
    filtered = jax.lax.cond(jnp.any(top_p < 1.0), lambda: jnp.where(
        top_p[:, None] < 1.0, top_p_filter(filtered, top_p[:, None]), filtered), lambda: filtered)
    sampled = jax.vmap(lambda key, row: jax.random.categorical(key, row[None])[0])(keys, filtered)
    return jnp.where(temperature > 0, sampled.astype(jnp.int32), greedy)

  return jax.lax.cond(jnp.any(temperature > 0), sample, lambda: greedy)


def _lm_step(model, params, cache, tokens, segment, position):
  """Feeds tokens [batch, len] through the cache -> next-token logits [batch, 1, vocab], cache."""
  logits, variables = model.apply({"params": params, "cache": cache}, tokens, segment, position,
                                  decode=True, last_only=True, mutable=["cache"])
  return logits, variables["cache"]


def _left_padded(width, lengths, start):
  """Rows of `lengths` real tokens at the end of `width` slots -> segment (0 on pads), positions from `start`."""
  pad = width - lengths[:, None]
  slot = jnp.arange(width)[None]
  segment = (slot >= pad).astype(jnp.int32)
  return segment, jnp.where(segment == 1, start + slot - pad, 0)     # both [batch, width]


def _prefill(model, params, tokens, lengths, cache):
  """Writes left-padded tokens [batch, width] after what the cache holds (a shared prefix).

  Pad slots get segment 0 (invisible); positions count real tokens only, continuing
  after the prefix, so each row matches an unpadded run. -> last logits [batch, vocab], cache.
  """
  segment, position = _left_padded(tokens.shape[1], lengths, _cache_index(cache))
  logits, cache = _lm_step(model, params, cache, tokens, segment, position)
  return logits[:, -1], cache


_prefill_jit = jax.jit(_prefill, static_argnums=0)


def sliding_window(model, fed, max_cache_len=None):
  """How a sample that feeds `fed` tokens per row (prefix + prompt + new - 1) fits the model -> window.

  Learned positions past the table (model.max_len) slide as nanoGPT does: each new
  token sees the last max_len tokens at positions 0..max_len-1; returns max_len. Else
  0: the cache holds all `fed` tokens, which with other positions (RoPE, ALiBi,
  sinusoidal, none) may not exceed `max_cache_len` (None: no limit; UserError above).
  """
  cfg = model.cfg
  if cfg.position == "learned":
    return cfg.max_len if fed > cfg.max_len else 0
  if max_cache_len is not None and fed > max_cache_len:
    raise UserError(f"this sample needs {fed} KV-cache slots per row (prefix + prompt + new tokens - 1), above "
                    f"decode.max_cache_len={max_cache_len}: ask for fewer new tokens or raise decode.max_cache_len")
  return 0


def _window_logits(model, params, seq, lengths, new, i, window):
  """nanoGPT's crop: each row's last `window` tokens before new token i, at positions 0.. -> logits [batch, vocab].

  seq [batch, window + width + max_new]: `window` PAD columns, the left-padded prompts
  (lengths [batch]), the new tokens from column `new`. One full forward without the
  cache, as nanoGPT's: learned positions shift with the window, so no key or value
  computed at an earlier step is still valid. A row shorter than the window is
  left-padded (segment 0), so its positions start at 0 too.
  """
  tokens = jax.lax.dynamic_slice_in_dim(seq, new + i - window, window, axis=1)
  segment, position = _left_padded(window, jnp.minimum(lengths + i, window), 0)
  return model.apply({"params": params}, tokens, segment, position, last_only=True)[:, -1]


def _left_pad(prompts, lengths=None):
  """A list of token lists, or a right-padded array [batch, width] with lengths -> left-padded, lengths."""
  if isinstance(prompts, (list, tuple)):
    lengths = np.array([len(p) for p in prompts], np.int32)
    tokens = np.full((len(prompts), lengths.max()), PAD_ID, np.int32)
    for row, p in enumerate(prompts):
      tokens[row, tokens.shape[1] - len(p):] = p
    return jnp.asarray(tokens), jnp.asarray(lengths)
  tokens = jnp.asarray(prompts, jnp.int32)
  width = tokens.shape[1]
  if lengths is None:
    return tokens, jnp.full(tokens.shape[:1], width, jnp.int32)
  lengths = jnp.asarray(lengths, jnp.int32)
  # Rotating row b right by width - lengths[b] moves its tokens to the end.
  rotated = jnp.take_along_axis(tokens, (jnp.arange(width)[None] + lengths[:, None]) % width, 1)
  return jnp.where(jnp.arange(width)[None] >= width - lengths[:, None], rotated, PAD_ID), lengths


def prefill(model, params, prompts, lengths=None, cache=None, max_len=None):
  """Runs the prompts in one call -> (next-token logits [batch, vocab], cache).

  prompts as in `generate`. Without `cache` a fresh one of `max_len` (default: the
  prompt width) slots is used; with one (`prefill_prefix`), the prompts follow its prefix.
  """
  tokens, lengths = _left_pad(prompts, lengths)
  if cache is None:
    cache = init_cache(model, tokens.shape[0], max_len or tokens.shape[1])
  return _prefill_jit(model, params, tokens, lengths, cache)


def prefill_prefix(model, params, prefix_ids, batch, max_len):
  """Runs a prompt prefix shared by all rows once (batch 1) -> its cache of `max_len` slots for `batch` rows."""
  _, cache = prefill(model, params, [list(prefix_ids)], max_len=max_len)
  cache = _map_rows(lambda x, axis: jnp.repeat(x, batch, axis), cache)
  if layers.kv_slots_axis(batch) != layers.kv_slots_axis(1):  # the rows' layout differs from one row's
    cache = jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.swapaxes(x, -3, -2) if path[-1].key in ("cached_key", "cached_value") else x, cache)
  return cache


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "top_k", "greedy", "nucleus", "window"))
def _generate(model, params, tokens, lengths, rng, cache, temperature, top_p, eos_id, max_new_tokens,
              top_k, greedy, nucleus, window):
  """`generate` in one program: prefill, cached steps, then (window > 0) nanoGPT's crop -> [batch, max_new_tokens]."""
  sample = functools.partial(_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                             greedy=greedy, nucleus=nucleus)
  batch, width = tokens.shape
  # One buffer for prompts and samples; `window` PAD columns in front keep the crop's start >= 0.
  seq = jnp.concatenate([jnp.full((batch, window), PAD_ID, jnp.int32), tokens,
                         jnp.full((batch, max_new_tokens), PAD_ID, jnp.int32)], 1)
  new = window + width                                        # column of new token 0
  # New tokens from the cache: all of them, or (sliding) while the longest row's next position fits the table.
  cached = max_new_tokens if not window else min(max_new_tokens, window - width + 1)

  def emit(i, logits, seq, done):
    token = jnp.where(done, PAD_ID, sample(logits, jax.random.fold_in(rng, i)))
    return seq.at[:, new + i].set(token), done | jnp.any(token[:, None] == eos_id, axis=-1)  # eos_id [stops]

  def running(until):
    return lambda state: (state[0] < until) & ~jnp.all(state[2])

  i, done = 0, jnp.zeros(batch, bool)
  if cached > 0:                                              # else the prompt alone overflows the table
    next_position = _cache_index(cache) + lengths             # [batch]

    def cached_step(state):
      i, seq, done, cache = state
      prev = jax.lax.dynamic_slice_in_dim(seq, new + i - 1, 1, axis=1)
      logits, cache = _lm_step(model, params, cache, prev, jnp.ones_like(prev), (next_position + i - 1)[:, None])
      return (i + 1, *emit(i, logits[:, -1], seq, done), cache)

    logits, cache = _prefill(model, params, tokens, lengths, cache)
    seq, done = emit(0, logits, seq, done)
    i, seq, done, _ = jax.lax.while_loop(running(cached), cached_step, (1, seq, done, cache))
  if cached < max_new_tokens:

    def window_step(state):
      i, seq, done = state
      return (i + 1, *emit(i, _window_logits(model, params, seq, lengths, new, i, window), seq, done))

    _, seq, done = jax.lax.while_loop(running(max_new_tokens), window_step, (i, seq, done))
  return seq[:, new:]


def generate(model, params, prompts, max_new_tokens, rng, temperature=1.0, top_k=0, top_p=1.0,
             eos_id=None, lengths=None, prefix_cache=None, max_cache_len=None):
  """Samples continuations of a batch of prompts with a decoder-only model.

  prompts: a list of token lists (any lengths), or a right-padded array [batch, width]
  with `lengths` [batch] (None: all full). They are left-padded and prefilled in one
  call, then one token per step. temperature 0 is greedy; top_k / top_p filter before
  sampling; `rng` (a key) fixes the sample. A row stops after `eos_id` (kept), then PAD;
  `eos_id` may be a sequence of ids, any of which stops (a chat turn's end-of-turn token and EOS).
  prefix_cache: from `prefill_prefix`; the prompts then continue that prefix.
  Learned positions: past the table each new token sees the row's last max_len tokens
  (nanoGPT's crop, one full forward per token; `sliding_window`). Other positions
  keep every token in the cache, at most `max_cache_len` slots (None: no limit).
  Returns tokens [batch, max_new_tokens] (the new tokens only).
  """
  if max_new_tokens < 1:
    raise UserError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
  tokens, lengths = _left_pad(prompts, lengths)
  batch, width = tokens.shape
  needed = width + max_new_tokens - 1                         # the last token is never fed back
  prefix = 0 if prefix_cache is None else int(_cache_index(prefix_cache))
  window = sliding_window(model, prefix + needed, max_cache_len)
  if prefix_cache is None:
    # Sliding, the cache serves the steps until the table is full: none when the prompt alone overflows it.
    cache = None if window and width > window else init_cache(model, batch, min(needed, window or needed))
  elif window:  # the crop would cut into the prefix, whose cached keys hold positions that no longer apply
    raise UserError(f"a prefix cache cannot slide past the {window}-position table (prefix + prompt + new tokens - 1 "
                    f"= {prefix + needed}): put the prefix in the prompts instead, or ask for fewer tokens")
  else:
    cache = prefix_cache
    if prefix + needed > _cache_size(cache):  # writes past the end would be clamped, silently wrong
      raise ValueError(f"prefix cache has {_cache_size(cache)} slots; prefix + prompts + "
                       f"max_new_tokens need {prefix + needed}")
  # Temperature, p and the stop ids are traced (no recompiles); only the kind of sampling is static.
  stops = np.atleast_1d(-1 if eos_id is None else np.asarray(eos_id, np.int64))
  stops = np.pad(stops, (0, -len(stops) % 4), constant_values=-1)  # [4k], -1: never sampled: one shape for 1-4 ids
  return _generate(model, params, tokens, lengths, rng, cache, jnp.float32(temperature),
                   jnp.float32(top_p), jnp.asarray(stops, jnp.int32),
                   max_new_tokens=max_new_tokens, top_k=int(top_k), greedy=bool(temperature == 0),
                   nucleus=bool(top_p < 1.0), window=window)
