"""Tests for jaxformer.layers: attention against numpy, masks, GQA/MQA, dropout, positions."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import layers
from jaxformer.config import ModelConfig, replace

# Each implementation against numpy. `auto` is einsum at these sizes on CPU (so not repeated here):
# test_auto_picks_dense_below_and_tiled_above_the_threshold checks the rule itself.
_IMPLS = ("einsum", "tiled", "xla")


def key(seed):
  """RBG keys: their random bits compile far faster on CPU than threefry's."""
  return jax.random.key(seed, impl="rbg")


# Tiny programs: compile once per signature (not op by op), spending little time optimising.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
attend = jax.jit(layers.dot_product_attention, compiler_options=FAST_COMPILE,
                 static_argnames=("dropout_rate", "deterministic", "implementation", "causal"))


def init(module, *args):
  return jax.jit(module.init, compiler_options=FAST_COMPILE)(key(1), *args)


def run(module, variables, *args):
  return jax.jit(module.apply, compiler_options=FAST_COMPILE)(variables, *args)


def np_attention(q, k, v, mask, bias=None):
  """Plain numpy softmax(q k^T / sqrt(d_k) + bias) v; k/v heads repeated up to q's heads.

  q [b, t, h, d], k/v [b, s, kvh, d], mask [b, t, s] bool (shared by all heads).
  """
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  scores = np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
  if bias is not None:
    scores = scores + np.asarray(bias, np.float64)
  scores = np.where(mask[:, None], scores, -np.inf)
  with np.errstate(invalid="ignore"):  # fully masked (padding) rows become NaN; callers skip them
    scores = scores - scores.max(-1, keepdims=True)
    w = np.exp(scores)
    w = w / w.sum(-1, keepdims=True)
  return np.einsum("bhts,bshd->bthd", w, v)


def np_mask(segments, causal):
  """The mask from first principles: same segment, key not padding, (causal) key not later."""
  segments = np.asarray(segments)
  b, n = segments.shape
  mask = np.zeros((b, n, n), bool)
  for r in range(b):
    for i in range(n):
      for j in range(n):
        mask[r, i, j] = (segments[r, i] == segments[r, j] and segments[r, j] != 0
                         and (not causal or j <= i))
  return mask


def random_qkv(seed=0, b=2, t=6, h=4, kvh=4, d=8, s=None):
  rng = np.random.default_rng(seed)
  s = t if s is None else s
  q = rng.normal(size=(b, t, h, d)).astype(np.float32)
  k = rng.normal(size=(b, s, kvh, d)).astype(np.float32)
  v = rng.normal(size=(b, s, kvh, d)).astype(np.float32)
  return q, k, v


# Row 0: padding at the end; row 1: two packed sequences then padding.
SEGMENTS = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 2, 2, 0]], np.int32)


@pytest.mark.parametrize("causal", [False, True])
def test_make_attention_mask(causal):
  seg = jnp.asarray(SEGMENTS)
  slots = jnp.arange(seg.shape[1]) if causal else None
  mask = layers.make_attention_mask(seg, seg, slots, slots)
  assert mask.shape == (2, 1, 6, 6) and mask.dtype == jnp.bool_
  np.testing.assert_array_equal(np.asarray(mask[:, 0]), np_mask(SEGMENTS, causal))


def ids(segments, causal):
  """(q_segment, kv_segment, q_slot, kv_slot) of self-attention over `segments` [b, n]."""
  seg = jnp.asarray(segments)
  slots = jnp.arange(seg.shape[1]) if causal else None
  return seg, seg, slots, slots


@pytest.mark.parametrize("impl", _IMPLS)
@pytest.mark.parametrize("kvh", [4, 2, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_numpy(impl, kvh, causal):
  q, k, v = random_qkv(kvh=kvh)
  out = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), *ids(SEGMENTS, causal), implementation=impl,
               causal=causal)
  assert out.shape == q.shape
  ref = np_attention(q, k, v, np_mask(SEGMENTS, causal))
  real = SEGMENTS != 0  # padding queries see nothing: their output is unspecified (but finite)
  np.testing.assert_allclose(np.asarray(out)[real], ref[real], atol=1e-5, rtol=1e-5)
  assert np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("kvh", [2, 1])
def test_causal_blocks_match_numpy_and_the_full_square(kvh):
  """causal=True skips key blocks above the diagonal (rows >= 2 blocks, a ragged last
  block here): same outputs and gradients as the full masked square, and as numpy."""
  t = 2 * layers._CAUSAL_BLOCK + 44  # pylint: disable=protected-access
  q, k, v = random_qkv(seed=8, b=2, t=t, h=4, kvh=kvh, d=4)
  segments = np.ones((2, t), np.int32)
  segments[1, 150:] = 2  # a packed second document
  segments[1, -10:] = 0  # and padding
  args = ids(segments, True)
  blocked = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), *args, implementation="einsum", causal=True)
  full = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), *args, implementation="einsum")
  real = segments != 0
  ref = np_attention(q, k, v, np_mask(segments, True))
  np.testing.assert_allclose(np.asarray(blocked)[real], ref[real], atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(blocked), np.asarray(full), atol=1e-6)

  def loss(causal):
    return jax.jit(jax.grad(lambda q_, k_, v_: jnp.sum(jnp.where(
        real[:, :, None, None], layers.dot_product_attention(q_, k_, v_, *args, implementation="einsum",
                                                             causal=causal), 0.0) ** 2),
        argnums=(0, 1, 2)), compiler_options=FAST_COMPILE)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
  for g_blocked, g_full in zip(loss(True), loss(False)):
    np.testing.assert_allclose(np.asarray(g_blocked), np.asarray(g_full), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", _IMPLS)
def test_alibi_matches_numpy(impl):
  """ALiBi from slopes and positions (packed: positions restart per document) = numpy's bias."""
  q, k, v = random_qkv(seed=1, kvh=2)
  positions = np.array([[0, 1, 2, 3, 0, 0], [0, 1, 2, 0, 1, 0]], np.int32)
  slopes = layers.alibi_slopes(4)
  out = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), *ids(SEGMENTS, True), alibi_slopes=slopes,
               q_position=jnp.asarray(positions), kv_position=jnp.asarray(positions), implementation=impl)
  bias = -slopes[None, :, None, None] * np.abs(positions[:, :, None] - positions[:, None, :])[:, None]
  ref = np_attention(q, k, v, np_mask(SEGMENTS, True), bias)
  real = SEGMENTS != 0
  np.testing.assert_allclose(np.asarray(out)[real], ref[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", _IMPLS)
def test_cross_attention_shapes_match_numpy(impl):
  """q_len != kv_len (cross-attention): decoder segments attend to the matching encoder segment."""
  q, k, v = random_qkv(seed=2, t=3, s=5, kvh=2)
  q_seg = np.array([[1, 1, 0], [1, 2, 2]], np.int32)
  kv_seg = np.array([[1, 1, 1, 0, 0], [1, 1, 2, 2, 2]], np.int32)
  out = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(q_seg), jnp.asarray(kv_seg),
               implementation=impl)
  ref_mask = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
  ref = np_attention(q, k, v, ref_mask)
  real = q_seg != 0
  np.testing.assert_allclose(np.asarray(out)[real], ref[real], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", _IMPLS)
@pytest.mark.parametrize("kvh", [2, 1])
def test_gqa_equals_mha_with_repeated_kv_heads(impl, kvh):
  q, k, v = random_qkv(seed=3, kvh=kvh)
  grouped = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), *ids(SEGMENTS, True), implementation=impl)
  g = 4 // kvh
  full = attend(jnp.asarray(q), jnp.repeat(jnp.asarray(k), g, axis=2),
                jnp.repeat(jnp.asarray(v), g, axis=2), *ids(SEGMENTS, True), implementation=impl)
  np.testing.assert_allclose(np.asarray(grouped), np.asarray(full), atol=1e-6)


def test_auto_picks_dense_below_and_tiled_above_the_threshold():
  """The dispatcher's rule on CPU, and that it says why; dropout keeps the dense path."""
  n, thr = 8, layers.TILED_MIN_LENGTH
  shape = lambda t: (1, t, 4, n)  # pylint: disable=unnecessary-lambda-assignment
  assert layers.choose_attention("auto", shape(512), shape(512), jnp.float32, False, "cpu")[0] == "einsum"
  assert layers.choose_attention("auto", shape(1), shape(4 * thr), jnp.float32, False, "cpu")[0] == "einsum"
  choice, reason = layers.choose_attention("auto", shape(thr), shape(thr), jnp.float32, False, "cpu")
  assert choice == "tiled" and str(thr) in reason
  assert layers.choose_attention("tiled", shape(8), shape(8), jnp.float32, False, "cpu")[0] == "tiled"
  # An explicit request is honoured whatever the default backend (compiling for a TPU from a CPU).
  assert layers.choose_attention("cudnn", shape(8), shape(8), jnp.bfloat16, False, "cpu")[0] == "cudnn"
  choice, reason = layers.choose_attention("xla", shape(8), shape(8), jnp.float32, True, "gpu")
  assert choice == "einsum" and "dropout" in reason and "xla requested" in reason


def test_attention_choice_is_logged_once_per_program():
  lines = []
  layers.log_attention_choices(lines.append)
  try:
    q, k, v = random_qkv(seed=9, t=5)
    for _ in range(2):
      layers.dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), *ids(SEGMENTS[:, :5], True),
                                   implementation="tiled")
  finally:
    layers.log_attention_choices(None)
  mine = [line for line in lines if "(2, 5, 4, 8)" in line]
  assert len(mine) == 1 and mine[0].startswith("attention: tiled") and "requested" in mine[0], lines


def _weights_probe(b=2, t=6, h=4):
  """q, k and a one-hot v so that the attention output *is* the attention weights [b, t, h, s]."""
  q, k, _ = random_qkv(seed=6, b=b, t=t, h=h, kvh=h, d=t)
  v = np.broadcast_to(np.eye(t, dtype=np.float32)[None, :, None, :], (b, t, h, t))
  seg = jnp.ones((b, t), jnp.int32)  # every key visible
  ref = np_attention(q, k, v, np.ones((b, t, t), bool))
  return jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), (seg, seg), ref


def test_attention_dropout():
  q, k, v, mask, weights = _weights_probe()
  rate = 0.5
  # deterministic=True: no dropout whatever the rate, on every path.
  for impl in _IMPLS + ("auto",):
    out = attend(q, k, v, *mask, dropout_rate=rate, deterministic=True, implementation=impl)
    np.testing.assert_allclose(np.asarray(out), weights, atol=1e-5)
  # With dropout on, every implementation runs the one dropout path (same key, same drops).
  drop_key = key(7)
  drop = {impl: np.asarray(attend(
      q, k, v, *mask, dropout_rate=rate, dropout_rng=drop_key, deterministic=False, implementation=impl))
          for impl in _IMPLS + ("auto",)}
  assert not np.allclose(drop["einsum"], weights, atol=1e-3)
  np.testing.assert_allclose(drop["xla"], drop["einsum"], atol=1e-6)
  np.testing.assert_allclose(drop["auto"], drop["einsum"], atol=1e-6)
  np.testing.assert_allclose(drop["tiled"], drop["einsum"], atol=1e-6)
  # deterministic=False: each weight is either dropped (0) or kept and scaled by 1/(1-rate).
  n = 1000
  sample = jax.jit(jax.vmap(lambda k_: layers.dot_product_attention(
      q, k, v, *mask, dropout_rate=rate, dropout_rng=k_, deterministic=False, implementation="einsum")),
      compiler_options=FAST_COMPILE)
  outs = np.asarray(sample(jax.random.split(key(0), n)))
  kept = ~np.isclose(outs, 0.0, atol=1e-7)
  expected = np.broadcast_to(weights / (1 - rate), outs.shape)
  np.testing.assert_allclose(outs[kept], expected[kept], rtol=1e-4, atol=1e-6)
  dropped = 1.0 - kept.mean()
  assert 0.47 < dropped < 0.53, dropped
  assert not np.allclose(outs[0], outs[1])  # different rngs drop different weights
  # Inverted dropout keeps the expectation: each sample has std = weight here (rate 0.5).
  assert np.all(np.abs(outs.mean(0) - weights) <= 5 * weights / math.sqrt(n) + 1e-6)


def _attention_module(position="none", **overrides):
  cfg = ModelConfig(d_model=16, num_heads=4, d_ff=32, position=position, dropout_rate=0.0,
                    vocab_size=11, max_len=16)
  return layers.Attention(replace(cfg, **overrides))


@pytest.mark.parametrize("kvh", [4, 1])
def test_self_attention_is_permutation_equivariant_without_positions(kvh):
  module = _attention_module(num_kv_heads=kvh)
  x = jax.random.normal(key(0), (2, 7, 16))
  seg = jnp.ones((2, 7), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
  params = init(module, x, seg, pos)
  perm = np.random.default_rng(0).permutation(7)
  out = run(module, params, x, seg, pos)
  out_perm = run(module, params, x[:, perm], seg, pos)
  np.testing.assert_allclose(np.asarray(out_perm), np.asarray(out[:, perm]), atol=1e-5)
  # Sanity: with RoPE the same check fails (positions matter).
  rope = _attention_module("rope", num_kv_heads=kvh)
  rp = init(rope, x, seg, pos)
  assert not np.allclose(np.asarray(run(rope, rp, x[:, perm], seg, pos)),
                         np.asarray(run(rope, rp, x, seg, pos)[:, perm]), atol=1e-3)


def test_attention_module_matches_numpy_reference():
  """The module's projections + attention equal a numpy recomputation from its params."""
  module = _attention_module(num_kv_heads=2)
  x = jax.random.normal(key(0), (2, 6, 16))
  seg = jnp.asarray(SEGMENTS)
  pos = jnp.broadcast_to(jnp.arange(6), (2, 6))
  params = nn.unbox(init(module, x, seg, pos))["params"]
  out = np.asarray(run(module, {"params": params}, x, seg, pos))
  p = jax.tree.map(np.asarray, params)
  xn = np.asarray(x)
  proj = lambda name: np.einsum("bld,dhk->blhk", xn, p[name]["kernel"]) + p[name]["bias"]
  att = np_attention(proj("query"), proj("key"), proj("value"), np_mask(SEGMENTS, False))
  ref = np.einsum("blhk,hkd->bld", att, p["out"]["kernel"]) + p["out"]["bias"]
  real = SEGMENTS != 0
  np.testing.assert_allclose(out[real], ref[real], atol=1e-5)


# ---------------------------------------------------------------------------------------
# Positions.


def _rope_score(cfg, q, k, m, n):
  qr = layers.apply_rope(q, jnp.array([[m]]), cfg)
  kr = layers.apply_rope(k, jnp.array([[n]]), cfg)
  return float(jnp.sum(qr * kr))


@pytest.mark.parametrize("scaling,factor", [("none", 1.0), ("ntk", 4.0), ("yarn", 4.0), ("llama3", 8.0)])
def test_rope_score_depends_only_on_relative_position(scaling, factor):
  cfg = ModelConfig(d_model=64, num_heads=4, position="rope", rope_scaling=scaling,
                    rope_scaling_factor=factor, rope_original_max_len=64)
  d = cfg.dim_per_head
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, d)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, d)), jnp.float32)
  for m, n in [(0, 0), (3, 1), (7, 2), (1, 5), (20, 20), (50, 13)]:
    base = _rope_score(cfg, q, k, m - n if m >= n else 0, 0 if m >= n else n - m)
    for shift in (1, 9, 100):
      assert _rope_score(cfg, q, k, m + shift, n + shift) == pytest.approx(base, rel=1e-4, abs=1e-4)
  # And the score does change with the distance (the rotation is not trivial).
  assert _rope_score(cfg, q, k, 5, 0) != pytest.approx(_rope_score(cfg, q, k, 0, 0), abs=1e-3)


def test_rope_scalings_change_frequencies_and_factor_one_is_none():
  base = ModelConfig(d_model=64, num_heads=4, position="rope", rope_original_max_len=64)
  ref, ref_scale = layers.rope_frequencies(base)
  np.testing.assert_allclose(ref, 1.0 / 10000.0 ** (np.arange(0, 16, 2) / 16))
  assert ref_scale == 1.0
  x = jax.random.normal(key(0), (1, 5, 2, 16))
  pos = jnp.arange(5)[None] * 13
  plain = layers.apply_rope(x, pos, base)
  # Rotation: norms preserved, position 0 is the identity.
  np.testing.assert_allclose(np.linalg.norm(plain, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(plain[:, 0]), np.asarray(x[:, 0]), atol=1e-6)
  for scaling in ("ntk", "yarn", "llama3"):
    one = replace(base, rope_scaling=scaling, rope_scaling_factor=1.0)
    np.testing.assert_allclose(np.asarray(layers.apply_rope(x, pos, one)), np.asarray(plain), atol=1e-5)
    scaled = replace(base, rope_scaling=scaling, rope_scaling_factor=4.0)
    inv, _ = layers.rope_frequencies(scaled)
    assert np.all(inv <= ref * (1 + 1e-9)) and not np.allclose(inv, ref)
    assert inv[0] == pytest.approx(ref[0])  # the highest frequency is kept by every scaling
  # llama3 and yarn divide the lowest frequency by the factor.
  for scaling in ("yarn", "llama3"):
    inv, _ = layers.rope_frequencies(replace(base, rope_scaling=scaling, rope_scaling_factor=4.0))
    assert inv[-1] == pytest.approx(ref[-1] / 4.0)
  assert layers.rope_frequencies(replace(base, rope_scaling="yarn", rope_scaling_factor=4.0))[1] == \
      pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_sinusoidal_values():
  pe = np.asarray(layers.sinusoidal(jnp.arange(4)[None], 512))
  assert pe.shape == (1, 4, 512)
  np.testing.assert_allclose(pe[0, 1, :2], [0.8415, 0.5403], atol=5e-5)
  np.testing.assert_allclose(pe[0, 3, :2], [0.1411, -0.9900], atol=5e-5)
  np.testing.assert_allclose(pe[0, 0, 0::2], 0.0, atol=1e-7)
  np.testing.assert_allclose(pe[0, 0, 1::2], 1.0, atol=1e-7)
  # The paper's formula, at a few (pos, i).
  for pos, i in [(2, 5), (3, 100), (1, 255)]:
    angle = pos / 10000 ** (2 * i / 512)
    assert pe[0, pos, 2 * i] == pytest.approx(math.sin(angle), abs=1e-5)
    assert pe[0, pos, 2 * i + 1] == pytest.approx(math.cos(angle), abs=1e-5)
  concat = np.asarray(layers.sinusoidal(jnp.arange(4)[None], 512, layout="concat"))
  assert not np.allclose(concat, pe)
  np.testing.assert_allclose(concat[0, 1, [0, 256]], [0.8415, 0.5403], atol=5e-5)  # sin half, cos half
  np.testing.assert_allclose(concat[0, 3, [0, 256]], [0.1411, -0.9900], atol=5e-5)
  assert concat[0, 1, 1] != pytest.approx(0.5403, abs=1e-3)


def test_marian_sinusoid_matches_transformers_formula():
  # transformers' MarianSinusoidalPositionalEmbedding.create_weight, written out in numpy.
  n_pos, dim = 6, 10
  enc = np.array([[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)] for pos in range(n_pos)])
  want = np.concatenate([np.sin(enc[:, 0::2]), np.cos(enc[:, 1::2])], axis=1)
  got = np.asarray(layers.sinusoidal(jnp.arange(n_pos)[None], dim, layout="marian"))[0]
  np.testing.assert_allclose(got, want, atol=1e-6)
  # The same numbers as the paper's, in another order; tensor2tensor's differ.
  paper = np.asarray(layers.sinusoidal(jnp.arange(n_pos)[None], dim))[0]
  np.testing.assert_allclose(got, np.concatenate([paper[:, 0::2], paper[:, 1::2]], 1), atol=1e-6)
  assert not np.allclose(got, np.asarray(layers.sinusoidal(jnp.arange(n_pos)[None], dim, layout="concat"))[0])


def _hf_yarn(d, theta, s, orig, beta_fast=32, beta_slow=1, truncate=True, attention_factor=None, mscale=None,
             mscale_all_dim=None):
  """transformers' _compute_yarn_parameters (modeling_rope_utils.py, v5.24), in numpy float64."""
  def get_mscale(scale, m=1):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
  if attention_factor is None:
    attention_factor = (get_mscale(s, mscale) / get_mscale(s, mscale_all_dim) if mscale and mscale_all_dim
                        else get_mscale(s))
  def corr(rot):
    return (d * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))
  low, high = corr(beta_fast), corr(beta_slow)
  if truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, d - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
  pos_freqs = theta ** (np.arange(0, d, 2) / d)
  extrapolation = 1 - ramp
  return (1 / (s * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation, attention_factor


def _hf_llama3(d, theta, s, orig, low_f, high_f):
  """transformers' _compute_llama3_parameters, in numpy."""
  inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
  wavelen = 2 * math.pi / inv
  out = np.where(wavelen > orig / low_f, inv / s, inv)
  smooth = (orig / wavelen - low_f) / (high_f - low_f)
  mid = (1 - smooth) * out / s + smooth * out
  medium = ~(wavelen < orig / high_f) & ~(wavelen > orig / low_f)
  return np.where(medium, mid, out)


@pytest.mark.parametrize("fields", [{}, {"rope_beta_fast": 16.0, "rope_beta_slow": 2.0},
                                    {"rope_truncate": False}, {"rope_attention_factor": 1.3},
                                    {"rope_mscale": 0.707, "rope_mscale_all_dim": 0.5}])
def test_yarn_constants_match_transformers(fields):
  cfg = ModelConfig(d_model=128, num_heads=2, position="rope", rope_scaling="yarn", rope_scaling_factor=8.0,
                    rope_theta=5000.0, rope_original_max_len=256, **fields)
  inv, scale = layers.rope_frequencies(cfg)
  hf_names = {"rope_beta_fast": "beta_fast", "rope_beta_slow": "beta_slow", "rope_truncate": "truncate",
              "rope_attention_factor": "attention_factor", "rope_mscale": "mscale",
              "rope_mscale_all_dim": "mscale_all_dim"}
  want_inv, want_scale = _hf_yarn(64, 5000.0, 8.0, 256, **{hf_names[k]: v for k, v in fields.items()})
  np.testing.assert_allclose(inv, want_inv, rtol=1e-12)
  assert scale == pytest.approx(want_scale, rel=1e-12)


@pytest.mark.parametrize("low_f, high_f", [(1.0, 4.0), (2.0, 8.0)])
def test_llama3_constants_match_transformers(low_f, high_f):
  cfg = ModelConfig(d_model=256, num_heads=2, position="rope", rope_scaling="llama3", rope_scaling_factor=8.0,
                    rope_theta=500000.0, rope_original_max_len=64, rope_low_freq_factor=low_f,
                    rope_high_freq_factor=high_f)
  inv, scale = layers.rope_frequencies(cfg)
  np.testing.assert_allclose(inv, _hf_llama3(128, 500000.0, 8.0, 64, low_f, high_f), rtol=1e-12)
  assert scale == 1.0


def test_alibi_slopes():
  np.testing.assert_allclose(layers.alibi_slopes(8), [2.0 ** -i for i in range(1, 9)], rtol=1e-6)
  np.testing.assert_allclose(layers.alibi_slopes(4), [2.0 ** -i for i in (2, 4, 6, 8)], rtol=1e-6)
  # Non-power of two (the paper's rule): the 4-head slopes, then every other 8-head slope.
  np.testing.assert_allclose(layers.alibi_slopes(6), [2.0 ** -i for i in (2, 4, 6, 8, 1, 3)], rtol=1e-6)


# ---------------------------------------------------------------------------------------
# FFN and norms.


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_exact", "silu", "swiglu"])
def test_feedforward_matches_numpy(activation):
  cfg = ModelConfig(d_model=8, d_ff=16, activation=activation)
  ffn = layers.FeedForward(cfg)
  x = jax.random.normal(key(0), (2, 3, 8))
  params = nn.unbox(init(ffn, x))["params"]
  out = np.asarray(run(ffn, {"params": params}, x))
  p = jax.tree.map(np.asarray, params)
  xn = np.asarray(x, np.float64)
  if activation == "swiglu":
    g = xn @ p["wi_gate"]["kernel"] + p["wi_gate"]["bias"]
    hidden = g / (1 + np.exp(-g)) * (xn @ p["wi_up"]["kernel"] + p["wi_up"]["bias"])
  else:
    hid = xn @ p["wi"]["kernel"] + p["wi"]["bias"]
    hidden = (np.maximum(hid, 0) if activation == "relu" else
              hid / (1 + np.exp(-hid)) if activation == "silu" else
              0.5 * hid * (1 + np.vectorize(math.erf)(hid / math.sqrt(2))) if activation == "gelu_exact" else
              0.5 * hid * (1 + np.tanh(math.sqrt(2 / math.pi) * (hid + 0.044715 * hid ** 3))))
  np.testing.assert_allclose(out, hidden @ p["wo"]["kernel"] + p["wo"]["bias"], atol=1e-5)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm(kind):
  cfg = ModelConfig(d_model=8, norm=kind, norm_eps=1e-6)
  x = jax.random.normal(key(0), (2, 3, 8)) * 3 + 1
  module = layers.norm(cfg)
  variables = init(module, x)
  out = np.asarray(run(module, variables, x))
  xn = np.asarray(x, np.float64)
  if kind == "layernorm":
    ref = (xn - xn.mean(-1, keepdims=True)) / np.sqrt(xn.var(-1, keepdims=True) + 1e-6)
  else:
    ref = xn / np.sqrt((xn ** 2).mean(-1, keepdims=True) + 1e-6)
  np.testing.assert_allclose(out, ref, atol=1e-5)


@pytest.mark.parametrize("spec,shapes", [("nk,kf->nf", ((6, 8), (8, 5))),
                                         ("bkrd,bksd->bkrs", ((2, 3, 5, 8), (2, 3, 7, 8))),
                                         ("bkrs,bksd->bkrd", ((2, 3, 5, 7), (2, 3, 7, 8)))])
def test_bf16_matmul_einsum_matches_numpy_on_bf16_operands(spec, shapes):
  """matmul_dtype=bfloat16: the product and both gradient products run on bf16-rounded
  operands with float32 results (numpy in float64 on the same rounded values)."""
  import ml_dtypes  # pylint: disable=g-import-not-at-top  (a jax dependency)
  rng = np.random.default_rng(9)
  a, b = (rng.normal(size=s).astype(np.float32) for s in shapes)
  low = lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float64)
  out, vjp = jax.vjp(lambda x, y: layers.einsum(spec, x, y, "bfloat16"), jnp.asarray(a), jnp.asarray(b))
  g = rng.normal(size=out.shape).astype(np.float32)
  ga, gb = vjp(jnp.asarray(g))
  spec_a, spec_b = layers._transposed_specs(spec)  # pylint: disable=protected-access
  assert out.dtype == ga.dtype == gb.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), np.einsum(spec, low(a), low(b)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ga), np.einsum(spec_a, low(g), low(b)), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gb), np.einsum(spec_b, low(a), low(g)), rtol=1e-5, atol=1e-5)
  # ... which is not the float32 product (the rounding is real), and float32 mode is plain einsum.
  assert not np.allclose(np.asarray(out), np.einsum(spec, a, b), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(layers.einsum(spec, jnp.asarray(a), jnp.asarray(b))),
                                np.asarray(jnp.einsum(spec, a, b)))
