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

# get_ende_bleu.sh's `perl -ple 's{(\S)-(\S)}{$1 ##AT##-##AT## $2}g'` reads
# UTF-8 as bytes (no `use utf8`, no -C): each \S is one byte, and \s is only
# the ASCII [ \t\n\v\f\r], so bytes >= 0x80 (0xA0 and 0x85 included) are \S.
# A bytes pattern does the same. It matters: in "Pointe-à-Pitre" perl's first
# match ends on the first byte of "à", so the second hyphen splits too; on
# characters the "à" would be consumed and "à-Pitre" kept whole. re.sub scans
# left to right without overlaps like perl's s///g ("a-b-c" -> "a ##AT##-##AT##
# b-c" in both). A hyphen is ASCII, so the bytes around it are whole-character
# boundaries and the result is valid UTF-8 again.
_COMPOUND = re.compile(rb"(\S)-(\S)")


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
  return _COMPOUND.sub(rb"\1 ##AT##-##AT## \2", line.encode("utf-8")).decode("utf-8")


@functools.cache
def _moses():
  import sacremoses
  return sacremoses.MosesTokenizer(lang="de")


def moses_tokenize(line: str) -> str:
  """tokenizer.perl -l de (with its XML escapes), as one string."""
  # No punctuation normalisation, so „Hallo“ against "Hallo" costs BLEU as in
  # get_ende_bleu.sh when the paper was written (tensor2tensor 2017: tokenize,
  # split, multi-bleu). A 2018 revision (t2t fc9335c0) added
  # replace-unicode-punctuation.perl on the hypothesis only, against a reference
  # tokenized beforehand; that is a different number from the paper's.
  return _moses().tokenize(line, return_str=True, escape=True)


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
