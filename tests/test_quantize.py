"""Weight-only int8/int4 quantization: the formats against numpy, the CPU kernel against the XLA path,
quantized workdirs through load_run/eval/generate against the float model of the dequantized weights."""

import concurrent.futures
import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import checkpoint as checkpoint_lib
from jaxformer import decode
from jaxformer import evaluate
from jaxformer import qkernel
from jaxformer import qmatmul
from jaxformer import quantize
from jaxformer.errors import UserError

QUIET = lambda *a, **k: None


def _ref_int8(w):
  """numpy reference, one output column at a time: q = round(w / s), s = max|w| / 127, back to s * q."""
  out = np.empty_like(w.T)
  for n in range(w.shape[1]):
    col = w[:, n]
    s = np.float32(np.abs(col).max() / np.float32(127)) if np.abs(col).max() > 0 else np.float32(1)
    out[n] = np.clip(np.rint(col / s), -127, 127) * s
  return out


def _ref_int4(w, group):
  """numpy reference, one (output, group) at a time: values -7..7 times max|w| / 7."""
  k, n_out = w.shape
  out = np.empty((n_out, k), np.float32)
  for n in range(n_out):
    for g in range(0, k, group):
      chunk = w[g:g + group, n]
      s = np.float32(np.abs(chunk).max() / np.float32(7)) if np.abs(chunk).max() > 0 else np.float32(1)
      out[n, g:g + group] = np.clip(np.rint(chunk / s), -7, 7) * s
  return out


def test_int8_roundtrip_equals_numpy_reference():
  rng = np.random.default_rng(0)
  w = rng.standard_normal((37, 11)).astype(np.float32) * 0.05
  w[:, 3] = 0  # an all-zero column keeps scale 1, not a division by zero
  q, s = qmatmul.quantize_int8(w)
  assert q.dtype == np.int8 and q.shape == (11, 37) and s.shape == (11,)
  np.testing.assert_array_equal(np.asarray(qmatmul.dequantize(jnp.asarray(q), jnp.asarray(s))), _ref_int8(w))
  assert np.abs(q).max() == 127  # the largest weight of a column maps to +-127


@pytest.mark.parametrize("k,group", [(64, 16), (48, 48), (256, 128)])
def test_int4_roundtrip_equals_numpy_reference(k, group):
  rng = np.random.default_rng(1)
  w = rng.standard_normal((k, 9)).astype(np.float32)
  q, s = qmatmul.quantize_int4(w, group)
  assert q.dtype == np.uint8 and q.shape == (9, k // 2) and s.shape == (9, k // group)
  np.testing.assert_array_equal(np.asarray(qmatmul.dequantize(jnp.asarray(q), jnp.asarray(s))), _ref_int4(w, group))
  # the packing itself: byte j holds k = 2j in its low nibble and 2j + 1 in its high one (two's complement)
  values = np.asarray(qmatmul.unpack_int4(jnp.asarray(q)))
  assert values.min() >= -7 and values.max() <= 7 and values.min() < 0
  np.testing.assert_array_equal(q, ((values[:, 0::2] & 15) | ((values[:, 1::2] & 15) << 4)).astype(np.uint8))


def _close(a, b, x, w):
  """|a - b| within 1e-5 of sum |x| |w| (the scale of float32 accumulation error), elementwise."""
  bound = 1e-5 * (np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T)
  assert np.all(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) <= bound + 1e-30)


def _layout(w, bits, group=0):
  """w [K, N] -> (q, scale) in a scheme: int8, int4 (in groups) or 32 (float32 output-major, the serving layout)."""
  if bits == 32:
    return np.ascontiguousarray(w.T), np.ones(w.shape[1], np.float32)
  return qmatmul.quantize_int8(w) if bits == 8 else qmatmul.quantize_int4(w, group)


@pytest.mark.parametrize("m,k,n,bits,group", [(1, 768, 130, 8, 0), (3, 33, 17, 8, 0), (16, 257, 5, 8, 0),
                                              (1, 96, 7, 4, 32), (5, 130, 9, 4, 130), (8, 64, 41, 4, 8),
                                              (2, 6, 3, 4, 6), (1, 768, 701, 8, 0), (20, 1024, 603, 4, 128),
                                              (1, 768, 130, 32, 0), (7, 37, 13, 32, 0), (16, 257, 5, 32, 0),
                                              (32, 1024, 603, 32, 0), (2, 3, 1, 32, 0),
                                              # int8 decode steps of 5-24 rows (the streaming loop's blocks of 4
                                              # rows and their tails, odd N and K)
                                              (5, 33, 17, 8, 0), (8, 768, 131, 8, 0), (13, 100, 3, 8, 0),
                                              (24, 3072, 70, 8, 0),
                                              # prefill rows: the blocked product (panels of 32 rows, tiles of 12)
                                              (48, 768, 130, 8, 0), (130, 257, 29, 8, 0), (64, 96, 7, 4, 32),
                                              (100, 130, 9, 4, 130), (77, 1024, 603, 4, 128), (48, 37, 13, 32, 0),
                                              (144, 768, 300, 32, 0), (150, 4096, 37, 8, 0),
                                              # inputs in chunks (GemmOutputs: 768 at most; int4's halves apart,
                                              # a group across a chunk's edge), rows in two blocks; rows in two
                                              # slabs (packed rows over 16 MiB)
                                              (400, 3000, 29, 8, 0), (300, 1800, 25, 4, 72), (1100, 4096, 13, 4, 128)])
def test_cpu_kernel_matches_xla_path(m, k, n, bits, group):
  reason = qkernel.unavailable()
  if reason:
    pytest.skip(reason)
  rng = np.random.default_rng(m * k + n)
  w = rng.standard_normal((k, n)).astype(np.float32)
  q, s = _layout(w, bits, group)
  x = rng.standard_normal((m, k)).astype(np.float32)
  kernel = jax.jit(qkernel.call)(x, q, s)
  xla = jax.jit(qmatmul.xla_matmul)(x, q, s)
  dense = np.asarray(qmatmul.dequantize(jnp.asarray(q), jnp.asarray(s)))
  if bits == 32:
    np.testing.assert_array_equal(dense, w.T)  # the float layout is w^T itself
  _close(kernel, xla, x, dense)
  _close(kernel, x.astype(np.float64) @ dense.T.astype(np.float64), x, dense)
  # the kernel up to KERNEL_MAX_ROWS rows, the XLA path above
  assert (qkernel.TARGETS[bits] in jax.jit(qmatmul.matmul).lower(x, q, s).as_text()) == (m <= qmatmul.kernel_max_rows(bits))


def _a8_reference(x, q, scale, act_bits=8):
  """numpy reference of the integer-activation product (`qmatmul.matmul(..., activations="int8" / "int16")`),
  float64: each row's blocks of 32 inputs (zeros past K) quantized as q = rint(x * (L / max|x|)) in float32 with L =
  127 (int8) or 32767 (int16), scale max|x| / L; the block's integer dot with the integer weights, exact; then the
  sum over blocks of x scale * w scale * dot."""
  x = np.asarray(x, np.float32)
  m, k = x.shape
  if q.dtype == np.uint8:  # int4, two a byte: the even input in the low nibble, signed
    w = np.stack([(q.astype(np.int8) << 4).astype(np.int8) >> 4, q.astype(np.int8) >> 4], -1).reshape(q.shape[0], k)
  else:
    w = q
  blocks = -(-k // 32)
  xp, wp = np.zeros((m, blocks * 32), np.float32), np.zeros((w.shape[0], blocks * 32), np.int64)
  xp[:, :k], wp[:, :k] = x, w
  xb = xp.reshape(m, blocks, 32)
  amax = np.abs(xb).max(-1)
  levels = np.float32(2 ** (act_bits - 1) - 1)
  inv = levels / np.where(amax > 0, amax, np.float32(1))
  xq = np.rint(xb * np.where(amax > 0, inv, np.float32(0))[..., None]).astype(np.int64)
  dots = np.einsum("mbk,nbk->mnb", xq, wp.reshape(-1, blocks, 32)).astype(np.float64)
  sx = (amax / levels).astype(np.float64)[:, None, :]
  if q.dtype == np.uint8:
    sw = np.repeat(np.asarray(scale, np.float64), (k // scale.shape[1]) // 32, axis=1)[None]  # [1, N, blocks]
    return (dots * sx * sw).sum(-1)
  return (dots * sx).sum(-1) * np.asarray(scale, np.float64)[None]


_A8_SHAPES = [(25, 100, 70, 8, 0), (30, 33, 5, 8, 0), (6, 64, 64, 8, 0), (2, 7, 3, 8, 0), (37, 256, 129, 4, 64),
              (100, 768, 300, 4, 128), (7, 96, 17, 4, 32), (64, 3072, 130, 8, 0), (50, 4096, 65, 4, 128),
              (2100, 8192, 5, 8, 0)]  # the last: rows in two slabs (16 MiB of int8 rows: 2048 rows of 8192; int16: 3)


@pytest.mark.parametrize("act_bits", [8, 16])
@pytest.mark.parametrize("m,k,n,bits,group", _A8_SHAPES)
def test_int8_activation_kernel_matches_numpy_reference(m, k, n, bits, group, act_bits):
  """The integer-activation product (AVX-512 VNNI builds; int8 and int16 rows) against `_a8_reference`: row tails
  (panels of 6), output tails (tiles of 64), K not a multiple of 32 or of 4 (or 2), int4 groups of 32-128 inputs,
  a large input per row."""
  if not qkernel.vnni():
    pytest.skip(qkernel.unavailable() or "the kernel was built without AVX-512 VNNI")
  rng = np.random.default_rng(m + k + n)
  q, s = _layout(rng.standard_normal((k, n)).astype(np.float32), bits, group)
  x = rng.standard_normal((m, k)).astype(np.float32)
  x[:, k // 2] *= 30  # an outlier input: its block's other inputs get few levels
  x[0, :min(k, 40)] = 0  # an all-zero block (scale 0)
  act = f"int{act_bits}"
  got = np.asarray(jax.jit(lambda x, q, s: qkernel.call(x, q, s, activations=act))(x, q, s), np.float64)
  want = _a8_reference(x, q, s, act_bits)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
  # not the weight-only product: the activations' rounding shows (int8: about 1% of the largest output, more beside
  # the outlier; int16: 258x finer levels)
  exact = np.asarray(qmatmul.xla_matmul(x, q, s))
  off = np.abs(got - exact).max() / np.abs(exact).max()
  assert (1e-4 < off < 0.1) if act_bits == 8 else (1e-7 < off < 1e-3)


def test_integer_activations_take_many_rows_and_say_why_not(monkeypatch, caplog):
  """`matmul(..., activations="int8" / "int16")` runs the VNNI product from ACT_MIN_ROWS rows, the weight-only one
  below; an int4 group that is not a multiple of 32 keeps float activations and says so once."""
  if not qkernel.vnni():
    pytest.skip(qkernel.unavailable() or "the kernel was built without AVX-512 VNNI")
  rng = np.random.default_rng(0)
  w = rng.standard_normal((96, 40)).astype(np.float32)
  lowered = lambda m, q, s: jax.jit(lambda x, q, s: qmatmul.matmul(x, q, s, activations="int8")).lower(
      np.zeros((m, 96), np.float32), q, s).as_text()
  q8, s8 = qmatmul.quantize_int8(w)
  assert qkernel.A8_TARGETS[8] in lowered(qmatmul.ACT_MIN_ROWS["int8"], q8, s8)
  assert qkernel.A8_TARGETS[8] not in lowered(qmatmul.ACT_MIN_ROWS["int8"] - 1, q8, s8)
  assert qkernel.A8_TARGETS[8] not in jax.jit(qmatmul.matmul).lower(np.zeros((64, 96), np.float32), q8, s8).as_text()
  int16 = lambda m: jax.jit(lambda x, q, s: qmatmul.matmul(x, q, s, activations="int16")).lower(
      np.zeros((m, 96), np.float32), q8, s8).as_text()
  assert "act_bits = 16" in int16(qmatmul.ACT_MIN_ROWS["int16"])
  assert qkernel.A8_TARGETS[8] not in int16(qmatmul.ACT_MIN_ROWS["int16"] - 1)
  q4, s4 = qmatmul.quantize_int4(w, 48)
  monkeypatch.setattr(qmatmul, "_LOGGED", set())
  with caplog.at_level(logging.WARNING, logger="jaxformer.qmatmul"):
    for _ in range(2):
      assert qkernel.A8_TARGETS[4] not in lowered(64, q4, s4)
  said = [r.getMessage() for r in caplog.records if "float activations" in r.getMessage()]
  assert said == ["quantized matmul: float activations (int4 groups of 48 inputs (integer activations take "
                  "multiples of 32))"]


@pytest.mark.parametrize("k,n", [(768, 300), (37, 13), (3072, 70)])
def test_float_kernel_rows_do_not_depend_on_the_batch(k, n):
  """The float32 kernel computes each output in one order whatever the row count and the row's place (row groups
  of 6 down to 1, a lane tail for odd k): every row of a 32-row product equals, bit for bit, the row alone and
  within 5- and 16-row products. The serving engine's greedy tokens then do not depend on what else runs."""
  if qkernel.unavailable():
    pytest.skip(qkernel.unavailable())
  rng = np.random.default_rng(k + n)
  q, s = _layout(rng.standard_normal((k, n)).astype(np.float32), 32)
  x = rng.standard_normal((32, k)).astype(np.float32)
  call = jax.jit(qkernel.call)
  full = np.asarray(call(x, q, s))
  for rows in (1, 5, 16):
    for start in range(0, 32 - rows + 1, 7):
      np.testing.assert_array_equal(np.asarray(call(x[start:start + rows], q, s)), full[start:start + rows])


def test_cpu_kernel_split_across_workers_from_concurrent_callers():
  """Products big enough to be split over the kernel's worker threads (>= 256 KiB of weights), called from
  four Python threads at once (concurrent XLA executions: one gets the workers, the others run inline), and
  prefill-sized ones (AVX-512 builds: the blocked product, in pieces on XLA's intra-op pool, several calls'
  pieces at once): every result equals the XLA path's, call after call."""
  if qkernel.unavailable():
    pytest.skip(qkernel.unavailable())
  rng = np.random.default_rng(7)
  cases = []
  for m, k, n, bits in ((1, 768, 1000, 8), (4, 1024, 700, 4), (3, 768, 1200, 8), (1, 2048, 600, 4), (16, 768, 500, 32),
                        (64, 768, 1000, 8), (40, 1024, 700, 4)):
    w = rng.standard_normal((k, n)).astype(np.float32)
    q, s = _layout(w, bits, 128)
    x = rng.standard_normal((m, k)).astype(np.float32)
    cases.append((x, q, s, np.asarray(qmatmul.dequantize(jnp.asarray(q), jnp.asarray(s)))))
  kernel = jax.jit(qkernel.call)

  def hammer(case):
    x, q, s, dense = case
    expected = jax.jit(qmatmul.xla_matmul)(x, q, s)
    for _ in range(30):
      _close(kernel(x, q, s), expected, x, dense)
    return True

  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    assert all(pool.map(hammer, cases))


def test_forced_fallback_runs_the_xla_path_and_says_why_once(monkeypatch, caplog):
  monkeypatch.setitem(qkernel._STATE, "reason", "JAXFORMER_QKERNEL=off")
  monkeypatch.setattr(qmatmul, "_LOGGED", set())
  rng = np.random.default_rng(2)
  w = rng.standard_normal((64, 24)).astype(np.float32)
  x = rng.standard_normal((1, 64)).astype(np.float32)
  for bits in (8, 4):
    q, s = qmatmul.quantize_int8(w) if bits == 8 else qmatmul.quantize_int4(w, 32)
    with caplog.at_level(logging.WARNING, logger="jaxformer.qmatmul"):
      text = jax.jit(qmatmul.matmul).lower(x, q, s).as_text()
      out = jax.jit(qmatmul.matmul)(x, q, s)
    assert "jaxformer_qmatmul" not in text
    np.testing.assert_array_equal(out, jax.jit(qmatmul.xla_matmul)(x, q, s))
  lines = [r.getMessage() for r in caplog.records if "XLA path" in r.getMessage()]
  assert lines == ["quantized matmul: XLA path on CPU (JAXFORMER_QKERNEL=off)"]
  # a workdir's default int16 activations (prefill rows) fall back the same way, and say so once too
  x = rng.standard_normal((64, 64)).astype(np.float32)
  q, s = qmatmul.quantize_int8(w)
  with caplog.at_level(logging.WARNING, logger="jaxformer.qmatmul"):
    for _ in range(2):
      f = jax.jit(lambda x, q, s: qmatmul.matmul(x, q, s, activations="int16"))
      assert "jaxformer_qmatmul" not in f.lower(x, q, s).as_text()
      np.testing.assert_array_equal(f(x, q, s), jax.jit(qmatmul.xla_matmul)(x, q, s))
  lines = [r.getMessage() for r in caplog.records if "float activations" in r.getMessage()]
  assert lines == ["quantized matmul: float activations (JAXFORMER_QKERNEL=off)"]


@pytest.mark.parametrize("fallback", [False, True])
def test_prefill_converts_each_weight_right_before_its_product(monkeypatch, fallback):
  """Prefill without the kernel (and above `KERNEL_MAX_ROWS` rows in builds without its blocked product) takes the
  XLA path, whose int8/int4 weights are converted to float32 for the product; with the kernel (AVX-512), 265 rows
  take the blocked product, and the same bounds hold. XLA:CPU's scheduler ran all those conversions first (they
  read parameters only), so every weight was in float32 at once; `qmatmul._after` orders each after its
  product's input. The compiled program's temporaries stay within two float32 weights of the float model's
  (all four layers' would be 12 MiB more), and the prefill's logits equal the float model's of the
  dequantized weights (within 1e-4)."""
  from jaxformer import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxformer import model as model_lib  # pylint: disable=g-import-not-at-top
  if fallback:
    monkeypatch.setitem(qkernel._STATE, "reason", "JAXFORMER_QKERNEL=off")
  cfg = config_lib.load_config("gpt2_tiny", ["model.d_model=256", "model.d_ff=1024", "model.num_heads=4",
                                             "model.num_layers=4", "model.max_len=512"]).model
  model = model_lib.build_model(cfg)
  params = jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"])
  params = jax.tree.map(lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value"))
  rows = 265
  prompt = [list(np.random.default_rng(0).integers(3, cfg.vocab_size, rows))]
  tokens, lengths = decode._left_pad(prompt, None)
  cache = decode.init_cache(model, 1, rows)
  temp = lambda p: decode._prefill_jit.lower(model, p, tokens, lengths, cache).compile().memory_analysis().temp_size_in_bytes
  weight = 4 * cfg.d_model * cfg.d_ff  # the largest kernel in float32
  for bits in (8, 4):
    qparams = quantize.quantize_params(params, cfg, bits, 128, "float")[0]
    assert temp(qparams) <= temp(params) + 2 * weight, bits
    dequantized = quantize.roundtrip_params(params, cfg, bits, 128, "float")
    got, want = (np.asarray(decode.prefill(model, jax.tree.map(jnp.asarray, p), prompt)[0]) for p in (qparams, dequantized))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_build_failure_is_a_reason_not_a_crash(monkeypatch, tmp_path):
  monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
  monkeypatch.setenv("JAXFORMER_CACHE", str(tmp_path))
  monkeypatch.setattr(qkernel, "INSTALLED", tmp_path / "_qmatmul.so")  # none installed: the cache build runs
  (tmp_path / "no-such-compiler").write_text("#!/bin/sh\necho 'broken compiler' >&2\nexit 1\n")
  os.chmod(tmp_path / "no-such-compiler", 0o755)
  reason = qkernel._load()
  assert reason.startswith("the C++ kernel is unavailable: building qmatmul.cc, paged_attention.cc failed: broken compiler")


@pytest.mark.parametrize("bits,vocab,d_model,group", [(8, 37, 24, 0), (4, 37, 24, 8), (4, 50, 64, 64)])
def test_table_lookup_equals_numpy_rows(bits, vocab, d_model, group):
  """`qmatmul.lookup` (the quantized embeddings' lookup) gives the numpy reference's dequantized rows, exactly,
  for repeated ids and the last row of an odd vocabulary."""
  rng = np.random.default_rng(bits + vocab)
  table = rng.standard_normal((vocab, d_model)).astype(np.float32)
  q, s = qmatmul.quantize_int8(table.T) if bits == 8 else qmatmul.quantize_int4(table.T, group)
  reference = _ref_int8(table.T) if bits == 8 else _ref_int4(table.T, group)   # [vocab, d_model]
  for ids in ([vocab - 1, 0, 3, 3, vocab // 2], [vocab - 1], [2]):  # one id: looked up twice (TPU), one row back
    got = qmatmul.lookup(jnp.asarray(q), jnp.asarray(s), jnp.asarray(ids, jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), reference[ids])


@pytest.mark.parametrize("dtype,width,scales", [(jnp.int8, 1024, ()), (jnp.uint8, 1024, (16,))])
def test_one_token_lookup_reads_the_table_as_it_lies_on_tpu(dtype, width, scales):
  """Compiled by the TPU compiler (libtpu's deviceless v6e chip; skipped without libtpu, as in CI): one id through
  `jnp.take` makes XLA re-tile a large int8/uint8 table (a copy of all of it in the temporaries, every decode step);
  through `qmatmul.lookup` nothing is copied. The int8 table and the int4 (packed) one of a 131,072-row vocabulary."""
  pytest.importorskip("libtpu")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  chip = topologies.get_topology_desc(platform="tpu", topology_name="v6e:1x1", chip_config_name="default",
                                      chips_per_host_bounds=(1, 1, 1), num_slices=1).devices[0]
  place = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=jax.sharding.SingleDeviceSharding(chip))
  q, s, ids = place((131072, width), dtype), place((131072, *scales), jnp.float32), place((1,), jnp.int32)
  temporaries = lambda f: jax.jit(f).lower(q, s, ids).compile().memory_analysis().temp_size_in_bytes
  assert temporaries(lambda q, s, i: qmatmul.dequantize(jnp.take(q, i, axis=0), jnp.take(s, i, axis=0))) >= 131072 * width
  assert temporaries(qmatmul.lookup) < 131072 * width / 100


def test_int4_tables_need_a_group_that_divides_d_model():
  from jaxformer import config as config_lib, inspect  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load_config("gpt2_tiny")
  with pytest.raises(UserError, match="--embedding int4: d_model 32 is not a multiple of --group-size 24"):
    inspect.quantized_manifest(cfg, 8, 24, "int4")
  with pytest.raises(UserError, match="--embedding int2: int8, int4 or float"):
    inspect.quantized_manifest(cfg, 8, 128, "int2")


def _logits(model, params, ids):
  return np.asarray(model.apply({"params": params}, ids))


@pytest.mark.parametrize("name,bits,embedding", [("gpt2", 8, "int8"), ("gpt2", 4, "float"),
                                                  pytest.param("llama", 8, "float", marks=pytest.mark.slow),  # gpt2's
                                                  ("llama", 4, "int8"), ("mixtral", 4, "int8"), ("gpt2", 4, "int4"),
                                                  ("llama", 8, "int4")])
def test_quantized_workdir_equals_the_dequantized_float_model(converted, tmp_path, name, bits, embedding):
  workdir, cfg, model, params, _ = converted(name)
  group = 16
  out = str(tmp_path / "q")
  # weight-only: float activations (the default int16 ones: test_a_workdir_quantized_with_integer_activations)
  manifest = quantize.quantize_run(workdir, out, bits, group, embedding=embedding, log=QUIET, activations="float")
  qcfg, qmodel, qparams, _, _ = evaluate.load_run(out, log=QUIET)
  leaves = jax.tree.leaves(qparams)
  assert any(x.dtype == (jnp.int8 if bits == 8 else jnp.uint8) for x in leaves)
  assert not any("router" in p for p in manifest["kernels"])  # routing stays float32
  tables = [p for p in manifest["kernels"] if p.endswith("/embedding") or p.startswith("logits/")]
  table_bits = {"int8": 8, "int4": 4}.get(embedding)
  assert all(manifest["kernels"][p]["bits"] == table_bits for p in tables) and bool(tables) == (embedding != "float")
  if embedding == "int4":  # packed two a byte, a scale per group of d_model
    q, scale = quantize._quantized_leaves(qparams, "embed/embedding")
    assert q.dtype == jnp.uint8 and q.shape == (cfg.model.vocab_size, cfg.model.d_model // 2)
    assert scale.shape == (cfg.model.vocab_size, cfg.model.d_model // group)
  if name == "mixtral":
    assert any("experts" in v for v in manifest["kernels"].values())
  reference = quantize.roundtrip_params(params, cfg.model, bits, group, embedding)
  ids = (np.arange(2 * 12).reshape(2, 12) % (cfg.model.vocab_size - 3) + 3).astype(np.int32)
  np.testing.assert_allclose(_logits(qmodel, qparams, ids), _logits(model, reference, ids), rtol=1e-4, atol=1e-4)
  # the quantization did something: the float model's logits differ from the dequantized one's
  assert np.abs(_logits(model, params, ids) - _logits(model, reference, ids)).max() > 1e-6
  # the chunked loss (model.logits_chunk: the output weight dequantized) gives the unchunked NLL
  from jaxformer import model as model_lib, tasks  # pylint: disable=g-import-not-at-top
  chunked = model_lib.build_model(dataclasses.replace(qcfg.model, logits_chunk=8))
  targets, weights = np.roll(ids, -1, axis=1), np.ones(ids.shape, np.float32)
  nll = lambda m: float(tasks.model_loss(m, qparams, (ids,), None, True, targets, weights, 0.0)[1])
  np.testing.assert_allclose(nll(chunked), nll(qmodel), rtol=1e-5)
  # greedy decoding (batch 1: the CPU kernel when built) gives the float reference's tokens
  prompt = [list(ids[0, :5])]
  got = decode.generate(qmodel, qparams, prompt, 12, jax.random.key(0), temperature=0.0)
  want = decode.generate(model, reference, prompt, 12, jax.random.key(0), temperature=0.0)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _kernel_bytes(tree, paths, manifest=None):
  total = 0
  for p in paths:
    *parents, leaf = p.split("/")
    node = quantize._get(tree, "/".join(parents))
    if manifest is None:
      total += np.asarray(node[leaf]).nbytes
    else:
      total += sum(np.asarray(x).nbytes for x in quantize._quantized_leaves(tree, p))
  return total


@pytest.mark.parametrize("bits,limit", [(8, 0.27), (4, 0.15)])
def test_bytes_of_checkpoint_and_decode_program(bits, limit, tmp_path):
  """The quantized kernels' bytes (in the params, hence the checkpoint) and in XLA's view of the
  decode step's arguments: at most 0.27x (int8) / 0.15x (int4) of float32."""
  from jaxformer import config as config_lib  # pylint: disable=g-import-not-at-top
  from jaxformer import model as model_lib  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load_config("gpt2_tiny", ["model.d_model=256", "model.d_ff=1024", "model.num_heads=4"]).model
  model = model_lib.build_model(cfg)
  ids = jnp.ones((1, 8), jnp.int32)
  params = jax.tree.map(np.asarray, jax.jit(model.init)(jax.random.key(0), ids)["params"])
  params = jax.tree.map(lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value"))
  qparams, manifest = quantize.quantize_params(params, cfg, bits, 128)
  paths = list(manifest["kernels"])
  float_k, quant_k = _kernel_bytes(params, paths), _kernel_bytes(qparams, paths, manifest)
  assert quant_k <= limit * float_k
  for name, tree in (("float", params), ("quantized", qparams)):
    checkpoint_lib.save_params(str(tmp_path / name), tree)
  disk = lambda d: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(tmp_path / d) for f in fs)
  # on disk (kernels ~97% of this model's params), against the float32 bytes; orbax compresses the
  # float checkpoint a little (random normals), the quantized one hardly
  total = quantize.tree_bytes(params)
  assert disk("float") > 0.9 * total and disk("quantized") <= limit * total

  cache = decode.init_cache(model, 1, 32)
  step = jax.jit(lambda p, c, t: model.apply({"params": p, "cache": c}, t, decode=True, mutable=["cache"]))
  arg_bytes = lambda p: step.lower(p, cache, ids[:, :1]).compile().memory_analysis().argument_size_in_bytes
  saved = arg_bytes(params) - arg_bytes(qparams)
  assert saved >= (1 - limit) * float_k  # XLA receives the int8/int4 bytes: the kernels' float bytes are gone


def test_checkpoint_on_disk_and_refusals(converted, tmp_path):
  workdir, cfg, _, _, _ = converted("llama")
  out = str(tmp_path / "q8")
  quantize.quantize_run(workdir, out, 8, log=QUIET)
  with pytest.raises(UserError, match="already quantized"):
    quantize.quantize_run(out, str(tmp_path / "again"), 8, log=QUIET)
  with pytest.raises(UserError, match="already holds a run"):
    quantize.quantize_run(workdir, out, 8, log=QUIET)
  with pytest.raises(UserError, match="--group-size"):
    quantize.quantize_run(workdir, str(tmp_path / "odd"), 4, 7, log=QUIET)
  from jaxformer.convert import hf_out  # pylint: disable=g-import-not-at-top
  with pytest.raises(UserError, match="quantized run"):
    hf_out.to_hf(out, str(tmp_path / "hf"))
  with pytest.raises(UserError, match="average"):
    evaluate.load_run(out, average_last=2, log=QUIET)
  assert checkpoint_lib.Checkpointer(out, max_to_keep=None, async_save=False, log=QUIET).all_steps()


def test_commands_on_a_quantized_workdir(converted, tmp_path, capsys):
  """`python -m jaxformer.quantize` then `python -m jaxformer.generate` on its output: greedy text equal to
  the float model of the dequantized weights; a bad flag is a one-line error."""
  from jaxformer import config as config_lib, generate  # pylint: disable=g-import-not-at-top
  workdir, cfg, model, params, tok = converted("gpt2")
  out = str(tmp_path / "q4")
  quantize.main(["--workdir", workdir, "--out", out, "--bits", "4", "--group-size", "16"])
  got = generate.main(["--workdir", out, "--prompt", "hello", "--temperature", "0", "--max-new-tokens", "8"])
  reference = quantize.roundtrip_params(params, cfg.model, 4, 16)
  greedy = config_lib.replace(cfg, **{"decode.temperature": 0.0, "decode.max_new_tokens": 8})
  assert got == generate.generate_text(model, reference, tok, greedy, ["hello"]) and got[0]
  capsys.readouterr()
  with pytest.raises(SystemExit) as e:
    quantize.main(["--workdir", workdir, "--out", str(tmp_path / "bad"), "--bits", "4", "--group-size", "7"])
  err = capsys.readouterr().err.strip()
  assert e.value.code == 2 and "\n" not in err and err.startswith("error: --group-size 7"), err


@pytest.mark.parametrize("name,bits,act", [("gpt2", 8, "int8"), ("llama", 4, "int8"), ("gpt2", 4, "int16"),
                                            ("llama", 8, "int16")])
def test_a_workdir_quantized_with_integer_activations(converted, tmp_path, monkeypatch, name, bits, act):
  """`quantize --activations int8` (or by default int16): the new workdir's config says so, and its logits over
  32 rows (every dense product and the output layer take integer activations) equal the same model with each product
  computed by `_a8_reference`, and differ from float activations' (an eval override; int16 by under 1e-3 of the
  largest logit); a float workdir and training refuse it, and so does quantize for int4 groups not a multiple of
  32."""
  if not qkernel.vnni():
    pytest.skip(qkernel.unavailable() or "the kernel was built without AVX-512 VNNI")
  from jaxformer import config as config_lib, train  # pylint: disable=g-import-not-at-top
  workdir, cfg, _, _, _ = converted(name)
  out = str(tmp_path / "q")
  quantize.main(["--workdir", workdir, "--out", out, "--bits", str(bits), "--group-size", "32"]
                + (["--activations", act] if act == "int8" else []))  # int16: the default
  qcfg, qmodel, qparams, _, _ = evaluate.load_run(out, log=QUIET)
  assert qcfg.model.quant_activations == act
  ids = (np.arange(2 * 16).reshape(2, 16) % (cfg.model.vocab_size - 3) + 3).astype(np.int32)
  got = _logits(qmodel, qparams, ids)
  calls, act_bits = [], qkernel.ACT_BITS[act]

  def reference(x, q, s, activations="float"):
    calls.append(activations)
    out = jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32)
    return jax.pure_callback(lambda x, q, s: _a8_reference(x, q, s, act_bits).astype(np.float32), out, x, q, s)
  with monkeypatch.context() as m:
    m.setattr(qkernel, "call", reference)
    want = _logits(qmodel, qparams, ids)
  assert calls and set(calls) == {act}
  # relative to the largest logit: int16's finer levels also round differently where float32 and float64 layers
  # below fed them inputs a rounding apart
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
  _, fmodel, fparams, _, _ = evaluate.load_run(out, log=QUIET, overrides=["model.quant_activations=float"])
  off = np.abs(_logits(fmodel, fparams, ids) - got).max() / np.abs(got).max()
  assert 1e-5 < off if act == "int8" else 1e-8 < off < 1e-3  # int16: near the weight-only logits
  with pytest.raises(UserError, match="quantize it first"):
    evaluate.load_run(workdir, log=QUIET, overrides=[f"model.quant_activations={act}"])
  with pytest.raises(UserError, match=f"--activations {act} with int4 takes a --group-size that is a multiple of 32"):
    quantize.quantize_run(workdir, str(tmp_path / "g48"), 4, group_size=48, activations=act, log=QUIET)
  assert not os.path.exists(tmp_path / "g48")  # refused before anything was written
  with pytest.raises(UserError, match="not for training"):
    train.train_and_evaluate(config_lib.load_config("gpt2_tiny", [f"model.quant_activations={act}"]),
                             str(tmp_path / "t"), log=QUIET)


@pytest.mark.parametrize("name,overrides", [("gpt2_tiny", []), ("llama_tiny", []),
                                            ("llama_tiny", ["model.moe_experts=4", "model.moe_top_k=2"])])
def test_inspect_weight_bytes_equal_quantize_params_output(name, overrides):
  """`inspect.weight_bytes` (shapes only) predicts the bytes of `quantize_params`' arrays exactly, and
  `inspect.quantized_manifest` (shapes only) is the manifest it writes."""
  from jaxformer import config as config_lib, inspect, model as model_lib  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load_config(name, overrides)
  model = model_lib.build_model(cfg.model)
  params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
  params = jax.tree.map(np.asarray, params)
  params = jax.tree.map(lambda x: getattr(x, "value", x), params, is_leaf=lambda x: hasattr(x, "value"))
  assert inspect.weight_bytes(cfg, "float32")["total"] == quantize.tree_bytes(params)
  for bits, group, embedding in ((8, 128, "int8"), (8, 128, "float"), (4, 16, "int8"), (4, 128, "float"),
                                 (8, 16, "int4"), (4, 16, "int4")):
    qparams, manifest = quantize.quantize_params(params, cfg.model, bits, group, embedding)
    predicted = inspect.weight_bytes(cfg, "float32", inspect.quantized_manifest(cfg, bits, group, embedding))
    assert inspect.quantized_manifest(cfg, bits, group, embedding) == manifest
    assert predicted["total"] == quantize.tree_bytes(qparams), (bits, group, embedding)
    tables = sum(np.asarray(x).nbytes for p, e in manifest["kernels"].items() if "bits" in e
                 for x in quantize._quantized_leaves(qparams, p))
    assert predicted["tables"] == tables and bool(tables) == (embedding != "float")
    # bfloat16: the float leaves at 2 bytes, the quantized ones as they are
    half = inspect.weight_bytes(cfg, "bfloat16", manifest)
    assert half["float"] * 2 == predicted["float"] and half["kernels"] == predicted["kernels"]


def test_inspect_cli_quantized(capsys):
  from jaxformer import inspect  # pylint: disable=g-import-not-at-top
  inspect.main(["--config", "gpt2_tiny", "--quantize", "4", "--group-size", "16", "--dtype", "float32"])
  out = capsys.readouterr().out
  assert "Weights, int4 weight-only" in out and "int4 weights (" in out
  for argv, message in ((["--quantize", "3"], "error: --quantize 3: 8 or 4"),
                        (["--quantize", "4", "--group-size", "24"], "error: int4: fan-in 32 is not a multiple"),
                        (["--embedding", "float"], "error: --group-size and --embedding describe")):
    with pytest.raises(SystemExit) as e:
      inspect.main(["--config", "gpt2_tiny", *argv])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err and err.startswith(message), err


def test_compile_decode_step_argument_bytes():
  """`aot.compile_decode_step` from abstract params on this CPU: XLA's arguments shrink by exactly the
  bytes `inspect.weight_bytes` predicts, and the quantized kernels' share of them is at most 0.27x
  (int8) / 0.15x (int4) of their float32 bytes, the tables' too (int8 tables, or `--embedding int4`)."""
  from jaxformer import aot, config as config_lib, inspect  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load_config("llama_tiny", ["model.d_model=128", "model.d_ff=256", "model.vocab_size=256"])
  args = {}
  for bits, embedding in ((None, "int8"), (8, "int8"), (4, "int8"), (4, "int4")):
    compiled, _, _ = aot.compile_decode_step(cfg, jax.devices()[:1], 1, 32, bits=bits, embedding=embedding)
    args[bits, embedding] = aot.memory(compiled)["argument"]
  plain = inspect.weight_bytes(cfg, "float32")["total"]
  for bits, embedding, limit, table_limit in ((8, "int8", 0.27, 0.27), (4, "int8", 0.15, 0.27), (4, "int4", 0.15, 0.15)):
    manifest = inspect.quantized_manifest(cfg, bits, embedding=embedding)
    predicted = inspect.weight_bytes(cfg, "float32", manifest)
    assert args[None, "int8"] - args[bits, embedding] == plain - predicted["total"]  # XLA gets the predicted bytes
    as_float = lambda tables: sum(4 * e["k"] * e["n"] * e.get("experts", 1) for e in manifest["kernels"].values()
                                  if ("bits" in e) == tables)
    assert predicted["kernels"] <= limit * as_float(False)  # the int8/int4 kernels
    assert predicted["tables"] <= table_limit * as_float(True)  # the int8/int4 tables (embeddings, output layer)
  with pytest.raises(UserError, match="decoder-only"):
    aot.compile_decode_step(config_lib.load_config("tiny_encdec"), jax.devices()[:1], 1, 8)


@pytest.mark.parametrize("m,k,n,group", [(1, 4096, 512, 128), (3, 2048, 1024, 128), (17, 1024, 256, 64)])
def test_pallas_int4_kernel_matches_the_xla_path_in_the_interpreter(m, k, n, group):
  """The TPU int4 kernel (`jaxformer.qpallas`), run by Pallas' TPU interpreter on CPU: within 1e-5 of a float64
  product with the dequantized weights and of the XLA path, for decode and short-prefill rows and 8-group blocks of
  64- and 32-byte groups (outputs in blocks of 512 and 256)."""
  from jaxformer import qpallas  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(m + k + n)
  q, s = qmatmul.quantize_int4(rng.standard_normal((k, n)).astype(np.float32), group)
  x = rng.standard_normal((m, k)).astype(np.float32)
  assert qpallas.blocks(m, q.shape, s.shape) == (512 if n % 512 == 0 else 256, 8)
  got = qpallas.int4_matmul(jnp.asarray(x), jnp.asarray(q), jnp.asarray(s), interpret=True)
  dense = np.asarray(qmatmul.dequantize(jnp.asarray(q), jnp.asarray(s)))
  _close(got, x.astype(np.float64) @ dense.T.astype(np.float64), x, dense)
  _close(got, qmatmul.xla_matmul(x, q, s), x, dense)


def test_int4_products_lower_to_the_pallas_kernel_for_tpu():
  """`qmatmul.matmul` lowered for platform "tpu" from this host holds the Mosaic kernel where `qpallas.blocks` fits
  (a [4, 4096] x int4 [4096, 1024] product) and not where it does not (1,000 outputs: no block of 128 divides
  them; 600 rows: past qpallas.MAX_ROWS); lowered for CPU it never does."""
  from jaxformer import qpallas  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  for rows, n, fits in ((4, 1024, True), (4, 1000, False), (600, 1024, False)):
    q, s = qmatmul.quantize_int4(rng.standard_normal((4096, n)).astype(np.float32), 128)
    x = jnp.ones((rows, 4096), jnp.bfloat16)
    assert (qpallas.blocks(rows, q.shape, s.shape) is not None) == fits
    tpu = jax.jit(qmatmul.matmul).trace(x, q, s).lower(lowering_platforms=("tpu",)).as_text()
    assert ("tpu_custom_call" in tpu) == fits, (rows, n)
    assert "tpu_custom_call" not in jax.jit(qmatmul.matmul).lower(x, q, s).as_text()


@pytest.mark.slow  # a second C++ build of the kernel (AVX2 only)
def test_an_avx2_build_has_no_blocked_product_and_streams_every_row(tmp_path):
  """The kernel built without AVX-512 (as on an AVX2-only CPU): `JfQmatmulGemmRows` says 0, so `qkernel.gemm_rows`
  would give None and `qmatmul.KERNEL_MAX_ROWS` bound the rows; its streaming loop still gives the XLA path's
  products at 1-150 rows (int8) and 3-24 (int4)."""
  import ctypes  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  from jaxformer import qbuild  # pylint: disable=g-import-not-at-top
  cxx = qbuild.compiler()
  if not cxx:
    pytest.skip("no C++ compiler")
  out = tmp_path / "avx2.so"
  subprocess.run([cxx, *qbuild.FLAGS, "-mno-avx512f", f"-I{jax.ffi.include_dir()}", *map(str, qbuild.SOURCES),
                  "-o", str(out)], check=True, capture_output=True)
  lib = ctypes.cdll.LoadLibrary(str(out))
  assert lib.JfQmatmulGemmRows() == 0
  assert lib.JfQmatmulHasVnni() == 0  # no int8-activation product either: `qkernel.vnni()` would be False
  targets = {8: "test_avx2_int8", 4: "test_avx2_int4"}
  jax.ffi.register_ffi_target(targets[8], jax.ffi.pycapsule(lib.JfQmatmulInt8), platform="cpu")
  jax.ffi.register_ffi_target(targets[4], jax.ffi.pycapsule(lib.JfQmatmulInt4), platform="cpu")
  rng = np.random.default_rng(9)
  for m, bits in ((1, 8), (40, 8), (150, 8), (3, 4), (24, 4)):
    w = rng.standard_normal((256, 70)).astype(np.float32)
    q, s = _layout(w, bits, 64)
    x = rng.standard_normal((m, 256)).astype(np.float32)
    got = jax.ffi.ffi_call(targets[bits], jax.ShapeDtypeStruct((m, 70), jnp.float32))(x, q, s)
    _close(got, qmatmul.xla_matmul(x, q, s), x, np.asarray(qmatmul.dequantize(jnp.asarray(q), jnp.asarray(s))))
