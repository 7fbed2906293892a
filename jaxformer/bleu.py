"""BLEU/chrF scoring: sacreBLEU (reportable) and tokenized compound-split BLEU.

Two numbers answer two questions:
* `sacrebleu_scores`: detokenized corpus BLEU (13a, cased) and chrF2 with
  their sacreBLEU signatures; comparable across papers that report sacreBLEU.
* `tokenized_bleu`: the number "Attention Is All You Need" reports, computed
  like tensor2tensor's `get_ende_bleu.sh` (Moses tokenizer, ##AT## compound
  splitting, multi-bleu.perl). Only comparable with numbers made the same way.
"""

import functools
import re

from jaxformer.data import read_lines
from jaxformer.errors import UserError

# The perl in get_ende_bleu.sh runs on bytes, where \s is ASCII whitespace only
# (e.g. U+00A0 is not a space to it); re.ASCII reproduces that. re.sub scans
# left to right without overlaps exactly like perl's s///g, so "a-b-c" becomes
# "a ##AT##-##AT## b-c" in both.
_COMPOUND = re.compile(r"(\S)-(\S)", re.ASCII)


def _check_same_length(hyps, refs):
  if len(hyps) != len(refs):
    raise UserError(
        f"hypotheses have {len(hyps)} lines but references have {len(refs)};"
        " they must be aligned line by line")


def sacrebleu_scores(hyps: list[str], refs: list[str]) -> dict:
  """Corpus sacreBLEU (13a, cased, exp smoothing) and chrF2 with signatures."""
  # Imported lazily so importing jaxformer does not require the eval extras.
  from sacrebleu.metrics import BLEU, CHRF
  _check_same_length(hyps, refs)
  bleu, chrf = BLEU(), CHRF()
  b = bleu.corpus_score(list(hyps), [list(refs)])
  c = chrf.corpus_score(list(hyps), [list(refs)])
  return {
      "bleu": b.score,
      "precisions": list(b.precisions),
      "bp": b.bp,
      "sys_len": b.sys_len,
      "ref_len": b.ref_len,
      "signature": bleu.get_signature().format(),
      "chrf": c.score,
      "chrf_signature": chrf.get_signature().format(),
  }


def split_compounds(line: str) -> str:
  """Rewrites `Test-Fall` as `Test ##AT##-##AT## Fall` (get_ende_bleu.sh)."""
  return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", line)


@functools.cache
def _moses():
  import sacremoses
  return sacremoses.MosesPunctNormalizer(lang="de"), sacremoses.MosesTokenizer(
      lang="de")


def moses_tokenize(line: str) -> str:
  """replace-unicode-punctuation.perl + tokenizer.perl -l de, as one string."""
  norm, tok = _moses()
  # get_ende_bleu.sh normalizes unicode punctuation of the hypothesis before
  # tokenizing; doing it to the raw reference too keeps „“ vs "" from
  # counting as errors.
  return tok.tokenize(norm.replace_unicode_punct(line), return_str=True,
                      escape=True)


def tokenized_bleu(hyps: list[str], refs: list[str],
                   compound_split: bool = True) -> dict:
  """BLEU-4 as in t2t get_ende_bleu.sh: Moses de, ##AT## split, multi-bleu."""
  from sacrebleu.metrics import BLEU
  _check_same_length(hyps, refs)

  def prep(line):
    line = moses_tokenize(line)
    return split_compounds(line) if compound_split else line

  # With tokenize='none' and no smoothing sacreBLEU counts whitespace-split
  # n-grams with clipping, brevity penalty and BLEU=0 on any zero precision,
  # i.e. multi-bleu.perl (tests cross-check this against a brute-force count).
  b = BLEU(tokenize="none", smooth_method="none", force=True).corpus_score(
      [prep(h) for h in hyps], [[prep(r) for r in refs]])
  return {
      "bleu": b.score,
      "precisions": list(b.precisions),
      "bp": b.bp,
      "sys_len": b.sys_len,
      "ref_len": b.ref_len,
      "compound_split": compound_split,
  }


def score_files(hyp_path: str, ref_path: str) -> dict:
  """Scores a hypothesis file against a reference file (both UTF-8)."""
  hyps, refs = read_lines(hyp_path), read_lines(ref_path)
  if len(hyps) != len(refs):
    raise UserError(f"{hyp_path} has {len(hyps)} lines but {ref_path} has "
                    f"{len(refs)}; they must be aligned line by line")
  if not refs:
    raise UserError(f"{ref_path} is empty; nothing to score")
  return {
      "segments": len(refs),
      "sacrebleu": sacrebleu_scores(hyps, refs),
      "tokenized": tokenized_bleu(hyps, refs, compound_split=True),
  }


def format_scores(scores: dict) -> str:
  """A short human-readable report of `score_files` output."""
  s, t = scores["sacrebleu"], scores["tokenized"]
  p = "/".join(f"{x:.1f}" for x in s["precisions"])
  tp = "/".join(f"{x:.1f}" for x in t["precisions"])
  return "\n".join([
      f"sacreBLEU  BLEU|{s['signature']} = {s['bleu']:.2f} {p} "
      f"(BP = {s['bp']:.3f} hyp_len = {s['sys_len']} ref_len = {s['ref_len']})",
      f"chrF       chrF2|{s['chrf_signature']} = {s['chrf']:.2f}",
      f"tokenized compound-split BLEU (comparable with the paper) = "
      f"{t['bleu']:.2f} {tp} (BP = {t['bp']:.3f} hyp_len = {t['sys_len']} "
      f"ref_len = {t['ref_len']})",
      f"segments   {scores['segments']}",
  ])
