"""Tests for jaxformer.decode: beam search, greedy, sampling, prefix caching, all against full forward passes."""

import dataclasses
import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import decode
from jaxformer import generate
from jaxformer.config import load_config
from jaxformer.errors import UserError
from jaxformer.model import EncoderDecoder, build_model
from jaxformer.tokenizer import CharTokenizer

BOS, EOS = decode.BOS_ID, decode.EOS_ID


@functools.lru_cache(None)
def _setup(name, overrides=(), logit_scale=5.0, seed=0):
  """A tiny model with random N(0, 0.2) weights drawn in numpy (no init compile; tests share it).

  Token embeddings, positions and hidden states get similar scales, so positions matter.
  The last norm before the logits is scaled by `logit_scale`: logit std ~ 1.1 * logit_scale,
  peaky enough that argmax never hinges on float noise.
  """
  cfg = load_config(name, ["model.dropout_rate=0", *overrides]).model
  model = build_model(cfg)
  ids = jnp.ones((1, 4), jnp.int32)
  args = (ids, ids) if cfg.arch == "encoder_decoder" else (ids,)
  shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), *args))["params"])
  rng = np.random.default_rng(seed)
  params = jax.tree_util.tree_map_with_path(
      lambda path, s: {"scale": jnp.ones, "bias": jnp.zeros}.get(path[-1].key, lambda shape: jnp.asarray(
          rng.normal(0.0, 0.2, shape), jnp.float32))(s.shape), shapes)
  last = (params["decoder"]["final_norm"] if cfg.norm_position == "pre"
          else params["decoder"][f"layer_{cfg.num_layers - 1}"]["ffn_norm"])
  last["scale"] = last["scale"] * logit_scale
  return model, params


@functools.lru_cache(None)
def _forward(model):
  """The full teacher-forced forward pass (no cache), jitted; targets are all real tokens."""
  if isinstance(model, EncoderDecoder):
    return jax.jit(lambda p, src, dec: model.apply({"params": p}, src, dec,
                                                   targets_segmentation=jnp.ones_like(dec)))
  return jax.jit(lambda p, ids: model.apply({"params": p}, ids))


def _pad(rows, width):
  return np.array([list(r) + [0] * (width - len(r)) for r in rows], np.int32)


def _lm_reference(model, params, prompt, n, eos_id=None, width=24):
  """Greedy by full recomputation of one prompt alone: each step re-runs the whole sequence.

  The sequence is right-padded to a fixed width (one compile); under the causal mask
  the trailing slots change nothing.
  """
  seq = list(prompt)
  while len(seq) < len(prompt) + n and seq[-1:] != [eos_id]:
    logits = _forward(model)(params, jnp.asarray(_pad([seq], width)))
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt):] + [0] * (len(prompt) + n - len(seq))


def _translate_reference(model, params, src, extra, eos_id, width=5):
  """Greedy translation of one source alone by full teacher-forced passes over the growing target."""
  dec = [BOS]
  while len(dec) <= len(src) + extra and dec[-1] != eos_id:
    logits = _forward(model)(params, jnp.asarray(_pad([src], width)), jnp.asarray(_pad([dec], width + extra)))
    dec.append(int(jnp.argmax(logits[0, len(dec) - 1])))
  return dec[1:] + [0] * (width + extra + 1 - len(dec))


def _pick_eos(row):
  """A token the model emits mid-way through `row` (first time late, if possible), to use as EOS."""
  row = [int(t) for t in row]
  return next((t for i, t in enumerate(row) if i and t not in row[:i]), row[0])


def _stopped_at_eos(row, eos):
  row = np.asarray(row)
  first = int(np.argmax(row == eos))
  return row[first] == eos and first < len(row) - 1 and not row[first + 1:].any()


SOURCES = [[5, 9, 12, 7, 3], [8, 4], [30, 31, 32]]
ENCDECS = {"sinusoidal-mha": ("tiny_encdec", ()),
           "rope-gqa": ("tiny_encdec", ("model.position=rope", "model.num_kv_heads=2"))}


def _translate_setup(name):
  model, params = _setup(*ENCDECS[name])
  # An EOS the model emits mid-way through row 0, so per-row stopping is exercised.
  eos = _pick_eos(_translate_reference(model, params, SOURCES[0], 4, eos_id=-1))
  return model, params, jnp.asarray(_pad(SOURCES, 5)), eos


@pytest.mark.parametrize("name", ENCDECS)
def test_greedy_translate_matches_full_recompute(name):
  model, params, inputs, eos = _translate_setup(name)
  got = np.asarray(decode.greedy_translate(model, params, inputs, max_extra_len=4, eos_id=eos))
  np.testing.assert_array_equal(got, [_translate_reference(model, params, s, 4, eos) for s in SOURCES])
  assert _stopped_at_eos(got[0], eos)


def test_translation_steps_reuse_the_cached_source_keys_and_values():
  """A sentence's first step caches the cross-attention keys and values; later steps (encoded=None)
  give the same log-probs as recomputing them, for fewer FLOPs by exactly those projections."""
  model, params, inputs, _ = _translate_setup("rope-gqa")
  cfg = model.cfg
  rows, width = inputs.shape
  encoded, segment, _ = decode._encode(model, params, inputs)  # pylint: disable=protected-access
  step = jax.jit(functools.partial(decode._translate_step, model))  # pylint: disable=protected-access
  cache = decode.init_cache(model, rows, 4, width)
  _, cache = step(params, cache, encoded, segment, jnp.full((rows,), BOS), 0)
  keys = [x for path, x in jax.tree_util.tree_leaves_with_path(cache) if path[-1].key == "cross_key"]
  assert len(keys) == cfg.num_layers and keys[0].shape == (rows, cfg.kv_heads, width, cfg.dim_per_head)  # head-major
  token = jnp.asarray([7, 8, 9])
  cached, _ = step(params, cache, None, segment, token, 1)
  recomputed, _ = step(params, cache, encoded, segment, token, 1)
  np.testing.assert_allclose(cached, recomputed, rtol=1e-6, atol=1e-6)

  def flops(source):
    return step.lower(params, cache, source, segment, token, 1).compile().cost_analysis()["flops"]

  projections = cfg.num_layers * 2 * 2 * rows * width * cfg.d_model * cfg.kv_heads * cfg.dim_per_head
  assert flops(encoded) - flops(None) == pytest.approx(projections, rel=0.05)


def test_beam_size_one_equals_greedy():
  # With alpha = 0 a finished hypothesis beats every longer one, so beam 1 is exactly greedy
  # (with alpha > 0 beam 1 may rightly go on past a finished hypothesis). This needs EOS to
  # finish only from the top beam_size candidates: t2t's rule (any of 2 * beam_size) fails here.
  model, params, inputs, eos = _translate_setup("rope-gqa")
  greedy = decode.greedy_translate(model, params, inputs, max_extra_len=4, eos_id=eos)
  tokens, scores = decode.beam_search(model, params, inputs, beam_size=1, alpha=0.0, max_extra_len=4,
                                      eos_id=eos)
  np.testing.assert_array_equal(tokens[:, 0], greedy)
  # The cached log-probs equal a full teacher-forced pass (positions, cache layout, all of it).
  for row, src in enumerate(SOURCES):
    hyp = [int(t) for t in greedy[row]]
    n = hyp.index(eos) + 1 if eos in hyp else len(src) + 4
    logits = _forward(model)(params, jnp.asarray(_pad([src], 5)), jnp.asarray(_pad([[BOS] + hyp[:n - 1]], 9)))
    logp = jax.nn.log_softmax(logits[0])
    np.testing.assert_allclose(scores[row, 0], sum(logp[t, hyp[t]] for t in range(n)), atol=1e-4)


def _all_hypotheses(model, params, src, max_len, vocab, alpha, rows=781):
  """Every hypothesis (ending in EOS, or cut at max_len) and its length-penalised score, no cache."""
  hyps = [s for n in range(1, max_len + 1) for s in itertools.product(range(vocab), repeat=n)
          if EOS not in s[:-1] and (s[-1] == EOS or n == max_len)]
  dec_in = _pad([(BOS,) + s[:-1] for s in hyps] + [()] * (rows - len(hyps)), 4)  # one shape
  logp = jax.nn.log_softmax(_forward(model)(params, jnp.array([src + [0] * (2 - len(src))] * rows),
                                            jnp.asarray(dec_in)))[:len(hyps)]
  lengths = np.array([len(s) for s in hyps])
  picked = np.take_along_axis(np.asarray(logp), _pad(hyps, 4)[..., None], -1)[..., 0]
  total = (picked * (np.arange(4)[None] < lengths[:, None])).sum(-1)
  return hyps, total / decode.length_penalty(lengths, alpha)


def test_beam_search_equals_exhaustive_search():
  vocab, extra, alpha = 6, 2, 0.6
  model, params = _setup("tiny_encdec", (f"model.vocab_size={vocab}",), logit_scale=2.0, seed=2)
  sources = [[3, 4], [5]]                          # at most 4 and 3 target tokens
  inputs = jnp.asarray(_pad(sources, 2))
  # 150 beams hold every candidate before the last step (5^2 * 6), so this search is exhaustive.
  tokens, scores = decode.beam_search(model, params, inputs, beam_size=150, alpha=alpha,
                                      max_extra_len=extra)
  for row, src in enumerate(sources):
    hyps, want = _all_hypotheses(model, params, src, len(src) + extra, vocab, alpha)
    order = np.argsort(-want)[:10]
    assert len(hyps[order[0]]) > 1                 # the length penalty matters here
    np.testing.assert_array_equal(tokens[row, :10], _pad([hyps[j] for j in order], 2 + extra))
    np.testing.assert_allclose(scores[row, :10], want[order], rtol=1e-5, atol=1e-5)


def test_suppress_pad_bans_the_pad_id_after_the_softmax():
  # The token greedy decoding emits first becomes the pad id (Marian: pad = decoder start).
  model, params, inputs, eos = _translate_setup("rope-gqa")
  first = int(decode.greedy_translate(model, params, inputs, max_extra_len=4, eos_id=eos)[0, 0])
  assert all(first not in s for s in SOURCES)
  banned = build_model(dataclasses.replace(model.cfg, pad_id=first))
  src = np.array([s + [first] * (5 - len(s)) for s in SOURCES], np.int32)  # padded with the new pad id
  allowed = decode.greedy_translate(banned, params, jnp.asarray(src), max_extra_len=4, eos_id=eos)
  assert int(allowed[0, 0]) == first                       # same model, same encoder padding: same choice
  tokens, scores = decode.beam_search(banned, params, jnp.asarray(src), beam_size=1, alpha=0.0, max_extra_len=4,
                                      eos_id=eos, suppress_pad=True)
  greedy = decode.greedy_translate(banned, params, jnp.asarray(src), max_extra_len=4, eos_id=eos, suppress_pad=True)
  np.testing.assert_array_equal(tokens[:, 0], greedy)
  hyp = [int(t) for t in greedy[0]]
  assert first not in hyp[:hyp.index(eos) + 1 if eos in hyp else len(hyp)]
  # HF's order: log-probs over the whole vocabulary (pad included), then the ban; no renormalisation.
  n = hyp.index(eos) + 1 if eos in hyp else len(SOURCES[0]) + 4
  logits = _forward(banned)(params, jnp.asarray(src[:1]), jnp.asarray(_pad([[BOS] + hyp[:n - 1]], 9)))
  logp = jax.nn.log_softmax(logits[0])
  np.testing.assert_allclose(scores[0, 0], sum(logp[t, hyp[t]] for t in range(n)), atol=1e-4)
  assert scores[0, 0] < sum(jax.nn.log_softmax(jnp.where(jnp.arange(logp.shape[-1]) == first, -jnp.inf,
                                                           logits[0]))[t, hyp[t]] for t in range(n)) - 1e-3


PROMPTS = [[5, 17, 3], [9, 8, 7, 6, 5, 4, 33], [11]]
LMS = {"gpt2-learned-mha": ("gpt2_tiny", ()), "llama-rope-gqa": ("llama_tiny", ()),
       "llama-moe": ("llama_tiny", ("model.moe_experts=4",))}  # dropless MoE FFNs (jaxformer.moe)


@pytest.mark.parametrize("name", LMS)
def test_generate_greedy_matches_full_recompute_of_each_prompt_alone(name):
  model, params = _setup(*LMS[name])
  n = 8
  eos = _pick_eos(_lm_reference(model, params, PROMPTS[0], n))
  want = [_lm_reference(model, params, p, n, eos) for p in PROMPTS]
  got = decode.generate(model, params, PROMPTS, n, jax.random.key(0), temperature=0, eos_id=eos)
  np.testing.assert_array_equal(got, want)
  assert _stopped_at_eos(got[0], eos)
  # The same batch as a right-padded array with lengths.
  lengths = [len(p) for p in PROMPTS]
  padded = decode.generate(model, params, _pad(PROMPTS, 7), n, jax.random.key(0), temperature=0,
                           eos_id=eos, lengths=lengths)
  np.testing.assert_array_equal(padded, want)
  # One row alone: its cache keeps the position-major layout (layers._head_major), same tokens.
  for prompt, row in zip(PROMPTS, want):
    alone = decode.generate(model, params, [prompt], n, jax.random.key(0), temperature=0, eos_id=eos)
    np.testing.assert_array_equal(alone[0], row)


def test_a_capacity_mode_moe_decodes_dropless_whatever_shares_its_batch():
  # Capacity (0.5: about half the copies dropped in training) is a training-time device: decoding routes
  # dropless, so prompt A's tokens do not depend on a longer prompt beside it (they did: issue 34, item 8).
  capped, params = _setup("llama_tiny", ("model.moe_experts=4", "model.moe_capacity_factor=0.5"))
  dropless, _ = _setup("llama_tiny", ("model.moe_experts=4",))
  batch = [PROMPTS[0], PROMPTS[1]]
  together = decode.generate(capped, params, batch, 6, jax.random.key(0), temperature=0)
  alone = decode.generate(capped, params, batch[:1], 6, jax.random.key(0), temperature=0)
  np.testing.assert_array_equal(alone[0], together[0])
  np.testing.assert_array_equal(together, decode.generate(dropless, params, batch, 6, jax.random.key(0),
                                                          temperature=0))


def test_top_k_filter():
  logits = jnp.array([[1.0, 4.0, 3.0, -2.0, 0.5], [0.0, -1.0, 2.0, 1.0, 3.0]])
  kept = np.isfinite(np.asarray(decode.top_k_filter(logits, 2)))
  np.testing.assert_array_equal(kept, [[0, 1, 1, 0, 0], [0, 0, 1, 0, 1]])
  np.testing.assert_array_equal(decode.top_k_filter(logits, 0), logits)
  np.testing.assert_array_equal(decode.top_k_filter(logits, 2)[0, 1:3], logits[0, 1:3])


def test_top_p_filter_keeps_smallest_set_reaching_p():
  probs = np.array([0.1, 0.45, 0.05, 0.3, 0.1])       # sorted: 0.45, 0.3, 0.1, 0.1, 0.05
  logits = jnp.log(jnp.asarray(probs, jnp.float32))[None]
  mass = np.cumsum(np.asarray(jax.nn.softmax(-jnp.sort(-logits))))  # the filter's own float sums

  def kept(p):
    return np.flatnonzero(np.isfinite(np.asarray(decode.top_p_filter(logits, p)[0]))).tolist()

  assert kept(0.2) == [1]                               # the top token alone reaches 0.2
  assert kept(float(mass[1])) == [1, 3]                 # boundary: 0.45 + 0.3 reaches p exactly
  assert kept(float(mass[1]) - 1e-4) == [1, 3]
  assert kept(float(mass[1]) + 1e-4) == [0, 1, 3, 4]    # just above: the next level (tied 0.1s)
  assert kept(1.0) == [0, 1, 2, 3, 4]
  np.testing.assert_array_equal(decode.top_p_filter(logits, 0.5)[0, 1], logits[0, 1])


def test_sampling_temperature_seed_and_filters():
  model, params = _setup(*LMS["llama-rope-gqa"])
  n = 8
  greedy = decode.generate(model, params, PROMPTS, n, jax.random.key(0), temperature=0)
  for kwargs in [{"temperature": 1e-6}, {"top_k": 1, "top_p": 1e-3}]:
    got = decode.generate(model, params, PROMPTS, n, jax.random.key(7), **kwargs)
    np.testing.assert_array_equal(got, greedy, err_msg=str(kwargs))
  # Hot enough that samples spread out.
  a = decode.generate(model, params, PROMPTS, n, jax.random.key(1), temperature=20.0)
  np.testing.assert_array_equal(a, decode.generate(model, params, PROMPTS, n, jax.random.key(1),
                                                   temperature=20.0))
  b = decode.generate(model, params, PROMPTS, n, jax.random.key(2), temperature=20.0)
  assert (np.asarray(a) != np.asarray(b)).any()
  assert len(np.unique(np.asarray(a))) > 8            # really sampling, not collapsing to argmax


@pytest.mark.parametrize("name", LMS)
def test_prefix_cache_matches_fresh_prefill(name):
  model, params = _setup(*LMS[name])
  prefix, n = [20, 21, 22, 23, 24], 6
  full = [prefix + p for p in PROMPTS]
  cache = decode.prefill_prefix(model, params, prefix, batch=len(PROMPTS), max_len=5 + 7 + n - 1)
  logits, _ = decode.prefill(model, params, PROMPTS, cache=cache)
  # Fresh: the whole prompt alone through the full forward pass, no cache.
  fresh = [_forward(model)(params, jnp.asarray(_pad([f], 24)))[0, len(f) - 1] for f in full]
  np.testing.assert_allclose(logits, jnp.stack(fresh), atol=1e-4, rtol=1e-4)
  got = decode.generate(model, params, PROMPTS, n, jax.random.key(0), temperature=0, prefix_cache=cache)
  np.testing.assert_array_equal(got, [_lm_reference(model, params, f, n) for f in full])
  with pytest.raises(ValueError, match="slots"):
    decode.generate(model, params, PROMPTS, n + 1, jax.random.key(0), prefix_cache=cache)



def _nanogpt_reference(model, params, prompts, n, block, eos_id=None):
  """nanoGPT's `generate`, greedy: crop each row to its last `block` tokens, full forward without cache, argmax.

  Rows run side by side, each right-padded to `block` (causal: the padding changes nothing).
  A row stops after `eos_id`, then PAD, as `decode.generate` reports it.
  """
  seqs = [list(p) for p in prompts]
  for _ in range(n):
    crops = [s[-block:] for s in seqs]
    logits = np.asarray(_forward(model)(params, jnp.asarray(_pad(crops, block))))
    for s, p, crop, row in zip(seqs, prompts, crops, logits):
      if len(s) == len(p) or s[-1] != eos_id:
        s.append(int(np.argmax(row[len(crop) - 1])))
  return [s[len(p):] + [0] * (len(p) + n - len(s)) for s, p in zip(seqs, prompts)]



def test_sampling_past_the_learned_table_follows_nanogpt_crop():
  # The baby GPT's shapes (max_len 64), random weights; 300 new tokens, batched prompts of different
  # lengths, so rows fill the table at different steps (the longest after 35 tokens, the others later).
  model, params = _setup("shakespeare_char")
  prompts = [[5, 17, 3], list(range(10, 40)), [11]]
  got = np.asarray(decode.generate(model, params, prompts, 300, jax.random.key(0), temperature=0))
  np.testing.assert_array_equal(got, _nanogpt_reference(model, params, prompts, 300, 64))
  assert all(len(set(row[100:])) > 10 for row in got)       # not stuck repeating a token
  # The comparison can tell the crop's size: one token less of context changes every row's sample.
  off_by_one = np.asarray(_nanogpt_reference(model, params, prompts, 80, 63))
  assert (got[:, :80] != off_by_one).any(1).all()


def test_sliding_window_eos_long_prompts_and_right_padded_input():
  # A tiny table (16): prompts longer than it (cropped before the first token), EOS per row.
  model, params = _setup("gpt2_tiny", ("model.max_len=16", "data.block_size=16"), seed=3)
  prompts = [[5, 17, 3], list(range(3, 23)), [11, 12]]      # widths 3, 20 (> 16), 2
  n, eos = 60, 38
  want = _nanogpt_reference(model, params, prompts, n, 16, eos_id=eos)
  # This model emits the EOS first at new tokens 23, 37, 43: each row stops at its own step, past the table.
  assert [int(np.argmax(np.asarray(row) == eos)) for row in want] == [23, 37, 43]
  assert all(_stopped_at_eos(row, eos) for row in want)
  got = decode.generate(model, params, prompts, n, jax.random.key(0), temperature=0, eos_id=eos)
  np.testing.assert_array_equal(got, want)
  padded = decode.generate(model, params, _pad(prompts, 20), n, jax.random.key(0), temperature=0, eos_id=eos,
                           lengths=[len(p) for p in prompts])
  np.testing.assert_array_equal(padded, want)
  # Sampling past the table runs too, and is reproducible.
  a = decode.generate(model, params, prompts, n, jax.random.key(3), temperature=1.0, top_k=20)
  np.testing.assert_array_equal(a, decode.generate(model, params, prompts, n, jax.random.key(3), temperature=1.0,
                                                   top_k=20))


def test_rope_grows_the_cache_past_max_len_up_to_the_limit():
  # RoPE has no table: model.max_len (16 here) does not bound a sample; the cache holds every token.
  model, params = _setup("llama_tiny", ("model.max_len=16",))
  n = 40
  got = decode.generate(model, params, PROMPTS, n, jax.random.key(0), temperature=0, max_cache_len=46)
  np.testing.assert_array_equal(got, [_lm_reference(model, params, p, n, width=48) for p in PROMPTS])
  with pytest.raises(UserError, match=r"needs 47 KV-cache slots .* decode.max_cache_len=46"):
    decode.generate(model, params, PROMPTS, n + 1, jax.random.key(0), max_cache_len=46)


def test_prefix_cache_past_the_table_is_an_error_and_generate_text_prepends_it():
  model, params = _setup("gpt2_tiny", ("model.max_len=16", "data.block_size=16"))
  prefix, n = [20, 21, 22, 23, 24], 10
  cache = decode.prefill_prefix(model, params, prefix, batch=len(PROMPTS), max_len=5 + 7 + n - 1)
  with pytest.raises(UserError, match="prefix cache cannot slide past the 16-position table"):
    decode.generate(model, params, PROMPTS, n, jax.random.key(0), prefix_cache=cache)
  # generate_text puts the prefix in each prompt instead, and says once that the context slides.
  tokenizer = CharTokenizer("abcdefghijklmnopqrstuvwxyz")
  cfg = load_config("gpt2_tiny", ["model.max_len=16", "data.block_size=16"])
  notes = []
  text = generate.generate_text(model, params, tokenizer, cfg, ["ab", "hello"], n, temperature=0, prefix="xyz",
                                stop_at_eos=False, log=notes.append)
  assert notes == ["note: sampling past the 16-position table: each new token sees the last 16 tokens "
                   "(nanoGPT's crop)"]
  ids = [tokenizer.encode("xyz" + p) for p in ["ab", "hello"]]
  assert text == [tokenizer.decode(row) for row in _nanogpt_reference(model, params, ids, n, 16)]


# ---------------------------------------------------------------------------------------
# The tiled kernel (jaxformer.attention) on the KV cache: one query over a partly filled
# cache, prefill, the prefix cache, beam search. Same weights as the dense model: the dense
# full-recompute references must come out token for token.

TILED = ("model.attention_impl=tiled",)


def test_tiled_kernel_generates_like_the_dense_full_recompute():
  dense, params = _setup("llama_tiny")
  tiled, _ = _setup("llama_tiny", TILED)
  n = 8
  want = [_lm_reference(dense, params, p, n) for p in PROMPTS]
  np.testing.assert_array_equal(decode.generate(tiled, params, PROMPTS, n, jax.random.key(0), temperature=0), want)
  prefix = [20, 21, 22, 23, 24]
  cache = decode.prefill_prefix(tiled, params, prefix, batch=len(PROMPTS), max_len=5 + 7 + n - 1)
  got = decode.generate(tiled, params, PROMPTS, n, jax.random.key(0), temperature=0, prefix_cache=cache)
  np.testing.assert_array_equal(got, [_lm_reference(dense, params, prefix + p, n) for p in PROMPTS])


def test_tiled_kernel_translates_and_beam_searches_like_the_dense_path():
  dense, params, inputs, eos = _translate_setup("rope-gqa")
  tiled, _ = _setup(ENCDECS["rope-gqa"][0], ENCDECS["rope-gqa"][1] + TILED)
  got = decode.greedy_translate(tiled, params, inputs, max_extra_len=4, eos_id=eos)
  np.testing.assert_array_equal(got, [_translate_reference(dense, params, s, 4, eos) for s in SOURCES])
  want_tokens, want_scores = decode.beam_search(dense, params, inputs, beam_size=3, alpha=0.6, max_extra_len=4,
                                                eos_id=eos)
  tokens, scores = decode.beam_search(tiled, params, inputs, beam_size=3, alpha=0.6, max_extra_len=4, eos_id=eos)
  np.testing.assert_array_equal(tokens, want_tokens)
  # float32 sums of log-probs (~5.6): the tiled kernel's online softmax reorders them, so a relative tolerance
  np.testing.assert_allclose(scores, want_scores, rtol=1e-5, atol=1e-5)
