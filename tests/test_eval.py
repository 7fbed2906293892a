"""Tests for eval.py: scoring mode, decoding a run, checkpoint averaging, errors, perplexity."""

import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import sacrebleu

from jaxformer import checkpoint as checkpoint_lib
from jaxformer import evaluate
from jaxformer import model as model_lib
from jaxformer import tasks
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.config import load_config
from jaxformer.errors import UserError
from conftest import window_by_window_nll

ROOT = pathlib.Path(__file__).resolve().parent.parent
HYPS = ["the cat sat on the mat .", "a dog is running in the park", "hello world"]
REFS = ["the cat sat on the mat .", "a dog runs in the park", "hello there world"]


def bleu_of(text):
  """The sacreBLEU score printed by `bleu.format_scores`."""
  return float(re.search(r"sacreBLEU\s+BLEU\|\S+ = ([\d.]+)", text).group(1))


def run_eval(capsys, *argv):
  """`eval.py argv` in-process -> (exit code, stdout, stderr, return value)."""
  try:
    value, code = evaluate.main(list(argv)), 0
  except SystemExit as e:
    value, code = None, e.code
  out, err = capsys.readouterr()
  return code, out, err, value


def assert_user_error(capsys, expected, *argv):
  code, _, err, _ = run_eval(capsys, *argv)
  assert code == 2, err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
  assert re.search(expected, lines[0]), lines[0]


def test_scoring_mode_cli(tmp_path):
  (tmp_path / "hyp.txt").write_text("\n".join(HYPS) + "\n")
  (tmp_path / "ref.txt").write_text("\n".join(REFS) + "\n")
  proc = subprocess.run([sys.executable, str(ROOT / "eval.py"), "--hyp", str(tmp_path / "hyp.txt"),
                         "--ref", str(tmp_path / "ref.txt")], capture_output=True, text=True, timeout=120,
                        env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert proc.returncode == 0, proc.stderr
  expected = sacrebleu.corpus_bleu(HYPS, [REFS]).score
  assert 0 < expected < 100
  assert bleu_of(proc.stdout) == pytest.approx(expected, abs=0.006)
  assert "segments   3" in proc.stdout


def test_scoring_mode_errors(tmp_path, capsys):
  (tmp_path / "hyp.txt").write_text("\n".join(HYPS[:2]) + "\n")
  (tmp_path / "ref.txt").write_text("\n".join(REFS) + "\n")
  assert_user_error(capsys, r"has 2 lines but .* has 3", "--hyp", str(tmp_path / "hyp.txt"),
                    "--ref", str(tmp_path / "ref.txt"))
  assert_user_error(capsys, "needs both", "--hyp", str(tmp_path / "hyp.txt"))
  assert_user_error(capsys, "file not found", "--hyp", str(tmp_path / "nope.txt"), "--ref", str(tmp_path / "ref.txt"))


@pytest.mark.slow
def test_decode_a_run(tiny_run, tmp_path, capsys):
  workdir, cfg, _ = tiny_run
  out = tmp_path / "test.hyp.txt"
  code, stdout, err, scores = run_eval(capsys, "--workdir", workdir, "--split", "test", "--limit", "20",
                                       "--beam", "2", "--out", str(out))
  assert code == 0, err
  hyps = out.read_text(encoding="utf-8").split("\n")
  assert len(hyps) == 21 and hyps[-1] == ""  # 20 lines, each ending in a newline
  refs = tasks.load_translation_splits(cfg)["test"][1][:20]
  expected = sacrebleu.corpus_bleu(hyps[:20], [refs]).score
  assert scores["segments"] == 20 and scores["sacrebleu"]["bleu"] == pytest.approx(expected, abs=1e-6)
  assert bleu_of(stdout) == pytest.approx(expected, abs=0.006)
  assert "restored step 8" in stdout and f"hypotheses: {out}" in stdout


def test_average_last_is_the_mean_of_the_checkpoints(tiny_run, capsys):
  workdir, cfg, result = tiny_run
  _, shapes = evaluate.abstract_params(cfg)
  with checkpoint_lib.Checkpointer(workdir, max_to_keep=None, async_save=False) as ckpt:
    assert ckpt.all_steps() == [4, 8]
    p4, meta4 = ckpt.restore_params(shapes, step=4)
    p8, meta8 = ckpt.restore_params(shapes, step=8)
  assert (meta4["step"], meta8["step"]) == (4, 8)
  # The last checkpoint holds the params the run ended with.
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(p8), jax.device_get(result["state"]["params"]))
  _, _, averaged, _, meta = evaluate.load_run(workdir, average_last=2, log=print)
  assert "averaged the last 2 checkpoints: steps [4, 8]" in capsys.readouterr().out
  assert meta["step"] == 8
  for a, x, y in zip(jax.tree.leaves(averaged), jax.tree.leaves(p4), jax.tree.leaves(p8)):
    np.testing.assert_allclose(np.asarray(a), (np.asarray(x, np.float64) + np.asarray(y)) / 2, rtol=1e-6, atol=1e-7)
  assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(p4), jax.tree.leaves(p8)))
  assert_user_error(capsys, r"cannot average the last 3 checkpoints", "--workdir", workdir, "--average-last", "3")
  # --average-last K --step S: the K checkpoints ending at S (the issue: S was ignored)
  _, _, same, _, meta = evaluate.load_run(workdir, average_last=2, step=8, log=lambda *a: None)
  assert meta["step"] == 8
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(same), jax.device_get(averaged))
  assert_user_error(capsys, r"cannot average the last 2 checkpoints ending at step 4: .* has 1 \(\[4\]\)",
                    "--workdir", workdir, "--average-last", "2", "--step", "4")
  assert_user_error(capsys, r"ending at step 6: .* has no step 6", "--workdir", workdir, "--average-last", "2",
                    "--step", "6")


def test_missing_run_errors(tiny_run, tmp_path, capsys):
  workdir, _, _ = tiny_run
  assert_user_error(capsys, "has no config.json", "--workdir", str(tmp_path / "missing"))
  (tmp_path / "empty").mkdir()
  assert_user_error(capsys, "has no config.json", "--workdir", str(tmp_path / "empty"))
  shutil.copy(os.path.join(workdir, "config.json"), tmp_path / "empty" / "config.json")
  assert_user_error(capsys, "no checkpoint in", "--workdir", str(tmp_path / "empty"))
  assert_user_error(capsys, r"no checkpoint for step 5 .*\[4, 8\]", "--workdir", workdir, "--step", "5")
  assert_user_error(capsys, "give --workdir")


def test_a_run_saved_by_an_older_version_still_evaluates(tiny_run, tmp_path, capsys):
  """Its config.json may hold a key this version lacks, or a setting older versions accepted and this
  one refuses (optim.weight_decay with Adam, silently ignored then): warnings, and the run evaluates;
  a bad override is still an error."""
  workdir = tmp_path / "old"
  shutil.copytree(tiny_run[0], workdir)
  saved = json.loads((workdir / "config.json").read_text())
  saved["optim"].update(optimizer="adam", weight_decay=0.1)
  saved["train"]["removed_knob"] = 1
  (workdir / "config.json").write_text(json.dumps(saved))
  cfg = evaluate.load_run(str(workdir), log=lambda *a: None, overrides=["decode.alpha=1.0"])[0]
  assert cfg.decode.alpha == 1.0 and cfg.optim.weight_decay == 0.1
  err = capsys.readouterr().err
  assert "skipping unknown config key 'train.removed_knob'" in err
  assert "optim.weight_decay=0.1 needs optim.optimizer=adamw" in err and "evaluating anyway" in err
  with pytest.raises(UserError, match="decode.beam_size=0 must be at least 1"):
    evaluate.load_run(str(workdir), log=lambda *a: None, overrides=["decode.beam_size=0"])
  # A run trained on a TPU with splash attention evaluates here: the kernel is a speed setting.
  saved["model"]["attention_impl"] = "splash"
  (workdir / "config.json").write_text(json.dumps(saved))
  capsys.readouterr()
  cfg = evaluate.load_run(str(workdir), log=lambda *a: None)[0]
  assert cfg.model.attention_impl == "auto"
  assert "attention_impl=splash runs on TPU only" in capsys.readouterr().err


def test_replaced_tokenizer_is_detected(tiny_run, tmp_path, capsys):
  workdir, cfg, _ = tiny_run
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy)
  with checkpoint_lib.Checkpointer(copy, max_to_keep=None, async_save=False) as ckpt:
    _, meta = ckpt.restore_params(evaluate.abstract_params(cfg)[1])
  assert meta["tokenizer_sha256"] == evaluate.file_sha256(str(copy / "tokenizer.model"))
  # Another tokenizer with the same vocabulary size, trained on other text.
  other = tmp_path / "other" / "tokenizer.model"
  tokenizer_lib.train_sentencepiece([f"line {i} of some other text, quite unlike numbers" for i in range(200)],
                                    64, str(other))
  shutil.copy(other, copy / "tokenizer.model")
  assert_user_error(capsys, r"tokenizer .* is not the one checkpoint step 8 was trained with",
                    "--workdir", str(copy), "--limit", "2", "--beam", "1")
  (copy / "tokenizer.model").unlink()
  assert_user_error(capsys, r"tokenizer .* is missing", "--workdir", str(copy), "--limit", "2")


def test_checkpoint_config_mismatch_is_detected(tiny_run, tmp_path, capsys):
  workdir, _, _ = tiny_run
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy)
  cfg = json.loads((copy / "config.json").read_text())
  assert cfg["model"]["d_model"] == 32
  cfg["model"]["d_model"] = 48
  (copy / "config.json").write_text(json.dumps(cfg))
  assert_user_error(capsys, r"checkpoint has params/\S+ \[[\d, ]+\] but the config builds \[[\d, ]+\]: "
                    "was it trained with another config", "--workdir", str(copy), "--limit", "2")


def test_damaged_checkpoints_are_refused(tiny_run, tmp_path, capsys):
  """A checkpoint whose params do not match their checksums, or that cannot be read: one line, for
  the latest, for --average-last and for --step (eval never decodes with numbers that fail the check)."""
  workdir, _, _ = tiny_run
  copy = tmp_path / "run"
  shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("tb"))
  meta_path = copy / "checkpoints" / "8" / "meta" / "metadata"
  meta = json.loads(meta_path.read_text())
  name = sorted(k for k in meta["checksums"]["arrays"] if k.startswith("params/"))[0]
  meta["checksums"]["arrays"][name] = "0" * 16  # as if that array had changed on disk
  meta_path.write_text(json.dumps(meta))
  damaged = rf"checkpoint {copy}/checkpoints/8 is damaged: {name} does not match its checksum"
  assert_user_error(capsys, damaged, "--workdir", str(copy), "--limit", "1", "--beam", "1")
  assert_user_error(capsys, damaged, "--workdir", str(copy), "--average-last", "2", "--limit", "1")
  os.truncate(copy / "checkpoints" / "4" / "meta" / "metadata", 50)
  assert_user_error(capsys, rf"checkpoint {copy}/checkpoints/4 is damaged: cannot read it \(JSONDecodeError",
                    "--workdir", str(copy), "--step", "4", "--limit", "1")


def lm_setup(text):
  cfg = load_config("gpt2_tiny")
  tok = tokenizer_lib.CharTokenizer.train([text])
  model = model_lib.build_model(cfg.model)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
  rng = np.random.default_rng(0)  # random params without compiling an init
  params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype), nn.unbox(shapes))
  return cfg, tok, model, params


TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\nAll: Speak, speak.\n" * 2


def test_perplexity_of_a_uniform_model_is_the_vocabulary_size():
  cfg, tok, model, params = lm_setup(TEXT)
  params = {**params, "embed": {"embedding": jnp.zeros_like(params["embed"]["embedding"])}}  # tied: logits 0
  result = evaluate.perplexity(model, params, tok, TEXT, block_size=cfg.data.block_size, batch_size=2)
  vocab = cfg.model.vocab_size
  assert result["tokens"] == len(tok.encode(TEXT)) - 1
  np.testing.assert_allclose(result["ppl_per_token"], vocab, rtol=1e-5)
  np.testing.assert_allclose(result["bits_per_char"], result["tokens"] * math.log2(vocab) / len(TEXT), rtol=1e-5)


def test_perplexity_matches_a_window_by_window_computation():
  """Non-overlapping windows of block_size, padding ignored: recomputed one window at a time."""
  cfg, tok, model, params = lm_setup(TEXT)
  block = cfg.data.block_size
  result = evaluate.perplexity(model, params, tok, TEXT, block_size=block, batch_size=2)
  ids = np.asarray(tok.encode(TEXT))
  total = window_by_window_nll(model, params, ids, block)
  assert len(ids) - 1 > 3 * block and (len(ids) - 1) % block  # several windows, the last one partial
  np.testing.assert_allclose(result["nll_per_token"], total / (len(ids) - 1), rtol=1e-5)
  np.testing.assert_allclose(result["ppl_per_char"], math.exp(total / len(TEXT)), rtol=1e-5)
