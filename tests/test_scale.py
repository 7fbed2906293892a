"""Tests for the model-scale switches: model.scan_layers, model.remat and model.logits_chunk.

Each is checked against the plain model it replaces: the same logits, loss, gradients,
train step and decoded tokens (scanned parameters are the unrolled ones, stacked by
`model.convert_layers`), and the chunked loss keeps its logits' memory to one chunk.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import with_fusion_emitters
from jaxformer import config, decode, evaluate, layers, losses, optim, tasks, train
from jaxformer.errors import UserError
from jaxformer.model import EncoderDecoder, build_model, convert_layers

FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
ROWS, LEN = 3, 9


def jit(fn, **kwargs):
  return jax.jit(fn, compiler_options=FAST_COMPILE, **kwargs)


@functools.lru_cache(None)
def setup(name, overrides=()):
  """(cfg, model, params): unrolled, random N(0, 0.2) weights drawn in numpy (no init compile)."""
  cfg = config.load_config(name, ["model.dropout_rate=0", *overrides])
  model = build_model(cfg.model)
  ids = jnp.ones((1, 4), jnp.int32)
  args = (ids, ids) if cfg.model.arch == "encoder_decoder" else (ids,)
  shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), *args))["params"])
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda path, s: jnp.asarray((path[-1].key == "scale") + rng.normal(0, 0.2, s.shape), jnp.float32), shapes)
  return cfg, model, params


def variant(cfg, **model_fields):
  """The same recipe with other model fields, and its model."""
  cfg = config.replace(cfg, **{f"model.{k}": v for k, v in model_fields.items()})
  return cfg, build_model(cfg.model)


def batch(cfg, seed=0):
  """A teacher-forced batch of the config's task, rows padded at the end (translation)."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(3, cfg.model.vocab_size, (ROWS, LEN + 1)).astype(np.int32)
  if cfg.model.arch == "decoder_only":
    return {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
  seg = (np.arange(LEN)[None] < np.array([[LEN], [5], [7]])).astype(np.int32)
  pos = np.broadcast_to(np.arange(LEN, dtype=np.int32), (ROWS, LEN)).copy()
  return {"inputs": ids[:, :-1] * seg, "decoder_inputs": ids[:, :-1] * seg, "targets": ids[:, 1:] * seg,
          "inputs_segmentation": seg, "targets_segmentation": seg, "inputs_position": pos, "targets_position": pos}


def task_of(cfg):
  return tasks.LMTask if cfg.data.task == "lm" else tasks.TranslationTask


def loss_and_grads(cfg, model, params, b, label_smoothing=0.1):
  """(smoothed loss sum, NLL sum, grads) through the task's own loss (so logits_chunk applies)."""
  def f(p):
    loss, nll, _ = task_of(cfg).loss(model, p, b, {}, True, label_smoothing)
    return loss, nll
  (loss, nll), grads = jit(jax.value_and_grad(f, has_aux=True))(params)
  return loss, nll, grads


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol), a, b)


FAMILIES = [("tiny_encdec", ()), ("llama_tiny", ()), ("gpt2_tiny", ())]


# ----------------------------------------------------------------------------- scan_layers


@pytest.mark.parametrize("name, overrides", FAMILIES)
@with_fusion_emitters  # gradients at rtol 1e-5: about the MLIR fusion emitters' rounding
def test_scan_layers_same_logits_and_gradients_as_unrolled(name, overrides):
  cfg, model, params = setup(name, overrides)
  scan_cfg, scan_model = variant(cfg, scan_layers=True)
  stacked = convert_layers(params, True)
  assert "layers" in stacked["decoder"] and "layer_0" not in stacked["decoder"]
  assert stacked["decoder"]["layers"]["ffn"]["wo"]["kernel"].shape[0] == cfg.model.num_layers
  b = batch(cfg)
  loss, nll, grads = loss_and_grads(cfg, model, params, b)
  scan_loss, scan_nll, scan_grads = loss_and_grads(scan_cfg, scan_model, stacked, b)
  np.testing.assert_allclose([scan_loss, scan_nll], [loss, nll], rtol=1e-5)
  assert_trees_close(convert_layers(scan_grads, False), grads)
  # The scanned model's own init has the same structure and logical names plus `layers`.
  ids = jnp.ones((1, 4), jnp.int32)
  boxed = jax.eval_shape(scan_model.init, jax.random.key(0), *((ids, ids) if name == "tiny_encdec" else (ids,)))
  names = nn.get_partition_spec(boxed["params"])["decoder"]["layers"]["self_attention"]["query"]["kernel"]
  assert tuple(names) == ("layers", "embed", "heads", "kv")
  assert jax.tree.structure(nn.unbox(boxed["params"])) == jax.tree.structure(stacked)


def test_convert_layers_round_trip_on_a_train_state():
  cfg, _, params = setup("llama_tiny")
  tx, _ = optim.build_optimizer(cfg)
  state = {"params": params, "opt_state": tx.init(params)}
  stacked = convert_layers(state, True)
  assert stacked["opt_state"][-1][0].mu["decoder"]["layers"]["ffn"]["wo"]["kernel"].shape[0] == 2
  again = convert_layers(stacked, True)  # already scanned: unchanged
  assert jax.tree.structure(again) == jax.tree.structure(stacked)
  assert_trees_close(again, stacked, rtol=0, atol=0)
  # The stack holds layer i at index i, in the parameters and in Adam's moments alike.
  moments = stacked["opt_state"][-1][0].mu, state["opt_state"][-1][0].mu
  for tree, flat in ((stacked["params"], state["params"]), moments):
    kernel = tree["decoder"]["layers"]["ffn"]["wo"]["kernel"]
    for i in range(2):
      np.testing.assert_array_equal(kernel[i], flat["decoder"][f"layer_{i}"]["ffn"]["wo"]["kernel"])
  assert_trees_close(convert_layers(convert_layers(stacked, True), False), state, rtol=0, atol=0)
  assert jax.tree.structure(convert_layers(stacked, False)) == jax.tree.structure(state)


def test_train_step_under_scan_remat_and_chunk_equals_the_plain_one():
  """One optimizer step (AdamW: weight decay on matrices only, also when stacked) on llama_tiny."""
  cfg, model, params = setup("llama_tiny")
  cfg = config.replace(cfg, **{"optim.weight_decay": 0.1, "optim.warmup_steps": 1})
  b = {k: jnp.asarray(v) for k, v in batch(cfg).items()}

  def one_step(cfg, model, params):
    tx, schedule = optim.build_optimizer(cfg)
    state = {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": tx.init(params),
             "skipped": jnp.zeros((), jnp.int32)}
    return jit(train.make_train_step(model, tasks.LMTask, cfg, tx, schedule))(state, b)

  state, metrics = one_step(cfg, model, params)
  scan_cfg, scan_model = variant(cfg, scan_layers=True, remat="full", logits_chunk=8)
  scan_state, scan_metrics = one_step(scan_cfg, scan_model, convert_layers(params, True))
  np.testing.assert_allclose(scan_metrics["loss_sum"], metrics["loss_sum"], rtol=1e-5)
  np.testing.assert_allclose(scan_metrics["grad_norm"], metrics["grad_norm"], rtol=1e-5)
  assert_trees_close(convert_layers(scan_state["params"], False), state["params"])


# ----------------------------------------------------------------------------- decoding under scan


SOURCES = [[5, 9, 12, 7, 3], [8, 4], [30, 31, 32]]
PROMPTS = [[5, 17, 3], [9, 8, 7, 6, 5, 4, 33], [11]]


def _pad(rows, width):
  return jnp.asarray([list(r) + [0] * (width - len(r)) for r in rows], jnp.int32)


def test_beam_search_and_greedy_translation_under_scan():
  cfg, model, params = setup("tiny_encdec", ("model.position=rope", "model.num_kv_heads=2"))
  _, scan_model = variant(cfg, scan_layers=True)
  stacked = convert_layers(params, True)
  inputs = _pad(SOURCES, 5)
  for fn in (functools.partial(decode.greedy_translate, max_extra_len=4),
             functools.partial(decode.beam_search, beam_size=3, alpha=0.6, max_extra_len=4)):
    want, got = fn(model, params, inputs), fn(scan_model, stacked, inputs)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5), got, want)
  cache = decode.init_cache(scan_model, 2, 7)
  assert int(decode._cache_index(cache)) == 0 and decode._cache_size(cache) == 7


def test_sampling_and_prefix_cache_under_scan():
  cfg, model, params = setup("llama_tiny")
  _, scan_model = variant(cfg, scan_layers=True)
  stacked = convert_layers(params, True)
  key = jax.random.key(3)
  for kwargs in ({"temperature": 0}, {"temperature": 1.0, "top_k": 20}):
    np.testing.assert_array_equal(decode.generate(scan_model, stacked, PROMPTS, 6, key, **kwargs),
                                  decode.generate(model, params, PROMPTS, 6, key, **kwargs))
  prefix, n = [20, 21, 22, 23, 24], 4
  caches = [decode.prefill_prefix(m, p, prefix, batch=3, max_len=5 + 7 + n - 1)
            for m, p in ((model, params), (scan_model, stacked))]
  assert int(decode._cache_index(caches[1])) == 5 and decode._cache_size(caches[1]) == 15
  np.testing.assert_array_equal(
      decode.generate(scan_model, stacked, PROMPTS, n, key, temperature=0, prefix_cache=caches[1]),
      decode.generate(model, params, PROMPTS, n, key, temperature=0, prefix_cache=caches[0]))
  with pytest.raises(ValueError, match="slots"):
    decode.generate(scan_model, stacked, PROMPTS, n + 1, key, prefix_cache=caches[1])


def test_load_run_converts_a_checkpoint_to_either_layout(tiny_run):
  workdir, cfg, _ = tiny_run  # trained unrolled
  _, _, params, _, _ = evaluate.load_run(workdir, log=lambda *a: None)
  assert "layer_0" in params["decoder"]
  scan_cfg, scan_model, stacked, _, _ = evaluate.load_run(workdir, scan_layers=True, log=lambda *a: None)
  assert scan_cfg.model.scan_layers and isinstance(scan_model, EncoderDecoder)
  assert_trees_close(stacked, convert_layers(params, True), rtol=0, atol=0)
  # Averaging reads each checkpoint in its stored layout too.
  _, _, averaged, _, _ = evaluate.load_run(workdir, average_last=2, scan_layers=True, log=lambda *a: None)
  assert averaged["decoder"]["layers"]["ffn"]["wo"]["kernel"].shape[0] == cfg.model.num_layers


# ----------------------------------------------------------------------------- remat


@pytest.mark.parametrize("name, overrides", FAMILIES[:2])
@with_fusion_emitters  # gradients at rtol 1e-5: about the MLIR fusion emitters' rounding
def test_remat_policies_same_loss_and_gradients(name, overrides):
  cfg, model, params = setup(name, overrides)
  b = batch(cfg)
  want = loss_and_grads(cfg, model, params, b)
  for policy, scan in [("full", False), ("dots_saveable", False), ("dots_with_no_batch_dims_saveable", True)]:
    remat_cfg, remat_model = variant(cfg, remat=policy, scan_layers=scan)
    got = loss_and_grads(remat_cfg, remat_model, convert_layers(params, scan), b)
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-6, err_msg=policy)
    assert_trees_close(convert_layers(got[2], False), want[2])


def test_remat_and_chunk_config_errors():
  with pytest.raises(UserError, match="model.remat='some'.*full"):
    config.load_config("llama_tiny", ["model.remat=some"])
  with pytest.raises(UserError, match="logits_chunk=-1"):
    config.load_config("llama_tiny", ["model.logits_chunk=-1"])


# ----------------------------------------------------------------------------- chunked logits


@pytest.mark.parametrize("spec", ["nd,vd->nv", "nd,dv->nv"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("matmul_dtype", ["float32", "bfloat16"])
def test_chunked_cross_entropy_equals_whole_logits(spec, label_smoothing, matmul_dtype):
  """Loss, NLL and both gradients; chunk 10 over 3 rows x 7: pieces of [3, 3], the last one padded."""
  cfg = config.ModelConfig(d_model=16, vocab_size=50, matmul_dtype=matmul_dtype)
  rng = np.random.default_rng(0)
  hidden = jnp.asarray(rng.normal(size=(3, 7, 16)), jnp.float32)
  weight = jnp.asarray(rng.normal(size=(50, 16) if spec == "nd,vd->nv" else (16, 50)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 50, (3, 7)), jnp.int32)
  weights = jnp.asarray(rng.random((3, 7)) > 0.3, jnp.float32)
  project = functools.partial(layers.project_logits, spec=spec, cfg=cfg)

  def whole(h, w):
    loss, nll, n = losses.cross_entropy(project(h.reshape(-1, 16), w).reshape(3, 7, 50), targets, weights,
                                        label_smoothing)
    return loss + 0.5 * nll, (loss, nll, n)

  def chunked(h, w):
    loss, nll, n = losses.chunked_cross_entropy(h, w, targets, weights, label_smoothing, 10, project)
    return loss + 0.5 * nll, (loss, nll, n)

  (_, want), want_grads = jit(jax.value_and_grad(whole, (0, 1), has_aux=True))(hidden, weight)
  (_, got), got_grads = jit(jax.value_and_grad(chunked, (0, 1), has_aux=True))(hidden, weight)
  assert_trees_close(got, want)
  # bf16 products round each chunk's weight gradient before the sum over chunks.
  assert_trees_close(got_grads, want_grads, rtol=1e-5 if matmul_dtype == "float32" else 2e-2, atol=1e-5)


@pytest.mark.parametrize("name, overrides", [("tiny_encdec", ()), ("llama_tiny", ("model.dtype=bfloat16",)),
                                             ("tiny_encdec", ("model.logits_bias=true",))])
def test_logits_chunk_in_the_model_loss(name, overrides):
  """Tied (tiny_encdec) and untied (llama_tiny) output layers, and a logits bias (Marian's), through the task's loss."""
  cfg, model, params = setup(name, overrides)
  b = batch(cfg)
  want = loss_and_grads(cfg, model, params, b)
  chunk_cfg, chunk_model = variant(cfg, logits_chunk=7)
  got = loss_and_grads(chunk_cfg, chunk_model, params, b)
  if cfg.model.dtype == "float32":
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-5)
    assert_trees_close(got[2], want[2])
  else:  # bf16 activations: each gradient within a few bf16 roundings (2^-8) of the whole-logits one
    np.testing.assert_allclose(got[:2], want[:2], rtol=1e-3)
    for a, b in zip(jax.tree.leaves(got[2]), jax.tree.leaves(want[2])):
      assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)


def test_chunked_loss_memory_is_one_chunk_of_logits():
  """XLA's temporaries for the loss's value and gradients: the whole [tokens, vocab] logits
  (and their gradient) without chunking, about one chunk's with it."""
  tokens, d_model, vocab, chunk = 2048, 32, 8192, 128
  cfg = config.ModelConfig(d_model=d_model, vocab_size=vocab)
  hidden = jax.ShapeDtypeStruct((1, tokens, d_model), jnp.float32)
  weight = jax.ShapeDtypeStruct((vocab, d_model), jnp.float32)
  targets = jnp.zeros((1, tokens), jnp.int32)
  weights = jnp.ones((1, tokens), jnp.float32)
  project = functools.partial(layers.project_logits, spec="nd,vd->nv", cfg=cfg)

  def temp(chunk):
    def f(h, w):
      if chunk:
        return losses.chunked_cross_entropy(h, w, targets, weights, 0.1, chunk, project)[0]
      return losses.cross_entropy(project(h[0], w)[None], targets, weights, 0.1)[0]
    return jax.jit(jax.grad(f, (0, 1))).lower(hidden, weight).compile().memory_analysis().temp_size_in_bytes

  logits_bytes = tokens * vocab * 4
  whole, chunked = temp(0), temp(chunk)
  assert whole >= logits_bytes
  assert chunked < 4 * chunk * vocab * 4 + 4 * (tokens + vocab) * d_model * 4  # a few chunks + activations


def test_automatic_logits_chunk():
  assert losses.logits_chunk(0, 64 * 32, 37000) == 0            # a small batch: whole logits
  assert losses.logits_chunk(0, 8192, 128256) == 2**28 // (4 * 128256)  # 4 GiB of logits: chunked
  assert losses.logits_chunk(0, 8 * 8192, 128256, batch_shards=8) == 8 * (2**28 // (4 * 128256))
  assert losses.logits_chunk(100, 64, 37000) == 0               # larger than the batch: one piece
  assert losses.logits_chunk(100, 640, 37000) == 100
