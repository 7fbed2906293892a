"""Tests for jaxformer.model: invariances (permutation, causality, padding, packing),
KV-cache decoding against the full forward pass, the dtype policy and logical axis names.

XLA compiles dominate the run time on CPU, so most checks go through two fixed-shape
harnesses (`lm` and `s2s`: 4 rows, explicit segments and positions, rows padded at the
end): one compile per model config serves the causality, padding and packing checks.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import config
from jaxformer.model import EncoderDecoder, build_model

AXES = {"vocab", "embed", "heads", "kv_heads", "kv", "mlp", "norm", "length"}
ROWS, LM_LEN, SRC_LEN, TGT_LEN = 4, 9, 8, 9
# Tiny programs: spend little time optimising them.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def key(seed):
  """RBG keys: their random bits compile far faster on CPU than threefry's."""
  return jax.random.key(seed, impl="rbg")


def model_config(name, **overrides):
  return config.load_config(name, [f"model.{k}={v}" for k, v in overrides.items()]).model


def init_args(model, length=4):
  ids = jnp.ones((1, length), jnp.int32)
  return (ids, ids) if isinstance(model, EncoderDecoder) else (ids,)


@functools.lru_cache(maxsize=None)
def make(name, **overrides):
  """(model, params) for a tiny recipe with `model.<field>` overrides.

  Params have init's shapes and float32 dtype but are drawn here with numpy (std 0.2,
  norm scales around 1): tracing init is cheap, compiling it is not.
  """
  model = build_model(model_config(name, **overrides))
  shapes = nn.unbox(jax.eval_shape(lambda: model.init(key(0), *init_args(model)))["params"])
  rng = np.random.default_rng(0)

  def draw(path, s):
    assert s.dtype == jnp.float32, (path, s.dtype)
    base = 1.0 if jax.tree_util.keystr(path).endswith("['scale']") else 0.0
    return jnp.asarray(base + 0.2 * rng.standard_normal(s.shape), jnp.float32)

  return model, jax.tree_util.tree_map_with_path(draw, shapes)


@functools.lru_cache(maxsize=None)
def _compiled_apply(model):
  return jax.jit(model.apply, static_argnames=("decode", "method", "mutable", "capture_intermediates"),
                 compiler_options=FAST_COMPILE)


def apply(model, variables, *args, **kwargs):
  """model.apply, jit-compiled once per model config and signature."""
  return _compiled_apply(model)(variables, *args, **kwargs)


def tokens(seed, shape, vocab):
  """Random non-pad token ids in [1, vocab)."""
  return np.random.default_rng(seed).integers(1, vocab, size=shape).astype(np.int32)


def _pad_rows(rows, length, fill_rows=ROWS):
  """[ids, segment, position] rows (1-D, <= length) -> [ROWS, length] arrays; padding has segment 0."""
  out = np.zeros((3, fill_rows, length), np.int32)
  for r, (ids, seg, pos) in enumerate(rows):
    n = len(ids)
    seg = np.ones(n, np.int32) if seg is None else seg
    pos = np.arange(n) if pos is None else pos
    out[:, r, :n] = ids, seg, pos
  return (jnp.asarray(a) for a in out)


def lm(model, params, rows):
  """DecoderOnly logits [ROWS, LM_LEN, vocab] for up to ROWS rows of (ids, segments, positions)."""
  ids, seg, pos = _pad_rows(rows, LM_LEN)
  return np.asarray(apply(model, {"params": params}, ids, seg, pos))


def s2s(model, params, rows, **kwargs):
  """EncoderDecoder logits [ROWS, TGT_LEN, vocab]; rows of (src, src_seg, src_pos, tgt, tgt_seg, tgt_pos)."""
  src, src_seg, src_pos = _pad_rows([r[:3] for r in rows], SRC_LEN)
  tgt, tgt_seg, tgt_pos = _pad_rows([r[3:] for r in rows], TGT_LEN)
  return apply(model, {"params": params}, src, tgt, src_seg, tgt_seg, src_pos, tgt_pos, **kwargs)


def close(a, b, atol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-5)


def differ(a, b, atol=1e-3):
  assert not np.allclose(np.asarray(a), np.asarray(b), atol=atol)


LM_CONFIGS = [
    ("gpt2_tiny", {}),                                             # learned positions, MHA, LayerNorm
    ("llama_tiny", {}),                                            # rope, GQA (4 heads, 2 kv), RMSNorm
    ("gpt2_tiny", {"position": "sinusoidal", "num_kv_heads": 1}),  # sinusoidal, MQA
    ("llama_tiny", {"position": "alibi", "num_kv_heads": 4}),      # alibi, MHA
]
S2S_CONFIGS = [
    {},                                                                   # the paper: sinusoidal, post-norm, MHA
    {"num_kv_heads": 2, "position": "rope"},                              # rope, GQA
    {"num_kv_heads": 2, "position": "learned", "norm_position": "pre"},  # learned, GQA, pre-norm
    {"position": "alibi", "num_kv_heads": 1},                             # alibi, MQA
]


# ---------------------------------------------------------------------------------------
# Invariances.


def test_encoder_is_permutation_equivariant_without_positions():
  src = jnp.asarray(tokens(0, (ROWS, SRC_LEN), 64))
  perm = np.random.default_rng(1).permutation(SRC_LEN)
  for position, equivariant in [("none", True), ("sinusoidal", False)]:
    model, params = make("tiny_encdec", position=position)
    enc = apply(model, {"params": params}, src, method="encode")
    enc_perm = apply(model, {"params": params}, src[:, perm], method="encode")
    if equivariant:
      close(enc_perm, enc[:, perm])
    else:  # the check has teeth: with positions the encoder is not equivariant
      differ(enc_perm, enc[:, perm])


@pytest.mark.parametrize("name,overrides", LM_CONFIGS)
def test_decoder_only_causality_padding_and_packing(name, overrides):
  model, params = make(name, **overrides)
  vocab = model.cfg.vocab_size
  a, b = tokens(0, 5, vocab), tokens(1, 4, vocab)
  ab = np.concatenate([a, b])
  changed = ab.copy()
  changed[5] = 7 if ab[5] != 7 else 8
  out = lm(model, params, [
      (ab, None, None),
      (changed, None, None),
      # a and b packed in one row, positions restarting at b.
      (ab, np.array([1] * 5 + [2] * 4), np.r_[np.arange(5), np.arange(4)]),
      # b after three pad tokens (segment 0, real tokens) that the positions skip.
      (np.r_[[5, 6, 7], b], np.array([0, 0, 0, 1, 1, 1, 1]), np.r_[[0, 0, 0], np.arange(4)]),
  ])
  assert out.shape == (ROWS, LM_LEN, vocab) and out.dtype == np.float32
  alone_a, alone_b = lm(model, params, [(a, None, None), (b, None, None)])[:2]
  # Causal: changing token 5 never changes positions 0..4, and does change 5..
  close(out[1, :5], out[0, :5], atol=1e-6)
  differ(out[1, 5:9], out[0, 5:9])
  # Packed == each alone; without segments b would see a.
  close(out[2, :5], alone_a[:5])
  close(out[2, 5:9], alone_b[:4])
  differ(out[0, 5:9], alone_b[:4])
  # Pad tokens in front change nothing.
  close(out[3, 3:7], alone_b[:4])


@pytest.mark.parametrize("impl", ["xla", "tiled"])
def test_attention_implementations_match_einsum_in_the_model(impl):
  """attention_impl=xla (jax.nn.dot_product_attention) and tiled (jaxformer.attention) give the
  einsum path's logits, and the same gradients of a masked next-token loss (an LM with ALiBi,
  packed and padded rows; an encoder-decoder with ALiBi and MQA, so cross-attention too)."""
  name, overrides = LM_CONFIGS[3]  # alibi: the bias goes through both paths too
  model, params = make(name, **overrides)
  other, _ = make(name, attention_impl=impl, **overrides)
  vocab = model.cfg.vocab_size
  rows = [(tokens(0, 9, vocab), np.array([1] * 5 + [2] * 4), np.r_[np.arange(5), np.arange(4)]),
          (tokens(1, 6, vocab), np.array([0, 0, 1, 1, 1, 1]), np.r_[[0, 0], np.arange(4)])]
  ref, out = lm(model, params, rows), lm(other, params, rows)
  close(out[0], ref[0])
  close(out[1, 2:6], ref[1, 2:6])
  ids, seg, pos = _pad_rows(rows, LM_LEN)
  targets = jnp.asarray(tokens(2, (ROWS, LM_LEN), vocab))

  def grads(m):
    def loss(p):
      logp = jax.nn.log_softmax(m.apply({"params": p}, ids, seg, pos))
      nll = -jnp.take_along_axis(logp, targets[..., None], -1)[..., 0]
      return jnp.sum(jnp.where(seg != 0, nll, 0.0)) / jnp.sum(seg != 0)
    return jax.jit(jax.grad(loss), compiler_options=FAST_COMPILE)(params)
  jax.tree.map(lambda a, b: close(a, b), grads(other), grads(model))

  s2s_model, s2s_params = make("tiny_encdec", **S2S_CONFIGS[3])
  s2s_other, _ = make("tiny_encdec", attention_impl=impl, **S2S_CONFIGS[3])
  src = [(tokens(3, 8, 64), None, None, tokens(4, 9, 64), None, None),
         (tokens(5, 5, 64), None, None, tokens(6, 7, 64), None, None)]
  ref, out = s2s(s2s_model, s2s_params, src), s2s(s2s_other, s2s_params, src)
  close(out[0], ref[0])
  close(out[1, :7], ref[1, :7])


@pytest.mark.parametrize("overrides", S2S_CONFIGS)
def test_encoder_decoder_padding_and_packing(overrides):
  model, params = make("tiny_encdec", **overrides)
  v = {"params": params}
  # Reference: exact-length inputs, no padding anywhere, default segments and positions.
  src, tgt = jnp.asarray(tokens(0, (1, 5), 64)), jnp.asarray(tokens(1, (1, 4), 64))
  ref = np.asarray(apply(model, v, src, tgt))[0]
  s, t = np.asarray(src[0]), np.asarray(tgt[0])
  src_a, tgt_a = tokens(2, 3, 64), tokens(3, 4, 64)
  src_b, tgt_b = tokens(4, 4, 64), tokens(5, 5, 64)
  out = np.asarray(s2s(model, params, [
      (s, None, None, t, None, None),                # source padded by 3, target by 5
      (s[:4], None, None, t, None, None),            # a shorter source (teeth for the padding check)
      (np.r_[src_a, src_b], np.array([1] * 3 + [2] * 4), np.r_[np.arange(3), np.arange(4)],
       np.r_[tgt_a, tgt_b], np.array([1] * 4 + [2] * 5), np.r_[np.arange(4), np.arange(5)]),
      (src_a, None, None, tgt_a, None, None),
  ]))
  close(out[0, :4], ref[:4])
  differ(out[1, :4], ref[:4])
  close(out[2, :4], out[3, :4])
  alone_b = np.asarray(s2s(model, params, [(src_b, None, None, tgt_b, None, None)]))[0]
  close(out[2, 4:9], alone_b[:5])


# ---------------------------------------------------------------------------------------
# KV-cache decoding.


def empty_cache(model, *inputs):
  """A zero cache sized by `inputs` (the last one has the full cache length)."""
  shapes = jax.eval_shape(lambda: model.init(key(0), *inputs, decode=True))["cache"]
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


PREFILL, LENGTH, CACHE = 3, 7, 10
STEPS = [(0, PREFILL)] + [(i, i + 1) for i in range(PREFILL, LENGTH)]


@pytest.mark.parametrize("name,overrides", LM_CONFIGS)
def test_decoder_only_kv_cache_matches_full_forward(name, overrides):
  model, params = make(name, **overrides)
  ids = tokens(0, (ROWS, LENGTH), model.cfg.vocab_size)
  full = lm(model, params, [(row, None, None) for row in ids])[:, :LENGTH]
  cache = empty_cache(model, jnp.ones((ROWS, CACHE), jnp.int32))
  assert cache["decoder"]["layer_0"]["self_attention"]["cached_key"].shape[::2] == (ROWS, CACHE)  # [batch, kv_heads, slots, head_dim]
  pos = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), (ROWS, LENGTH))
  outs = []
  for lo, hi in STEPS:
    logits, mutated = apply(model, {"params": params, "cache": cache}, jnp.asarray(ids[:, lo:hi]), None,
                            jnp.asarray(pos[:, lo:hi]), decode=True, mutable="cache")
    cache = mutated["cache"]
    outs.append(logits)
  assert int(cache["decoder"]["layer_0"]["self_attention"]["cache_index"]) == LENGTH
  close(jnp.concatenate(outs, axis=1), full)


@pytest.mark.parametrize("overrides", S2S_CONFIGS[:3])
def test_encoder_decoder_kv_cache_matches_full_forward(overrides):
  model, params = make("tiny_encdec", **overrides)
  src = tokens(0, (ROWS, SRC_LEN), 64)
  src[1, 5:] = 0  # one row with source padding
  tgt = tokens(1, (ROWS, LENGTH), 64)
  full = np.asarray(s2s(model, params, [(s[s != 0], None, None, t, None, None) for s, t in zip(src, tgt)]))
  src_seg = jnp.asarray((src != 0).astype(np.int32))
  encoded = apply(model, {"params": params}, jnp.asarray(src), src_seg, method="encode")
  cache = empty_cache(model, jnp.ones((ROWS, 1), jnp.int32), jnp.ones((ROWS, CACHE), jnp.int32))
  pos = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), (ROWS, LENGTH))
  outs = []
  for lo, hi in STEPS:
    logits, mutated = apply(model, {"params": params, "cache": cache}, encoded, src_seg,
                            jnp.asarray(tgt[:, lo:hi]), None, jnp.asarray(pos[:, lo:hi]),
                            decode=True, method="decode", mutable="cache")
    cache = mutated["cache"]
    outs.append(logits)
  close(jnp.concatenate(outs, axis=1), full[:, :LENGTH])


# ---------------------------------------------------------------------------------------
# Dtype policy.


@pytest.mark.parametrize("name,overrides", [("tiny_encdec", S2S_CONFIGS[0]), LM_CONFIGS[0], LM_CONFIGS[1]])
def test_bfloat16_compute_float32_params_and_logits(name, overrides):
  model32, params = make(name, **overrides)
  model16 = build_model(model_config(name, dtype="bfloat16", **overrides))
  boxed = jax.eval_shape(lambda: model16.init(key(0), *init_args(model16)))["params"]
  assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(nn.unbox(boxed)))
  vocab = model32.cfg.vocab_size
  if isinstance(model32, EncoderDecoder):
    rows = [(tokens(r, 6, vocab), None, None, tokens(r + 9, 8, vocab), None, None) for r in range(ROWS)]
    ref = np.asarray(s2s(model32, params, rows))
    out, inter = s2s(model16, params, rows, capture_intermediates=True, mutable="intermediates")
  else:
    rows = [(tokens(r, LM_LEN, vocab), None, None) for r in range(ROWS)]
    ref = lm(model32, params, rows)
    ids, seg, pos = _pad_rows(rows, LM_LEN)
    out, inter = apply(model16, {"params": params}, ids, seg, pos, capture_intermediates=True,
                       mutable="intermediates")
  assert out.dtype == jnp.float32
  layer = inter["intermediates"]["decoder"]["layer_0"]
  assert layer["__call__"][0].dtype == jnp.bfloat16
  assert layer["ffn"]["__call__"][0].dtype == jnp.bfloat16
  assert layer["self_attention"]["__call__"][0].dtype == jnp.bfloat16
  out = np.asarray(out)
  err, scale = np.max(np.abs(out - ref)), np.max(np.abs(ref))
  assert 0 < err < 0.05 * scale, (err, scale)  # close, but really computed in bf16


# ---------------------------------------------------------------------------------------
# Logical axis names.


@pytest.mark.parametrize("name,overrides", [
    ("tiny_encdec", {}), ("gpt2_tiny", {}), ("llama_tiny", {}),
    ("tiny_encdec", {"share_embeddings": False, "tie_output": False, "position": "learned",
                     "norm": "rmsnorm", "activation": "swiglu", "num_kv_heads": 1}),
    ("tiny_encdec", {"logits_bias": True}), ("gpt2_tiny", {"logits_bias": True}),
])
def test_every_param_has_logical_axis_names(name, overrides):
  model = build_model(model_config(name, **overrides))
  boxed = jax.eval_shape(lambda: model.init(key(0), *init_args(model)))["params"]
  leaves = jax.tree_util.tree_leaves_with_path(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert len(leaves) > 10
  for path, leaf in leaves:
    where = jax.tree_util.keystr(path)
    assert isinstance(leaf, nn.LogicallyPartitioned), f"{where} is not boxed with logical names"
    assert len(leaf.names) == leaf.value.ndim, f"{where}: names {leaf.names} for shape {leaf.value.shape}"
    assert set(leaf.names) <= AXES, f"{where}: {leaf.names}"
  names = {tuple(leaf.names) for _, leaf in leaves}
  assert ("vocab", "embed") in names and ("embed", "kv_heads", "kv") in names
  if not model.cfg.tie_output:
    assert ("embed", "vocab") in names


@pytest.mark.parametrize("name", ["llama_tiny", "tiny_encdec"])
def test_bf16_matmuls_in_the_model(name):
  """model.matmul_dtype=bfloat16 (dense layers, attention, tied logits on bf16 operands):
  logits and float32 gradients within bf16 rounding of the float32 model's, not equal to them."""
  model, params = make(name)
  low, _ = make(name, matmul_dtype="bfloat16")
  args = init_args(model)

  def loss_and_grads(m):
    f = lambda p: jnp.mean(jnp.square(m.apply({"params": p}, *args)))
    return jax.jit(jax.value_and_grad(f))(params)

  (ref, ref_g), (out, out_g) = loss_and_grads(model), loss_and_grads(low)
  assert out != ref and abs(out - ref) < 2e-2 * abs(ref)
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(out_g))
  flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
  g, rg = flat(out_g), flat(ref_g)
  assert 0 < np.linalg.norm(g - rg) < 3e-2 * np.linalg.norm(rg)


# ---------------------------------------------------------------------------------------
# Imported-model conventions: special ids and the output bias (Marian).


@pytest.mark.parametrize("name", ["tiny_encdec", "gpt2_tiny"])
def test_logits_bias_is_added_to_the_logits_and_off_by_default(name):
  model, params = make(name)
  biased, biased_params = make(name, logits_bias=True)
  assert "logits_bias" not in params and biased_params["logits_bias"].shape == (model.cfg.vocab_size,)
  count = lambda p: sum(x.size for x in jax.tree.leaves(p))
  assert count(biased_params) == count(params) + model.cfg.vocab_size
  same = dict(biased_params, **{k: v for k, v in params.items()})  # the unbiased weights, plus a bias
  ids = jnp.asarray(tokens(0, (2, 5), 64))
  args = (ids, ids) if name == "tiny_encdec" else (ids,)
  close(apply(biased, {"params": same}, *args), np.asarray(apply(model, {"params": params}, *args))
        + np.asarray(same["logits_bias"]))


def test_padding_masks_follow_the_pad_id():
  # Marian's conventions: pad = decoder start = the last id, eos = 0 (a real token).
  vocab = 64
  model, params = make("tiny_encdec", pad_id=vocab - 1, bos_id=vocab - 1, eos_id=0)
  v = {"params": params}
  src = np.array([[5, 0, 7, 0]], np.int32)                     # id 0 (EOS here) is not padding
  tgt = np.array([[vocab - 1, 9, 0]], np.int32)                # starts with the pad id
  ref = np.asarray(apply(model, v, jnp.asarray(src), jnp.asarray(tgt)))
  padded = np.full((1, 7), vocab - 1, np.int32)
  padded[0, :4] = src[0]
  close(apply(model, v, jnp.asarray(padded), jnp.asarray(tgt)), ref)
  # The decoder start token is real although it is the pad id: as explicit all-ones segments.
  close(ref, apply(model, v, jnp.asarray(src), jnp.asarray(tgt), targets_segmentation=jnp.ones_like(tgt)))
  # And pad 0 would have masked the source's zeros.
  differ(apply(make("tiny_encdec")[0], v, jnp.asarray(src), jnp.asarray(tgt)), ref)
