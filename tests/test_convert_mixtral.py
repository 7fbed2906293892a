"""Mixtral in and out through jaxformer.convert, against transformers' own outputs (tests/fixtures/hf/mixtral).

The fixture is a tiny MixtralForCausalLM (2 layers, d_model 64, 4 SwiGLU experts of d_ff 96, top 2,
GQA 4/2, RoPE theta 1e6) with non-trivial random weights, saved by transformers 5.24 in the hub's
per-expert layout (`block_sparse_moe.experts.E.w1/w2/w3`) with its logits, hidden states, router
logits, top-2 choices and weights, load-balancing losses and greedy generations
(tests/fixtures/make_hf_fixtures.py --only mixtral). One import is shared by every test here.
"""

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from jaxformer import checkpoint as checkpoint_lib
from jaxformer import config as config_lib
from jaxformer import convert
from jaxformer import decode
from jaxformer import evaluate
from jaxformer import moe
from jaxformer import train
from jaxformer.errors import UserError

from conftest import hf_tensors
from test_convert import edited_copy

FIXTURE = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf" / "mixtral"
QUIET = {"log": lambda *a, **k: None}


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
  """(workdir, cfg, model, params, HF's arrays, HF's meta, our forward's logits and intermediates)."""
  workdir = str(tmp_path_factory.mktemp("mixtral") / "w")
  convert.from_hf(str(FIXTURE), workdir, **QUIET)
  cfg, model, params, _, _ = evaluate.load_run(workdir, **QUIET)
  arrays = np.load(FIXTURE / "expected.npz")
  meta = json.loads((FIXTURE / "expected.json").read_text())
  forward = jax.jit(lambda p, x: model.apply({"params": p}, x, capture_intermediates=True, mutable=["intermediates"]))
  logits, inter = forward(params, jnp.asarray(arrays["inputs"]))  # one compile (eager MoE is ~10x slower)
  return workdir, cfg, model, params, arrays, meta, np.asarray(logits), inter["intermediates"]["decoder"]


def test_the_imported_config_is_mixtrals(mixtral):
  _, cfg, _, params, _, _, _, _ = mixtral
  m = cfg.model
  assert (m.moe_experts, m.moe_top_k, m.moe_every, m.moe_shared_experts, m.moe_capacity_factor) == (4, 2, 1, 0, 0.0)
  assert (m.num_kv_heads, m.d_ff, m.rope_theta, m.norm_eps, m.tie_output) == (2, 96, 1e6, 1e-5, False)
  assert (cfg.optim.moe_aux_loss, cfg.optim.moe_z_loss, cfg.data.tokenizer, cfg.data.add_bos) == (
      0.02, 0.0, "sentencepiece", True)
  layer = params["decoder"]["layer_1"]["moe"]
  assert {k: tuple(v.shape) for k, v in layer.items() if k != "router"} == {
      "wi_gate": (4, 64, 96), "wi_up": (4, 64, 96), "wo": (4, 96, 64)}
  assert "ffn" not in params["decoder"]["layer_0"]


def test_logits_hidden_states_and_routing_match_transformers(mixtral):
  _, cfg, _, _, arrays, _, logits, inter = mixtral
  np.testing.assert_allclose(logits, arrays["logits"], atol=1e-4)
  assert np.abs(arrays["logits"]).max() > 1.0
  hidden = arrays["hidden_states"]  # the embeddings, layer 0's output, then the final norm's
  np.testing.assert_allclose(np.asarray(inter["layer_0"]["__call__"][0]), hidden[1], atol=1e-4)
  np.testing.assert_allclose(np.asarray(inter["final_norm"]["__call__"][0]), hidden[-1], atol=1e-4)
  for i in range(cfg.model.num_layers):
    ours = inter[f"layer_{i}"]["moe"]
    router_logits = np.asarray(ours["router"]["__call__"][0])  # [tokens, experts]
    np.testing.assert_allclose(router_logits, arrays["router_logits"][i], atol=1e-4, err_msg=f"layer {i}")
    # moe.route against HF's MixtralTopKRouter (softmax, top 2, renormalised), on HF's own logits:
    weights, experts, _ = moe.route(jnp.asarray(arrays["router_logits"][i]), cfg.model.moe_top_k)
    np.testing.assert_array_equal(np.asarray(experts), arrays["router_experts"][i])
    np.testing.assert_allclose(np.asarray(weights), arrays["router_weights"][i], rtol=1e-6)
    assert len(np.unique(arrays["router_experts"][i][:, 0])) > 1  # tokens go to different experts
    # The load-balancing loss each layer sows is HF's load_balancing_loss_func on that layer's logits.
    np.testing.assert_allclose(float(ours["load_balancing"][0]), arrays["aux_loss_per_layer"][i], rtol=1e-5)
  # HF's MixtralForCausalLM pools the counts and probabilities of all layers before multiplying;
  # jaxformer averages the per-layer losses (moe.aux_losses): equal for one layer, not in general.
  mean = float(np.mean(arrays["aux_loss_per_layer"]))
  assert float(moe.aux_losses({"decoder": inter})["load_balancing"]) == pytest.approx(mean, rel=1e-5)
  assert abs(mean - float(arrays["aux_loss_pooled"])) > 1e-4


def test_greedy_generation_with_the_kv_cache_matches_transformers(mixtral):
  _, cfg, model, params, _, meta, _, _ = mixtral
  got = decode.generate(model, params, meta["prompts"], 8, jax.random.key(0), temperature=0, eos_id=cfg.model.eos_id)
  np.testing.assert_array_equal(np.asarray(got), meta["greedy"])


def test_export_writes_the_hub_layout_and_reimports_bitwise(mixtral, tmp_path):
  workdir, cfg, _, params, _, _, _, _ = mixtral
  out = tmp_path / "hf"
  convert.to_hf(workdir, str(out), **QUIET)
  original, exported = hf_tensors(FIXTURE), hf_tensors(out)
  assert sorted(exported) == sorted(original)
  assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in exported
  for key, value in original.items():
    assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
  theirs = json.loads((FIXTURE / "config.json").read_text())
  ours = json.loads((out / "config.json").read_text())
  for key in ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "num_local_experts", "num_experts_per_tok",
              "router_aux_loss_coef", "router_jitter_noise", "sliding_window", "rms_norm_eps", "rope_parameters",
              "tie_word_embeddings", "bos_token_id", "eos_token_id", "hidden_act"):
    assert ours.get(key) == theirs.get(key), key
  assert "attention_bias" not in ours and "mlp_bias" not in ours  # no such MixtralConfig fields
  assert (out / "tokenizer.model").read_bytes() == (FIXTURE / "tokenizer.model").read_bytes()
  again = str(tmp_path / "w2")
  convert.from_hf(str(out), again, **QUIET)
  with checkpoint_lib.Checkpointer(again, async_save=False) as ckpt:
    reloaded, _ = ckpt.restore_params(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
  assert json.loads((pathlib.Path(again) / "config.json").read_text())["model"] == config_lib.to_dict(cfg)["model"]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), reloaded, params)


def _one_line_error(capsys, pattern, *argv):
  with pytest.raises(SystemExit) as e:
    convert.main(list(argv))
  lines = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
  assert re.search(pattern, lines[0]), lines[0]


def _edited(tmp_path, name, edit):
  """A copy of the Mixtral fixture, named `name`, whose config.json went through `edit(dict)`."""
  return edited_copy(tmp_path, "mixtral", edit, name)


def test_mixtral_fields_and_layouts_we_do_not_support_are_one_line_errors(tmp_path, capsys):
  w = str(tmp_path / "w")
  for name, edit, pattern in (
      ("window", lambda c: c.update(sliding_window=4096), r"sliding_window=4096 is not supported.*sliding_window null"),
      ("jitter", lambda c: c.update(router_jitter_noise=0.01), r"router_jitter_noise=0\.01 is not supported"),
      ("act", lambda c: c.update(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
      ("topk", lambda c: c.update(num_experts_per_tok=5), r"num_experts_per_tok=5 is not supported.*=4\)"),
      ("bias", lambda c: c.update(attention_bias=True), r"attention_bias=True is not supported by jaxformer's Mixtral"),
      ("experts", lambda c: c.update(num_local_experts=8), r"gate\.weight has shape \[4, 64\] but config\.json implies \[8, 64\]"),
  ):
    _one_line_error(capsys, pattern, "--from-hf", _edited(tmp_path, name, edit), "--workdir", w)
  # transformers' in-memory names (experts fused into gate_up_proj / down_proj), one file.
  fused = pathlib.Path(_edited(tmp_path, "fused", lambda c: None))
  tensors = hf_tensors(fused)
  for f in list(fused.glob("model*.safetensors*")):
    f.unlink()
  w1 = [tensors.pop(f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight") for e in range(4)]
  w3 = [tensors.pop(f"model.layers.0.block_sparse_moe.experts.{e}.w3.weight") for e in range(4)]
  tensors["model.layers.0.mlp.experts.gate_up_proj"] = np.concatenate([np.stack(w1), np.stack(w3)], axis=1)
  save_file(tensors, str(fused / "model.safetensors"))
  _one_line_error(capsys, r"holds model\.layers\.0\.mlp\.experts\.gate_up_proj: transformers' in-memory fused",
                  "--from-hf", str(fused), "--workdir", w)
  assert not pathlib.Path(w).exists()


def test_moe_models_without_a_mixtral_equivalent_are_not_exported():
  cfg = config_lib.load_config("mixtral_8x7b")
  assert convert.infer_model_type(cfg) == "mixtral"
  assert convert.infer_model_type(cfg, "llama") == "mixtral"  # a Llama upcycled to MoE exports as Mixtral
  dense = config_lib.replace(cfg, **{"model.moe_experts": 0})
  assert convert.infer_model_type(dense, "mixtral") == "llama"
  for overrides, pattern in (({"model.moe_every": 2}, r"model\.moe_every=2 has no Hugging Face mixtral"),
                             ({"model.moe_shared_experts": 1}, r"model\.moe_shared_experts=1 has no Hugging Face mixtral"),
                             ({"model.use_bias": True}, r"model\.use_bias=True has no Hugging Face mixtral")):
    with pytest.raises(UserError, match=pattern):
      convert.infer_model_type(config_lib.replace(cfg, **overrides))
  gpt2_moe = config_lib.load_config("moe_shakespeare")  # GPT-2's layout with MoE FFNs: no HF architecture
  with pytest.raises(UserError, match=r"model\.moe_experts=8 has no Hugging Face gpt2 equivalent"):
    convert.infer_model_type(gpt2_moe, "gpt2")
  with pytest.raises(UserError, match=r"model\.norm='layernorm' has no Hugging Face mixtral equivalent"):
    convert.infer_model_type(gpt2_moe)


def test_a_hub_style_config_json_imports_as_the_fixture(mixtral, tmp_path):
  """Mixtral-8x7B-v0.1's config.json has rope_theta at the top level, no rope_parameters, head_dim or
  router_jitter_noise (transformers 4.x wrote it): the same model as the fixture's 5.x config."""
  _, cfg, _, _, _, _, _, _ = mixtral

  def hub_style(c):
    c["rope_theta"] = c.pop("rope_parameters")["rope_theta"]
    for key in ("head_dim", "router_jitter_noise", "dtype"):
      c.pop(key)
    c["torch_dtype"] = "bfloat16"
  got = convert.config_from_hf(_edited(tmp_path, "hub", hub_style))[0]
  assert config_lib.to_dict(got)["model"] == config_lib.to_dict(cfg)["model"]
  assert got.optim == cfg.optim


def test_a_lora_run_on_the_experts_exports_merged_and_refuses_peft_in_one_line(mixtral, tmp_path, capsys):
  """LoRA's default targets adapt each expert (A_e, B_e): the merged export carries them into every
  expert's w1/w2/w3; PEFT has no module for our per-expert adapters, so --peft is one line, nothing written."""
  workdir = mixtral[0]
  text = tmp_path / "text.txt"
  text.write_text(" ".join(["A man in an orange hat starring at something."] * 40) + "\n")
  cfg = config_lib.load_config(str(pathlib.Path(workdir) / "config.json"), [
      f"train.init_from={workdir}", "train.lora_rank=2", "data.block_size=16", f"data.text_path={text}",
      "data.batch_size=2", "train.num_steps=1", "train.eval_every=1000", "train.checkpoint_every=1",
      "train.sample_every_eval=false", "optim.schedule=constant", "optim.learning_rate=0.05"])
  run = str(tmp_path / "run")
  train.train_and_evaluate(cfg, run, **QUIET)
  convert.to_hf(run, str(tmp_path / "merged"), **QUIET)
  original, merged = hf_tensors(FIXTURE), hf_tensors(tmp_path / "merged")
  for w in ("w1", "w2", "w3"):
    key = f"model.layers.1.block_sparse_moe.experts.3.{w}.weight"
    assert not np.array_equal(merged[key], original[key]), key  # the expert's adapter is in the export
  _one_line_error(capsys, r"--peft: the adapter on decoder/layer_0/moe/\w+_lora has no Hugging Face mixtral module",
                  "--to-hf", run, "--out", str(tmp_path / "peft"), "--peft")
  assert not (tmp_path / "peft").exists()
