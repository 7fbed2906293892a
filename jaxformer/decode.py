"""Decoding on the KV cache: beam search for translation, sampling for language models.

Every decoder runs in one `jit` as a `lax.while_loop` over steps and always goes
through the model itself (`decode=True`), so there is one attention implementation.
The cache is the model's "cache" collection (see `layers.Attention`): static-size,
written at a shared `cache_index`, with segment-0 slots invisible.

Conventions: PAD=0, BOS=1, EOS=2. Translation inputs are right-padded with PAD.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxformer.model import EncoderDecoder

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


def init_cache(model, batch, max_len):
  """A zeroed KV cache with `max_len` slots per row; only shapes are traced, no parameters built."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), _cache_shapes(model, batch, max_len))


@functools.lru_cache(maxsize=64)
def _cache_shapes(model, batch, max_len):
  """The cache's shapes, traced once per (model, size): tracing model.init takes ~0.1 s."""
  def init():
    dummy = jnp.ones((batch, max_len), jnp.int32)
    if isinstance(model, EncoderDecoder):  # cross-attention has no cache: a 1-token source will do
      return model.init(jax.random.key(0), jnp.ones((batch, 1), jnp.int32), dummy, decode=True)
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
  path, key = _cache_entries(cache, "cached_key")[0]  # [(layers,) batch, slots, kv_heads, head_dim]
  return key.shape[2 if _is_scanned(path) else 1]


def _map_rows(fn, cache):
  """fn(x, axis) on each per-row cache array, `axis` its batch axis (1 when stacked over layers);
  the `cache_index` counters, shared by all rows, stay as they are."""
  return jax.tree_util.tree_map_with_path(
      lambda path, x: x if path[-1].key == "cache_index" else fn(x, 1 if _is_scanned(path) else 0), cache)


def length_penalty(length, alpha):
  """GNMT's ((5 + length) / 6)^alpha (Wu et al. 2016); scores are log-prob / penalty."""
  return ((5.0 + length) / 6.0) ** alpha


# ----------------------------------------------------------------------------- translation


def _encode(model, params, inputs):
  """inputs [batch, src] (right-padded) -> encoded, source segments, source lengths."""
  segment = (inputs != PAD_ID).astype(jnp.int32)
  encoded = model.apply({"params": params}, inputs, segment, method="encode")
  return encoded, segment, segment.sum(-1)


def _translate_step(model, params, cache, encoded, src_segment, ids, index):
  """Feeds ids [rows] at decoder position `index` -> log-probs [rows, vocab], new cache."""
  ids = ids[:, None]
  logits, variables = model.apply(
      {"params": params, "cache": cache}, encoded, src_segment, ids,
      targets_segmentation=jnp.ones_like(ids),  # a generated PAD is still a real token
      targets_position=jnp.full_like(ids, index), decode=True, method="decode", mutable=["cache"])
  return jax.nn.log_softmax(logits[:, -1]), variables["cache"]


@functools.partial(jax.jit, static_argnames=("model", "max_extra_len"))
def greedy_translate(model, params, inputs, max_extra_len=50, eos_id=EOS_ID):
  """Greedy decoding. inputs [batch, src] -> tokens [batch, src + max_extra_len] (no BOS; PAD after EOS).

  Row b stops at EOS or after its own source length + max_extra_len tokens.
  """
  batch, width = inputs.shape
  max_len = width + max_extra_len
  encoded, src_segment, src_len = _encode(model, params, inputs)
  row_max = src_len + max_extra_len
  seqs = jnp.full((batch, max_len + 1), PAD_ID, jnp.int32).at[:, 0].set(BOS_ID)

  def body(state):
    i, seqs, done, cache = state
    logp, cache = _translate_step(model, params, cache, encoded, src_segment, seqs[:, i], i)
    token = jnp.where(done, PAD_ID, jnp.argmax(logp, -1))
    done = done | (token == eos_id) | (i + 1 >= row_max)
    return i + 1, seqs.at[:, i + 1].set(token), done, cache

  def cond(state):
    return (state[0] < max_len) & ~jnp.all(state[2])

  state = (0, seqs, jnp.zeros(batch, bool), init_cache(model, batch, max_len))
  return jax.lax.while_loop(cond, body, state)[1][:, 1:]


def _gather_beams(cache, parent):
  """Row (b, k) of the cache's flattened [batch * beam, ...] rows takes row (b, parent[b, k])."""
  batch, beam = parent.shape
  rows = (jnp.arange(batch)[:, None] * beam + parent).reshape(-1)
  return _map_rows(lambda x, axis: jnp.take(x, rows, axis=axis), cache)


def _take(x, index):
  """x [batch, n, ...] indexed by index [batch, m] along axis 1."""
  return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


@functools.partial(jax.jit, static_argnames=("model", "beam_size", "alpha", "max_extra_len"))
def beam_search(model, params, inputs, beam_size=4, alpha=0.6, max_extra_len=50, eos_id=EOS_ID):
  """Beam search as in tensor2tensor / the Flax WMT example, batched on the KV cache.

  inputs [batch, src] (right-padded) -> tokens [batch, beam, src + max_extra_len] (no
  BOS; PAD after EOS), scores [batch, beam], best first.

  Scores follow tensor2tensor: log-prob / length_penalty(len, alpha), where len counts
  the generated tokens *including* EOS (not BOS). Each step ranks 2 * beam_size
  candidates; those that end (EOS, or reaching row b's limit of source length +
  max_extra_len tokens, where they finish as they are) and rank in the top beam_size
  join a finished set of the beam_size best; the alive set keeps the best beam_size
  that did not end. A row stops early once no alive hypothesis can beat its worst
  finished one. Slots with no hypothesis (tiny vocabularies) score -inf.
  """
  batch, width = inputs.shape
  k, max_len = beam_size, width + max_extra_len
  encoded, src_segment, src_len = _encode(model, params, inputs)
  row_max = src_len + max_extra_len                                    # [batch]
  # The encoder ran once; each beam is a row of its own, [batch * beam, ...], beam fastest.
  encoded, src_segment = jnp.repeat(encoded, k, 0), jnp.repeat(src_segment, k, 0)

  def body(s):
    i = s["i"]
    logp, cache = _translate_step(model, params, s["cache"], encoded, src_segment,
                                  s["alive_seqs"][:, :, i].reshape(-1), i)
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
    score = jnp.where(finishes, cand_logp / length_penalty(length, alpha), -jnp.inf)
    fin_score, fin = jax.lax.top_k(jnp.concatenate([s["fin_score"], score], 1), k)
    return {"i": length, "alive_logp": alive_logp, "alive_seqs": _take(seqs, keep),
            "fin_score": fin_score, "fin_seqs": _take(jnp.concatenate([s["fin_seqs"], seqs], 1), fin),
            "cache": _gather_beams(cache, _take(parent, keep))}

  def cond(s):
    # Log-probs only fall and the penalty is at most lp(row_max), so this bounds every
    # alive hypothesis's final score (alive_logp is sorted best first).
    bound = s["alive_logp"][:, 0] / length_penalty(row_max, alpha)
    row_done = (s["fin_score"][:, -1] > bound) | (s["i"] >= row_max)
    return (s["i"] < max_len) & ~jnp.all(row_done)

  seqs = jnp.full((batch, k, max_len + 1), PAD_ID, jnp.int32).at[:, :, 0].set(BOS_ID)
  state = {"i": jnp.array(0), "alive_seqs": seqs, "fin_seqs": seqs,
           # Only beam 0 is real at first; the others would duplicate it.
           "alive_logp": jnp.tile(jnp.array([0.0] + [-jnp.inf] * (k - 1)), (batch, 1)),
           "fin_score": jnp.full((batch, k), -jnp.inf), "cache": init_cache(model, batch * k, max_len)}
  state = jax.lax.while_loop(cond, body, state)
  return state["fin_seqs"][:, :, 1:], state["fin_score"]


# ----------------------------------------------------------------------------- language models


def top_k_filter(logits, k):
  """Keeps the k largest logits [..., vocab] (and ties with the k-th); the rest -> -inf. k <= 0: all."""
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


def _lm_step(model, params, cache, tokens, segment, position):
  logits, variables = model.apply({"params": params, "cache": cache}, tokens, segment, position,
                                  decode=True, mutable=["cache"])
  return logits, variables["cache"]


def _prefill(model, params, tokens, lengths, cache):
  """Writes left-padded tokens [batch, width] after what the cache holds (a shared prefix).

  Pad slots get segment 0 (invisible); positions count real tokens only, continuing
  after the prefix, so each row matches an unpadded run. -> last logits [batch, vocab], cache.
  """
  width = tokens.shape[1]
  pad = width - lengths[:, None]
  slot = jnp.arange(width)[None]
  segment = (slot >= pad).astype(jnp.int32)
  position = jnp.where(segment == 1, _cache_index(cache) + slot - pad, 0)
  logits, cache = _lm_step(model, params, cache, tokens, segment, position)
  return logits[:, -1], cache


_prefill_jit = jax.jit(_prefill, static_argnums=0)


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
  return _map_rows(lambda x, axis: jnp.repeat(x, batch, axis), cache)


@functools.partial(jax.jit, static_argnames=("model", "max_new_tokens", "top_k", "greedy", "nucleus"))
def _generate(model, params, tokens, lengths, rng, cache, temperature, top_p, eos_id, max_new_tokens,
              top_k, greedy, nucleus):
  sample = functools.partial(_sample, temperature=temperature, top_k=top_k, top_p=top_p,
                             greedy=greedy, nucleus=nucleus)
  next_position = _cache_index(cache) + lengths               # [batch]
  logits, cache = _prefill(model, params, tokens, lengths, cache)
  first = sample(logits, jax.random.fold_in(rng, 0))
  out = jnp.full((tokens.shape[0], max_new_tokens), PAD_ID, jnp.int32).at[:, 0].set(first)
  done = first == eos_id

  def body(state):
    i, out, done, cache = state
    prev = out[:, i - 1][:, None]
    logits, cache = _lm_step(model, params, cache, prev, jnp.ones_like(prev),
                             (next_position + i - 1)[:, None])
    token = jnp.where(done, PAD_ID, sample(logits[:, -1], jax.random.fold_in(rng, i)))
    done = done | (token == eos_id)
    return i + 1, out.at[:, i].set(token), done, cache

  def cond(state):
    return (state[0] < max_new_tokens) & ~jnp.all(state[2])

  return jax.lax.while_loop(cond, body, (1, out, done, cache))[1]


def generate(model, params, prompts, max_new_tokens, rng, temperature=1.0, top_k=0, top_p=1.0,
             eos_id=None, lengths=None, prefix_cache=None):
  """Samples continuations of a batch of prompts with a decoder-only model.

  prompts: a list of token lists (any lengths), or a right-padded array [batch, width]
  with `lengths` [batch] (None: all full). They are left-padded and prefilled in one
  call, then one token per step. temperature 0 is greedy; top_k / top_p filter before
  sampling; `rng` (a key) fixes the sample. A row stops after `eos_id` (kept), then PAD.
  prefix_cache: from `prefill_prefix`; the prompts then continue that prefix.
  Returns tokens [batch, max_new_tokens] (the new tokens only).
  """
  tokens, lengths = _left_pad(prompts, lengths)
  needed = tokens.shape[1] + max_new_tokens - 1               # the last token is never fed back
  if prefix_cache is None:
    cache = init_cache(model, tokens.shape[0], needed)
  else:
    cache, needed = prefix_cache, needed + int(_cache_index(prefix_cache))
    if needed > _cache_size(cache):  # writes past the end would be clamped, silently wrong
      raise ValueError(f"prefix cache has {_cache_size(cache)} slots; prefix + prompts + "
                       f"max_new_tokens need {needed}")
  # Temperature, p and EOS are traced (no recompiles); only the kind of sampling is static.
  return _generate(model, params, tokens, lengths, rng, cache, jnp.float32(temperature),
                   jnp.float32(top_p), jnp.int32(-1 if eos_id is None else eos_id),
                   max_new_tokens=max_new_tokens, top_k=int(top_k), greedy=bool(temperature == 0),
                   nucleus=bool(top_p < 1.0))
