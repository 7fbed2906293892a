"""Prepared data on disk as resources: damaged shards, open files, streamed single documents and texts."""

import math
import os
import pathlib
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import config as config_lib
from jaxformer import data
from jaxformer import evaluate
from jaxformer import model as model_lib
from jaxformer import prepare
from jaxformer import shards
from jaxformer import sources
from jaxformer import tasks
from jaxformer import tokenizer as tokenizer_lib
from jaxformer import train
from conftest import window_by_window_nll
from jaxformer.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS = "the cat dog sat on a mat and ran to big red house of king queen".split()
QUIET = lambda *a, **k: None


def _docs(n, seed=0, max_words=30):
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, rng.integers(0, max_words))) for _ in range(n)]


def _lm_config(*overrides):
  return config_lib.load_config("gpt2_tiny", ["model.vocab_size=300", "data.num_proc=1", *overrides])


@pytest.fixture(name="prepared")
def _prepared(tmp_path):
  """(cfg, workdir, data dir) of a multi-shard char corpus, a document per line."""
  (tmp_path / "c.txt").write_text("\n".join(_docs(400)) + "\n")
  cfg = _lm_config(f"data.text_path={tmp_path / 'c.txt'}", "data.doc_per=line", "data.tokenizer=char",
                   "data.shard_tokens=500")
  workdir = str(tmp_path / "run")
  prepare.ensure_prepared(cfg, workdir, log=QUIET)
  return cfg, workdir, os.path.join(workdir, "data")


# ------------------------------------------------------------------ damaged shards


def test_a_truncated_or_deleted_shard_is_one_line_naming_it(prepared):
  cfg, workdir, ddir = prepared
  path = os.path.join(ddir, "train", "shard-00002.text.bin")
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) - 6)
  with pytest.raises(UserError, match=r"shard-00002\.text\.bin has [\d,]+ bytes, its manifest says [\d,]+: .* "
                                      r"delete .*shard-00002\.json and .*manifest\.json, then run "
                                      r"python -m jaxformer\.prepare"):
    tasks.LMTask(cfg, workdir, log=QUIET)
  os.remove(path)
  with pytest.raises(UserError, match=r"shard-00002\.text\.bin is missing"):
    shards.TokenStream(ddir, "train", "text")
  # The advice works: the shards before it are kept, the rest prepared again, identical.
  before = {n: open(os.path.join(ddir, "train", n), "rb").read() for n in os.listdir(os.path.join(ddir, "train"))}
  os.remove(os.path.join(ddir, "train", "shard-00002.json"))
  os.remove(os.path.join(ddir, "manifest.json"))
  prepare.ensure_prepared(cfg, workdir, log=QUIET)
  after = {n: open(os.path.join(ddir, "train", n), "rb").read() for n in os.listdir(os.path.join(ddir, "train"))}
  assert {n: v for n, v in after.items() if "00002.text.bin" not in n and "00002.json" not in n} == \
         {n: v for n, v in before.items() if "00002.json" not in n}
  assert tasks.LMTask(cfg, workdir, log=QUIET).train_batch(0)["inputs"].shape == (cfg.data.batch_size,
                                                                                   cfg.data.block_size)


def test_prepare_verify_checks_every_sha256(prepared, capsys):
  cfg, workdir, ddir = prepared
  args = ["--config", "gpt2_tiny", "--workdir", workdir, "--verify", *[f"{k}={v}" for k, v in (
      ("model.vocab_size", 300), ("data.text_path", cfg.data.text_path), ("data.doc_per", "line"),
      ("data.tokenizer", "char"), ("data.shard_tokens", 500))]]
  prepare.main(args)
  manifest = shards.read_manifest(ddir)
  files = sum(len(s["sha256"]) for split in manifest["splits"].values() for s in split["shards"])
  assert f"the sha256 of all {files} shard files match the manifest" in capsys.readouterr().out
  path = os.path.join(ddir, "val", "shard-00001.text.bin")
  data_bytes = bytearray(open(path, "rb").read())
  data_bytes[3] ^= 1  # same size: only the hash can tell
  open(path, "wb").write(bytes(data_bytes))
  shards.TokenStream(ddir, "val", "text")  # the cheap check on open passes
  with pytest.raises(SystemExit) as e:
    prepare.main(args)
  err = capsys.readouterr().err
  assert e.value.code == 2 and len(err.strip().splitlines()) == 1
  assert "val/shard-00001.text.bin has sha256" in err and "delete" in err and "shard-00001.json" in err


# ------------------------------------------------------------------ open files


def _open_fds():
  return len(os.listdir("/proc/self/fd"))


def test_readers_open_shards_lazily_boundedly_and_close(prepared, monkeypatch):
  _, _, ddir = prepared
  monkeypatch.setattr(shards, "MAX_OPEN", 2)
  n_shards = len(shards.read_manifest(ddir)["splits"]["train"]["shards"])
  assert n_shards >= 6
  base = _open_fds()
  stream = shards.TokenStream(ddir, "train", "text")
  assert _open_fds() == base  # nothing opened before a read
  everything = stream.read(0, len(stream))  # touches every shard
  starts = np.arange(0, len(stream) - 8, 97)
  stream.segments(starts, 8)
  assert base < _open_fds() <= base + 2 * 2  # a descriptor and a map per open shard, two shards at most
  stream.close()
  assert _open_fds() == base
  np.testing.assert_array_equal(stream.read(0, len(stream)), everything)  # reopens after close
  stream.close()
  with shards.RaggedShards(ddir, "train", "text") as ragged:
    assert len(ragged) == stream.num_docs and _open_fds() <= base + 2 * 2
  assert _open_fds() == base


_EXIT_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
from jaxformer import config, tasks
cfg = config.load_config("gpt2_tiny", ["model.vocab_size=300", "data.num_proc=1", "data.tokenizer=char",
                                       "data.doc_per=line", "data.text_path=" + sys.argv[2]])
task = tasks.LMTask(cfg, sys.argv[3], log=lambda *a: None)
batch = task.train_batch(0)
"""


def test_a_script_that_builds_a_task_exits_silently(tmp_path):
  (tmp_path / "c.txt").write_text("\n".join(_docs(200)) + "\n")
  proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(ROOT), str(tmp_path / "c.txt"), str(tmp_path / "w")],
                        capture_output=True, text=True, timeout=120, check=False)
  assert proc.returncode == 0 and proc.stderr == "", proc.stderr


# ------------------------------------------------------------------ one big document, streamed


def _single_file_reference(path, fraction):
  """The one-file document as it was read before streaming: whole, split at a character."""
  text = "\n".join(data.read_lines(path)) + "\n"
  n = int(len(text) * fraction)
  return text[:n], text[n:]


@pytest.mark.parametrize("add_bos", [False, True])
def test_a_one_file_document_streamed_in_pieces_is_the_whole_document(tmp_path, monkeypatch, add_bos):
  """Pieces of 64 bytes (hundreds of them, the split point inside one): the same tokens, one document per
  split, the same validation text, as reading the file whole."""
  (tmp_path / "t.txt").write_text("\ufeff" + "\r\n".join(_docs(300, seed=3)) + "\nthe cat sat on a mat")
  monkeypatch.setattr(sources, "PIECE_BYTES", 64)
  cfg = _lm_config(f"data.text_path={tmp_path / 't.txt'}", "data.tokenizer=char", "data.train_fraction=0.83",
                   f"data.add_bos={str(add_bos).lower()}")
  task = tasks.LMTask(cfg, str(tmp_path / "run"), log=QUIET)
  train_text, val_text = _single_file_reference(tmp_path / "t.txt", 0.83)
  tok = tokenizer_lib.CharTokenizer.train([train_text])
  assert task.tokenizer.chars == tok.chars
  bos = [task.tokenizer.bos_id] if add_bos else []
  for stream, text in ((task.train_stream, train_text), (task.val_stream, val_text)):
    docs = list(stream.documents())
    assert len(docs) == 1
    np.testing.assert_array_equal(docs[0], bos + tok.encode(text))
  assert task.val_text == val_text
  manifest = shards.read_manifest(os.path.join(tmp_path, "run", "data"))
  assert [s["docs"] for s in manifest["splits"]["train"]["shards"]] == [1]
  assert manifest["splits"]["train"]["shards"][0]["end"] > 100  # it did come in pieces


def test_document_blocks_join_to_the_normalized_document(tmp_path):
  content = "\ufeffa\r\nb\rc\n\n\ufeffd\r" + "x" * 500 + "\n" + "é" * 300
  (tmp_path / "f.txt").write_text(content, newline="")
  for block_size in (1, 5, 64, 1 << 20):
    blocks = list(sources.document_blocks(str(tmp_path / "f.txt"), block_size))
    assert "".join(blocks) == sources.normalize_document(content)
    assert all(b.endswith("\n") for b in blocks)


# ------------------------------------------------------------------ perplexity in blocks


def _lm_setup(text):
  cfg = config_lib.load_config("gpt2_tiny")
  tok = tokenizer_lib.CharTokenizer.train([text])
  model = model_lib.build_model(cfg.model)
  shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: jnp.asarray(rng.normal(0.0, 0.3, s.shape), s.dtype), nn.unbox(shapes))
  return cfg, tok, model, params


def test_perplexity_of_a_file_in_blocks_equals_the_whole_text(tmp_path):
  """eval.py --text reads the file a block of lines at a time: the same windows, the same result as
  scoring the whole text (`"\\n".join(read_lines) + "\\n"`, as before), checked against a numpy
  window-by-window reference."""
  text = "".join(f"{d}\n" for d in _docs(40, seed=7))
  (tmp_path / "t.txt").write_text(text)
  cfg, tok, model, params = _lm_setup(text)
  block = cfg.data.block_size
  whole = evaluate.perplexity(model, params, tok, "\n".join(data.read_lines(tmp_path / "t.txt")) + "\n", block, 2)
  for block_size in (16, 200):
    blocks = sources.document_blocks(str(tmp_path / "t.txt"), block_size)
    assert evaluate.perplexity(model, params, tok, blocks, block, 2) == whole
  ids = np.asarray(tok.encode(text))
  total = window_by_window_nll(model, params, ids, block)
  assert (len(ids) - 1) > 4 * block
  assert whole["tokens"] == len(ids) - 1 and whole["chars"] == len(text) and whole["words"] == len(text.split())
  np.testing.assert_allclose(whole["nll_per_token"], total / (len(ids) - 1), rtol=1e-5)
  np.testing.assert_allclose(whole["ppl_per_char"], math.exp(total / len(text)), rtol=1e-5)


# ------------------------------------------------------------------ the training sample's prompt


def test_the_default_sample_prompt_is_one_the_tokenizer_encodes(monkeypatch):
  """A char vocabulary without "\\n" (data.doc_per=line) samples from BOS; with one, from "\\n"."""
  fed = []
  real = train.decode.generate
  monkeypatch.setattr(train.decode, "generate", lambda model, params, prompts, *a, **k: (
      fed.append(prompts), real(model, params, prompts, *a, **k))[1])
  for chars, want in (("abc de", lambda t: [t.bos_id]), ("abc de\n", lambda t: t.encode("\n"))):
    tokenizer = tokenizer_lib.CharTokenizer(chars)
    cfg = config_lib.load_config("gpt2_tiny", ["model.max_len=16", "data.block_size=16", f"model.vocab_size={tokenizer.vocab_size}"])
    model = model_lib.build_model(cfg.model)
    params = jax.jit(model.init)(jax.random.key(0), jnp.ones((1, 8), jnp.int32))["params"]
    text = train.sample_text(model, params, tokenizer, cfg, step=1, max_new_tokens=4)
    assert fed[-1] == [want(tokenizer)] and isinstance(text, str)


_PREPARE_HWM = r"""
import sys
sys.path.insert(0, sys.argv[1])
from jaxformer import prepare
prepare.main(["--config", "shakespeare_char", "--workdir", sys.argv[3], "data.text_path=" + sys.argv[2],
              "data.num_proc=1"])
print([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])
"""


@pytest.mark.slow
def test_preparing_one_big_file_does_not_grow_memory_with_it(tmp_path):
  """VmHWM of `prepare` (in its own process, tokenizing in it) on one 4 MB and one 16 MB file: reading
  the document whole grew it ~13x the file (92 -> 262 MiB here); streamed, 66 -> 69 MiB."""
  line = " ".join(WORDS) + "\n"
  peaks = []
  for mb in (4, 16):
    path = tmp_path / f"t{mb}.txt"
    path.write_text(line * (mb * 2**20 // len(line)))
    proc = subprocess.run([sys.executable, "-c", _PREPARE_HWM, str(ROOT), str(path), str(tmp_path / f"run{mb}")],
                          capture_output=True, text=True, timeout=300, check=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    peaks.append(int(proc.stdout.split()[-1]) / 1024)  # MiB
  assert peaks[1] - peaks[0] < 8, peaks  # the file grew by 12 MiB


@pytest.mark.slow
def test_eval_text_streams_the_file_and_scores_as_the_whole_text(tmp_path, capsys):
  """`eval.py --workdir W --text FILE` on a trained char LM: the result of scoring the whole text."""
  (tmp_path / "train.txt").write_text("\n".join(_docs(200, seed=1)) + "\n")
  cfg = config_lib.load_config("gpt2_tiny", [f"data.text_path={tmp_path / 'train.txt'}", "model.num_layers=1",
                                             "train.num_steps=2", "train.checkpoint_every=2", "train.eval_every=1000",
                                             "train.sample_every_eval=false"])
  train.train_and_evaluate(cfg, str(tmp_path / "run"), log=QUIET)
  text = "".join(f"{d}\r\n" for d in _docs(30, seed=2))  # CRLF: read as read_lines reads it
  (tmp_path / "t.txt").write_text(text, newline="")
  got = evaluate.main(["--workdir", str(tmp_path / "run"), "--text", str(tmp_path / "t.txt")])
  assert f"{tmp_path / 't.txt'}:\nperplexity per token" in capsys.readouterr().out
  cfg, model, params, tokenizer, _ = evaluate.load_run(str(tmp_path / "run"), log=QUIET)
  assert got == evaluate.perplexity(model, params, tokenizer, text.replace("\r\n", "\n"), cfg.data.block_size)
  (tmp_path / "empty.txt").write_text("  \n")
  for path, message in ((tmp_path / "empty.txt", "file is empty"), (tmp_path / "nope.txt", "file not found")):
    with pytest.raises(SystemExit):
      evaluate.main(["--workdir", str(tmp_path / "run"), "--text", str(path)])
    assert capsys.readouterr().err == f"error: {path}: {message}\n"
