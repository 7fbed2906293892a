"""The decoder features of today's open models (issue 36), each against a numpy reference.

q/k/v biases (Qwen2), q/k norms (Qwen3, Gemma 3), sliding-window and global layers with a
RoPE base per kind (Mistral, Gemma 2/3), attention and final logit soft-capping and the
query scale (Gemma 2), (1 + w) RMSNorm, GeGLU, post-norms and the embedding scale (Gemma),
and the ring-buffer KV cache of a local layer (decoding past the window = full recompute).
"""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import decode
from jaxformer import layers
from jaxformer import model as model_lib
from jaxformer.config import ModelConfig, load_config
from jaxformer.errors import UserError

from conftest import FEATURES_OFF, feature_off, feature_off_changes

# Every feature on, small enough for numpy; init_std large so each one moves the logits.
ALL = dict(arch="decoder_only", vocab_size=61, d_model=32, num_heads=4, num_kv_heads=2, head_dim=12, num_layers=4,
           d_ff=40, activation="geglu", norm="rmsnorm", norm_position="pre", norm_eps=1e-6, position="rope",
           use_bias=False, dropout_rate=0.0, tie_output=True, scale_embeddings=True, kernel_init="normal",
           init_std=0.25, qkv_bias=True, qk_norm=True, norm_unit_offset=True, post_norms=True, sliding_window=5,
           attention_pattern="local,local,global", attn_softcap=2.0, final_softcap=3.0, query_pre_attn_scalar=20.0,
           rope_theta=1000.0, rope_local_theta=50.0, rope_scaling="linear", rope_scaling_factor=2.0)
OFF = FEATURES_OFF


def _randomize(params, seed, unit_offset):
  """Norm gains and biases drawn too (init leaves them 0/1, which would hide a wrong formula);
  gains around 1, or around 0 for (1 + w) norms."""
  leaves, tree = jax.tree_util.tree_flatten_with_path(params)
  rng = np.random.default_rng(seed)
  out = []
  for path, x in leaves:
    name = "/".join(str(getattr(p, "key", p)) for p in path)
    if name.endswith("bias") or "norm" in name:
      x = jnp.asarray(rng.normal(0.0, 0.3, x.shape), x.dtype) + (1.0 if "norm" in name and not unit_offset else 0.0)
    out.append(x)
  return jax.tree_util.tree_unflatten(tree, out)


def build(**changes):
  cfg = ModelConfig(**{**ALL, **changes})
  model = model_lib.DecoderOnly(cfg)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 17)), jnp.int32)
  params = _randomize(nn.unbox(model.init(jax.random.key(0), ids)["params"]), 1, cfg.norm_unit_offset)
  return cfg, model, params, ids


FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


@functools.partial(jax.jit, static_argnums=0, compiler_options=FAST_COMPILE)
def step(model, params, cache, ids, segment, position):
  """One cached call -> (logits, cache)."""
  logits, v = model.apply({"params": params, "cache": cache}, ids, segment, position, decode=True, mutable=["cache"])
  return logits, v["cache"]


# ----------------------------------------------------------------------------- numpy reference

def np_rms(x, w, eps, offset):
  y = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
  return y * ((1.0 + w) if offset else w)


def np_rope(x, pos, theta, factor):
  """Half-split RoPE of x [t, h, d] at positions [t]; frequencies divided by `factor` (linear scaling)."""
  d = x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, d, 2) / d) / factor
  ang = pos[:, None] * inv[None]
  cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
  x1, x2 = x[..., : d // 2], x[..., d // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def np_decoder(cfg, params, ids):
  """The decoder written out from the papers / HF's Gemma and Qwen code, one row at a time -> logits."""
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  emb = p["embed"]["embedding"]
  gelu = lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
  silu = lambda x: x / (1 + np.exp(-x))
  norm = lambda x, q: np_rms(x, q["scale"], cfg.norm_eps, cfg.norm_unit_offset)
  out = []
  for row in np.asarray(ids):
    t = len(row)
    x = emb[row] * (math.sqrt(cfg.d_model) if cfg.scale_embeddings else 1.0)
    pos = np.arange(t, dtype=np.float64)
    for i in range(cfg.num_layers):
      lp = p["decoder"][f"layer_{i}"]
      a = lp["self_attention"]
      local = cfg.layer_is_local(i)
      h = norm(x, lp["self_attention_norm"])
      proj = lambda name: np.einsum("td,dhk->thk", h, a[name]["kernel"]) + (a[name]["bias"] if cfg.qkv_bias else 0)
      q, k, v = proj("query"), proj("key"), proj("value")
      if cfg.qk_norm:
        q, k = norm(q, a["query_norm"]), norm(k, a["key_norm"])
      if local and cfg.rope_local_theta is not None:
        theta, factor = cfg.rope_local_theta, 1.0
      else:
        theta, factor = cfg.rope_theta, (cfg.rope_scaling_factor if cfg.rope_scaling == "linear" else 1.0)
      q, k = np_rope(q, pos, theta, factor), np_rope(k, pos, theta, factor)
      g = cfg.num_heads // cfg.kv_heads
      k, v = np.repeat(k, g, 1), np.repeat(v, g, 1)
      scale = (cfg.query_pre_attn_scalar or cfg.dim_per_head) ** -0.5
      s = np.einsum("thd,shd->hts", q, k) * scale
      if cfg.attn_softcap:
        s = cfg.attn_softcap * np.tanh(s / cfg.attn_softcap)
      qi, ki = np.arange(t)[:, None], np.arange(t)[None]
      visible = ki <= qi
      if local:
        visible &= qi - ki < cfg.sliding_window
      s = np.where(visible[None], s, -np.inf)
      w = np.exp(s - s.max(-1, keepdims=True))
      w /= w.sum(-1, keepdims=True)
      y = np.einsum("hts,shd,hdm->tm", w, v, a["out"]["kernel"])
      if cfg.post_norms:
        y = norm(y, lp["self_attention_post_norm"])
      x = x + y
      f = lp["ffn"]
      h = norm(x, lp["ffn_norm"])
      gate, up = h @ f["wi_gate"]["kernel"], h @ f["wi_up"]["kernel"]
      y = ((gelu(gate) if cfg.activation == "geglu" else silu(gate)) * up) @ f["wo"]["kernel"]
      if cfg.post_norms:
        y = norm(y, lp["ffn_post_norm"])
      x = x + y
    x = norm(x, p["decoder"]["final_norm"])
    logits = x @ emb.T
    if cfg.final_softcap:
      logits = cfg.final_softcap * np.tanh(logits / cfg.final_softcap)
    out.append(logits)
  return np.stack(out)


@pytest.mark.parametrize("off", [None] + sorted(OFF))
def test_decoder_matches_numpy_with_every_feature_and_each_one_off(off):
  """Logits within 1e-4 of the numpy decoder with all features, and with each turned off."""
  cfg, model, params, ids = build(**({} if off is None else feature_off_changes(off)))
  got = np.asarray(model.apply({"params": params}, ids))
  want = np_decoder(cfg, params, ids)
  np.testing.assert_allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("feature", sorted(OFF))
def test_every_feature_moves_the_logits(feature):
  """Turning one feature off (same weights where they still exist) changes the logits by more than 0.1:
  the reference test above would catch a feature that silently did nothing."""
  cfg, model, params, ids = build()
  m, kept = feature_off(cfg, params, feature)
  off = model_lib.DecoderOnly(m)
  diff = np.abs(np.asarray(model.apply({"params": params}, ids)) - np.asarray(off.apply({"params": kept}, ids)))
  assert diff.max() > 0.1, f"{feature}: logits moved by {diff.max():.3g} only"


@pytest.mark.parametrize("rows", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_ring_buffer_decode_past_the_window_equals_full_recompute(rows):
  """Local layers keep a window-sized ring (5 slots) while global layers keep all 17: one token
  at a time, and prompts in chunks longer than the window, give the full forward's logits."""
  cfg, model, params, ids = build()
  ids = jnp.tile(ids, (2, 1))[:rows]
  full = np.asarray(model.apply({"params": params}, ids))
  t = ids.shape[1]
  for chunks in ([1] * t,) if rows == 1 else ([7, 1, 1, 6, 2],):  # one token at a time; prompts longer than the ring
    cache = decode.init_cache(model, rows, t)
    sizes = {path[-3].key: x.shape for path, x in jax.tree_util.tree_leaves_with_path(cache)
             if path[-1].key == "cached_segment"}
    assert sizes == {f"layer_{i}": (rows, 5 if cfg.layer_is_local(i) else t) for i in range(cfg.num_layers)}
    got, at = [], 0
    for n in chunks:
      seg = jnp.ones((rows, n), jnp.int32)
      pos = jnp.broadcast_to(jnp.arange(at, at + n), (rows, n))
      logits, cache = step(model, params, cache, ids[:, at:at + n], seg, pos)
      at += n
      got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, 1), full, atol=2e-5, rtol=2e-5)


def test_generate_past_the_window_is_greedy_recompute():
  """decode.generate (left-padded prompts of two lengths, 12 new tokens: past the 5-token window)
  emits exactly the tokens a full forward's argmax gives at every step."""
  cfg, model, params, _ = build()
  prompts = [[3, 14, 15, 9], [2, 6]]
  got = np.asarray(decode.generate(model, params, prompts, 12, jax.random.key(0), temperature=0.0))
  forward = jax.jit(lambda ids: model.apply({"params": params}, ids), compiler_options=FAST_COMPILE)
  for row, prompt in enumerate(prompts):
    seq = list(prompt)
    for _ in range(12):  # one program: right padding to 16 tokens does not reach a causal query before it
      logits = forward(jnp.asarray([seq + [0] * (16 - len(seq))], jnp.int32))
      seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
    assert got[row].tolist() == seq[len(prompt):]


def test_unit_offset_rmsnorm_and_geglu_match_numpy():
  x = np.random.default_rng(3).normal(size=(2, 3, 8)).astype(np.float32)
  w = np.random.default_rng(4).normal(size=(8,)).astype(np.float32)
  got = layers.UnitOffsetRMSNorm(epsilon=1e-6).apply({"params": {"scale": w}}, x)
  np.testing.assert_allclose(got, np_rms(x.astype(np.float64), w, 1e-6, True), rtol=1e-5, atol=1e-6)
  cfg = ModelConfig(activation="geglu")
  gate, up = x, x[..., ::-1]
  want = 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3))) * up
  np.testing.assert_allclose(layers.ffn_activation(cfg, [jnp.asarray(gate), jnp.asarray(up)]), want, rtol=1e-5,
                             atol=1e-6)


@pytest.mark.parametrize("override, message", [
    ("model.attention_pattern=local,full", "a comma-separated cycle of local and global"),
    ("model.attention_pattern=local,global", "set model.sliding_window"),
    ("model.rope_local_theta=10000", "it needs model.sliding_window"),
    ("model.norm_unit_offset=true", "set model.norm=rmsnorm"),
    ("model.sliding_window=-1", "must be 0 (off) or a window in tokens"),
    ("model.attn_softcap=-1", "must be 0 (off) or positive"),
    ("model.query_pre_attn_scalar=0", "must be positive (or None: head_dim)"),
])
def test_bad_feature_settings_are_one_line(override, message):
  with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
    load_config("gpt2_tiny", [override])


def test_scan_layers_refuses_a_mixed_pattern_and_scans_a_uniform_one():
  with pytest.raises(UserError, match="mixes local and global"):
    load_config("llama_tiny", ["model.scan_layers=true", "model.sliding_window=8",
                               "model.attention_pattern=local,global"])
  cfg = load_config("llama_tiny", ["model.scan_layers=true", "model.sliding_window=8"]).model
  assert all(cfg.layer_is_local(i) for i in range(cfg.num_layers))


def test_tiled_kernel_gives_the_dense_logits_and_gradients_with_every_feature():
  """model.attention_impl=tiled (window, soft-cap and query scale inside the online softmax) against the
  dense path on the same weights: the loss within 1e-5 relative, each parameter's gradient within 1e-5 of
  its largest entry (float32 sums in another order)."""
  cfg, model, params, ids = build()
  tiled = model_lib.DecoderOnly(dataclasses.replace(cfg, attention_impl="tiled"))
  dense = model_lib.DecoderOnly(dataclasses.replace(cfg, attention_impl="einsum"))
  loss = lambda m: jax.jit(jax.value_and_grad(lambda p: jnp.sum(jnp.sin(m.apply({"params": p}, ids)))))
  (lt, gt), (ld, gd) = loss(tiled)(params), loss(dense)(params)
  np.testing.assert_allclose(lt, ld, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(gt), jax.tree.leaves(gd)):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(b).max()))
