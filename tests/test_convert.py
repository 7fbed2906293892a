"""Tests for jaxformer.convert against outputs of transformers itself (tests/fixtures/make_hf_fixtures.py).

The fixtures are tiny GPT-2, Llama (GQA; default, llama3 and yarn RoPE) and Marian models with
non-trivial random weights, saved by transformers with its logits, hidden states, greedy and beam
search outputs and tokenizer round trips; torch and transformers are not needed here.
"""

import json
import os
import pathlib
import re
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from etils import epath

from jaxformer import checkpoint as checkpoint_lib
from jaxformer import config as config_lib
from jaxformer import convert
from jaxformer import decode
from jaxformer import evaluate
from jaxformer import generate
from jaxformer import model as model_lib
from jaxformer import prepare
from jaxformer import shards
from jaxformer import tasks
from jaxformer import train
from jaxformer.errors import UserError

from conftest import HF_FIXTURES, hf_expected, hf_tensors

FIXTURES = HF_FIXTURES
LMS = ["gpt2", "llama", "llama3", "llama_yarn"]
ALL = LMS + ["marian"]
QUIET = {"log": lambda *a, **k: None}


expected = hf_expected


# ----------------------------------------------------------------------------- numerics


@pytest.mark.parametrize("name", ALL)
def test_logits_and_hidden_states_match_transformers(converted, name):
  _, cfg, model, params, _ = converted(name)
  arrays, _ = expected(name)
  if name == "marian":
    logits, inter = model.apply({"params": params}, jnp.asarray(arrays["inputs"]),
                                jnp.asarray(arrays["decoder_inputs"]), capture_intermediates=True)
    inter = inter["intermediates"]
    for side, mask in (("encoder", arrays["attention_mask"][..., None]), ("decoder", 1)):
      hidden = arrays[f"{side}_hidden_states"]  # [layers + 1, batch, length, d]: the input, then each layer's output
      for i in range(hidden.shape[0] - 1):
        ours = np.asarray(inter[side][f"layer_{i}"]["__call__"][0])
        np.testing.assert_allclose(ours * mask, hidden[i + 1] * mask, atol=1e-4, err_msg=f"{side} layer {i}")
  else:
    logits, inter = model.apply({"params": params}, jnp.asarray(arrays["inputs"]), capture_intermediates=True)
    inter = inter["intermediates"]["decoder"]
    hidden = arrays["hidden_states"]  # the embeddings, layers 0..L-2, then the final norm's output
    for i in range(cfg.model.num_layers - 1):
      np.testing.assert_allclose(np.asarray(inter[f"layer_{i}"]["__call__"][0]), hidden[i + 1], atol=1e-4)
    np.testing.assert_allclose(np.asarray(inter["final_norm"]["__call__"][0]), hidden[-1], atol=1e-4)
  np.testing.assert_allclose(np.asarray(logits), arrays["logits"], atol=1e-4)
  assert np.abs(arrays["logits"]).max() > 1.0  # not vanishing logits that any mapping would match


@pytest.mark.parametrize("name", ALL)
def test_greedy_generation_with_the_kv_cache_matches_transformers(converted, name):
  _, cfg, model, params, _ = converted(name)
  arrays, meta = expected(name)
  if name == "marian":  # all three end in EOS well before either side's length limit
    got = np.asarray(decode.greedy_translate(model, params, jnp.asarray(arrays["inputs"]), max_extra_len=50,
                                             suppress_pad=cfg.decode.suppress_pad))
    want = np.asarray(meta["greedy"])
    np.testing.assert_array_equal(got[:, :want.shape[1]], want)
    assert (got[:, want.shape[1]:] == cfg.model.pad_id).all()
  else:  # prompts of different lengths in one left-padded batch; HF ran each alone
    got = decode.generate(model, params, meta["prompts"], 8, jax.random.key(0), temperature=0, eos_id=cfg.model.eos_id)
    np.testing.assert_array_equal(np.asarray(got), meta["greedy"])


@pytest.mark.parametrize("name", ["llama", "marian"])
def test_greedy_generation_with_the_tiled_attention_kernel_matches_transformers(converted, name):
  """The same converted weights with model.attention_impl=tiled (jaxformer.attention on the KV cache)."""
  _, cfg, model, params, _ = converted(name)
  model = type(model)(config_lib.replace(cfg.model, attention_impl="tiled"))
  arrays, meta = expected(name)
  if name == "marian":
    got = np.asarray(decode.greedy_translate(model, params, jnp.asarray(arrays["inputs"]), max_extra_len=50,
                                             suppress_pad=cfg.decode.suppress_pad))
    np.testing.assert_array_equal(got[:, :np.asarray(meta["greedy"]).shape[1]], meta["greedy"])
  else:
    got = decode.generate(model, params, meta["prompts"], 8, jax.random.key(0), temperature=0, eos_id=cfg.model.eos_id)
    np.testing.assert_array_equal(np.asarray(got), meta["greedy"])


@pytest.mark.parametrize("variant", ["default", "alpha0.6_true", "alpha0.5_never", "alpha1.5", "alpha1.5_true"])
def test_marian_beam_search_with_hf_length_penalty_matches_generate(converted, variant):
  _, cfg, model, params, _ = converted("marian")
  arrays, meta = expected("marian")
  beams = meta["beams"][variant]
  early = {True: "true", False: "false"}.get(beams["kwargs"].get("early_stopping", False), "never")
  alpha = beams["kwargs"].get("length_penalty", cfg.decode.alpha)  # default: generation_config's (1.0)

  def search(kind, early_stopping):
    tokens, scores = decode.beam_search(model, params, jnp.asarray(arrays["inputs"]), beam_size=4, alpha=alpha,
                                        max_extra_len=50, length_penalty_kind=kind, early_stopping=early_stopping,
                                        suppress_pad=True)
    return np.asarray(tokens), np.asarray(scores)

  tokens, scores = search("hf", early)
  for row in range(3):
    for k in range(4):  # every beam, best first, as generate(num_beams=4, num_return_sequences=4) ranks them
      want = beams["sequences"][row][k]
      np.testing.assert_array_equal(tokens[row, k, :len(want)], want, err_msg=f"row {row} beam {k}")
  np.testing.assert_allclose(scores, beams["scores"], atol=1e-4)
  if variant == "default":  # the paper's penalty decodes otherwise here: the switch matters
    assert not np.array_equal(search("gnmt", "false")[0][:, 0, :8], tokens[:, 0, :8])
  if variant == "alpha1.5_true":  # and so does HF's early_stopping
    assert meta["beams"]["alpha1.5"]["sequences"] != beams["sequences"]


# ----------------------------------------------------------------------------- tokenizers


@pytest.mark.parametrize("name", ALL)
def test_tokenizers_encode_and_decode_as_transformers(converted, name):
  _, cfg, _, _, tok = converted(name)
  _, meta = expected(name)
  for case in meta["tokenizer"]:
    text = case["text"]
    ids = tok.encode(text) + ([tok.eos_id] if name == "marian" else [])  # MarianTokenizer appends </s>
    if name in ("llama", "llama_yarn") and text[:1].isspace():
      # sentencepiece itself (Meta's reference tokenizer) always adds the dummy-prefix space;
      # transformers' converted Llama tokenizer (legacy=False) does not before a leading space.
      assert ids != case["ids"] and tok.decode(ids) == text
      continue
    assert ids == case["ids"], text
    assert tok.decode(case["ids"]) == case["decoded"], text
  if name == "marian":  # targets are split by target.spm
    assert [tok.encode_target(t) + [tok.eos_id] for t in meta["targets"]] == meta["target_ids"]
    assert [tok.encode(t) + [tok.eos_id] for t in meta["targets"]] != meta["target_ids"]


CONFIG_SPECIALS = FIXTURES.parent / "hf_config_specials"  # tests/fixtures/make_config_specials.py


def _config_specials_cfg(vocab_size):
  """A config for CONFIG_SPECIALS' tokenizer (<s> 380, </s> 381, <pad> 385) and `vocab_size` embedding rows."""
  return config_lib.replace(config_lib.load_config("gpt2_tiny"), **{
      "data.tokenizer": "hf", "model.vocab_size": vocab_size, "model.bos_id": 380, "model.eos_id": 381,
      "model.pad_id": 385})


def test_special_tokens_named_only_in_tokenizer_config_encode_as_transformers(tmp_path):
  """bos/eos/mask/additional_special_tokens named only in tokenizer_config.json (pad only in
  special_tokens_map.json), not in tokenizer.json's added_tokens: transformers matches them in text as
  added special tokens, and so do we, from the HF folder, from the workdir convert copies it to, and
  from the tokenizer.json that --to-hf writes (which holds them: it alone gives the same ids)."""
  import tokenizers
  from jaxformer import tokenizer as tokenizer_lib
  from jaxformer.convert import hf_in, hf_out
  want = json.loads((CONFIG_SPECIALS / "expected.json").read_text(encoding="utf-8"))
  cfg = _config_specials_cfg(want["len"])
  workdir, out = tmp_path / "w", tmp_path / "hf"
  workdir.mkdir()
  out.mkdir()
  dest = hf_in.import_tokenizer(str(CONFIG_SPECIALS), cfg, "gpt2", str(workdir), **QUIET)
  hf_out.export_tokenizer(cfg, "gpt2", str(workdir), str(out))
  exported = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
  for case in want["cases"]:
    assert exported.encode(case["text"], add_special_tokens=False).ids == case["ids"], case["text"]
  for path in (CONFIG_SPECIALS / "tokenizer.json", dest, out / "tokenizer.json"):
    tok = tokenizer_lib.load_tokenizer(path)
    added = {str(i): t.__getstate__() for i, t in sorted(tok.tok.get_added_tokens_decoder().items())}
    assert (tok.vocab_size, added) == (want["len"], want["added_tokens"]), path  # the same ids and flags
    for case in want["cases"]:
      assert tok.encode(case["text"]) == case["ids"], case["text"]
      assert tok.decode(case["ids"]) == case["decoded"], case["text"]
      assert tok.tok.decode(case["ids"], skip_special_tokens=True) == case["decoded_skip_special"], case["text"]
    assert tok.encode_batch([c["text"] for c in want["cases"]]) == [c["ids"] for c in want["cases"]]
  # <pad> is not in the vocabulary: transformers gives it a new id (385), which needs an embedding row.
  with pytest.raises(UserError, match=r"has 386 ids but config\.json's vocab_size is 385 \(.*'<pad>' from "
                                      r"\S*special_tokens_map\.json"):
    hf_in.import_tokenizer(str(CONFIG_SPECIALS), _config_specials_cfg(385), "gpt2", str(tmp_path), **QUIET)


# ----------------------------------------------------------------------------- export


@pytest.mark.parametrize("name", ALL)
def test_export_writes_the_original_tensors_and_reimports_bitwise(converted, name, tmp_path):
  workdir, cfg, _, params, _ = converted(name)
  out = tmp_path / "hf"
  convert.to_hf(workdir, str(out), **QUIET)
  original, exported = hf_tensors(FIXTURES / name), hf_tensors(out)
  assert sorted(exported) == sorted(original)
  for key, value in original.items():
    assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
  theirs = json.loads((FIXTURES / name / "config.json").read_text())
  ours = json.loads((out / "config.json").read_text())
  for key in ("model_type", "vocab_size", "n_layer", "num_hidden_layers", "num_key_value_heads", "decoder_layers",
              "activation_function", "pad_token_id", "eos_token_id", "decoder_start_token_id", "tie_word_embeddings"):
    assert ours.get(key) == theirs.get(key), key
  again = str(tmp_path / "w2")
  convert.from_hf(str(out), again, **QUIET)
  with checkpoint_lib.Checkpointer(again, async_save=False) as ckpt:
    reloaded, _ = ckpt.restore_params(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params))
  assert json.loads((pathlib.Path(again) / "config.json").read_text())["model"] == config_lib.to_dict(cfg)["model"]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), reloaded, params)


def test_bfloat16_checkpoints_stay_bfloat16_in_the_workdir_and_export_back(tmp_path):
  import ml_dtypes
  from safetensors.numpy import save_file
  source = tmp_path / "gpt2_bf16"
  shutil.copytree(FIXTURES / "gpt2", source)
  bf16 = {k: v.astype(ml_dtypes.bfloat16) for k, v in hf_tensors(source).items()}
  save_file(bf16, str(source / "model.safetensors"))
  workdir = str(tmp_path / "w")
  convert.from_hf(str(source), workdir, **QUIET)
  stored = ocp.StandardCheckpointHandler().metadata(epath.Path(workdir) / "checkpoints" / "0" / "state").tree
  assert {str(m.dtype) for m in jax.tree.leaves(stored)} == {"bfloat16"}  # half the bytes of float32
  _, _, params, _, _ = evaluate.load_run(workdir, **QUIET)
  embedding = np.asarray(params["embed"]["embedding"])
  assert embedding.dtype == np.float32  # restored as float32, widened exactly
  np.testing.assert_array_equal(embedding, bf16["transformer.wte.weight"].astype(np.float32))
  out = tmp_path / "out"
  convert.to_hf(workdir, str(out), dtype="bfloat16", **QUIET)
  exported = hf_tensors(out)
  assert sorted(exported) == sorted(bf16)
  for key, value in bf16.items():
    assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key


# ----------------------------------------------------------------------------- errors


def run_cli(capsys, *argv):
  try:
    convert.main(list(argv))
    code = 0
  except SystemExit as e:
    code = e.code
  return code, capsys.readouterr().err


def assert_one_line_error(capsys, pattern, *argv):
  code, err = run_cli(capsys, *argv)
  lines = err.strip().splitlines()
  assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
  assert re.search(pattern, lines[0]), lines[0]


def edited_copy(tmp_path, name, edit, copy_name=None):
  """A copy of a fixture (named `copy_name`, default `name`) whose config.json went through `edit(dict)`."""
  d = pathlib.Path(tempfile.mkdtemp(dir=tmp_path)) / (copy_name or name)
  shutil.copytree(FIXTURES / name, d)
  conf = json.loads((d / "config.json").read_text())
  edit(conf)
  (d / "config.json").write_text(json.dumps(conf))
  return str(d)


def test_unsupported_architectures_and_mismatched_files_are_one_line_errors(tmp_path, capsys):
  w = str(tmp_path / "w")
  assert_one_line_error(capsys, r"model_type 'bert' is not supported.*gpt2, llama, mixtral, marian",
                        "--from-hf", edited_copy(tmp_path, "gpt2", lambda c: c.update(model_type="bert")),
                        "--workdir", w)
  assert_one_line_error(capsys, r"has no tensor transformer\.h\.2\.ln_1\.weight",
                        "--from-hf", edited_copy(tmp_path, "gpt2", lambda c: c.update(n_layer=3)), "--workdir", w)
  assert_one_line_error(capsys, r"tensor\(s\) the config does not use, e\.g\. model\.layers\.1\.",
                        "--from-hf", edited_copy(tmp_path, "llama", lambda c: c.update(num_hidden_layers=1)),
                        "--workdir", w)
  assert_one_line_error(capsys, r"embed_tokens\.weight has shape \[400, 64\] but config\.json implies \[401, 64\]",
                        "--from-hf", edited_copy(tmp_path, "llama", lambda c: c.update(vocab_size=401)), "--workdir", w)
  assert_one_line_error(capsys, r"rope type='dynamic' is not supported.*default, linear, llama3, yarn",
                        "--from-hf", edited_copy(tmp_path, "llama", lambda c: c.update(
                            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})),
                        "--workdir", w)
  empty = tmp_path / "no_weights"
  empty.mkdir()
  shutil.copy(FIXTURES / "gpt2" / "config.json", empty)
  assert_one_line_error(capsys, r"has no \*\.safetensors weights", "--from-hf", str(empty), "--workdir", w)
  assert_one_line_error(capsys, r"config\.json not found", "--from-hf", str(tmp_path), "--workdir", w)
  assert_one_line_error(capsys, r"--from-hf needs --workdir", "--from-hf", str(FIXTURES / "gpt2"))
  assert not os.path.exists(w)  # nothing half-written
  assert run_cli(capsys, "--from-hf", str(FIXTURES / "gpt2"), "--workdir", w)[0] == 0
  assert_one_line_error(capsys, r"already holds a run", "--from-hf", str(FIXTURES / "gpt2"), "--workdir", w)
  assert_one_line_error(capsys, r"already holds a model", "--to-hf", w, "--out", str(FIXTURES / "gpt2"))


def test_null_token_ids_are_one_line_errors_until_given_by_flags(converted, tmp_path, capsys):
  """`"bos_token_id": null` / `"eos_token_id": null` (transformers' config of a model built from a bare
  config object) was a TypeError traceback in the config check."""
  w = str(tmp_path / "w")
  nulls = edited_copy(tmp_path, "gpt2", lambda c: c.update(bos_token_id=None, eos_token_id=None))
  assert_one_line_error(capsys, r"config\.json has eos_token_id null \(or absent\): give the id with --eos-id N",
                        "--from-hf", nulls, "--workdir", w)
  assert_one_line_error(capsys, r"has bos_token_id null .*--bos-id N", "--from-hf",
                        edited_copy(tmp_path, "llama", lambda c: c.update(bos_token_id=None)), "--workdir", w)
  assert_one_line_error(capsys, r"has decoder_start_token_id null .*--bos-id N", "--from-hf",
                        edited_copy(tmp_path, "marian", lambda c: c.update(decoder_start_token_id=None)),
                        "--workdir", w)
  assert not os.path.exists(w)
  _, cfg, _, params, _ = converted("gpt2")
  eos = cfg.model.eos_id
  assert run_cli(capsys, "--from-hf", nulls, "--workdir", w, "--eos-id", str(eos))[0] == 0
  got_cfg, _, got, _, _ = evaluate.load_run(w, **QUIET)
  assert (got_cfg.model.bos_id, got_cfg.model.eos_id, got_cfg.model.pad_id) == (eos, eos, eos)  # GPT-2: BOS = EOS
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, params)


def test_a_folder_without_tokenizer_imports_the_weights_with_a_warning(converted, tmp_path, capsys):
  """Users with their own tokenization have only the weights: import them, warn that eval/generate need a
  tokenizer, and take one with --tokenizer PATH (a file or a folder)."""
  bare = pathlib.Path(edited_copy(tmp_path, "gpt2", lambda c: None))
  for f in ("tokenizer.json", "tokenizer_config.json"):
    (bare / f).unlink()
  w = str(tmp_path / "w")
  code, err = run_cli(capsys, "--from-hf", str(bare), "--workdir", w)
  assert code == 0, err
  _, cfg, _, params, tok = converted("gpt2")
  with pytest.raises(UserError, match=r"tokenizer \S+tokenizer\.json is missing: eval and generate need"):
    evaluate.load_run(w, **QUIET)
  with_file, with_dir = str(tmp_path / "w2"), str(tmp_path / "w3")
  assert run_cli(capsys, "--from-hf", str(bare), "--workdir", with_file,
                 "--tokenizer", str(FIXTURES / "gpt2" / "tokenizer.json"))[0] == 0
  assert run_cli(capsys, "--from-hf", str(bare), "--workdir", with_dir, "--tokenizer", str(FIXTURES / "gpt2"))[0] == 0
  for workdir in (with_file, with_dir):
    _, _, got, got_tok, _ = evaluate.load_run(workdir, **QUIET)
    assert got_tok.encode("A man in") == tok.encode("A man in")
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, params)
  assert_one_line_error(capsys, r"--tokenizer \S+ holds no hf tokenizer", "--from-hf", str(bare), "--workdir",
                        str(tmp_path / "w4"), "--tokenizer", str(tmp_path))
  assert_one_line_error(capsys, r"--tokenizer \S+tokenizer\.model: expected a tokenizer\.json", "--from-hf",
                        str(bare), "--workdir", str(tmp_path / "w4"),
                        "--tokenizer", str(FIXTURES / "llama" / "tokenizer.model"))


def test_the_missing_tokenizer_warning_is_printed(tmp_path):
  bare = pathlib.Path(edited_copy(tmp_path, "gpt2", lambda c: None))
  (bare / "tokenizer.json").unlink()
  logs = []
  convert.from_hf(str(bare), str(tmp_path / "w"), log=logs.append)
  assert any(line.startswith(f"warning: {bare} has no tokenizer files: imported the weights only; eval.py and "
                             "jaxformer.generate need a tokenizer") for line in logs), logs


def test_a_model_without_an_exact_hf_equivalent_is_not_exported():
  # The paper's encoder-decoder interleaves its sinusoids; Marian's are in halves.
  with pytest.raises(UserError, match=r"model\.sinusoidal_layout='interleaved' has no Hugging Face marian equivalent"):
    convert.infer_model_type(config_lib.load_config("tiny_encdec"))
  assert convert.infer_model_type(config_lib.load_config("llama_tiny")) == "llama"
  assert convert.infer_model_type(config_lib.load_config("gpt2_tiny")) == "gpt2"


# ----------------------------------------------------------------------------- the workdir in use


def _fine_tuning_config(workdir, tmp_path, steps, *overrides):
  """A tiny fine-tuning run of the converted `workdir` on a repeated sentence at a real learning rate
  (the converted AdamW, constant 1e-2, clipped at 1), logging every step."""
  text = tmp_path / "text.txt"
  text.write_text(" ".join(["A man in an orange hat starring at something."] * 40) + "\n")
  return config_lib.load_config(os.path.join(workdir, "config.json"), [
      f"train.init_from={workdir}", f"data.text_path={text}", "data.block_size=16", "data.batch_size=2",
      f"train.num_steps={steps}", "train.log_every=1", f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
      "train.eval_batches=1", "train.sample_every_eval=false", "optim.learning_rate=1e-2", "model.dropout_rate=0",
      "model.attention_dropout_rate=0", *overrides])


def _logged(workdir, key="nll"):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [r[key] for r in map(json.loads, f) if key in r]


def _assert_every_leaf_moved(new, old):
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(new), jax.tree.leaves(old)):
    assert not np.array_equal(np.asarray(a), np.asarray(b)), f"{jax.tree_util.keystr(path)} did not change"


@pytest.mark.slow
def test_converted_workdirs_generate_translate_and_fine_tune(converted, tmp_path, capsys):
  # generate: Llama 3's prompt gets its BOS (data.add_bos) and decodes as transformers did.
  workdir, cfg, _, _, tok = converted("llama3")
  _, meta = expected("llama3")
  out = generate.main(["--workdir", workdir, "--prompt", "A man in", "--max-new-tokens", "8", "--temperature", "0"])
  assert out == [tok.decode(meta["greedy"][0])]
  # eval.py: beam search with the converted decode.* settings (hf penalty, suppress_pad) = generate()'s.
  workdir, cfg, _, _, tok = converted("marian")
  _, meta = expected("marian")
  (tmp_path / "src.txt").write_text("\n".join(meta["sources"]) + "\n")
  (tmp_path / "ref.txt").write_text("\n".join(meta["sources"]) + "\n")
  hyp = tmp_path / "hyp.txt"
  evaluate.main(["--workdir", workdir, f"data.test_src={tmp_path / 'src.txt'}", f"data.test_tgt={tmp_path / 'ref.txt'}",
                 "--out", str(hyp)])
  assert hyp.read_text().splitlines() == [tok.decode(b[0]) for b in meta["beams"]["default"]["sequences"]]
  # train.init_from: the imported params and tokenizer, a fresh optimizer; the loss of step 1 is the
  # imported model's (checked against a forward pass of the converted params), then it falls.
  workdir, cfg, model, params, tok = converted("gpt2")
  fine = str(tmp_path / "fine")
  ft_cfg = _fine_tuning_config(workdir, tmp_path, 6)
  result = train.train_and_evaluate(ft_cfg, fine, **QUIET)
  assert int(result["state"]["step"]) == 6 and os.path.isfile(os.path.join(fine, "tokenizer.json"))
  nll = _logged(fine)
  batch = result["task"].train_batch(0)
  logits = np.asarray(model.apply({"params": params}, jnp.asarray(batch["inputs"]), jnp.asarray(batch["segment_ids"]),
                                  jnp.asarray(batch["positions"])), np.float64)
  logp = logits - logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  first = -np.take_along_axis(logp, batch["targets"][..., None], -1).mean()
  assert nll[0] == pytest.approx(first, rel=1e-4)  # step 1 starts from the converted params
  assert len(nll) == 6 and nll[-1] < nll[0] - 1.0, nll  # a lost or zero update would not fall
  _assert_every_leaf_moved(result["state"]["params"], params)


def test_prepare_uses_a_converted_llama3_tokenizer_and_its_ids(converted, tmp_path, monkeypatch):
  """train.init_from copies the hf tokenizer.json before preparing; worker processes load it; every
  document is BOS + transformers' ids + EOS with Llama 3's ids (380, 381), and random windows start
  a segment after that EOS."""
  workdir, cfg, _, _, tok = converted("llama3")
  _, meta = expected("llama3")
  cases = [c for c in meta["tokenizer"] if "\n" not in c["text"]]
  (tmp_path / "docs.txt").write_text("".join(c["text"] + "\n" for c in cases) * 20)
  monkeypatch.setattr(prepare, "CHUNK_CHARS", 300)  # many chunks: two worker processes tokenize
  fine = str(tmp_path / "fine")
  ft_cfg = config_lib.load_config(os.path.join(workdir, "config.json"), [
      f"train.init_from={workdir}", f"data.text_path={tmp_path / 'docs.txt'}", "data.doc_per=line",
      "data.num_proc=2", "data.block_size=64", "data.batch_size=4"])
  assert (ft_cfg.model.bos_id, ft_cfg.model.eos_id, ft_cfg.data.add_bos) == (380, 381, True)
  with pytest.raises(UserError, match=r"^hf tokenizer \S+/tokenizer\.json not found: it comes with a converted model"):
    tasks.LMTask(ft_cfg, str(tmp_path / "no_tokenizer"), **QUIET)  # never trained: one line
  os.makedirs(fine)
  train.copy_init_tokenizer(ft_cfg, fine, **QUIET)
  task = tasks.LMTask(ft_cfg, fine, **QUIET)
  want = sorted([tuple([380] + c["ids"] + [381]) for c in cases] * 20)
  got = [tuple(doc.tolist()) for split in ("train", "val")
         for doc in shards.TokenStream(task.data_dir, split, "text").documents()]
  assert sorted(got) == want and len(shards.read_manifest(task.data_dir)["splits"]["val"]["shards"]) == 1
  batch = task.train_batch(0)
  eos_inside = batch["inputs"][:, :-1] == 381
  assert eos_inside.any() and batch["segment_ids"].max() > 1
  new = np.zeros(batch["inputs"].shape, bool)
  new[:, 1:] = eos_inside
  np.testing.assert_array_equal(batch["segment_ids"], 1 + np.cumsum(new, axis=1))
  assert (batch["inputs"][new] == 380).all()  # each new segment starts with its document's BOS
  # With a shared data.data_dir the tokenizer goes there, next to the data it makes (from W's own place).
  shared = config_lib.replace(ft_cfg, **{"data.data_dir": str(tmp_path / "shared")})
  train.copy_init_tokenizer(shared, str(tmp_path / "other"), **QUIET)
  assert (tmp_path / "shared" / "tokenizer.json").read_bytes() == pathlib.Path(workdir, "tokenizer.json").read_bytes()


def test_marian_translation_data_is_prepared_with_its_target_side(converted, tmp_path, monkeypatch):
  """A converted Marian model's fine-tuning data: sources split by source.spm and targets by
  target.spm (as transformers' text_target), by two worker processes; batches pad with 261, end
  in EOS 0 and start the decoder with 261, also when a process reads only its half of the rows."""
  workdir, cfg, _, _, tok = converted("marian")
  _, meta = expected("marian")
  cases = [c for c in meta["tokenizer"] if "\n" not in c["text"]]
  n = len(cases) * len(meta["targets"]) * 4
  src = [cases[i % len(cases)] for i in range(n)]
  tgt = [(meta["targets"][i % 2], meta["target_ids"][i % 2]) for i in range(n)]
  (tmp_path / "train.en").write_text("".join(c["text"] + "\n" for c in src))
  (tmp_path / "train.de").write_text("".join(t + "\n" for t, _ in tgt))
  monkeypatch.setattr(prepare, "CHUNK_CHARS", 300)
  fine = str(tmp_path / "fine")
  overrides = [f"train.init_from={workdir}", "data.source=local", f"data.train_src={tmp_path / 'train.en'}",
               f"data.train_tgt={tmp_path / 'train.de'}", "data.num_proc=2", "data.batch_multiple=1"]
  ft_cfg = config_lib.load_config(os.path.join(workdir, "config.json"), overrides)
  assert (ft_cfg.model.pad_id, ft_cfg.model.bos_id, ft_cfg.model.eos_id) == (261, 261, 0)
  assert ft_cfg.data.tokenizer == "marian"
  os.makedirs(fine)
  train.copy_init_tokenizer(ft_cfg, fine, **QUIET)
  task = tasks.TranslationTask(ft_cfg, fine, batch_multiple=2, **QUIET)
  source_ids, target_ids = task.ids["train"]
  for i in range(n):  # transformers' ids end in </s>; the shards hold none (the batcher adds it)
    assert source_ids[i].tolist() == src[i]["ids"][:-1] and target_ids[i].tolist() == tgt[i][1][:-1], i
  rows = np.arange(len(cases) * 2)
  batch = task.train.make_batch(rows)
  for r in rows:
    s, t = src[r]["ids"], tgt[r][1]
    assert batch["inputs"][r].tolist() == s + [261] * (batch["inputs"].shape[1] - len(s))
    assert batch["targets"][r].tolist() == t + [261] * (batch["targets"].shape[1] - len(t))
    assert batch["decoder_inputs"][r].tolist() == [261] + t[:-1] + [261] * (batch["targets"].shape[1] - len(t))
  half = tasks.TranslationTask(ft_cfg, fine, batch_multiple=2, part=(1, 2, 2), **QUIET).train.make_batch(rows)
  for key, value in batch.items():
    np.testing.assert_array_equal(half[key][len(rows) // 2:], value[len(rows) // 2:], err_msg=key)


def test_fine_tuning_with_scanned_layers_and_exporting_it(converted, tmp_path):
  """A converted (per-layer) checkpoint fine-tunes with model.scan_layers=true (train.init_from stacks
  its layers): the loss falls and every weight moves; the scanned run exports to HF's per-layer tensor
  names, and importing that export gives back the fine-tuned params bit for bit."""
  workdir, cfg, _, params, _ = converted("llama")
  fine = str(tmp_path / "fine")
  ft_cfg = _fine_tuning_config(workdir, tmp_path, 4, "model.scan_layers=true")
  result = train.train_and_evaluate(ft_cfg, fine, **QUIET)
  assert "layers" in result["state"]["params"]["decoder"]
  nll = _logged(fine)
  assert len(nll) == 4 and nll[-1] < nll[0] - 0.5, nll
  tuned = model_lib.convert_layers(jax.device_get(result["state"]["params"]), False)  # per-layer, as imported
  _assert_every_leaf_moved(tuned, params)
  out = tmp_path / "hf"
  convert.to_hf(fine, str(out), **QUIET)
  assert sorted(hf_tensors(out)) == sorted(hf_tensors(FIXTURES / "llama"))
  back = str(tmp_path / "back")
  convert.from_hf(str(out), back, **QUIET)
  reimported = evaluate.load_run(back, **QUIET)[2]
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), reimported, tuned)
