"""Tests for paged attention (jaxformer.paged, layers.paged_attention): the C++ kernel and the gather path against
a numpy reference, and the serving engine on both paths, with a sliding-window model, against decode.generate."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import engine as engine_lib
from jaxformer import layers
from jaxformer import paged
from jaxformer import qkernel
from jaxformer import serve as serve_lib
from jaxformer.errors import UserError

from test_engine import _prompts, _reference, _setup

needs_kernel = pytest.mark.skipif(qkernel.unavailable() is not None, reason=f"no C++ kernel: {qkernel.unavailable()}")


def _case(rng, rows, t, heads, kv_heads, d, hist, slots):
  """Random operands: rows with histories of random lengths (some slots empty), and new tokens of which some
  rows pack two segments (the second's history after the first's, as Engine._layout lays a prefill row out)."""
  q, k, v = (rng.normal(size=(rows, t, h, d)).astype(np.float32) for h in (heads, kv_heads, kv_heads))
  pool_k, pool_v = (rng.normal(size=(kv_heads * slots, d)).astype(np.float32) for _ in range(2))
  src = rng.integers(0, slots, (rows, hist)).astype(np.int32)
  kv_seg, kv_pos = np.zeros((rows, hist), np.int32), np.zeros((rows, hist), np.int32)
  q_seg, q_pos = np.zeros((rows, t), np.int32), np.zeros((rows, t), np.int32)
  for r in range(rows):
    pieces = 2 if t > 2 and r % 2 else 1
    h0 = c0 = 0
    for j in range(pieces):
      n_hist = int(rng.integers(0, (hist - h0) // (pieces - j) + 1))
      n_new = max(1, (t - c0) // (pieces - j) - (r % 2))           # some rows end in pads
      kv_seg[r, h0:h0 + n_hist], kv_pos[r, h0:h0 + n_hist] = j + 1, np.arange(n_hist)
      q_seg[r, c0:c0 + n_new], q_pos[r, c0:c0 + n_new] = j + 1, n_hist + np.arange(n_new)
      h0, c0 = h0 + n_hist, c0 + n_new
  return q, k, v, pool_k, pool_v, src, kv_seg, kv_pos, q_seg, q_pos


def _numpy(q, k, v, pool_k, pool_v, src, kv_seg, kv_pos, q_seg, q_pos, window, softcap, scale):
  """Brute force: each query's visible keys listed one by one, softmax in float64."""
  rows, t, heads, d = q.shape
  kv_heads = k.shape[2]
  slots = pool_k.shape[0] // kv_heads
  out = np.zeros(q.shape)
  for r in range(rows):
    for i in range(t):
      if q_seg[r, i] == 0:
        continue
      for h in range(heads):
        g = h // (heads // kv_heads)
        keys = [(pool_k[g * slots + src[r, j]], pool_v[g * slots + src[r, j]], kv_seg[r, j], kv_pos[r, j])
                for j in range(src.shape[1])] + [(k[r, j, g], v[r, j, g], q_seg[r, j], q_pos[r, j]) for j in range(t)]
        seen = [(kk, vv) for kk, vv, s, p in keys
                if s == q_seg[r, i] and p <= q_pos[r, i] and (not window or q_pos[r, i] - p < window)]
        logits = np.array([np.dot(q[r, i, h].astype(np.float64) * scale, kk) for kk, _ in seen])
        if softcap:
          logits = softcap * np.tanh(logits / softcap)
        w = np.exp(logits - logits.max())
        out[r, i, h] = (w[:, None] * np.array([vv for _, vv in seen])).sum(0) / w.sum()
  return out


CASES = [  # rows, new tokens, heads, kv heads, head_dim, history slots, pool slots per head, window, softcap
    (4, 1, 4, 4, 64, 13, 40, 0, 0.0),      # decode, MHA
    (3, 7, 6, 2, 12, 17, 30, 0, 0.0),      # a prefill chunk, GQA, packed pieces, head_dim not a multiple of 8
    (2, 6, 4, 1, 8, 9, 16, 4, 2.0),        # MQA, a sliding window, soft-capping
    (5, 1, 2, 2, 40, 25, 64, 6, 0.0),      # decode under a window
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", ["kernel", "gather"])
def test_paged_attention_matches_numpy(case, path, monkeypatch):
  """The kernel and the gather + dense path, each within 1e-5 of a float64 brute force, on every query that
  sees a key (GQA/MQA, packed pieces, empty slots, pads, windows, soft-capping, head_dim not a multiple of 8)."""
  if path == "kernel" and qkernel.unavailable() is not None:
    pytest.skip(f"no C++ kernel: {qkernel.unavailable()}")
  if path == "gather":
    monkeypatch.setenv("JAXFORMER_PAGED", "gather")
  rows, t, heads, kv_heads, d, hist, slots, window, softcap = case
  args = _case(np.random.default_rng(sum(case[:7])), rows, t, heads, kv_heads, d, hist, slots)
  fn = jax.jit(lambda *a: layers.paged_attention(*a, window=window, softcap=softcap))
  text = fn.lower(*args).as_text()
  assert ("jaxformer_paged_attention" in text) == (path == "kernel")
  got = np.asarray(fn(*args))
  want = _numpy(*args, window, softcap, d ** -0.5)
  seen = args[8] != 0
  np.testing.assert_allclose(got[seen], want[seen], atol=1e-5, rtol=1e-5)
  if path == "kernel":
    assert not np.any(got[~seen])          # a pad sees nothing and gets zeros


@needs_kernel
def test_kernel_refuses_a_slot_outside_the_pool():
  args = list(_case(np.random.default_rng(0), 2, 1, 2, 2, 8, 5, 10))
  args[5] = np.full_like(args[5], 10)      # slot 10 of a 10-slot pool
  with pytest.raises(Exception, match="outside the pool"):
    jax.block_until_ready(jax.jit(lambda *a: paged.kernel_attention(*a))(*args))


WINDOWED = ("llama_tiny", ("model.sliding_window=6", "model.attention_pattern=local,global", "model.attn_softcap=3.0"))


@pytest.mark.parametrize("path", ["kernel", "gather"])
def test_engine_serves_a_sliding_window_model(path, monkeypatch):
  """A model with local (window 6) and global layers and soft-capped logits: the engine's greedy tokens equal
  decode.generate's (its local layers keep ring caches) for prompts longer than the window, alone and 6 at once,
  through the C++ kernel and through the gather path (the engine's program has the custom call or not)."""
  if path == "kernel" and qkernel.unavailable() is not None:
    pytest.skip(f"no C++ kernel: {qkernel.unavailable()}")
  if path == "gather":
    monkeypatch.setenv("JAXFORMER_PAGED", "gather")
  engine_lib._step_program.cache_clear()   # the program is traced again under this path
  model, params = _setup(*WINDOWED)
  eng = engine_lib.Engine(model, params, max_batch=3, block_size=4, max_seq_len=48, prefill_chunk=8)
  layout = eng._layout([[]] * 3, 1, eng.history_buckets[0], 1)[0]
  text = eng._step_fn.lower(eng.params, eng.kv, *layout, *eng._sampling_rows([None] * 3), True, False).as_text()
  assert ("jaxformer_paged_attention" in text) == (path == "kernel")
  lengths, new = (3, 14, 25, 7, 19, 30), [10, 8, 12, 6, 9, 11]
  prompts = _prompts(model.cfg.vocab_size, lengths, seed=4)
  requests = [eng.submit(p, engine_lib.SamplingParams(max_tokens=n)) for p, n in zip(prompts, new)]
  eng.run_until_done()
  expected = [row[:n] for row, n in zip(_reference(model, params, prompts, max(new)), new)]
  assert [r.output for r in requests] == expected
  engine_lib._step_program.cache_clear()


PALLAS_MODEL = ("llama_tiny", ("model.d_model=256", "model.num_heads=2", "model.num_kv_heads=1"))  # head_dim 128
_PALLAS_KERNEL = paged.pallas_attention


@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_pallas_tpu_kernel_matches_numpy_in_the_interpreter(softcap, monkeypatch):
  """JAX's Pallas TPU paged-attention kernel, run by Pallas' TPU interpreter on CPU through `paged.pallas_attention`:
  each row reads the pages of its block table up to its length (1 key included), GQA, soft-capping, within 1e-5 of
  a float64 brute force over the same keys and values rounded to bfloat16 (the kernel reads them so)."""
  monkeypatch.setenv("JAXFORMER_PAGED", "pallas-interpret")
  rng = np.random.default_rng(5)
  rows, heads, kv_heads, d, blocks, bs, width = 4, 4, 2, 16, 12, 8, 4
  q = rng.normal(size=(rows, 1, heads, d)).astype(np.float32)
  pool_k, pool_v = (rng.normal(size=(kv_heads * blocks * bs, d)).astype(np.float32) for _ in range(2))
  pages = np.stack([rng.permutation(np.arange(1, blocks))[:width] for _ in range(rows)]).astype(np.int32)
  lengths = np.array([1, 13, 32, 20], np.int32)
  got = np.asarray(jax.jit(lambda *a: paged.pallas_attention(*a, kv_heads, bs, softcap=softcap, scale=0.3))(
      q, pool_k, pool_v, pages, lengths))
  bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32), np.float64)
  for r in range(rows):
    slots = [pages[r, p // bs] * bs + p % bs for p in range(lengths[r])]
    for h in range(heads):
      g = h // (heads // kv_heads)
      keys, values = bf16(pool_k[g * blocks * bs + np.array(slots)]), bf16(pool_v[g * blocks * bs + np.array(slots)])
      logits = keys @ (q[r, 0, h].astype(np.float64) * 0.3)
      if softcap:
        logits = softcap * np.tanh(logits / softcap)
      w = np.exp(logits - logits.max())
      np.testing.assert_allclose(got[r, 0, h], w @ values / w.sum(), atol=1e-5, rtol=1e-5)


def _pallas_reference(q, pool_k, pool_v, pages, lengths, kv_heads, block_size, *, softcap=0.0, scale=None):
  """What `paged.pallas_attention` computes, in plain jnp at float32 "highest" precision: each row's first
  `lengths` keys of its block table (no rounding of the keys and values)."""
  rows, _, heads, d = q.shape
  p = jnp.arange(pages.shape[1] * block_size)
  rows_of = (pages[:, p // block_size] * block_size + p % block_size)[..., None] + jnp.arange(kv_heads) * (
      pool_k.shape[0] // kv_heads)                                                    # [rows, L, kv_heads]
  keys, values = pool_k[rows_of].astype(jnp.float32), pool_v[rows_of].astype(jnp.float32)
  qg = q[:, 0].astype(jnp.float32).reshape(rows, kv_heads, heads // kv_heads, d) * (d ** -0.5 if scale is None else scale)
  logits = jnp.einsum("rkgd,rlkd->rkgl", qg, keys, precision="highest")
  if softcap:
    logits = softcap * jnp.tanh(logits / softcap)
  weights = jax.nn.softmax(jnp.where(p < lengths[:, None, None, None], logits, -1e30), -1)
  return jnp.einsum("rkgl,rlkd->rkgd", weights, values, precision="highest").reshape(rows, 1, heads, d)


def _serve_decoding_by(model, params, attention, monkeypatch):
  """The engine's greedy tokens (4 requests, prompts past a block) with `attention` in `paged.pallas_attention`'s
  place (None: the kernel itself), each layer's calls recorded; nothing compiles after warm-up."""
  calls = []
  real = attention or _PALLAS_KERNEL
  monkeypatch.setattr(paged, "pallas_attention", lambda *a, **k: calls.append(a[3].shape) or real(*a, **k))
  engine_lib._step_program.cache_clear()   # the program is traced again under this path
  eng = engine_lib.Engine(model, params, max_batch=3, block_size=8, max_seq_len=48, prefill_chunk=16)
  assert eng.pallas_fallback is None and eng.paged_fallback == "JAXFORMER_PAGED=pallas-interpret"
  assert serve_lib._attention_path(eng) == "Pallas decode, gather prefill (JAXFORMER_PAGED=pallas-interpret)"  # ready line
  eng.warm_up()
  # Traced once per layer for each decode width: block tables of 4 and 6 blocks (the new token's included).
  assert sorted(set(calls)) == [(3, w) for w in eng.history_buckets] and len(calls) == 2 * len(eng.history_buckets)
  compiled = engine_lib.compilations()
  prompts = _prompts(model.cfg.vocab_size, (3, 14, 25, 9), seed=6)
  requests = [eng.submit(p, engine_lib.SamplingParams(max_tokens=n)) for p, n in zip(prompts, (10, 7, 12, 5))]
  eng.run_until_done()
  assert engine_lib.compilations() == compiled and eng.pool.used() == 0
  engine_lib._step_program.cache_clear()
  return prompts, [r.output for r in requests]


@pytest.mark.slow  # the whole engine in Pallas' interpreter; the kernel against numpy stays quick
def test_engine_decodes_through_the_pallas_kernel_in_the_interpreter(monkeypatch):
  """The engine as it runs on a TPU (JAXFORMER_PAGED=pallas-interpret: prefill by the gather path, decode steps by
  the Pallas kernel, which reads the new token's key and value from the pool the layer wrote them to).
  The plumbing (block tables, lengths, the write before the read, the written pool handed back) is exact: with a
  float32 reference in the kernel's place, a float32 model's greedy tokens equal decode.generate's. The kernel
  reads keys and values as bfloat16 (a float32 pool is refused: with its rounding the first request's 9th token
  differed from generate's here), so it serves bfloat16 pools; there its tokens equal the reference's."""
  monkeypatch.setenv("JAXFORMER_PAGED", "pallas-interpret")
  model, params = _setup(*PALLAS_MODEL)
  refused = engine_lib.Engine(model, params, max_seq_len=16)
  assert "reads keys and values as bfloat16" in refused.pallas_fallback
  assert serve_lib._attention_path(refused).startswith("gather (JAXFORMER_PAGED=pallas-interpret; Pallas: the Pallas")
  monkeypatch.setattr(paged, "pallas_why_not", lambda *a, **k: None)
  prompts, tokens = _serve_decoding_by(model, params, _pallas_reference, monkeypatch)
  assert tokens == [row[:len(t)] for row, t in zip(_reference(model, params, prompts, 12), tokens)]
  monkeypatch.undo()
  monkeypatch.setenv("JAXFORMER_PAGED", "pallas-interpret")
  model, params = _setup(PALLAS_MODEL[0], PALLAS_MODEL[1] + ("model.dtype=bfloat16",))
  assert _serve_decoding_by(model, params, None, monkeypatch)[1] == _serve_decoding_by(
      model, params, _pallas_reference, monkeypatch)[1]


def test_the_tpu_decode_step_lowers_to_the_mosaic_kernel():
  """`aot.lower_engine_decode` lowers the engine's decode step for platform "tpu" from this CPU host: each layer's
  attention is a Mosaic kernel (tpu_custom_call); a model whose head_dim the kernel's blocks refuse is refused in
  one line. (Compiled by libtpu: `benchmarks/aot_compile.py --serve-decode`, BENCHMARKS.md.)"""
  from jaxformer import aot  # pylint: disable=g-import-not-at-top
  from jaxformer.config import load_config  # pylint: disable=g-import-not-at-top
  cfg = load_config(PALLAS_MODEL[0], [*PALLAS_MODEL[1], "model.dtype=bfloat16"])
  lowered, _ = aot.lower_engine_decode(cfg, slots=4, context=64, block_size=16)
  text = lowered.as_text()
  assert "tpu_custom_call" in text and "paged_flash_attention" in text
  with pytest.raises(UserError, match="head_dim 8 is not a multiple of 128"):
    aot.lower_engine_decode(load_config("gpt2_tiny", ["model.dtype=bfloat16"]), slots=4, context=64)
