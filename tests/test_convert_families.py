"""Qwen2, Qwen3, Mistral, Phi-3, Gemma 2 and Gemma 3 through jaxformer.convert, against transformers' own outputs.

The fixtures (tests/fixtures/make_hf_fixtures.py, by hand with transformers 5.24) are tiny random-weight
models whose every family feature moves HF's logits by more than 0.1 (expected.json "feature_effects"),
with inputs of 24 tokens and greedy continuations of 16 past a sliding window of 8.
"""

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import chat
from jaxformer import checkpoint as checkpoint_lib
from jaxformer import config as config_lib
from jaxformer import convert
from jaxformer import decode
from jaxformer import model as model_lib
from jaxformer import tasks
from jaxformer.errors import UserError

from conftest import HF_FIXTURES, feature_off, hf_expected, hf_tensors

FIXTURES = HF_FIXTURES
NAMES = ["qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3"]
QUIET = {"log": lambda *a, **k: None}
expected = hf_expected


# What each fixture must turn on (the family's features, read from its config.json).
FEATURES = {
    "qwen2": dict(qkv_bias=True, use_bias=False, tie_output=True),
    "qwen3": dict(qk_norm=True, head_dim=32),
    "mistral": dict(sliding_window=8, attention_pattern=""),
    "phi3": dict(sliding_window=8),
    "gemma2": dict(activation="geglu", norm_unit_offset=True, post_norms=True, scale_embeddings=True,
                   attn_softcap=5.0, final_softcap=3.0, query_pre_attn_scalar=24.0, sliding_window=8,
                   attention_pattern="local,global", tie_output=True),
    "gemma3": dict(activation="geglu", norm_unit_offset=True, post_norms=True, scale_embeddings=True, qk_norm=True,
                   attn_softcap=0.0, query_pre_attn_scalar=24.0, sliding_window=8,
                   attention_pattern="local,local,local,global", rope_theta=1e6, rope_scaling="linear",
                   rope_scaling_factor=2.0, rope_local_theta=1e4),
}


@pytest.mark.parametrize("name", NAMES)
def test_config_json_becomes_the_family_features(converted, name):
  _, cfg, _, _, _ = converted(name)
  for field, value in FEATURES[name].items():
    assert getattr(cfg.model, field) == value, field


@pytest.mark.parametrize("name", NAMES)
def test_logits_and_hidden_states_match_transformers(converted, name):
  """24 tokens, three times the window of 8: each layer's output and the logits within 1e-4."""
  _, cfg, model, params, _ = converted(name)
  arrays, _ = expected(name)
  assert arrays["inputs"].shape[1] > 2 * (cfg.model.sliding_window or 8)
  logits, inter = model.apply({"params": params}, jnp.asarray(arrays["inputs"]), capture_intermediates=True)
  inter = inter["intermediates"]["decoder"]
  hidden = arrays["hidden_states"]  # the embeddings (scaled, for Gemma), layers 0..L-2, then the final norm's output
  for i in range(cfg.model.num_layers - 1):
    np.testing.assert_allclose(np.asarray(inter[f"layer_{i}"]["__call__"][0]), hidden[i + 1], atol=1e-4,
                               rtol=1e-5, err_msg=f"layer {i}")
  np.testing.assert_allclose(np.asarray(logits), arrays["logits"], atol=1e-4)
  assert np.abs(arrays["logits"]).max() > 1.0


@pytest.mark.parametrize("name, impl", [(n, "einsum") for n in NAMES] +
                         [(n, "tiled") for n in ("mistral", "gemma2", "gemma3")])  # the windowed families
def test_greedy_generation_past_the_window_matches_transformers(converted, name, impl):
  """Prompts of several lengths in one left-padded batch, 16 new tokens each (HF ran each alone):
  past the window of 8, so the local layers' ring-buffer cache wraps around."""
  _, cfg, model, params, _ = converted(name)
  _, meta = expected(name)
  model = model_lib.DecoderOnly(dataclasses.replace(cfg.model, attention_impl=impl))
  new = len(meta["greedy"][0])
  if cfg.model.sliding_window:
    assert min(len(p) for p in meta["prompts"]) + new > 2 * cfg.model.sliding_window
    cache = decode.init_cache(model, 1, 40)
    ring = [x.shape for p, x in jax.tree_util.tree_leaves_with_path(cache) if p[-1].key == "cached_segment"]
    assert (1, cfg.model.sliding_window) in ring  # the local layers hold the window only
  got = decode.generate(model, params, meta["prompts"], new, jax.random.key(0), temperature=0, eos_id=-1)
  np.testing.assert_array_equal(np.asarray(got), meta["greedy"])


@pytest.mark.parametrize("name, field", [
    ("qwen2", "qkv_bias"), ("qwen3", "qk_norm"), ("mistral", "sliding_window"), ("phi3", "sliding_window"),
    *[("gemma2", f) for f in ("activation", "norm_unit_offset", "post_norms", "scale_embeddings", "attn_softcap",
                              "final_softcap", "query_pre_attn_scalar", "sliding_window")],
    *[("gemma3", f) for f in ("qk_norm", "rope_local_theta", "rope_scaling", "sliding_window",
                              "query_pre_attn_scalar", "post_norms")]])
def test_every_feature_of_a_family_moves_its_logits(converted, name, field):
  """Turning one feature off in the converted model changes the logits by more than 0.1 (so the
  match above exercises it); transformers' own ablations moved them too (expected.json)."""
  _, cfg, model, params, _ = converted(name)
  arrays, meta = expected(name)
  m, kept = feature_off(cfg.model, params, field)
  diff = np.abs(np.asarray(model_lib.DecoderOnly(m).apply({"params": kept}, jnp.asarray(arrays["inputs"])))
                - arrays["logits"]).max()
  assert diff > 0.1, f"{name}: {field} off moves the logits by {diff:.3g} only"
  assert all(e["max_abs_logit_change"] > 0.1 for e in meta["feature_effects"].values())


@pytest.mark.parametrize("name", NAMES)
def test_tokenizers_encode_and_decode_as_transformers(converted, name):
  _, _, _, _, tok = converted(name)
  _, meta = expected(name)
  for case in meta["tokenizer"]:
    text = case["text"]
    if name == "mistral" and text[:1].isspace():  # sentencepiece's dummy prefix (as for Llama, test_convert)
      continue
    assert tok.encode(text) == case["ids"], text
    assert tok.decode(case["ids"]) == case["decoded"], text


@pytest.mark.parametrize("name", NAMES)
def test_chat_templates_render_as_transformers_renders_them(converted, name):
  """The family's real template (its tokenizer_config.json, copied in by convert) through jaxformer.chat:
  the strings transformers' apply_chat_template gave, and its errors (Gemma refuses a system turn)."""
  workdir, cfg, _, _, tok = converted(name)
  _, meta = expected(name)
  hf = cfg.data.tokenizer == "hf"
  template = chat.load_template("", tasks.tokenizer_path(cfg, workdir), hf)
  config = json.loads((FIXTURES / name / "tokenizer_config.json").read_text())
  for case in meta["chat"]:
    if case.get("kwargs"):  # Qwen3's enable_thinking=False: jaxformer passes no template arguments of its own
      continue
    for key, generation in (("with_generation_prompt", True), ("without_generation_prompt", False)):
      want = case[key]
      if isinstance(want, dict):
        with pytest.raises(UserError, match=want["error"].split(": ", 1)[-1]):
          template.render(case["messages"], add_generation_prompt=generation)
        continue
      got = template.render(case["messages"], add_generation_prompt=generation)
      if not hf:  # a sentencepiece model's BOS/EOS are written as our markers, encoded to their ids (chat.encode_pieces)
        got = got.replace(chat.BOS_TEXT, config["bos_token"]).replace(chat.EOS_TEXT, config["eos_token"])
      assert got == want
  for case, want in zip(meta["chat"][2:], meta.get("chat_ids", [])):  # Mistral: [INST] and [/INST] are control ids
    assert chat.prompt_ids(template, tok, case["messages"], cfg.data.add_bos, hf) == want


@pytest.mark.parametrize("name", NAMES)
def test_export_writes_the_original_tensors_and_config_and_reimports_bitwise(converted, name, tmp_path):
  workdir, cfg, _, params, _ = converted(name)
  out = tmp_path / "hf"
  convert.to_hf(workdir, str(out), **QUIET)
  original, exported = hf_tensors(FIXTURES / name), hf_tensors(out)
  assert sorted(exported) == sorted(original)
  for key, value in original.items():
    assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
  theirs = json.loads((FIXTURES / name / "config.json").read_text())
  ours = json.loads((out / "config.json").read_text())
  for key in ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads",
              "head_dim", "sliding_window", "layer_types", "rope_parameters", "query_pre_attn_scalar",
              "attn_logit_softcapping", "final_logit_softcapping", "tie_word_embeddings", "hidden_activation",
              "use_sliding_window"):
    assert json.dumps(ours.get(key), sort_keys=True) == json.dumps(theirs.get(key), sort_keys=True), key  # 24 != 24.0
  again = str(tmp_path / "w2")
  convert.from_hf(str(out), again, **QUIET)
  with checkpoint_lib.Checkpointer(again, async_save=False) as ckpt:
    reloaded, _ = ckpt.restore_params(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
  assert json.loads((pathlib.Path(again) / "config.json").read_text())["model"] == config_lib.to_dict(cfg)["model"]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), reloaded, params)


@pytest.mark.parametrize("recipe, family", [
    (["model.qkv_bias=true", "model.use_bias=false", "model.activation=swiglu"], "qwen2"),
    (["model.qk_norm=true", "model.use_bias=false", "model.activation=swiglu"], "qwen3"),
    (["model.sliding_window=16", "model.use_bias=false", "model.activation=swiglu"], "mistral"),
    (["model.activation=geglu", "model.norm_unit_offset=true", "model.post_norms=true", "model.use_bias=false",
      "model.scale_embeddings=true", "model.sliding_window=16", "model.attention_pattern=local,global",
      "model.attn_softcap=50", "model.final_softcap=30", "model.tie_output=true"], "gemma2"),
])
def test_a_run_trained_here_exports_as_the_family_that_holds_it(recipe, family):
  cfg = config_lib.load_config("llama_tiny", recipe)
  assert convert.infer_model_type(cfg) == family


def test_a_feature_the_family_lacks_is_refused_in_one_line():
  cfg = config_lib.load_config("llama_tiny", ["model.sliding_window=16", "model.attention_pattern=local,global",
                                              "model.use_bias=false"])
  with pytest.raises(UserError, match="model.attention_pattern='local,global' has no Hugging Face mistral"):
    convert.infer_model_type(cfg, "mistral")
  cfg = config_lib.load_config("llama_tiny", ["model.qk_norm=true", "model.use_bias=false"])
  with pytest.raises(UserError, match="model.qk_norm=True has no Hugging Face llama equivalent"):
    convert.infer_model_type(cfg, "llama")


def _edited(tmp_path, name, edit):
  import shutil
  folder = tmp_path / name
  shutil.copytree(FIXTURES / name, folder)
  conf = json.loads((folder / "config.json").read_text())
  edit(conf)
  (folder / "config.json").write_text(json.dumps(conf))
  return str(folder)


@pytest.mark.parametrize("name, edit, message", [
    ("gemma3", lambda c: c.update(model_type="gemma3"), "model_type 'gemma3' is Gemma 3's image-text model"),
    ("qwen3", lambda c: c.update(attention_bias=True), "attention_bias=True is not supported"),
    ("phi3", lambda c: c.update(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
     "rope type='longrope' is not supported"),
    ("gemma2", lambda c: c.update(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ("gemma2", lambda c: c.update(layer_types=["chunked_attention"] * 4), "layer_types entry='chunked_attention'"),
    ("gemma3", lambda c: c["rope_parameters"]["sliding_attention"].update(rope_type="linear", factor=2.0),
     "rope_parameters.sliding_attention.rope_type='linear'"),
    ("mistral", lambda c: c.update(attention_bias=True), "attention_bias=True is not supported"),
])
def test_what_jaxformer_cannot_express_is_refused_naming_the_field(tmp_path, name, edit, message):
  with pytest.raises(UserError, match=message.replace("(", r"\(")) as e:
    convert.from_hf(_edited(tmp_path, name, edit), str(tmp_path / "w"), **QUIET)
  assert "\n" not in str(e.value)
