"""Incremental detokenization: the text each new token adds, decoded in the context of the tokens before it.

A token's text depends on its neighbours: a sentencepiece piece's leading space is dropped at the start
of a decode, a word-level tokenizer joins words with the separator only between them, and a byte-level
BPE token may hold part of a multi-byte character. Decoding new tokens alone loses all three, so the
server's streams, echoes and logprob tokens use `IncrementalDecoder`, which follows vLLM's detokenizer
(and transformers' `TextStreamer`): the text of ids[prefix:i + 1] minus the text of ids[prefix:read],
held back while it ends in an unfinished character (U+FFFD), where `prefix` trails `read` by the last
emitted tokens, so each step decodes a few tokens, not the whole sequence.
"""

CONTEXT = 5  # tokens of the prompt decoded before the first new one (vLLM's initial offset)
_INCOMPLETE = "\ufffd"


class IncrementalDecoder:
  """The text of tokens appended one at a time after `context` ids (a prompt), each in context.

  `pieces[i]` is what the i-th appended token adds to the text ('' while it ends an unfinished
  character: the token that completes it carries the character); `text` is their concatenation, which
  equals decode(context + appended)[len(decode(context)):] wherever decoding is prefix-stable (the
  tokenizers tests/test_detokenize.py checks: byte-level BPE, sentencepiece, word-level).
  """

  def __init__(self, tokenizer, context=()):
    self.tokenizer = tokenizer
    self.ids = [int(t) for t in context]
    self.read = len(self.ids)                      # ids up to here are in the emitted text
    self.prefix = max(0, self.read - CONTEXT)      # decoding starts here, for context
    self._first = True                             # nothing emitted after the context yet
    self.pieces = []

  def _decode(self, start, end):
    return self.tokenizer.decode(self.ids[start:end]) if end > start else ""

  def _before(self):
    """The text already emitted, as the decoding window shows it. A context that ends inside a character (a
    prompt cut mid-character) shows U+FFFD there, which the character replaces once completed: that character
    belongs to the new text. (Later windows may start inside one; the U+FFFD there is in both texts.)"""
    before = self._decode(self.prefix, self.read)
    return before.rstrip(_INCOMPLETE) if self._first else before

  def add(self, token):
    """Appends one token id -> the text it adds now ('' when held back)."""
    self.ids.append(int(token))
    before = self._before()
    after = self._decode(self.prefix, len(self.ids))
    if len(after) > len(before) and not after.endswith(_INCOMPLETE):
      piece = after[len(before):]
      self.prefix, self.read, self._first = self.read, len(self.ids), False
    else:
      piece = ""
    self.pieces.append(piece)
    return piece

  def extend(self, tokens):
    """Appends several token ids -> the text they add."""
    return "".join(self.add(t) for t in tokens)

  def flush(self):
    """At the end of the sequence: the held-back text (an unfinished character's U+FFFD), added to the last
    token's piece -> that text."""
    rest = self._decode(self.prefix, len(self.ids))[len(self._before()):]
    if rest and self.pieces:
      self.pieces[-1] += rest
      self.prefix, self.read, self._first = self.read, len(self.ids), False
    return rest if self.pieces else ""

  @property
  def text(self):
    """The text of the appended tokens so far (held-back text excluded until `flush`)."""
    return "".join(self.pieces)


def token_texts(tokenizer, ids, context=()):
  """Each of `ids`' texts after `context`, decoded incrementally and flushed at the end -> list[str]."""
  decoder = IncrementalDecoder(tokenizer, context)
  decoder.extend(ids)
  decoder.flush()
  return decoder.pieces
