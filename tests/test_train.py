"""Tests for the training loop: schedule, losses, gradient accumulation, NaN policy, resume."""

import json
import math
import os
import platform
import subprocess
import sys
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import tiny_config
from jaxformer import data as data_lib
from jaxformer import evaluate
from jaxformer import losses
from jaxformer import model as model_lib
from jaxformer import optim
from jaxformer import runtime
from jaxformer import tasks
from jaxformer import train
from jaxformer.config import load_config
from jaxformer.errors import UserError

DATA = os.environ.get("JAXFORMER_DATA", os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data"))


def read_metrics(workdir, key="loss"):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [(r["step"], r[key]) for r in map(json.loads, f) if key in r]


# ---------------------------------------------------------------------------
# Schedules.


def test_rsqrt_schedule_matches_the_paper():
  sched = optim.rsqrt_schedule(512, 4000)
  paper = lambda step: 512 ** -0.5 * min(step ** -0.5, step * 4000 ** -1.5)  # step counts from 1
  for count in (0, 1, 999, 3998, 3999, 4000, 15999, 99999):
    np.testing.assert_allclose(float(sched(count)), paper(count + 1), rtol=1e-6)
  # The 4000th update (count 3999) gets the peak, 512^-0.5 * 4000^-0.5.
  np.testing.assert_allclose(float(sched(3999)), 6.98771e-4, rtol=1e-5)
  counts = np.arange(0, 20000)
  assert int(np.argmax(np.asarray(sched(counts)))) == 3999
  # The config path builds the same schedule, with the learning_rate scale.
  cfg = load_config("wmt_base", ["optim.learning_rate=2"])
  np.testing.assert_allclose(float(optim.learning_rate_schedule(cfg)(3999)), 2 * paper(4000), rtol=1e-6)


def test_optimizer_uses_the_count_from_zero():
  """Adam's first update has size lr(count=0): the schedule's step 1, not step 0 (lr 0)."""
  cfg = load_config("wmt_base", ["optim.warmup_steps=10"])
  tx, sched = optim.build_optimizer(cfg)
  params = {"w": jnp.zeros(3)}
  state = tx.init(params)
  for count in range(3):
    updates, state = tx.update({"w": jnp.array([1.0, -2.0, 0.5])}, state, params)
    # With a constant gradient Adam's bias-corrected step is lr * sign(g).
    np.testing.assert_allclose(np.asarray(updates["w"]), -512 ** -0.5 * (count + 1) * 10 ** -1.5
                               * np.array([1, -1, 1]), rtol=1e-5)
  np.testing.assert_allclose(float(sched(0)), 512 ** -0.5 * 10 ** -1.5, rtol=1e-6)


def test_cosine_schedule_endpoints():
  cfg = load_config("gpt2_tiny", ["optim.learning_rate=1e-3", "optim.min_learning_rate=1e-5",
                                  "optim.warmup_steps=10", "train.num_steps=100"])
  sched = optim.learning_rate_schedule(cfg)
  expected = lambda t: (1e-3 * t / 10 if t < 10
                        else 1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * (t - 10) / 90)))
  for t in (0, 5, 10, 20, 55, 99, 100):
    np.testing.assert_allclose(float(sched(t)), expected(t), rtol=1e-5, atol=1e-12)
  assert float(sched(0)) == 0.0 and float(sched(500)) == pytest.approx(1e-5)


# ---------------------------------------------------------------------------
# Losses.


def np_log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_label_smoothed_loss_matches_numpy():
  rng = np.random.default_rng(0)
  vocab, eps = 7, 0.1
  logits = rng.normal(size=(2, 3, vocab)).astype(np.float32) * 3
  targets = rng.integers(0, vocab, (2, 3))
  weights = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  q = np.full((2, 3, vocab), eps / (vocab - 1))
  np.put_along_axis(q, targets[..., None], 1 - eps, -1)
  np.testing.assert_allclose(np.asarray(losses.smoothed_targets(jnp.asarray(targets), vocab, eps)), q, rtol=1e-6)
  logp = np_log_softmax(logits.astype(np.float64))
  kl = (q * (np.log(q) - logp)).sum(-1)  # = cross-entropy minus the entropy of q
  nll = -np.take_along_axis(logp, targets[..., None], -1)[..., 0]
  loss_sum, nll_sum, weight = losses.cross_entropy(jnp.asarray(logits), jnp.asarray(targets),
                                                   jnp.asarray(weights), eps)
  np.testing.assert_allclose(float(loss_sum), (kl * weights).sum(), rtol=1e-5)
  np.testing.assert_allclose(float(nll_sum), (nll * weights).sum(), rtol=1e-5)
  assert float(weight) == 3.0
  # Without smoothing the loss is the NLL.
  plain = losses.cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights), 0.0)
  np.testing.assert_allclose(float(plain[0]), (nll * weights).sum(), rtol=1e-5)


def test_label_smoothed_loss_is_minimal_at_the_smoothed_distribution():
  vocab, eps = 5, 0.2
  targets = jnp.array([[0, 3, 4]])
  weights = jnp.ones((1, 3))
  q = np.asarray(losses.smoothed_targets(targets, vocab, eps))
  loss = lambda logits: losses.cross_entropy(logits, targets, weights, eps)[0]
  best = jnp.asarray(np.log(q), jnp.float32) + 1.7  # softmax is shift-invariant
  assert abs(float(loss(best))) < 1e-5
  np.testing.assert_allclose(np.asarray(jax.grad(loss)(best)), 0.0, atol=1e-5)
  rng = np.random.default_rng(1)
  for _ in range(5):
    assert float(loss(best + jnp.asarray(rng.normal(size=best.shape), jnp.float32))) > 1e-3
  # The one-hot target is *not* optimal under smoothing.
  assert float(loss(jax.nn.one_hot(targets, vocab) * 20.0)) > 1.0


def _reference_cross_entropy(logits, targets, weights, eps):
  """The loss by autodiff-able formula (log-softmax against the smoothed one-hot)."""
  vocab = logits.shape[-1]
  logp = jax.nn.log_softmax(logits)
  q = jax.nn.one_hot(targets, vocab) * (1 - eps - eps / (vocab - 1)) + eps / (vocab - 1)
  entropy = -jnp.sum(jnp.where(q > 0, q * jnp.log(jnp.where(q > 0, q, 1.0)), 0.0), axis=-1)
  loss = -jnp.sum(q * logp, axis=-1) - entropy
  nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
  return jnp.sum(loss * weights), jnp.sum(nll * weights), jnp.sum(weights)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_cross_entropy_gradients_match_autodiff_of_the_formula(eps):
  """The hand-written VJP (softmax - smoothed targets) against autodiff of the plain
  formula, for any cotangents of (loss, nll, weight sum), w.r.t. logits and weights."""
  rng = np.random.default_rng(2)
  vocab = 11
  logits = jnp.asarray(rng.normal(size=(3, 4, vocab)) * 3, jnp.float32)
  targets = jnp.asarray(rng.integers(0, vocab, (3, 4)))
  weights = jnp.asarray(rng.integers(0, 2, (3, 4)), jnp.float32)
  ours, vjp = jax.vjp(lambda x, w: losses.cross_entropy(x, targets, w, eps), logits, weights)
  ref, ref_vjp = jax.vjp(lambda x, w: _reference_cross_entropy(x, targets, w, eps), logits, weights)
  np.testing.assert_allclose(np.array(ours), np.array(ref), rtol=1e-5)
  for cot in [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.3, -2.0, 0.7)]:
    cot = tuple(jnp.float32(c) for c in cot)
    for got, want in zip(vjp(cot), ref_vjp(cot)):
      np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-6)
  # And against central differences of the numpy loss (float64), a few logits.
  q = np.full((3, 4, vocab), eps / (vocab - 1))
  np.put_along_axis(q, np.asarray(targets)[..., None], 1 - eps, -1)
  def np_loss(x):
    return (-(q * np_log_softmax(x)).sum(-1) * np.asarray(weights)).sum()
  x0 = np.asarray(logits, np.float64)
  grad = np.asarray(jax.grad(lambda x: losses.cross_entropy(x, targets, weights, eps)[0])(logits))
  for idx in [(0, 0, 0), (1, 2, 5), (2, 3, 10)]:
    dx = np.zeros_like(x0)
    dx[idx] = 1e-4
    np.testing.assert_allclose(grad[idx], (np_loss(x0 + dx) - np_loss(x0 - dx)) / 2e-4, rtol=1e-3, atol=1e-6)


# ---------------------------------------------------------------------------
# The train step, on hand-made batches.


def translation_batch(src, tgt, max_len=16):
  """A batch in the data pipeline's format from lists of token ids."""
  batcher = data_lib.Batcher(src, tgt, tokens_per_batch=len(src) * max_len, max_len=max_len,
                             shuffle=False, buckets=(max_len,))
  return batcher.make_batch(np.arange(len(src)))


def fresh_state(cfg, tx, batch):
  model = model_lib.build_model(cfg.model)
  state = train.init_state(model, tx, (jnp.asarray(batch["inputs"]), jnp.asarray(batch["decoder_inputs"])),
                           jax.random.PRNGKey(0))
  return model, nn.unbox(state)


TASK = types.SimpleNamespace(loss=tasks.TranslationTask.loss)


@pytest.mark.slow
def test_gradient_accumulation_equals_one_big_batch():
  rng = np.random.default_rng(0)
  # Rows of very different lengths: micro-batch 1 has far more target tokens than 2,
  # so averaging per micro-batch (instead of per token) would give another update.
  lens = [(9, 12), (11, 14), (3, 1), (2, 2)]
  src = [list(rng.integers(4, 64, a)) for a, _ in lens]
  tgt = [list(rng.integers(4, 64, b)) for _, b in lens]
  batch = translation_batch(src, tgt)
  tx = optax.sgd(1.0)  # the update is the gradient itself
  cfg = tiny_config("model.num_layers=1", "optim.grad_accum_steps=2")
  model, state = fresh_state(cfg, tx, batch)
  step = jax.jit(train.make_train_step(model, TASK, cfg, tx, optim.learning_rate_schedule(cfg)))
  new_state, metrics = step(state, batch)
  # The reference: one big batch, the gradient of the summed smoothed loss / token count.
  params = state["params"]
  tokens = float(batch["targets_segmentation"].sum())
  ref_grads = jax.jit(jax.grad(lambda p, b: TASK.loss(model, p, b, {}, True, cfg.optim.label_smoothing)[0]))(
      params, batch)
  ref_grads = jax.tree.map(lambda g: np.asarray(g, np.float64) / tokens, ref_grads)
  ref_params = jax.tree.map(lambda p, g: np.asarray(p) - g, params, ref_grads)
  ref_norm = np.sqrt(sum((g ** 2).sum() for g in jax.tree.leaves(ref_grads)))
  assert ref_norm > 1e-2
  assert float(metrics["tokens"]) == tokens
  np.testing.assert_allclose(float(metrics["grad_norm"]), ref_norm, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, atol=1e-5, rtol=1e-5),
               new_state["params"], ref_params)
  ref_loss = TASK.loss(model, params, batch, {}, True, cfg.optim.label_smoothing)[0]
  np.testing.assert_allclose(float(metrics["loss_sum"]), float(ref_loss), rtol=1e-5)


def poisoned_loss(model, params, batch, *args):
  """The translation loss times batch["scale"] (NaN poisons loss and gradient)."""
  loss, nll, weight = tasks.TranslationTask.loss(model, params, batch, *args)
  return loss * batch["scale"], nll * batch["scale"], weight


@pytest.fixture(scope="module")
def small_step():
  """(batch of 8 random pairs, model, fresh state, jitted step): compiled once for two tests."""
  rng = np.random.default_rng(1)
  src = [list(rng.integers(4, 64, rng.integers(3, 7))) for _ in range(8)]
  tgt = [list(rng.integers(4, 64, rng.integers(3, 7))) for _ in range(8)]
  batch = {**translation_batch(src, tgt, max_len=8), "scale": np.float32(1.0)}
  cfg = tiny_config("optim.label_smoothing=0")
  tx = optax.adam(1e-2)
  model, state = fresh_state(cfg, tx, batch)
  step = jax.jit(train.make_train_step(model, types.SimpleNamespace(loss=poisoned_loss), cfg, tx,
                                       optax.constant_schedule(1e-2)))
  return batch, model, state, step


@pytest.mark.slow
def test_tiny_encoder_decoder_overfits(small_step):
  batch, model, state, step = small_step
  first = None
  for _ in range(150):
    state, metrics = step(state, batch)
    first = first or float(metrics["nll_sum"] / metrics["tokens"])
  final = float(metrics["nll_sum"] / metrics["tokens"])
  assert first > 3.0 and final < 0.05, (first, final)
  logits = model.apply({"params": state["params"]}, batch["inputs"], batch["decoder_inputs"])
  mask = batch["targets_segmentation"] > 0
  np.testing.assert_array_equal(np.asarray(logits.argmax(-1))[mask], batch["targets"][mask])


def test_nonfinite_step_is_skipped(small_step):
  batch, _, state, step = small_step
  before = jax.device_get(state)
  state, metrics = step(state, {**batch, "scale": np.float32(np.nan)})
  assert not bool(metrics["finite"]) and int(state["skipped"]) == 1 and int(state["step"]) == 1
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["params"]), before["params"])
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state["opt_state"]), before["opt_state"])
  state, metrics = step(state, batch)
  assert bool(metrics["finite"]) and int(state["skipped"]) == 1 and int(state["step"]) == 2
  changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)),
                                         state["params"], before["params"]))
  assert all(changed)


@pytest.mark.slow
def test_nan_policy_in_the_loop(tiny_run, tmp_path, monkeypatch):
  """NaN params: `skip` trains through (every step skipped), then refuses to save the poisoned
  state with one line (jaxformer.checkpoint.NonFiniteState); `stop` raises at the first step."""
  workdir, _, _ = tiny_run
  init_state = train.init_state

  def nan_init(*args, **kwargs):
    state = init_state(*args, **kwargs)
    return {**state, "params": jax.tree.map(lambda x: x * jnp.nan, state["params"])}

  monkeypatch.setattr(train, "init_state", nan_init)
  tok = f"data.tokenizer_path={workdir}/tokenizer.model"
  cfg = tiny_config(tok, "train.num_steps=3", "train.log_every=1", "train.nan_policy=skip")
  with pytest.raises(UserError, match="holds NaN or inf .* so it was not saved"):
    train.train_and_evaluate(cfg, str(tmp_path / "skip"), log=lambda *a: None)
  with open(tmp_path / "skip" / "metrics.jsonl") as f:
    records = [json.loads(line) for line in f]
  assert [r["skipped"] for r in records if "skipped" in r] == [1, 2, 3]  # trained through, skipping each step
  assert not os.path.exists(tmp_path / "skip" / "checkpoints" / "3")
  cfg = tiny_config(tok, "train.num_steps=3", "train.log_every=1", "train.nan_policy=stop")
  with pytest.raises(UserError, match="non-finite loss or gradient before step 1"):
    train.train_and_evaluate(cfg, str(tmp_path / "stop"), log=lambda *a: None)
  assert not os.path.exists(tmp_path / "stop" / "checkpoints" / "1")


# ---------------------------------------------------------------------------
# Whole runs.


def test_resume_continues_exactly(tiny_run, tmp_path):
  """8 steps in one go == 4 steps, then a new call with num_steps=8 in the same workdir."""
  workdir_a, cfg_a, result_a = tiny_run
  workdir_b = str(tmp_path / "b")
  tok = f"data.tokenizer_path={workdir_a}/tokenizer.model"  # the same tokenizer, not retrained
  first = train.train_and_evaluate(tiny_config(tok, "train.num_steps=4", "train.log_every=1"), workdir_b,
                                   log=lambda *a: None)
  assert first["step"] == 4
  logs = []
  result_b = train.train_and_evaluate(tiny_config(tok, "train.num_steps=8", "train.log_every=1"), workdir_b,
                                      log=logs.append)
  assert any(line.startswith("resumed from") and "(step 4)" in line for line in logs), logs
  assert result_b["step"] == 8 and int(result_b["state"]["step"]) == 8
  # Bitwise the same state (README: "bitwise the same final weights"), every array.
  leaves_a, leaves_b = jax.tree.leaves(result_a["state"]), jax.tree.leaves(result_b["state"])
  assert len(leaves_a) == len(leaves_b)
  for a, b in zip(leaves_a, leaves_b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # Every step's loss (both runs log each step: 1..4 from the first call, 5..8 from the resumed one)
  # is bitwise that of an uninterrupted run logging each step.
  every = train.train_and_evaluate(tiny_config(tok, "train.log_every=1"), str(tmp_path / "c"), log=lambda *a: None)
  for a, b in zip(jax.tree.leaves(every["state"]), leaves_a):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  logged = read_metrics(str(tmp_path / "c"))
  assert [s for s, _ in logged] == list(range(1, 9))
  assert read_metrics(workdir_b) == logged
  # Batches are a pure function of the step: same across tasks and call orders.
  task_a, task_b = result_a["task"], result_b["task"]
  fresh = tasks.make_task(cfg_a, workdir_a, log=lambda *a: None)
  for s in (7, 0, 5, 0, 3, 250):
    for other in (task_b, fresh):
      jax.tree.map(np.testing.assert_array_equal, task_a.train_batch(s), other.train_batch(s))
  assert any(not np.array_equal(task_a.train_batch(0)["inputs"], task_a.train_batch(s)["inputs"])
             for s in (1, 2))


def test_eval_batches_0_is_the_whole_validation_stream_for_lm(tmp_path):
  """train.eval_batches=0 is documented as the whole dev set; language models used 20 random batches."""
  (tmp_path / "text.txt").write_text("".join(f"line {i} of the corpus, a little text.\n" for i in range(800)))
  cfg = load_config("gpt2_tiny", [f"data.text_path={tmp_path / 'text.txt'}", "train.eval_batches=0"])
  task = tasks.LMTask(cfg, str(tmp_path / "run"), log=lambda *a: None)
  n, block, rows = len(task.val_stream), cfg.data.block_size, cfg.data.batch_size
  stream = task.val_stream.take(np.array([0]), n)[0]
  batches = task.eval_batches("dev", cfg.train.eval_batches)
  windows = -(-(n - 1) // block)
  assert (n - 1) % block and windows % rows and len(batches) == -(-windows // rows) > 20  # partial last ones
  weights = np.concatenate([b["weights"] for b in batches])
  targets = np.concatenate([b["targets"] for b in batches])
  np.testing.assert_array_equal(targets[weights == 1], stream[1:])  # each target exactly once, in order
  for b in batches:
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
  # The loop's evaluate counts each token once: uniform logits (zero params) give ln(vocab) over n - 1 tokens.
  model = model_lib.build_model(cfg.model)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
  zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), nn.unbox(shapes))
  val = evaluate.mean_nll(jax.jit(train.make_eval_step(model, task)), zeros, batches)
  assert val["val_tokens"] == n - 1
  assert val["val_nll"] == pytest.approx(math.log(cfg.model.vocab_size), rel=1e-5)
  assert len(task.eval_batches("dev", 3)) == 3  # a count still means that many random batches


@pytest.mark.slow
def test_bleu_during_training_honours_decode_settings(tiny_run, tmp_path, monkeypatch):
  """train.eval_bleu_sentences decodes with decode.max_extra_len (it used translate's default, 50)."""
  seen, real = [], evaluate.translate

  def spy(*args, **kwargs):
    seen.append(kwargs)
    return real(*args, **kwargs)

  monkeypatch.setattr(evaluate, "translate", spy)
  tok = f"data.tokenizer_path={tiny_run[0]}/tokenizer.model"
  result = train.train_and_evaluate(tiny_config(tok, "train.num_steps=1", "train.eval_every=1",
                                                "train.eval_bleu_sentences=3", "decode.max_extra_len=3"),
                                    str(tmp_path / "run"), log=lambda *a: None)
  assert len(seen) == 1 and seen[0]["max_extra_len"] == 3 and seen[0]["beam_size"] == 1
  assert "val_bleu" in result


@pytest.mark.slow
def test_train_cli_on_multi30k_slice(tmp_path, capsys):
  src = os.path.join(DATA, "multi30k")
  if not all(os.path.exists(os.path.join(src, f)) for f in ("train.en", "train.de", "val.en", "val.de")):
    pytest.skip("Multi30k not found in ../shared/data")
  paths = {}
  for split, n in (("train", 300), ("val", 50)):
    for lang in ("en", "de"):
      with open(os.path.join(src, f"{split}.{lang}"), encoding="utf-8") as f:
        lines = [next(f) for _ in range(n)]
      paths[split, lang] = tmp_path / f"{split}.{lang}"
      paths[split, lang].write_text("".join(lines), encoding="utf-8")
  workdir = tmp_path / "run"
  result = train.main(["--config", "multi30k", "--workdir", str(workdir),
                       f"data.train_src={paths['train', 'en']}", f"data.train_tgt={paths['train', 'de']}",
                       f"data.dev_src={paths['val', 'en']}", f"data.dev_tgt={paths['val', 'de']}",
                       "data.test_src=", "data.test_tgt=", "model.vocab_size=500", "model.d_model=32",
                       "model.num_heads=4", "model.num_layers=1", "model.d_ff=64", "data.max_len=32",
                       "data.tokens_per_batch=1024", "train.num_steps=12", "train.log_every=1",
                       "train.eval_every=12", "train.eval_batches=1", "train.eval_bleu_sentences=0",
                       "train.checkpoint_every=1000", "optim.warmup_steps=10", "model.dropout_rate=0"])
  out = capsys.readouterr().out
  assert '"name": "multi30k"' in out and "step 12/12" in out
  assert result["step"] == 12 and os.listdir(workdir / "checkpoints") == ["12"]
  nll = [v for _, v in read_metrics(workdir, "nll")]
  assert len(nll) == 12 and all(np.isfinite(nll))
  vocab = result["task"].tokenizer.vocab_size
  assert 100 < vocab <= 500
  # An untrained model is near uniform over the model's vocabulary (7.0 here: the tied, sqrt(d_model)-
  # scaled embeddings make the initial logits spread), and 12 steps take >= 1.2 nats off the train and
  # the held-out NLL (measured: 7.01 -> 5.27-5.38 over steps 10-12): a run whose updates are lost or
  # wrong (no update, a sign error, NaN) does not get there.
  assert abs(nll[0] - math.log(500)) < 1.0, nll
  assert np.mean(nll[-3:]) < nll[0] - 1.2, nll
  assert result["val_nll"] < nll[0] - 1.2, (result["val_nll"], nll)


@pytest.mark.slow
def test_tiny_lm_loss_goes_down(tmp_path):
  rng = np.random.default_rng(0)
  words = "the cat dog sat on a mat and ran to big red house".split()
  text = "\n".join(" ".join(rng.choice(words, 8)) + "." for _ in range(400))
  (tmp_path / "text.txt").write_text(text)
  cfg = load_config("gpt2_tiny", [f"data.text_path={tmp_path / 'text.txt'}", "model.num_layers=1",
                                  "train.num_steps=30", "train.log_every=1", "train.eval_every=1000",
                                  "train.eval_batches=1", "train.sample_every_eval=false",
                                  "train.checkpoint_every=1000", "optim.learning_rate=3e-3"])
  seen = len(runtime.COMPILES)
  result = train.train_and_evaluate(cfg, str(tmp_path / "run"), log=lambda *a: None)
  nll = [v for _, v in read_metrics(str(tmp_path / "run"), "nll")]
  assert len(nll) == 30
  # The run reports the XLA compilations it made (none after setup's if the persistent cache
  # is warm) and the log's ms/step is the wall time between consecutive log records.
  assert result["programs_compiled"] == len(runtime.COMPILES) - seen
  assert read_metrics(str(tmp_path / "run"), "programs_compiled")[0][1] == result["programs_compiled"]
  records = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "step_ms" in r]
  for prev, r in zip(records, records[1:]):
    assert r["step_ms"] == pytest.approx(1e3 * (r["time"] - prev["time"]) / (r["step"] - prev["step"]),
                                         rel=0.05, abs=2.0)
  # Init: logits ~ 0, so the NLL is about log(vocab).
  assert abs(np.mean(nll[:2]) - math.log(cfg.model.vocab_size)) < 0.3, nll[:3]
  assert np.mean(nll[-3:]) < np.mean(nll[:3]) - 1.0, nll
  assert result["val_nll"] < nll[0] - 0.5


def test_sample_text_runs_past_the_position_table():
  # The samples printed at eval time are no longer cut at the learned-position table (16 here).
  from jaxformer.tokenizer import CharTokenizer  # pylint: disable=g-import-not-at-top
  decoded = []

  class Recording(CharTokenizer):
    def decode(self, ids):  # the text stops at a sampled EOS: the test looks at the ids
      decoded.append(np.asarray(ids))
      return super().decode(ids)

  tokenizer = Recording("abcdefghijklmnopqrstuvwxyz .\n")
  cfg = load_config("gpt2_tiny", ["model.max_len=16", "data.block_size=16", f"model.vocab_size={tokenizer.vocab_size}"])
  model = model_lib.build_model(cfg.model)
  params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
  text = train.sample_text(model, params, tokenizer, cfg, step=1, prompt="the ", max_new_tokens=60)
  assert text.startswith("the ") and decoded[0].shape == (60,)
  assert len(set(decoded[0][16:].tolist())) > 10     # sampled past the table (near-uniform logits at init)


_FAULTS_PROBE = r"""
import ctypes, resource, sys, threading
sys.path.insert(0, sys.argv[1])
from jaxformer import runtime
applied = runtime.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
size = 48 << 20  # a scratch buffer (glibc maps over 32 MiB), allocated and freed 4 times off the main thread
def work():
  for _ in range(4):
    p = libc.malloc(size); ctypes.memset(p, 1, size); libc.free(p)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
thread = threading.Thread(target=work); thread.start(); thread.join()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt settings are glibc's")
def test_keep_freed_memory_stops_refaulting():
  """With keep_freed_memory() a big buffer freed and allocated again is reused (faulted
  in once); with JAXFORMER_KEEP_MEMORY=off glibc unmaps it and every allocation faults."""
  def faults(setting):
    env = dict(os.environ, JAXFORMER_KEEP_MEMORY=setting)
    out = subprocess.run([sys.executable, "-c", _FAULTS_PROBE, os.path.dirname(os.path.dirname(train.__file__))],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    return out[0] == "True", int(out[1])
  pages = (48 << 20) // 4096
  applied_off, off = faults("off")
  applied_on, on = faults("on")
  assert not applied_off and applied_on
  if off < 2 * pages:
    pytest.skip(f"this kernel backs fresh memory with huge pages ({off} faults): nothing to compare")
  assert off > 3.5 * pages, off  # four fresh buffers
  assert on < 1.5 * pages, on  # one


def test_compilation_cache_setting(monkeypatch, tmp_path):
  """train.py keeps compiled programs in $JAXFORMER_COMPILATION_CACHE; `off` disables it;
  a cache directory JAX already has (here the test suite's) is left alone."""
  saved = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")}
  try:
    monkeypatch.setenv("JAXFORMER_COMPILATION_CACHE", str(tmp_path / "xla"))
    assert runtime.use_compilation_cache() is None  # conftest's cache dir is already set
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("JAXFORMER_COMPILATION_CACHE", "off")
    assert runtime.use_compilation_cache() is None and jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv("JAXFORMER_COMPILATION_CACHE", str(tmp_path / "xla"))
    assert runtime.use_compilation_cache() == str(tmp_path / "xla")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
  finally:
    for k, v in saved.items():
      jax.config.update(k, v)
