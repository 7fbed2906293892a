"""The backend kernels (jaxformer/kernels.py) against a dense numpy reference.

Splash attention runs here in Pallas' interpret mode (no TPU): forward and the gradients of
q, k, v within the tolerances JAX's own splash tests use (tests/pallas/
tpu_splash_attention_kernel_test.py: output atol = rtol = 3e-3; dq, dk, dv atol 2e-2,
rtol 3e-2). The cuDNN call cannot run without a GPU: its `_supported` reasons are checked,
and the arguments it is given are run through jax.nn.dot_product_attention's XLA
implementation, which reads them the same way, against the reference.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import kernels

FWD_TOL = dict(atol=3e-3, rtol=3e-3)
BWD_TOL = dict(atol=2e-2, rtol=3e-2)


def reference(q, k, v, q_segment, kv_segment, causal, d_out, window=0, softcap=0.0, scale=None):
  """Dense attention and its hand-written backward in numpy (float64).

  q [b, t, h, d]; k, v [b, s, kvh, d]; d_out [b, t, h, d], the cotangent. Returns
  (out, dq, dk, dv, valid [b, t]); rows with no visible key (padding queries) are not valid.
  window > 0: also q - k < window (rows); softcap > 0: logits softcap * tanh(scale * q.k / softcap);
  scale None: d^-0.5.
  """
  q, k, v, d_out = (np.asarray(x, np.float64) for x in (q, k, v, d_out))
  b, t, h, d = q.shape
  s, kvh = k.shape[1], k.shape[2]
  g = h // kvh
  kr, vr = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)  # query head i reads kv head i // g
  qs = np.ones((b, t), int) if q_segment is None else np.asarray(q_segment)
  ks = np.ones((b, s), int) if kv_segment is None else np.asarray(kv_segment)
  mask = (qs[:, :, None] == ks[:, None, :]) & (ks[:, None, :] != 0)
  if causal:
    mask &= np.tril(np.ones((t, s), bool))[None]
  if window:
    mask &= (np.arange(t)[:, None] - np.arange(s)[None, :] < window)[None]
  mask = mask[:, None]  # [b, 1, t, s]
  scale = d ** -0.5 if scale is None else scale
  logits = np.einsum("bthd,bshd->bhts", q, kr) * scale
  if softcap:
    cap = np.tanh(logits / softcap)
    logits = softcap * cap
  logits = np.where(mask, logits, -np.inf)
  valid = mask.any(-1)[:, 0]  # [b, t]
  logits = np.where(valid[:, None, :, None], logits, 0.0)
  p = np.exp(logits - logits.max(-1, keepdims=True))
  p = np.where(mask | ~valid[:, None, :, None], p, 0.0)
  p /= p.sum(-1, keepdims=True)
  out = np.einsum("bhts,bshd->bthd", p, vr)
  d_out = d_out * valid[:, :, None, None]
  dv = np.einsum("bhts,bthd->bshd", p, d_out)
  dp = np.einsum("bthd,bshd->bhts", d_out, vr)
  ds = p * (dp - (dp * p).sum(-1, keepdims=True))
  if softcap:
    ds = ds * (1 - cap ** 2)
  dq = np.einsum("bhts,bshd->bthd", ds, kr) * scale
  dk = np.einsum("bhts,bthd->bshd", ds, q) * scale
  # The g query heads that share a kv head add their gradients into it.
  dk = dk.reshape(b, s, kvh, g, d).sum(3)
  dv = dv.reshape(b, s, kvh, g, d).sum(3)
  return out, dq, dk, dv, valid


def _inputs(b, t, s, h, kvh, d, seed=0):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, t, h, d)).astype(np.float32)
  k = rng.normal(size=(b, s, kvh, d)).astype(np.float32)
  v = rng.normal(size=(b, s, kvh, d)).astype(np.float32)
  d_out = rng.normal(size=(b, t, h, d)).astype(np.float32)
  return q, k, v, d_out


def _check_splash(q, k, v, d_out, q_segment, kv_segment, causal, **variant):
  """Splash (interpret mode) forward and q, k, v gradients against `reference` -> splash's output."""
  out_ref, dq_ref, dk_ref, dv_ref, valid = reference(q, k, v, q_segment, kv_segment, causal, d_out, **variant)
  segs = (None, None) if q_segment is None else (jnp.asarray(q_segment), jnp.asarray(kv_segment))
  valid_rows = jnp.asarray(valid[:, :, None, None], jnp.float32)

  def loss(q, k, v):
    out = kernels.splash_attention(q, k, v, *segs, causal=causal, interpret=True, **variant)
    return jnp.sum(out * d_out * valid_rows), out

  (_, out), (dq, dk, dv) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(dq)).all()
  np.testing.assert_allclose(np.asarray(out)[valid], out_ref[valid], **FWD_TOL)
  np.testing.assert_allclose(np.asarray(dq), dq_ref, **BWD_TOL)
  np.testing.assert_allclose(np.asarray(dk), dk_ref, **BWD_TOL)
  np.testing.assert_allclose(np.asarray(dv), dv_ref, **BWD_TOL)
  return np.asarray(out), valid


def test_splash_causal_gqa_with_packed_and_padded_segments():
  q, k, v, d_out = _inputs(2, 256, 256, 4, 2, 128)
  # Row 0: three packed documents; row 1: one document, then padding (segment 0).
  seg = np.array([[1] * 100 + [2] * 60 + [3] * 96, [1] * 200 + [0] * 56], np.int32)
  _check_splash(q, k, v, d_out, seg, seg, causal=True)


def test_splash_full_mask_mqa_no_segments():
  q, k, v, d_out = _inputs(1, 256, 256, 2, 1, 128, seed=1)
  _check_splash(q, k, v, d_out, None, None, causal=False)


def test_splash_cross_attention_mha_padded_source_and_target():
  """q_len != kv_len, no causal mask; the padding target rows see the padding source keys only."""
  q, k, v, d_out = _inputs(2, 128, 256, 2, 2, 128, seed=2)
  q_seg = np.array([[1] * 128, [1] * 90 + [0] * 38], np.int32)
  kv_seg = np.array([[1] * 256, [1] * 150 + [0] * 106], np.int32)
  _check_splash(q, k, v, d_out, q_seg, kv_seg, causal=False)


def test_splash_is_checked_by_the_reference():
  """The comparison can fail: splash attention with the other mask is far from the reference."""
  q, k, v, d_out = _inputs(1, 256, 256, 2, 1, 128, seed=3)
  out = kernels.splash_attention(q, k, v, causal=False, interpret=True)
  out_ref = reference(q, k, v, None, None, True, d_out)[0]
  assert np.abs(np.asarray(out) - out_ref).max() > 0.1


@pytest.mark.slow
def test_splash_under_a_mesh_equals_one_device(tmp_path):
  """shard_map over data=2 x tensor=2 (4 simulated CPU devices) gives one device's numbers."""
  script = tmp_path / "mesh.py"
  script.write_text(_MESH_SCRIPT)
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true", JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  proc = subprocess.run([sys.executable, str(script), root], env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "shard_map ok" in proc.stdout, proc.stdout


_MESH_SCRIPT = r'''
import sys
sys.path.insert(0, sys.argv[1])
import jax, jax.numpy as jnp, numpy as np
from jaxformer import config, kernels, sharding

rng = np.random.default_rng(0)
b, t, h, kvh, d = 2, 256, 4, 2, 128
q = rng.normal(size=(b, t, h, d)).astype(np.float32)
k, v = (rng.normal(size=(b, t, kvh, d)).astype(np.float32) for _ in range(2))
seg = np.array([[1] * 128 + [2] * 128, [1] * 200 + [0] * 56], np.int32)

def loss(q, k, v, seg):
  out = kernels.splash_attention(q, k, v, seg, seg, causal=True, interpret=True)
  return jnp.sum(out * jnp.cos(out)), out

step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
(_, out1), grads1 = step(q, k, v, seg)
mesh = sharding.make_mesh(config.MeshConfig(data=2, fsdp=1, tensor=2))
with sharding.use_mesh(mesh):
  assert kernels.splash_supported(q.shape, k.shape, q.dtype, causal=True, backend="tpu") is None
  (_, out2), grads2 = step(q, k, v, seg)
  text = step.lower(q, k, v, seg).as_text()
assert "shard_map" in text or "sdy.manual_computation" in text, "no shard_map in the program"
valid = (seg != 0)
np.testing.assert_allclose(np.asarray(out2)[valid], np.asarray(out1)[valid], atol=1e-5, rtol=1e-5)
for a, b_ in zip(grads1, grads2):
  np.testing.assert_allclose(np.asarray(b_), np.asarray(a), atol=1e-5, rtol=1e-5)
print("shard_map ok")
'''


@pytest.mark.parametrize("kwargs, reason", [
    (dict(), None),
    (dict(backend="cpu"), "TPU kernel"),
    (dict(q=(2, 256, 4, 64)), "head_dim 64"),
    (dict(q=(2, 200, 4, 128), kv=(2, 200, 2, 128)), "multiples of 128"),
    (dict(q=(2, 1, 4, 128)), "one query"),
    (dict(has_bias=True), "ALiBi"),
    (dict(dropout=True), "dropout"),
    (dict(decode=True), "KV cache"),
    (dict(q=(2, 128, 4, 128)), "causal attention with q_len 128 != kv_len 256"),
    (dict(dtype=jnp.float16), "float16"),
    (dict(window=128, softcap=50.0), None),
    (dict(window=128, causal=False, q=(2, 256, 4, 128)), "sliding window"),
])
def test_splash_supported_reasons(kwargs, reason):
  q = kwargs.pop("q", (2, 256, 4, 128))
  kv = kwargs.pop("kv", (2, 256, 2, 128))
  dtype = kwargs.pop("dtype", jnp.bfloat16)
  got = kernels.splash_supported(q, kv, dtype, mesh=jax.sharding.AbstractMesh((), ()),
                                 **{"backend": "tpu", "causal": True, **kwargs})
  assert (got is None) if reason is None else (reason in got), got


def test_splash_supported_checks_the_mesh():
  mesh = jax.sharding.AbstractMesh((2, 1, 4), ("data", "fsdp", "tensor"))
  check = lambda q, kv: kernels.splash_supported(q, kv, jnp.bfloat16, causal=True, backend="tpu", mesh=mesh)
  assert check((4, 256, 8, 128), (4, 256, 4, 128)) is None
  assert check((4, 256, 8, 128), (4, 256, 1, 128)) is None  # MQA: the one kv head is replicated
  assert "batch 3" in check((3, 256, 8, 128), (3, 256, 4, 128))
  assert "tensor" in check((4, 256, 8, 128), (4, 256, 2, 128))


def test_splash_block_sizes_follow_the_lengths():
  bs = kernels.splash_block_sizes(8192, 384)
  assert (bs.block_q, bs.block_kv, bs.block_q_dkv, bs.block_kv_dkv, bs.block_q_dq, bs.block_kv_dq) == (
      512, 128, 512, 128, 512, 128)
  assert kernels.splash_block_sizes(768, 256).block_q == 256 and bs.has_backward_blocks


@pytest.mark.parametrize("kwargs, reason", [
    (dict(), None),
    (dict(backend="tpu"), "GPU kernel"),
    (dict(dtype=jnp.float32), "float32"),
    (dict(segments="packed"), "packed"),
    (dict(has_bias=True), "ALiBi"),
    (dict(dropout=True), "dropout"),
    (dict(decode=True), "KV cache"),
    (dict(q=(2, 64, 8, 64)), "q_len 64 != kv_len 128"),
    (dict(q=(2, 128, 8, 256), kv=(2, 128, 2, 256)), "at most 128"),
    (dict(q=(2, 128, 8, 256), kv=(2, 128, 2, 256), compute_capability="9.0"), None),
    (dict(q=(2, 128, 8, 60), kv=(2, 128, 2, 60)), "multiple of 8"),
    (dict(softcap=50.0), "soft-capping"),
    (dict(softcap=50.0, window=64), "soft-capping"),
    (dict(window=64), None),
    (dict(window=64, causal=False), "sliding window"),
])
def test_cudnn_supported_reasons(kwargs, reason):
  q = kwargs.pop("q", (2, 128, 8, 64))
  kv = kwargs.pop("kv", (2, 128, 2, 64))
  dtype = kwargs.pop("dtype", jnp.bfloat16)
  got = kernels.cudnn_supported(q, kv, dtype, **{"backend": "gpu", "compute_capability": "8.0", "causal": True,
                                                 "segments": "padding", **kwargs})
  assert (got is None) if reason is None else (reason in got), got


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_arguments_mean_the_reference_mask(causal):
  """The lengths and is_causal built for cuDNN, read by JAX's XLA implementation, equal the dense mask."""
  q, k, v, d_out = _inputs(2, 16, 16, 4, 2, 8, seed=4)
  seg = np.array([[1] * 16, [1] * 11 + [0] * 5], np.int32)
  args = kernels.cudnn_arguments(jnp.asarray(seg), jnp.asarray(seg), causal=causal)
  np.testing.assert_array_equal(np.asarray(args["query_seq_lengths"]), [16, 11])
  assert args["query_seq_lengths"].dtype == jnp.int32 and args["is_causal"] == causal
  out = jax.nn.dot_product_attention(q, k, v, implementation="xla", **args)
  out_ref, *_, valid = reference(q, k, v, seg, seg, causal, d_out)
  np.testing.assert_allclose(np.asarray(out)[valid], out_ref[valid], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- through the dispatcher

def test_the_dispatcher_picks_splash_and_cudnn_where_they_hold_and_says_why_not():
  from jaxformer import layers
  choose = layers.choose_attention
  n = layers.TILED_MIN_LENGTH
  llama, gpt2 = (2, n, 32, 128), (2, n, 12, 64)
  kv = lambda q, kvh: (q[0], q[1], kvh, q[3])  # pylint: disable=unnecessary-lambda-assignment
  choice, reason = choose("auto", llama, kv(llama, 8), jnp.bfloat16, False, "tpu", causal=True)
  assert choice == "splash" and reason.startswith("auto on tpu")
  choice, reason = choose("auto", gpt2, kv(gpt2, 12), jnp.bfloat16, False, "tpu", causal=True)
  assert choice == "tiled" and "head_dim 64" in reason
  choice, reason = choose("splash", llama, kv(llama, 8), jnp.bfloat16, False, "cpu", causal=True, alibi=True)
  assert choice == "tiled" and "ALiBi" in reason
  one = (2, 1, 32, 128)  # a decode step against a 256-slot cache: requested, splash says why not
  assert "KV cache" in choose("splash", one, kv((2, 256, 32, 128), 8), jnp.bfloat16, False, "tpu", slotted=True)[1]
  assert choose("auto", gpt2, kv(gpt2, 12), jnp.bfloat16, False, "gpu", causal=True)[0] == "cudnn"
  choice, reason = choose("auto", gpt2, kv(gpt2, 12), jnp.float32, False, "gpu", causal=True)
  assert choice == "tiled" and "float32" in reason
  assert choose("cudnn", gpt2, kv(gpt2, 12), jnp.bfloat16, True, "gpu")[0] == "einsum"  # dropout: dense only
  # Below the length threshold auto keeps each backend's dense path (splash/cuDNN untimed on a device).
  short_llama, short_gpt2 = (2, 256, 32, 128), (2, 256, 12, 64)
  choice, reason = choose("auto", short_llama, kv(short_llama, 8), jnp.bfloat16, False, "tpu", causal=True)
  assert choice == "einsum" and "not timed on a TPU" in reason
  choice, reason = choose("auto", short_gpt2, kv(short_gpt2, 12), jnp.bfloat16, False, "gpu", causal=True)
  assert choice == "xla" and "not timed on a GPU" in reason
  assert choose("auto", (1, 1, 32, 128), kv(llama, 8), jnp.bfloat16, False, "tpu", slotted=True)[0] == "einsum"


def test_cudnn_rows_ok_only_for_one_sequence_then_padding():
  ok = lambda q, kv: bool(kernels.cudnn_rows_ok(jnp.asarray(q), jnp.asarray(kv)))  # pylint: disable=unnecessary-lambda-assignment
  assert ok([[1, 1, 1, 0], [1, 1, 0, 0]], [[1, 1, 1, 0], [1, 0, 0, 0]])
  assert not ok([[1, 1, 2, 2], [1, 1, 0, 0]], [[1, 1, 2, 2], [1, 1, 0, 0]])  # packed
  assert not ok([[1, 0, 1, 0]], [[1, 1, 1, 0]])  # a hole: not a prefix
  assert not ok([[0, 0, 0, 0]], [[0, 0, 0, 0]])  # an all-padding (filler) row
  assert not ok([[2, 2, 0, 0]], [[1, 1, 0, 0]])  # q and kv in different segments


@pytest.mark.parametrize("packed", [False, True])
def test_cudnn_through_the_dispatcher_equals_the_reference(monkeypatch, packed):
  """cuDNN replaced by the XLA implementation given the same arguments (no GPU here): a padded batch
  runs it, a packed one the tiled kernel (lax.cond on the segment ids), both the reference's numbers."""
  from jaxformer import layers
  calls = []

  def fake_cudnn(q, k, v, q_segment=None, kv_segment=None, *, causal):
    calls.append(causal)
    return jax.nn.dot_product_attention(q, k, v, implementation="xla",
                                        **kernels.cudnn_arguments(q_segment, kv_segment, causal=causal))

  monkeypatch.setattr(kernels, "cudnn_attention", fake_cudnn)
  q, k, v, d_out = (x.astype(jnp.bfloat16) for x in _inputs(2, 16, 16, 4, 2, 8, seed=5))  # cuDNN: bf16
  seg = np.array([[1] * 6 + [2] * 10, [1] * 12 + [0] * 4] if packed else [[1] * 16, [1] * 12 + [0] * 4], np.int32)
  slots = jnp.arange(16)
  out = jax.jit(lambda q, k, v, s: layers.dot_product_attention(q, k, v, s, s, slots, slots, implementation="cudnn",
                                                                causal=True))(q, k, v, jnp.asarray(seg))
  assert calls == [True]  # traced into the program (which branch runs is the segment ids' call)
  out_ref, *_, valid = reference(*(np.asarray(x, np.float32) for x in (q, k, v)), seg, seg, True,
                                 np.asarray(d_out, np.float32))
  assert out.dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(out, np.float32)[valid], out_ref[valid], atol=2e-2, rtol=2e-2)


@pytest.mark.slow
def test_splash_in_a_llama_model_equals_einsum(monkeypatch):
  """attention_impl=splash (interpret mode) in a 2-layer Llama-style model with head_dim 128 and GQA:
  the logits and the gradients of a next-token loss over packed + padded rows equal the einsum path's."""
  from jaxformer import config as config_lib
  from jaxformer import model as model_lib
  calls = []  # shapes of the splash calls traced: a fallback to another kernel would leave none

  def splash(q, *args, **kwargs):
    calls.append(q.shape)
    return real_splash(q, *args, interpret=True, **kwargs)
  real_splash = kernels.splash_attention
  monkeypatch.setattr(kernels, "splash_attention", splash)
  over = ["model.d_model=256", "model.num_heads=2", "model.num_kv_heads=1", "model.max_len=128"]
  build = lambda impl: model_lib.build_model(config_lib.load_config(  # pylint: disable=unnecessary-lambda-assignment
      "llama_tiny", over + [f"model.attention_impl={impl}"]).model)
  ref_model, splash_model = build("einsum"), build("splash")
  rng = np.random.default_rng(6)
  ids = jnp.asarray(rng.integers(3, 68, (2, 128)), jnp.int32)
  seg = jnp.asarray([[1] * 70 + [2] * 58, [1] * 100 + [0] * 28], jnp.int32)
  pos = jnp.asarray(np.stack([np.r_[np.arange(70), np.arange(58)], np.arange(128)]), jnp.int32)
  targets = jnp.asarray(rng.integers(3, 68, (2, 128)), jnp.int32)
  params = ref_model.init(jax.random.key(0), ids[:1, :8])["params"]

  def run(m):
    def loss(p):
      logits = m.apply({"params": p}, ids, seg, pos)
      nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]
      return jnp.sum(jnp.where(seg != 0, nll, 0.0)) / jnp.sum(seg != 0), logits
    return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)

  (_, ref_logits), ref_grads = run(ref_model)
  assert not calls
  (_, logits), grads = run(splash_model)
  assert len(calls) >= 2, calls  # both layers ran splash
  valid = np.asarray(seg) != 0
  np.testing.assert_allclose(np.asarray(logits)[valid], np.asarray(ref_logits)[valid], **FWD_TOL)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), **BWD_TOL), grads, ref_grads)


# ----------------------------------------------------------------------------- window, soft-capping, scale

@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_splash_mask_is_the_causal_window(window):
  """LocalMask(window_size=(window - 1, 0)) as built here is exactly k <= q and q - k < window."""
  got = np.asarray(kernels.splash_mask(16, 16, True, window)[:, :])
  diff = np.arange(16)[:, None] - np.arange(16)[None, :]
  np.testing.assert_array_equal(got, (diff >= 0) & (diff < window))


def test_splash_window_softcap_and_scale_gqa_packed():
  """Splash with a window, soft-capping and a custom scale (interpret mode) against numpy, forward and
  gradients; without any one of them numpy's output is far from splash's (the check can fail)."""
  variant = dict(window=100, softcap=2.0, scale=0.15)
  q, k, v, d_out = _inputs(2, 256, 256, 4, 2, 128, seed=7)
  seg = np.array([[1] * 100 + [2] * 60 + [3] * 96, [1] * 200 + [0] * 56], np.int32)
  out, valid = _check_splash(q, k, v, d_out, seg, seg, True, **variant)
  for dropped in variant:
    rest = {key: value for key, value in variant.items() if key != dropped}
    ref = reference(q, k, v, seg, seg, True, d_out, **rest)[0]
    assert np.abs(out[valid] - ref[valid]).max() > 0.05, dropped


def test_splash_kernel_is_cached_per_window_and_softcap_and_skips_blocks():
  """The cached kernel differs per variant, carries the cap, and with a 100-row window visits at most two
  512-row key blocks per query block (the window and the diagonal) where causal needs up to three."""
  window = kernels._splash_kernel(1, 1536, 1536, True, False, True, 100, 2.0)
  causal = kernels._splash_kernel(1, 1536, 1536, True, False, True, 0, 0.0)
  assert window is not causal and window is kernels._splash_kernel(1, 1536, 1536, True, False, True, 100, 2.0)
  assert window.kwargs["attn_logits_soft_cap"] == 2.0 and causal.kwargs["attn_logits_soft_cap"] is None
  assert (np.asarray(window.fwd_mask_info.block_mask) != 0).sum(-1).max() == 2
  assert (np.asarray(causal.fwd_mask_info.block_mask) != 0).sum(-1).max() == 3


def test_cudnn_window_and_scale_arguments_mean_the_reference_mask(monkeypatch):
  """cudnn_attention's call (captured: no GPU) with a window and a scale: local_window_size (window - 1, 0)
  and the scale; the same arguments on JAX's XLA implementation give numpy's numbers, and without the
  window they would not."""
  calls = []
  real = jax.nn.dot_product_attention

  def capture(q, k, v, **kwargs):
    calls.append(kwargs)
    return real(q, k, v, **{**kwargs, "implementation": "xla"})

  monkeypatch.setattr(jax.nn, "dot_product_attention", capture)
  q, k, v, d_out = _inputs(2, 16, 16, 4, 2, 8, seed=8)
  seg = np.array([[1] * 16, [1] * 11 + [0] * 5], np.int32)
  out = kernels.cudnn_attention(q, k, v, jnp.asarray(seg), jnp.asarray(seg), causal=True, window=5, scale=0.2)
  (args,) = calls
  assert args["implementation"] == "cudnn" and args["is_causal"]
  assert args["local_window_size"] == (4, 0) and args["scale"] == 0.2
  out_ref, *_, valid = reference(q, k, v, seg, seg, True, d_out, window=5, scale=0.2)
  np.testing.assert_allclose(np.asarray(out)[valid], out_ref[valid], atol=1e-5, rtol=1e-5)
  no_window = reference(q, k, v, seg, seg, True, d_out, scale=0.2)[0]
  assert np.abs(np.asarray(out)[valid] - no_window[valid]).max() > 0.05
  assert "local_window_size" not in kernels.cudnn_arguments(causal=True) and "scale" not in kernels.cudnn_arguments(
      causal=True)


def test_the_dispatcher_passes_window_and_softcap_to_the_kernel_checks():
  from jaxformer import layers
  choose = layers.choose_attention
  n = layers.TILED_MIN_LENGTH
  gemma = (2, n, 8, 128)
  kv = (2, n, 4, 128)
  assert choose("auto", gemma, kv, jnp.bfloat16, False, "tpu", causal=True, window=4096, softcap=50.0)[0] == "splash"
  assert choose("auto", gemma, kv, jnp.bfloat16, False, "gpu", causal=True, window=4096)[0] == "cudnn"
  choice, reason = choose("auto", gemma, kv, jnp.bfloat16, False, "gpu", causal=True, window=4096, softcap=50.0)
  assert choice == "tiled" and "soft-capping" in reason
