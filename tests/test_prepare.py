"""Prepared data: shards and manifest, memory-mapped batches, packing, resuming, refusals."""

import gzip
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import config as config_lib
from jaxformer import data
from jaxformer import layers
from jaxformer import model as model_lib
from jaxformer import prepare
from jaxformer import shards
from jaxformer import sources
from jaxformer import tasks
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.errors import UserError

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = pathlib.Path(os.environ.get("JAXFORMER_DATA", ROOT / ".." / "shared" / "data")).resolve()
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"
WORDS = "the cat dog sat on a mat and ran to big red house of king queen".split()
QUIET = lambda *a, **k: None


def _docs(n, seed=0, max_words=30):
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(WORDS, rng.integers(0, max_words))) for _ in range(n)]


def _lm_config(*overrides, base="gpt2_tiny"):
  return config_lib.load_config(base, ["model.vocab_size=300", "data.num_proc=1", *overrides])


def _tree_digest(folder):
  """sha256 of every file under `folder` (relative path -> hex), the lock file aside."""
  out = {}
  for dirpath, _, names in os.walk(folder):
    for name in names:
      if name != ".lock":
        path = os.path.join(dirpath, name)
        out[os.path.relpath(path, folder)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
  return out


# ------------------------------------------------------------- shards = tokenization


@pytest.mark.parametrize("kind", ["char", "byte", "sentencepiece"])
def test_shards_and_manifest_equal_in_memory_tokenization(tmp_path, kind):
  docs = _docs(400)
  (tmp_path / "corpus.txt").write_text("\n".join(docs) + "\n")
  cfg = _lm_config(f"data.text_path={tmp_path / 'corpus.txt'}", "data.doc_per=line", f"data.tokenizer={kind}",
                   "data.shard_tokens=500", "data.train_fraction=0.8")
  manifest = prepare.ensure_prepared(cfg, str(tmp_path / "run"), log=QUIET)
  tok = tokenizer_lib.load_tokenizer(prepare.tokenizer_path(cfg, str(tmp_path / "run")))
  # The split: each document by a seeded draw of its index, the same rule as prepare's.
  is_val = sources.val_draws(0.8)
  expected = {"train": [], "val": []}
  for i, doc in enumerate(docs):
    expected["val" if is_val(i) else "train"].append(np.array(tok.encode(doc) + [tokenizer_lib.EOS_ID]))
  assert 40 < len(expected["val"]) < 120  # ~20%
  ddir = str(tmp_path / "run" / "data")
  for split, want in expected.items():
    stream = shards.TokenStream(ddir, split, "text", manifest)
    got = list(stream.documents())
    assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
    flat = np.concatenate(want)
    np.testing.assert_array_equal(stream.read(0, len(stream)), flat)  # across shard boundaries
    info = manifest["splits"][split]
    assert info["tokens"]["text"] == len(flat) and info["docs"] == len(want)
    # Shards close at the first document boundary past shard_tokens.
    sizes = [s["tokens"]["text"] for s in info["shards"]]
    assert len(sizes) > 1 and all(s >= 500 for s in sizes[:-1]) and sum(sizes) == len(flat)
    for k, s in enumerate(info["shards"]):
      for name, digest in s["sha256"].items():
        path = os.path.join(ddir, split, name)
        assert hashlib.sha256(open(path, "rb").read()).hexdigest() == digest
  assert manifest["dtype"] == "uint16" and manifest["eos"] is True
  assert manifest["tokenizer"]["sha256"] == prepare.file_sha256(prepare.tokenizer_path(cfg, str(tmp_path / "run")))
  ragged = shards.RaggedShards(ddir, "train", "text", manifest)
  np.testing.assert_array_equal(ragged.lengths, [len(x) for x in expected["train"]])
  rows = ragged.gather(np.array([3, 0, 7]), 8)
  for row, i in zip(rows, (3, 0, 7)):
    want = expected["train"][i][:8]
    np.testing.assert_array_equal(row[:len(want)], want)
    assert not row[len(want):].any()


@pytest.mark.parametrize("content", [b"a", b"a\n", b"a\n\nb\n\n", b"\xef\xbb\xbfa\r\nb\rc\n\nd", b"x\n" * 5 + b"yyy",
                                     "gr\u00fc\u00dfe\n\u00df\u2028x\n".encode()])
def test_streamed_lines_are_read_lines(tmp_path, content):
  """Lines read a block at a time split exactly as data.read_lines (on "\\n" only), whatever the block size."""
  (tmp_path / "f.txt").write_bytes(content)
  for block_size in (1, 2, 3, 7, 1 << 20):
    assert list(sources.lines(str(tmp_path / "f.txt"), block_size)) == data.read_lines(tmp_path / "f.txt")
  (tmp_path / "bad.txt").write_bytes(b"ok\nfine\ngr\xfc\xdfe\nx\n")
  for block_size in (1, 4, 1 << 20):
    with pytest.raises(UserError, match=r"bad\.txt:3: not valid UTF-8"):
      list(sources.lines(str(tmp_path / "bad.txt"), block_size))


def test_uint32_when_the_vocabulary_needs_it():
  assert shards.token_dtype(65536) == np.uint16 and shards.token_dtype(65537) == np.uint32


def test_local_sources_globs_gzip_jsonl_and_doc_per_file(tmp_path):
  docs = _docs(30, seed=1)
  (tmp_path / "a").mkdir()
  for i in range(3):  # one document per file
    (tmp_path / "a" / f"{i}.txt").write_text(docs[i] + "\nsecond line\n")
  with gzip.open(tmp_path / "b.jsonl.gz", "wt") as f:
    f.writelines(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs))
  files = sources.local_files("data.text_path", f"{tmp_path}/a/*.txt")
  assert [os.path.basename(f) for f in files] == ["0.txt", "1.txt", "2.txt"]
  assert list(sources.file_documents(files[1], "file", "text")) == [docs[1] + "\nsecond line\n"]
  assert list(sources.file_documents(str(tmp_path / "b.jsonl.gz"), "line", "body")) == docs
  with pytest.raises(UserError, match=r"b\.jsonl\.gz:1 has no field 'text' \(it has body, id\); set data\.text_field"):
    next(sources.file_documents(str(tmp_path / "b.jsonl.gz"), "line", "text"))
  with pytest.raises(UserError, match=r"data\.text_path=.*nope\*\.txt: file not found"):
    sources.local_files("data.text_path", f"{tmp_path}/nope*.txt")
  (tmp_path / "bad.txt").write_bytes(b"ok\ngr\xfc\xdfe\n")
  with pytest.raises(UserError, match=r"bad\.txt:2: not valid UTF-8"):
    list(sources.file_documents(str(tmp_path / "bad.txt"), "line", "text"))
  cfg = _lm_config(f"data.text_path={tmp_path}/a/*.txt,{tmp_path}/b.jsonl.gz", "data.tokenizer=byte",
                   "data.train_fraction=0.5", "data.text_field=body")
  manifest = prepare.ensure_prepared(cfg, str(tmp_path / "run"), log=QUIET)
  assert manifest["splits"]["train"]["docs"] + manifest["splits"]["val"]["docs"] == 33
  # A document per file, several files: documents end in EOS, like a corpus of lines.
  assert manifest["eos"] is True


# ------------------------------------------- the memory-mapped path = the in-memory path


def _in_memory_reference(path, seed, block, batch):
  """Today's LM path before shards existed: the whole text, nanoGPT's split, one stream."""
  text = "\n".join(data.read_lines(path)) + "\n"
  train, val = data.nanogpt_split(text, 0.9)
  tok = tokenizer_lib.CharTokenizer.train([train])
  return (tok, val, data.LMBatcher(data.lm_token_stream([train], tok, add_eos=False), block, batch, seed=seed),
          data.LMBatcher(data.lm_token_stream([val], tok, add_eos=False), block, batch, seed=seed + 1))


def _assert_same_batches(task, ref_train, ref_val, steps):
  for step in steps:
    want = ref_train.batch_at(step)
    got = task.train_batch(step)
    for k in got:
      np.testing.assert_array_equal(got[k], want[k])
  for want, got in zip([ref_val.batch_at(i) for i in range(20)], task.eval_batches("dev", 20)):
    for k in got:
      np.testing.assert_array_equal(got[k], want[k])


def test_memmapped_batches_equal_the_in_memory_path(tmp_path):
  """One text file: nanoGPT's character split, no EOS, the same windows for the same seed."""
  (tmp_path / "t.txt").write_text("\ufeff" + "\r\n".join(_docs(300, seed=3)))  # BOM, CRLF, no final newline
  cfg = _lm_config(f"data.text_path={tmp_path / 't.txt'}", "train.seed=5", "data.use_segments=true")
  task = tasks.LMTask(cfg, str(tmp_path / "run"), log=QUIET)
  tok, val, ref_train, ref_val = _in_memory_reference(tmp_path / "t.txt", 5, 32, 4)
  assert task.tokenizer.chars == tok.chars
  assert task.val_text == val
  _assert_same_batches(task, ref_train, ref_val, [0, 1, 2, 999, 12345])


def test_char_vocabulary_holds_the_held_out_characters(tmp_path):
  """A one-line text: nanoGPT's split leaves its final newline (and here a `!`) to val only; the char
  vocabulary is every split's characters, so val encodes (it was 'characters ['\\n', '!'] are not in
  the char vocabulary' on a text that holds them)."""
  text = "the quick brown fox jumps over the lazy dog. " * 20 + "!"
  (tmp_path / "t.txt").write_text(text)
  cfg = _lm_config(f"data.text_path={tmp_path / 't.txt'}", "data.tokenizer=char")
  task = tasks.LMTask(cfg, str(tmp_path / "run"), log=QUIET)
  train, val = data.nanogpt_split(text + "\n", 0.9)
  assert "!" not in train and task.tokenizer.chars == "".join(sorted(set(text + "\n")))
  assert task.tokenizer.decode(task.val_stream.take(np.array([0]), len(task.val_stream))[0].tolist()) == val


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="shared data absent")
def test_shakespeare_char_batches_unchanged(tmp_path):
  """shakespeare_char's published val loss (1.8685 at 2,000) rests on these batches."""
  cfg = config_lib.load_config("shakespeare_char", [f"data.text_path={SHAKESPEARE}"])
  task = tasks.LMTask(cfg, str(tmp_path), log=QUIET)
  tok, val, ref_train, ref_val = _in_memory_reference(SHAKESPEARE, 0, 64, 12)
  assert open(tmp_path / "tokenizer.json").read() == json.dumps({"type": "char", "chars": tok.chars})
  assert (len(task.train_stream), len(task.val_stream)) == (1_003_854, 111_540)
  assert set(task.train_batch(0)) == {"inputs", "targets"}  # use_segments=False: nanoGPT's model
  _assert_same_batches(task, ref_train, ref_val, [0, 1, 1000, 1999])


def test_resume_after_n_steps_gives_the_same_next_batch(tmp_path):
  (tmp_path / "c.txt").write_text("\n".join(_docs(300)) + "\n")
  for packing in ("random_windows", "packed"):
    cfg = _lm_config(f"data.text_path={tmp_path / 'c.txt'}", "data.doc_per=line", f"data.packing={packing}")
    first = tasks.LMTask(cfg, str(tmp_path / "run"), log=QUIET)
    seen = [first.train_batch(s) for s in range(7)]  # a run that trained 7 steps
    again = tasks.LMTask(cfg, str(tmp_path / "run"), log=QUIET)  # a restart: a new process, the same files
    for step in (7, 3, 500):
      jax.tree.map(np.testing.assert_array_equal, again.train_batch(step), first.train_batch(step))
    assert not np.array_equal(seen[0]["inputs"], seen[1]["inputs"])


# ------------------------------------------------------------------- packed rows


def test_permute_is_a_bijection():
  for n in (1, 2, 3, 7, 64, 1000, 4097):
    for key in ((0, 0), (0, 1), (9, 4)):
      out = data.permute(np.arange(n), n, key)
      np.testing.assert_array_equal(np.sort(out), np.arange(n))
  a, b = data.permute(np.arange(1000), 1000, (0, 0)), data.permute(np.arange(1000), 1000, (0, 1))
  assert (a != b).mean() > 0.9 and (a != np.arange(1000)).mean() > 0.9  # shuffled, differently per epoch
  np.testing.assert_array_equal(data.permute(np.array([5, 17]), 1000, (0, 0)), a[[5, 17]])


@pytest.fixture(scope="module")
def packed_task(tmp_path_factory):
  d = tmp_path_factory.mktemp("packed")
  (d / "c.txt").write_text("\n".join(_docs(500, seed=2, max_words=12)) + "\n")
  cfg = _lm_config(f"data.text_path={d / 'c.txt'}", "data.doc_per=line", "data.packing=packed",
                   "data.shard_tokens=700", "data.batch_size=8", "data.block_size=16")
  return tasks.LMTask(cfg, str(d / "run"), log=QUIET), cfg


def test_packed_rows_restart_segments_at_document_boundaries(packed_task):
  task, cfg = packed_task
  stream, L = task.train_stream, 16
  assert len(stream.paths) > 2  # rows cross shard boundaries too
  doc_of = np.repeat(np.arange(stream.num_docs), np.concatenate([np.diff(np.asarray(o)) for o in stream.offsets]))
  rows_seen = []
  for step in range(task.train.steps_per_epoch):
    batch = task.train_batch(step)
    rows = data.permute(np.arange(step * 8, step * 8 + 8), task.train.rows, (cfg.train.seed, 0))
    rows_seen.extend(rows)
    for r, row in enumerate(rows):
      span = np.arange(row * L, row * L + L)
      np.testing.assert_array_equal(batch["inputs"][r], stream.read(row * L, row * L + L))
      np.testing.assert_array_equal(batch["targets"][r], stream.read(row * L + 1, row * L + L + 1))
      seg, pos = batch["segment_ids"][r], batch["positions"][r]
      # Same segment <=> same document; positions count from the document's start (or the row's).
      np.testing.assert_array_equal(seg[:, None] == seg[None, :], doc_of[span][:, None] == doc_of[span][None, :])
      starts = np.maximum(np.searchsorted(doc_of, doc_of[span]), row * L)
      np.testing.assert_array_equal(pos, span - starts)
    # With EOS ending every document, the offsets agree with the EOS rule of random windows.
    eos_seg, eos_pos = data._segments_after_eos(batch["inputs"], tokenizer_lib.EOS_ID)
    np.testing.assert_array_equal(eos_seg, batch["segment_ids"])
    np.testing.assert_array_equal(eos_pos, batch["positions"])
  # An epoch visits every row at most once (the rows that do not fill a batch wait for the next epoch).
  assert len(set(rows_seen)) == len(rows_seen) == task.train.rows // 8 * 8 and max(rows_seen) < task.train.rows
  mask = layers.make_attention_mask(jnp.asarray(batch["segment_ids"]), jnp.asarray(batch["segment_ids"]),
                                    jnp.arange(L), jnp.arange(L))
  same_doc = batch["segment_ids"][:, :, None] == batch["segment_ids"][:, None, :]
  assert not np.asarray(mask)[:, 0][~same_doc].any()


@pytest.mark.parametrize("base", ["gpt2_tiny", "llama_tiny"])
def test_packed_document_logits_do_not_see_the_neighbour(base):
  """A document's logits in a packed row equal its logits alone, whatever precedes it."""
  cfg = config_lib.load_config(base, ["model.vocab_size=300"])
  model = model_lib.build_model(cfg.model)
  rng = np.random.default_rng(0)
  a, other_a, b = rng.integers(3, 300, 9), rng.integers(3, 300, 9), rng.integers(3, 300, 7)
  packed_seg, packed_pos = [1] * 9 + [2] * 7, list(range(9)) + list(range(7))
  params = jax.jit(model.init)(jax.random.PRNGKey(0), jnp.zeros((1, 16), jnp.int32))["params"]
  apply = jax.jit(lambda x, s, p: model.apply({"params": params}, x, s, p))  # one shape: one compilation
  logits = lambda x, s, p: np.asarray(apply(jnp.asarray([x]), jnp.asarray([s]), jnp.asarray([p])))[0]
  packed = logits(np.concatenate([a, b]), packed_seg, packed_pos)
  np.testing.assert_allclose(packed[9:], logits(np.concatenate([other_a, b]), packed_seg, packed_pos)[9:],
                             atol=1e-5)
  alone = lambda doc: logits(np.pad(doc, (0, 16 - len(doc))), [1] * len(doc) + [0] * (16 - len(doc)),
                             list(range(len(doc))) + [0] * (16 - len(doc)))[:len(doc)]  # segment 0 = padding
  np.testing.assert_allclose(packed[9:], alone(b), atol=1e-5)
  np.testing.assert_allclose(packed[:9], alone(a), atol=1e-5)
  unmasked = logits(np.concatenate([a, b]), [1] * 16, list(range(16)))
  assert np.abs(unmasked[9:] - packed[9:]).max() > 1e-3  # without segments b does see a


# ----------------------------------------------------------- one process, its rows


def test_each_process_reads_only_its_rows(packed_task, tmp_path):
  task, cfg = packed_task
  for batcher in (task.train, data.LMBatcher(task.train_stream, 16, 8, seed=0)):
    full = batcher.batch_at(3)
    batcher.part = (1, 2, 2)  # the second of two processes
    read = []
    take = task.train_stream.take
    task.train_stream.take = lambda starts, length: read.append(len(starts)) or take(starts, length)
    try:
      half = batcher.batch_at(3)
    finally:
      del task.train_stream.take
      batcher.part = None
    assert read == [4]  # four rows of eight
    for k in full:
      np.testing.assert_array_equal(half[k][4:], full[k][4:])
    assert not half["inputs"][:4].any()
  src, tgt = data.Ragged.from_lists(_random_pairs(300)[0]), data.Ragged.from_lists(_random_pairs(300)[1])
  full = data.Batcher(src, tgt, 256, 32, seed=1, batch_multiple=4).batch_at(2)
  part = data.Batcher(src, tgt, 256, 32, seed=1, batch_multiple=4, part=(0, 1, 4)).batch_at(2)
  n = len(full["inputs"]) // 4
  for k in full:
    np.testing.assert_array_equal(part[k][:n], full[k][:n])
  for k in ("inputs_segmentation", "targets_segmentation", "inputs_position", "targets_position"):
    np.testing.assert_array_equal(part[k], full[k])  # every process agrees on shapes and token counts
  assert set(np.unique(part["targets"][n:])) == {0, tokenizer_lib.EOS_ID}  # no token read, EOS from the lengths
  assert len(np.unique(full["targets"][n:])) > 2


def _random_pairs(n, seed=0):
  rng = np.random.default_rng(seed)
  return [[list(rng.integers(4, 100, rng.integers(1, 20))) for _ in range(n)] for _ in range(2)]


# ------------------------------------------------------ crash safety, refusals


def test_interrupted_prepare_resumes_to_identical_files(tmp_path, monkeypatch):
  (tmp_path / "c.txt").write_text("\n".join(_docs(600)) + "\n")
  cfg = _lm_config(f"data.text_path={tmp_path / 'c.txt'}", "data.doc_per=line", "data.tokenizer=byte",
                   "data.shard_tokens=2000")
  clean = prepare.ensure_prepared(cfg, str(tmp_path / "clean"), log=QUIET)
  assert len(clean["splits"]["train"]["shards"]) > 4
  closes, close = [], prepare._Writer.close

  def crash_after_three(self):
    if self.files is not None and len(closes) == 3:
      self.files[next(iter(self.files))][0].write(b"half a shard")  # an open shard left behind
      raise KeyboardInterrupt("killed")
    closes.append(1)
    close(self)

  monkeypatch.setattr(prepare._Writer, "close", crash_after_three)
  with pytest.raises(KeyboardInterrupt):
    prepare.ensure_prepared(cfg, str(tmp_path / "crashed"), log=QUIET)
  monkeypatch.setattr(prepare._Writer, "close", close)
  assert not shards.read_manifest(str(tmp_path / "crashed" / "data"))["complete"]
  assert any(n.endswith(".tmp") for n in os.listdir(tmp_path / "crashed" / "data" / "train"))
  logs = []
  prepare.ensure_prepared(cfg, str(tmp_path / "crashed"), log=logs.append)
  assert any("resuming" in line and "after 3 complete shards" in line for line in logs), logs
  assert _tree_digest(tmp_path / "crashed" / "data") == _tree_digest(tmp_path / "clean" / "data")


def test_kill_9_during_prepare_then_rerun_gives_identical_shards(tmp_path):
  """A real kill -9 of `python -m jaxformer.prepare` (with worker processes) mid-way."""
  rng = np.random.default_rng(0)
  words = np.array(WORDS)
  with open(tmp_path / "c.txt", "w") as f:
    for _ in range(20):
      f.write("\n".join(" ".join(words[rng.integers(0, len(WORDS), 12)]) for _ in range(4000)) + "\n")
  args = ["--config", "gpt2_tiny", f"data.text_path={tmp_path / 'c.txt'}", "data.doc_per=line",
          "data.tokenizer=byte", "model.vocab_size=300", "data.shard_tokens=100000", "data.num_proc=2"]
  run = lambda workdir: subprocess.Popen([sys.executable, "-m", "jaxformer.prepare", *args, "--workdir", workdir],
                                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  assert run(str(tmp_path / "clean")).wait(timeout=300) == 0
  proc = run(str(tmp_path / "killed"))
  marker = tmp_path / "killed" / "data" / "train" / "shard-00001.json"
  deadline = time.time() + 300
  while not marker.exists() and proc.poll() is None and time.time() < deadline:
    time.sleep(0.01)
  proc.send_signal(signal.SIGKILL)
  assert proc.wait(timeout=60) == -signal.SIGKILL, "prepare finished before it could be killed"
  assert not shards.read_manifest(str(tmp_path / "killed" / "data"))["complete"]
  resumed = run(str(tmp_path / "killed"))
  out = resumed.communicate(timeout=300)[0].decode()
  assert resumed.returncode == 0 and "resuming" in out, out
  assert _tree_digest(tmp_path / "killed" / "data") == _tree_digest(tmp_path / "clean" / "data")


def test_workers_write_what_one_process_writes(tmp_path, monkeypatch):
  (tmp_path / "c.txt").write_text("\n".join(_docs(3000)) + "\n")
  monkeypatch.setattr(prepare, "CHUNK_CHARS", 4000)  # many chunks, so workers start
  digests = []
  for n in (1, 2, 3):
    cfg = _lm_config(f"data.text_path={tmp_path / 'c.txt'}", "data.doc_per=line", "data.shard_tokens=9000",
                     f"data.num_proc={n}", "data.tokenizer_path=" + str(tmp_path / "tok.json"))
    prepare.ensure_prepared(cfg, str(tmp_path / f"run{n}"), log=QUIET)
    digests.append(_tree_digest(tmp_path / f"run{n}" / "data"))
  assert digests[0] == digests[1] == digests[2]


def test_a_manifest_of_another_tokenizer_source_or_setting_is_refused(tmp_path):
  (tmp_path / "c.txt").write_text("\n".join(_docs(200)) + "\n")
  workdir = str(tmp_path / "run")
  cfg = _lm_config(f"data.text_path={tmp_path / 'c.txt'}", "data.doc_per=line")
  tasks.LMTask(cfg, workdir, log=QUIET)
  ddir = os.path.join(workdir, "data")
  tokenizer_lib.CharTokenizer.train(["other characters"]).save(os.path.join(workdir, "tokenizer.json"))
  with pytest.raises(UserError, match=r"^\S+/run/data was prepared with another tokenizer \(sha256 \w{12}, "
                                      r"\S+tokenizer\.json is \w{12}\): delete \S+ to prepare it again") as e:
    tasks.LMTask(cfg, workdir, log=QUIET)
  assert "\n" not in str(e.value)
  os.remove(os.path.join(workdir, "tokenizer.json"))
  with pytest.raises(UserError, match=r"tokenizer \S+ that \S+ was prepared with is missing"):
    tasks.LMTask(cfg, workdir, log=QUIET)
  shutil_rm(ddir)
  tasks.LMTask(cfg, workdir, log=QUIET)  # prepared again, with a new tokenizer
  with pytest.raises(UserError, match=r"prepared with data\.train_fraction=0\.9 \(now 0\.5\)"):
    tasks.LMTask(config_lib.replace(cfg, **{"data.train_fraction": 0.5}), workdir, log=QUIET)
  with open(tmp_path / "c.txt", "a") as f:
    f.write("one more line\n")
  with pytest.raises(UserError, match=r"prepared from another source than \S+c\.txt"):
    tasks.LMTask(cfg, workdir, log=QUIET)


def shutil_rm(path):
  import shutil  # pylint: disable=g-import-not-at-top
  shutil.rmtree(path)


def test_prepare_cli(tmp_path, capsys):
  (tmp_path / "c.txt").write_text("\n".join(_docs(100)) + "\n")
  manifest = prepare.main(["--config", "gpt2_tiny", f"data.text_path={tmp_path / 'c.txt'}", "--workdir",
                           str(tmp_path / "run"), "data.doc_per=line", "model.vocab_size=300"])
  out = capsys.readouterr().out
  assert manifest["complete"] and f"{tmp_path / 'run' / 'data'}: train " in out and "(uint16)" in out
  with pytest.raises(SystemExit) as e:
    prepare.main(["--config", "gpt2_tiny", "data.text_path=/nope.txt", "--workdir", str(tmp_path / "x")])
  assert e.value.code == 2 and "error: data.text_path=/nope.txt: file not found" in capsys.readouterr().err
  assert not (tmp_path / "x").exists()


# ----------------------------------------------------- datasets streaming = plain reader


@pytest.mark.parametrize("kind", ["text-line", "text-file", "json"])
def test_datasets_streaming_gives_the_same_shards_as_the_plain_reader(tmp_path, kind):
  pytest.importorskip("datasets")
  docs = _docs(300, seed=4)
  if kind == "json":
    with gzip.open(tmp_path / "c.jsonl.gz", "wt") as f:
      f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    files, hub_name, doc_per = tmp_path / "c.jsonl.gz", "json", "line"
  else:
    (tmp_path / "c.txt").write_text("\n".join(docs) + "\n")
    files, hub_name, doc_per = tmp_path / "c.txt", "text", kind.split("-")[1]
  common = [f"data.doc_per={doc_per}", "data.shard_tokens=3000", f"data.tokenizer_path={tmp_path / 'tok.json'}"]
  plain = _lm_config(f"data.text_path={files}", *common)
  streamed = _lm_config("data.source=hub", f"data.hub_name={hub_name}", "data.hub_config=", *common,
                        f"data.hub_data_files={files}")
  a = prepare.ensure_prepared(plain, str(tmp_path / "plain"), log=QUIET)
  b = prepare.ensure_prepared(streamed, str(tmp_path / "streamed"), log=QUIET)
  # A marker's "end" is the input position its shard ends at: the plain reader streams a one-file
  # document as pieces (one position each), the hub's "text" builder gives it whole (one position).
  no_end = lambda m: {s: {**info, "shards": [{k: v for k, v in shard.items() if k != "end"}
                                               for shard in info["shards"]]} for s, info in m["splits"].items()}
  assert no_end(a) == no_end(b) and a["eos"] == b["eos"] == (kind != "text-file")
  if kind != "text-file":
    assert a["splits"] == b["splits"]
  digest = lambda run: {k: v for k, v in _tree_digest(tmp_path / run / "data").items()
                        if k != "manifest.json" and not k.endswith(".json")}  # markers: compared above
  assert digest("plain") == digest("streamed")


# ------------------------------------------------------------------- translation


def test_translation_shards_and_batches_equal_the_in_memory_path(tmp_path):
  """The memory-mapped ragged arrays give today's batches: the same joint tokenizer (its sample is
  every pair, in order, when the corpus is smaller than data.tokenizer_sample_docs), ids and buckets."""
  cfg = config_lib.load_config("tiny_encdec", ["data.synthetic_size=600", "data.num_proc=1"])
  task = tasks.TranslationTask(cfg, str(tmp_path / "run"), batch_multiple=2, log=QUIET)
  splits = sources.load_translation_splits(cfg)
  ref_path = str(tmp_path / "ref.model")
  ref_tok = tokenizer_lib.load_or_train_tokenizer("sentencepiece", ref_path, [*splits["train"][0],
                                                                              *splits["train"][1]], 64)
  pieces = lambda tok: [tok.sp.id_to_piece(i) for i in range(tok.vocab_size)]
  assert pieces(task.tokenizer) == pieces(ref_tok)
  names = ["train", "dev", "test"]
  ref = data.tokenize_corpus(ref_path, [t for n in names for t in splits[n]], None, num_proc=1)
  for i, name in enumerate(names):
    for side, want in zip(task.ids[name], ref[2 * i:2 * i + 2]):
      np.testing.assert_array_equal(side.lengths, want.lengths)
      idx = np.arange(len(want))
      np.testing.assert_array_equal(side.gather(idx, 40), want.gather(idx, 40))
  kept, _ = data.filter_pairs(*ref[:2], cfg.data.max_len)
  old = data.Batcher(*ref[:2], cfg.data.tokens_per_batch, cfg.data.max_len, seed=cfg.train.seed,
                     batch_multiple=2, indices=kept)
  for step in (0, 1, old.steps_per_epoch + 3):
    jax.tree.map(np.testing.assert_array_equal, task.train_batch(step), old.batch_at(step))
  assert task.splits["dev"] == splits["dev"] and "train" not in task.splits  # BLEU's text; train stays on disk


def test_one_process_reads_every_row():
  from jaxformer import sharding  # pylint: disable=g-import-not-at-top
  part = sharding.batch_part(sharding.batch_sharding(sharding.make_mesh(config_lib.MeshConfig())))
  assert part == (0, jax.device_count(), jax.device_count()) and data.row_range(8, part) == (0, 8)
  assert data.row_range(8, (1, 3, 4)) == (2, 6)
