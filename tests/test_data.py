"""Tests for tokenizers, data loading, batching and the synthetic corpus."""

import os
import pathlib
import time

import numpy as np
import pytest

from jaxformer import data
from jaxformer import synthetic
from jaxformer import tokenizer as tokenizer_lib
from jaxformer.errors import UserError

DATA = pathlib.Path(__file__).resolve().parents[1] / ".." / "shared" / "data"
DATA = pathlib.Path(os.environ.get("JAXFORMER_DATA", DATA)).resolve()
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"


def _write(path, content):
  path.write_bytes(content if isinstance(content, bytes) else content.encode())
  return path


# ---------------------------------------------------------------- reading


def test_read_parallel_ok(tmp_path):
  src = _write(tmp_path / "a.en", "hello world\nsecond\u2028line\n")
  tgt = _write(tmp_path / "a.de", "hallo welt\nzweite zeile\n")
  assert data.read_parallel(src, tgt) == (
      ["hello world", "second\u2028line"], ["hallo welt", "zweite zeile"])


def test_read_parallel_line_mismatch(tmp_path):
  src = _write(tmp_path / "a.en", "a\nb\nc\n")
  tgt = _write(tmp_path / "a.de", "a\nb\n")
  with pytest.raises(UserError, match=r"a\.en has 3 lines.*a\.de has 2"):
    data.read_parallel(src, tgt)


def test_read_parallel_not_utf8(tmp_path):
  src = _write(tmp_path / "a.en", "a\nb\n")
  tgt = _write(tmp_path / "a.de", b"a\ngr\xfc\xdfe\n")  # Latin-1 "grüße".
  with pytest.raises(UserError, match=r"a\.de:2: not valid UTF-8"):
    data.read_parallel(src, tgt)


def test_read_parallel_empty_and_missing(tmp_path):
  src = _write(tmp_path / "a.en", "a\n")
  with pytest.raises(UserError, match="empty"):
    data.read_parallel(src, _write(tmp_path / "a.de", ""))
  with pytest.raises(UserError, match="not found"):
    data.read_parallel(src, tmp_path / "missing.de")


def test_load_translation_local_dir(tmp_path):
  _write(tmp_path / "val.en", "one\ntwo\nthree\n")
  _write(tmp_path / "val.de", "eins\nzwei\ndrei\n")
  src, tgt = data.load_translation(str(tmp_path), "val", max_examples=2)
  assert (src, tgt) == (["one", "two"], ["eins", "zwei"])


# ------------------------------------------------------------- tokenizers


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
  en, de = synthetic.numbers_corpus(2000, seed=0)
  d = tmp_path_factory.mktemp("spm")
  _write(d / "train.en", "\n".join(en) + "\n")
  _write(d / "train.de", "\n".join(de) + "\n")
  path = d / "joint.model"
  tokenizer_lib.train_sentencepiece(
      [d / "train.en", d / "train.de"], 200, path)
  return path


def test_sentencepiece_round_trip(spm_model):
  tok = tokenizer_lib.load_tokenizer(spm_model)
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  assert tok.vocab_size <= 200
  for text in ["ich sehe dreihundertfünfundvierzig rote autos .",
               "i see twenty-one red cars ."]:
    ids = tok.encode(text)
    assert min(ids) > 3  # No PAD/BOS/EOS/UNK inside known text.
    assert tok.decode(ids) == text
    # decode stops at EOS and drops PAD/BOS.
    assert tok.decode([1] + ids + [2, 7, 8, 0, 0]) == text


def test_load_or_train_caches_and_checks_vocab(tmp_path):
  texts = ["der hund ist groß", "the dog is big"] * 50
  path = tmp_path / "tok.model"
  tok = tokenizer_lib.load_or_train_tokenizer("sentencepiece", path, texts, 60)
  mtime = path.stat().st_mtime_ns
  again = tokenizer_lib.load_or_train_tokenizer(
      "sentencepiece", path, None, 60)  # No texts needed: not retrained.
  assert path.stat().st_mtime_ns == mtime
  assert again.encode("der hund") == tok.encode("der hund")
  with pytest.raises(UserError, match="vocab size 60 but 8000"):
    tokenizer_lib.load_or_train_tokenizer("sentencepiece", path, None, 8000)


def test_char_and_byte_tokenizers(tmp_path):
  path = tmp_path / "chars.json"
  tok = tokenizer_lib.load_or_train_tokenizer("char", path,
                                              ["hello\n", "wörld"])
  assert tok.vocab_size == 3 + len(set("hello\nwörld"))
  assert tokenizer_lib.load_tokenizer(path).chars == tok.chars
  assert tok.decode(tok.encode("lo\nwö") + [2, 5]) == "lo\nwö"
  with pytest.raises(UserError, match="not in the char vocabulary"):
    tok.encode("xyz")
  tokenizer_lib.load_or_train_tokenizer("char", path, None, 64)  # Capacity.
  with pytest.raises(UserError, match="set vocab_size >= 12"):
    tokenizer_lib.load_or_train_tokenizer("char", path, None, 8)
  byte = tokenizer_lib.ByteTokenizer()
  assert byte.vocab_size == 259
  assert byte.decode([1] + byte.encode("grüße") + [2, 50]) == "grüße"


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason="shared data absent")
def test_char_tokenizer_tiny_shakespeare():
  text = SHAKESPEARE.read_text(encoding="utf-8")
  tok = tokenizer_lib.CharTokenizer.train([text])
  assert len(tok.chars) == 65 and tok.vocab_size == 68
  train, val = data.nanogpt_split(text, 0.9)
  assert (len(train), len(val)) == (1_003_854, 111_540)
  stream = data.lm_token_stream([train], tok, add_eos=False)
  assert stream.shape == (1_003_854,) and stream.min() >= 3
  assert tok.decode(stream[:200]) == train[:200]


# -------------------------------------------------------------- caching


def test_tokenize_corpus_cache(tmp_path, spm_model, monkeypatch):
  en, de = synthetic.numbers_corpus(3000, seed=1)
  src = _write(tmp_path / "c.en", "\n".join(en) + "\n")
  cache = tmp_path / "cache"
  start = time.perf_counter()
  first = data.tokenize_corpus(spm_model, [src, de], cache, num_proc=1)
  cold = time.perf_counter() - start
  tok = tokenizer_lib.load_tokenizer(spm_model)
  assert list(first[0][5]) == tok.encode(en[5])
  assert list(first[1][7]) == tok.encode(de[7])

  def no_tokenizer(path):
    raise AssertionError("cache hit must not load the tokenizer")

  monkeypatch.setattr(tokenizer_lib, "load_tokenizer", no_tokenizer)
  start = time.perf_counter()
  second = data.tokenize_corpus(spm_model, [src, de], cache, num_proc=1)
  assert time.perf_counter() - start < max(0.5, cold)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a.flat, b.flat)
    np.testing.assert_array_equal(a.offsets, b.offsets)
  # A changed input is a new key: it must retokenize (and so fail here).
  _write(src, "\n".join(en[:10]) + "\n")
  with pytest.raises(AssertionError, match="cache hit"):
    data.tokenize_corpus(spm_model, [src, de], cache)


def test_tokenize_corpus_parallel_matches_serial(spm_model):
  lines = synthetic.numbers_corpus(50, seed=2)[0]
  serial = data.tokenize_corpus(spm_model, [lines], None, num_proc=1)[0]
  parallel = data.tokenize_corpus(spm_model, [lines], None, num_proc=2,
                                  chunk_size=20)[0]
  assert len(serial) == 50
  np.testing.assert_array_equal(serial.flat, parallel.flat)
  np.testing.assert_array_equal(serial.offsets, parallel.offsets)


# ------------------------------------------------------------- batching


def _random_corpus(n, max_len, seed=0):
  rng = np.random.default_rng(seed)
  def seqs():
    return [list(rng.integers(4, 100, rng.integers(0, max_len)))
            for _ in range(n)]
  return seqs(), seqs()


def test_filter_pairs():
  src = [[5], [], [5] * 9, [5] * 3, [5] * 10]
  tgt = [[6], [6], [6], [], [6] * 2]
  kept, counts = data.filter_pairs(src, tgt, max_len=10)
  assert list(kept) == [0, 2]
  assert counts == {"kept": 2, "empty": 2, "too_long": 1}


def test_batcher_epoch_covers_each_pair_once_within_budget():
  src, tgt = _random_corpus(2000, 60)
  kept, _ = data.filter_pairs(src, tgt, max_len=64)
  b = data.Batcher(src, tgt, tokens_per_batch=512, max_len=64, seed=3,
                   batch_multiple=4, indices=kept)
  allowed = {(512 // n // 4 * 4, n) for n in data.bucket_lengths(64)}
  assert set(b.shapes()) <= allowed
  for epoch in (0, 1):
    batches = b.epoch_batches(epoch)
    assert len(batches) == len(b)
    seen = np.concatenate(batches)
    np.testing.assert_array_equal(np.sort(seen[seen >= 0]), kept)
  assert not all(np.array_equal(x, y) for x, y in
                 zip(b.epoch_batches(0), b.epoch_batches(1)))
  for step in range(len(b)):
    batch = b.batch_at(step)
    shape = batch["inputs"].shape
    assert shape in allowed and shape[0] % 4 == 0
    assert shape[0] * shape[1] <= 512
    assert all(v.shape == shape and v.dtype == np.int32
               for v in batch.values())
  assert 0.0 < b.padding_fraction() < 0.5


def test_batcher_resume_is_exact():
  src, tgt = _random_corpus(500, 30, seed=1)
  b1 = data.Batcher(src, tgt, tokens_per_batch=256, max_len=32, seed=7)
  b2 = data.Batcher(src, tgt, tokens_per_batch=256, max_len=32, seed=7)
  steps = [0, 1, len(b1) - 1, len(b1), 3 * len(b1) + 5]
  for step in steps:  # b2 jumps straight to each step, as after a restart.
    x, y = b1.batch_at(step), b2.batch_at(step)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k])
  other = data.Batcher(src, tgt, tokens_per_batch=256, max_len=32, seed=8)
  assert not np.array_equal(other.batch_at(0)["inputs"],
                            b1.batch_at(0)["inputs"])


def test_batch_teacher_forcing_and_segmentation():
  src, tgt = _random_corpus(300, 20, seed=2)
  b = data.Batcher(src, tgt, tokens_per_batch=200, max_len=24, seed=0)
  for indices in b.epoch_batches(0):
    batch = b.make_batch(indices)
    for row, i in enumerate(indices):
      seg_s = batch["inputs_segmentation"][row]
      seg_t = batch["targets_segmentation"][row]
      if i < 0:  # Filler row: all padding.
        assert not seg_s.any() and not seg_t.any()
        assert not batch["inputs"][row].any()
        continue
      ns, nt = len(src[i]) + 1, len(tgt[i]) + 1
      assert list(batch["inputs"][row][:ns]) == src[i] + [2]
      assert list(batch["targets"][row][:nt]) == tgt[i] + [2]
      assert list(batch["decoder_inputs"][row][:nt]) == [1] + tgt[i]
      assert list(seg_s) == [1] * ns + [0] * (len(seg_s) - ns)
      assert list(seg_t) == [1] * nt + [0] * (len(seg_t) - nt)
      assert list(batch["targets_position"][row][:nt]) == list(range(nt))
      for k in ("inputs", "inputs_position"):
        assert not batch[k][row][ns:].any()
      for k in ("targets", "decoder_inputs", "targets_position"):
        assert not batch[k][row][nt:].any()


def test_batcher_budget_too_small():
  with pytest.raises(UserError, match="too small for length 64"):
    data.Batcher([[5] * 60], [[6]], tokens_per_batch=100, max_len=64,
                 batch_multiple=2)


# ------------------------------------------------------ language modelling


def test_lm_windows_shift_and_segments():
  tok = tokenizer_lib.CharTokenizer.train(["abcdefgh"])
  docs = ["abc", "defgh", "a", "bcdefg"] * 20
  stream = data.lm_token_stream(docs, tok)
  assert (stream == 2).sum() == len(docs) and stream[-1] == 2
  lm = data.LMBatcher(stream, block_size=16, batch_size=8, seed=0)
  batch = lm.batch_at(5)
  np.testing.assert_array_equal(batch["inputs"], lm.batch_at(5)["inputs"])
  assert not np.array_equal(batch["inputs"], lm.batch_at(6)["inputs"])
  x, y = batch["inputs"], batch["targets"]
  assert x.shape == y.shape == (8, 16)
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
  seg, pos = batch["segment_ids"], batch["positions"]
  after_eos = x[:, :-1] == 2
  np.testing.assert_array_equal(np.diff(seg, axis=1), after_eos)
  np.testing.assert_array_equal(pos[:, 1:] == 0, after_eos)
  assert (seg[:, 0] == 1).all() and (pos[:, 0] == 0).all()
  np.testing.assert_array_equal(pos[:, 1:][~after_eos],
                                (pos[:, :-1] + 1)[~after_eos])


# ------------------------------------------------------------ synthetic


@pytest.mark.parametrize("n,en,de", [
    (16, "sixteen", "sechzehn"), (17, "seventeen", "siebzehn"),
    (21, "twenty-one", "einundzwanzig"), (60, "sixty", "sechzig"),
    (70, "seventy", "siebzig"), (77, "seventy-seven", "siebenundsiebzig"),
    (30, "thirty", "dreißig"), (100, "one hundred", "einhundert"),
    (101, "one hundred and one", "einhunderteins"),
    (345, "three hundred and forty-five", "dreihundertfünfundvierzig"),
    (999, "nine hundred and ninety-nine", "neunhundertneunundneunzig"),
])
def test_number_words(n, en, de):
  assert synthetic.english_number(n) == en
  assert synthetic.german_number(n) == de


def test_numbers_corpus_and_split():
  en, de = synthetic.numbers_corpus(3000, seed=4)
  assert (en, de) == synthetic.numbers_corpus(3000, seed=4)
  assert en != synthetic.numbers_corpus(3000, seed=5)[0]
  assert max(len(s.split()) for s in en + de) < 20
  words = {synthetic.english_number(n): n for n in range(1, 1000)}
  for e, d in zip(en[:300], de[:300]):  # Each German line matches its English.
    t_en, t_de = next(t for t in synthetic.TEMPLATES
                      if e.startswith(t[0].split("{}")[0]) and
                      e.endswith(t[0].split("{}")[1]))
    n = words[e[len(t_en.split("{}")[0]):len(e) - len(t_en.split("{}")[1])]]
    assert n != 1 and n % 100 != 1
    assert d == t_de.format(synthetic.german_number(n))
  (tr_en, tr_de), (te_en, te_de) = synthetic.split_train_test(en, de, 0.1)
  train, test = set(zip(tr_en, tr_de)), set(zip(te_en, te_de))
  assert test and not train & test and train | test == set(zip(en, de))


def test_load_translation_hub_mapping(monkeypatch):
  datasets = pytest.importorskip("datasets")
  calls = []

  def fake_load_dataset(name, config, split):
    calls.append((name, config, split))
    return datasets.Dataset.from_dict({"translation": [
        {"de": "hallo", "en": "hello"}, {"de": "welt", "en": "world"}]})

  monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
  monkeypatch.setattr(data.hub, "reachable", lambda *a, **k: True)  # No network here; tests/test_hub.py covers it.
  src, tgt = data.load_translation("hf:wmt14", "validation", "en", "de",
                                   max_examples=2)
  assert calls == [("wmt14", "de-en", "validation[:2]")]
  assert (src, tgt) == (["hello", "world"], ["hallo", "welt"])
  with pytest.raises(UserError, match="not fr and de"):
    data.load_translation("hf:wmt14", "test", "fr", "de")


def test_sentencepiece_trains_on_long_lines_and_reports_the_ones_it_skips(tmp_path, monkeypatch):
  """sentencepiece skips lines over its max_sentence_length (default 4,192 bytes) without a word: a
  corpus of long paragraphs trained its tokenizer on what was left."""
  short = [f"the quick brown fox {i} jumps over the lazy dog" for i in range(200)]
  paragraph = " ".join(["жук"] * 1500)  # 10,499 bytes: its letters appear nowhere else
  assert 4192 < len(paragraph.encode()) < tokenizer_lib.MAX_SENTENCE_BYTES
  logs = []
  tok = tokenizer_lib.train_sentencepiece(short + [paragraph], 120, tmp_path / "a.model", log=logs.append)
  assert tokenizer_lib.UNK_ID not in tok.encode("жук") and not logs  # trained on, nothing skipped
  # Lines longer than the raised limit are still skipped by the trainer, and now counted, from
  # strings and from files.
  monkeypatch.setattr(tokenizer_lib, "MAX_SENTENCE_BYTES", 5000)
  (tmp_path / "corpus.txt").write_text("\n".join(short + [paragraph, paragraph]) + "\n")
  for source, n in (([*short, paragraph], 1), ([str(tmp_path / "corpus.txt")], 2)):
    logs = []
    tok = tokenizer_lib.train_sentencepiece(source, 120, tmp_path / f"b{n}.model", log=logs.append)
    assert logs == [f"warning: {n} lines longer than 5,000 bytes were left out of sentencepiece training "
                    "(its max_sentence_length); split them (e.g. data.doc_per=line) to use them"]
    assert tokenizer_lib.UNK_ID in tok.encode("жук")  # the skipped line taught it nothing
