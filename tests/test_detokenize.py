"""Tests for jaxformer.detokenize: tokens decoded one at a time, in context, on three kinds of tokenizer."""

import pathlib
import random

import pytest

from jaxformer import detokenize
from jaxformer import tokenizer as tokenizer_lib

HF = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
TEXTS = ["Zwei junge Männer stehen am Strand.", "emoji \U0001F600 漢字 éüß end", " leading and  double  spaces ",
         "w78 w72 w19 w80 w63 w67"]
WORDS = sorted({w for t in TEXTS for w in t.split()})


def word_level(tmp_path):
  """A word-level tokenizer.json (whitespace-split words, no decoder: decode joins words with spaces), as
  `tokenizers` writes one; the texts' words are its vocabulary."""
  tokenizers = pytest.importorskip("tokenizers")
  vocab = {w: i for i, w in enumerate(["<unk>", "<eos>"] + WORDS)}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens(["<eos>"])
  path = tmp_path / "tokenizer.json"
  tok.save(str(path))
  return tokenizer_lib.HFTokenizer(path)


@pytest.fixture(params=["gpt2-byte-level", "llama-sentencepiece", "word-level"])
def tok(request, tmp_path):
  if request.param == "gpt2-byte-level":
    return tokenizer_lib.HFTokenizer(HF / "gpt2" / "tokenizer.json")
  if request.param == "llama-sentencepiece":
    return tokenizer_lib.SentencePieceTokenizer(str(HF / "llama" / "tokenizer.model"))
  return word_level(tmp_path)


def _sequences(tok):
  """The texts' ids, and random id sequences (byte-level and byte-fallback tokens that split characters)."""
  rng = random.Random(0)
  out = [tok.encode(t) for t in TEXTS]
  out += [[rng.randrange(3, tok.vocab_size) for _ in range(12)] for _ in range(40)]
  return out


def test_a_whole_sequence_decoded_token_by_token_is_its_decode(tok):
  """Echo: the pieces of a sequence decoded from its start add up to decode(sequence), and the naive join of
  each token decoded alone does not (the bug this module fixes: word-level separators, sentencepiece's
  leading spaces, split multi-byte characters)."""
  naive_differs = 0
  for ids in _sequences(tok):
    pieces = detokenize.token_texts(tok, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == tok.decode(ids), ids
    naive_differs += "".join(tok.decode([i]) for i in ids) != tok.decode(ids)
  assert naive_differs > 0


def test_a_completion_decoded_after_its_prompt_is_the_rest_of_the_whole_decode(tok):
  """A completion's text after its prompt, at every cut of each sequence (cuts inside a character included):
  the whole decode past the prompt's text (U+FFFD of a character the prompt leaves unfinished excluded)."""
  for ids in _sequences(tok):
    full = tok.decode(ids)
    for cut in range(len(ids)):
      base = tok.decode(ids[:cut]).rstrip("\ufffd")
      if not full.startswith(base):   # decoding not prefix-stable at this cut (random ids only)
        continue
      assert "".join(detokenize.token_texts(tok, ids[cut:], ids[:cut])) == full[len(base):], (ids, cut)


def test_streamed_pieces_hold_back_an_unfinished_character():
  """A byte-level BPE emits nothing for a token that ends inside a character, and the whole character with the
  token that completes it; what a sequence leaves unfinished comes out at flush (as U+FFFD)."""
  tok = tokenizer_lib.HFTokenizer(HF / "gpt2" / "tokenizer.json")
  ids = tok.encode("a \U0001F600")
  byte_tokens = [i for i in range(tok.vocab_size) if tok.decode([i]) == "\ufffd"]
  assert byte_tokens and len(ids) > 2       # the emoji is several tokens in this small vocabulary
  decoder = detokenize.IncrementalDecoder(tok, ids[:1])
  pieces = [decoder.add(t) for t in ids[1:]]
  assert "".join(pieces) == " \U0001F600" and all("\ufffd" not in p for p in pieces)
  assert "" in pieces                        # held while the character was unfinished
  decoder.add(byte_tokens[0])
  assert decoder.text == " \U0001F600" and decoder.flush() == "\ufffd" and decoder.text.endswith("\ufffd")
