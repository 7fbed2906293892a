"""DPO after SFT: train.init_from a LoRA workdir (read merged), the refusal without train.init_from,
DPO with LoRA (reference = the base with the adapters off), held-out DPO figures at eval steps,
and inspect's memory for these cases. Tiny runs: gpt2_tiny, 1 layer, byte tokenizer, 2 steps."""

import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import config as config_lib
from jaxformer import evaluate
from jaxformer import inspect
from jaxformer import lora
from jaxformer import model as model_lib
from jaxformer import synthetic
from jaxformer import tasks
from jaxformer import train
from jaxformer.errors import UserError

QUIET = lambda *a, **k: None
BETA = 0.1
COMMON = ["data.tokenizer=byte", "model.vocab_size=259", "data.chat_template=plain", "model.num_layers=1",
          "data.block_size=64", "data.batch_size=4", "model.dropout_rate=0", "optim.label_smoothing=0",
          "train.sample_every_eval=false", "train.log_every=1", "train.checkpoint_every=2",
          "optim.schedule=constant", "optim.warmup_steps=0"]


def _write_jsonl(path, records):
  with open(path, "w") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """(tmp, base workdir, LoRA SFT workdir on it, dpo_cfg(*overrides)): 2 steps each; the LoRA run's
  adapters trained (B != 0), so its merged model differs from its base."""
  tmp = tmp_path_factory.mktemp("dpo")
  _write_jsonl(tmp / "sft.jsonl", synthetic.reverse_words_records(40))
  _write_jsonl(tmp / "prefs.jsonl", synthetic.reverse_words_preferences(16))
  # 6 held-out pairs in batches of 4: the second batch has 2 filler rows, which must count for nothing.
  _write_jsonl(tmp / "prefs_val.jsonl", synthetic.reverse_words_preferences(6, seed=7))
  sft = lambda *o: config_lib.load_config("gpt2_tiny", COMMON + [f"data.chat_path={tmp / 'sft.jsonl'}", "data.train_fraction=1.0",
                                                                 "train.num_steps=2", *o])
  base, lora_dir = str(tmp / "base"), str(tmp / "lora")
  train.train_and_evaluate(sft("optim.learning_rate=3e-3"), base, log=QUIET)
  train.train_and_evaluate(sft(f"train.init_from={base}", "train.lora_rank=4", "optim.learning_rate=3e-2"),
                           lora_dir, log=QUIET)
  dpo_cfg = lambda *o: config_lib.load_config("gpt2_tiny", COMMON + [
      f"data.chat_path={tmp / 'prefs.jsonl'}", f"data.chat_val_path={tmp / 'prefs_val.jsonl'}",
      "train.objective=dpo", f"train.dpo_beta={BETA}", "train.num_steps=2", "train.eval_every=2",
      "optim.learning_rate=1e-2", *o])
  return tmp, base, lora_dir, dpo_cfg


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def numpy_dpo(model, policy, reference, batches, beta=BETA):
  """The DPO figures of `policy` against `reference` (plain params) over [rows, 2, length] batches, from the
  model's logits on in float64 numpy: per-response summed log-probs of the weighted targets, rewards
  beta (policy - reference), loss log(1 + exp(-(chosen - rejected))), over rows with a chosen loss token."""
  apply = jax.jit(lambda p, b: model.apply({"params": p}, b["inputs"], b["segment_ids"], b["positions"]))

  def logps(params, b):
    flat = {k: np.asarray(v).reshape(-1, v.shape[-1]) for k, v in b.items()}
    logits = np.asarray(apply(params, flat), np.float64)
    tok = np.take_along_axis(_log_softmax(logits), flat["targets"][..., None], -1)[..., 0]
    return (tok * flat["weights"]).sum(-1).reshape(-1, 2)

  chosen, rejected, nll = [], [], []
  for b in batches:
    real = np.asarray(b["weights"])[:, 0].sum(-1) > 0
    pol, ref = logps(policy, b)[real], logps(reference, b)[real]
    chosen.append(beta * (pol[:, 0] - ref[:, 0]))
    rejected.append(beta * (pol[:, 1] - ref[:, 1]))
    nll.append(-pol[:, 0])
  chosen, rejected, nll = map(np.concatenate, (chosen, rejected, nll))
  margin = chosen - rejected
  return {"val_loss": np.mean(np.log1p(np.exp(-margin))), "val_rewards/accuracy": np.mean(chosen > rejected),
          "val_rewards/margin": np.mean(margin), "val_rewards/chosen": np.mean(chosen),
          "val_rewards/rejected": np.mean(rejected), "val_nll": np.mean(nll), "val_pairs": len(chosen)}


def _metrics(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _check_eval(workdir, expected):
  """The run's logged held-out figures (its one eval, at step 2) equal numpy's."""
  val = [r for r in _metrics(workdir) if "val_rewards/accuracy" in r]
  assert [r["step"] for r in val] == [2], val
  assert val[0]["val_pairs"] == expected["val_pairs"] == 6  # the filler rows counted for nothing
  for key, want in expected.items():
    np.testing.assert_allclose(val[0][key], want, rtol=2e-4, atol=1e-6, err_msg=key)
  assert abs(expected["val_rewards/margin"]) > 1e-4  # the policy moved: a comparison that can fail


@pytest.mark.slow
def test_dpo_from_a_lora_workdir_reads_it_merged_and_reports_held_out_figures(runs):
  """train.init_from=<a LoRA SFT workdir> (full DPO after LoRA SFT): the policy and the reference start as
  its merged model (what eval.py reads), and the eval step's held-out loss, rewards/accuracy and
  rewards/margin on data.chat_val_path equal numpy's on the final policy and the reference."""
  tmp, _, lora_dir, dpo_cfg = runs
  logs = []
  result = train.train_and_evaluate(dpo_cfg(f"train.init_from={lora_dir}"), str(tmp / "full"), log=logs.append)
  assert any(line.startswith("initialised from") and "LoRA adapters merged into" in line for line in logs), logs
  _, model, merged, _, _ = evaluate.load_run(lora_dir, log=QUIET)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(result["state"]["ref_params"]), merged)
  batches = result["task"].eval_batches("dev")
  _check_eval(str(tmp / "full"), numpy_dpo(model, jax.device_get(result["state"]["params"]), merged, batches))
  assert any(line.startswith("step 2 | val_loss") and "val_rewards/accuracy" in line for line in logs), logs


@pytest.mark.slow
def test_dpo_with_lora_trains_adapters_against_the_base_with_them_off(runs):
  """DPO with LoRA on a LoRA SFT workdir: the state holds no reference (nor any base weight), the base is that
  run merged, the first step's loss is log 2 (B = 0: policy = reference), and the held-out figures equal
  numpy's with the policy = the base with the trained adapters merged in, the reference = the base."""
  tmp, _, lora_dir, dpo_cfg = runs
  workdir = str(tmp / "dpo_lora")
  result = train.train_and_evaluate(dpo_cfg(f"train.init_from={lora_dir}", "train.lora_rank=4"), workdir, log=QUIET)
  state, base = jax.device_get(result["state"]), jax.device_get(result["lora_base"])
  assert "ref_params" not in state
  assert {p[-1].key for p, _ in jax.tree_util.tree_leaves_with_path(state["params"])} == {lora.A, lora.B}
  _, model, merged, _, _ = evaluate.load_run(lora_dir, log=QUIET)
  jax.tree.map(np.testing.assert_array_equal, base, merged)
  loss = [r["loss"] for r in _metrics(workdir) if "loss" in r]
  assert loss[0] == pytest.approx(np.log(2), rel=1e-6) and loss[1] != pytest.approx(np.log(2), rel=1e-4)
  cfg = dpo_cfg("train.lora_rank=4", "train.init_from=unused")
  policy = jax.device_get(lora.merge(base, state["params"], cfg))
  _check_eval(workdir, numpy_dpo(model, policy, base, result["task"].eval_batches("dev")))


def test_dpo_with_lora_numerics(runs):
  """The LoRA preference loss alone: at B = 0 the policy is the reference (loss log 2 per pair, rewards 0)
  and only the adapters get gradients (A's zero while B is 0, B's not); with random B the reference
  log-probs are the base model's and the policy's the merged model's (numpy)."""
  tmp, base_dir, _, dpo_cfg = runs
  cfg = dpo_cfg(f"train.init_from={base_dir}", "train.lora_rank=4")
  task = tasks.make_task(cfg, str(tmp / "numerics"), log=QUIET)
  batch = task.train_batch(0)
  model = model_lib.build_model(cfg.model)
  _, _, base, _, _ = evaluate.load_run(base_dir, log=QUIET)
  with lora.adapters_active(cfg):
    init = jax.jit(lambda ids: nn.unbox(model.init(jax.random.PRNGKey(0), ids)["params"]))
    adapters = lora.split(init(jnp.asarray(batch["inputs"][:1, 0])))[1]
  loss_fn = jax.jit(lambda a, b: train.preference_loss(model, task, cfg, a, b, {}, True, base))
  loss, sums = loss_fn(adapters, batch)
  pairs = float(sums["tokens"])
  assert pairs == 4
  np.testing.assert_allclose(float(loss), pairs * np.log(2), rtol=1e-6)
  assert float(sums["rewards/chosen_sum"]) == float(sums["rewards/rejected_sum"]) == 0.0
  grads = jax.grad(lambda a: loss_fn(a, batch)[0])(adapters)
  assert jax.tree.structure(grads) == jax.tree.structure(adapters)  # the adapters' alone: the base is frozen
  paths = {p[-1].key: [] for p, _ in jax.tree_util.tree_leaves_with_path(grads)}
  for p, g in jax.tree_util.tree_leaves_with_path(grads):
    paths[p[-1].key].append(float(np.abs(np.asarray(g)).max()))
  assert set(paths) == {lora.A, lora.B} and max(paths[lora.A]) == 0.0 and min(paths[lora.B]) > 0.0
  # Random B: rewards = beta (merged - base) log-probs, computed independently.
  rng = np.random.default_rng(0)
  adapters = jax.tree.map(lambda x: (0.05 * rng.standard_normal(x.shape)).astype(np.float32), adapters)
  loss, sums = loss_fn(adapters, batch)
  want = numpy_dpo(model, jax.device_get(lora.merge(base, adapters, cfg)), base, [batch])
  np.testing.assert_allclose(float(sums["rewards/chosen_sum"]) / pairs, want["val_rewards/chosen"], rtol=1e-4)
  np.testing.assert_allclose(float(sums["rewards/rejected_sum"]) / pairs, want["val_rewards/rejected"], rtol=1e-4)
  np.testing.assert_allclose(float(loss) / pairs, want["val_loss"], rtol=1e-5)
  assert abs(want["val_rewards/chosen"]) > 1e-3  # the adapters move the policy away from the reference


def test_dpo_settings_are_one_line_errors(runs):
  """DPO without train.init_from is refused before any work unless train.dpo_from_scratch says it is meant;
  DPO with LoRA takes no other train.dpo_reference; a LoRA workdir of another model is one line."""
  tmp, base_dir, lora_dir, dpo_cfg = runs
  with pytest.raises(UserError, match="train.dpo_from_scratch=true") as e:
    train.train_and_evaluate(dpo_cfg(), "/nonexistent/dpo", log=QUIET)  # before the workdir is made
  assert "\n" not in str(e.value) and "train.init_from" in str(e.value)
  with pytest.raises(UserError, match="needs train.init_from"):
    train.train_and_evaluate(dpo_cfg(f"train.dpo_reference={base_dir}"), "/nonexistent/dpo", log=QUIET)
  with pytest.raises(UserError, match="no second copy"):
    dpo_cfg(f"train.init_from={base_dir}", "train.lora_rank=4", f"train.dpo_reference={lora_dir}")
  dpo_cfg(f"train.init_from={base_dir}", "train.lora_rank=4", f"train.dpo_reference={base_dir}")  # the same: fine
  other = dpo_cfg(f"train.init_from={lora_dir}", "model.d_model=64")
  abstract = evaluate.abstract_params(other)[1]
  with pytest.raises(UserError, match="a LoRA run, read merged") as e:
    train.restore_params(other, lora_dir, abstract, key="train.init_from")
  assert "\n" not in str(e.value) and "[32]" in str(e.value) and "[64]" in str(e.value)


def test_inspect_dpo_memory(monkeypatch):
  """DPO's memory plan: two sequences per pair; full fine-tuning adds the reference (a copy of the params),
  LoRA does not (the base with the adapters off is its reference), and the report says so."""
  make = lambda *o: config_lib.load_config("gpt2_tiny", ["data.chat_path=prefs.jsonl", *o])
  lm, dpo = make(), make("train.objective=dpo")
  lora_lm, lora_dpo = make("train.lora_rank=4"), make("train.objective=dpo", "train.lora_rank=4")
  plan = lambda cfg, rows: inspect.memory_plan(cfg, {"data": 1}, rows, (64,))
  assert plan(dpo, 2)["reference"] == plan(dpo, 2)["params"] > 0
  assert plan(dpo, 2)["activations"] == plan(lm, 4)["activations"]
  assert plan(dpo, 2)["total"] == plan(lm, 4)["total"] + plan(dpo, 2)["params"]
  assert "reference" not in plan(lora_dpo, 2) and plan(lora_dpo, 2)["total"] == plan(lora_lm, 4)["total"]
  monkeypatch.setattr(inspect, "largest_batch", lambda *a: 1)  # (its search: 10 s for this tiny model)
  report = inspect.memory_report(lora_dpo, "data=1", 2, (64,))
  assert "batch 2 DPO pairs x 64 tokens (4 sequences per device)" in report
  assert "reference is the frozen base with the adapters off" in report


@pytest.mark.slow
def test_lora_dpo_memory_plan_matches_xla_and_holds_no_reference():
  """The compiled LoRA DPO step (not run, one CPU device): XLA's bytes within 10% of inspect's plan (0.955
  here; the plan's LoRA LM step at 2 x the rows is as far off), and its arguments hold the base once (with
  the adapters, their Adam moments and the batch): no reference copy."""
  from jaxformer import aot  # pylint: disable=g-import-not-at-top
  cfg = config_lib.load_config("llama_tiny", [
      "model.d_model=128", "model.num_heads=4", "model.num_kv_heads=2", "model.d_ff=384", "model.num_layers=4",
      "model.vocab_size=512", "model.scan_layers=true", "data.chat_path=prefs.jsonl", "mesh.data=1",
      "train.objective=dpo", "train.lora_rank=4", "train.init_from=unused"])
  plan, xla, _ = aot.plan_vs_xla(cfg, jax.devices()[:1], 8, (128,))
  assert abs(plan["total"] / xla["total"] - 1) <= 0.10, (plan, xla)
  assert "reference" not in plan and plan["params"] < xla["argument"] < 1.5 * plan["params"]
