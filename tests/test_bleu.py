"""Tests for jaxformer.bleu against published scores and a brute-force BLEU."""

import collections
import math
import os

import pytest

from jaxformer import bleu
from jaxformer.errors import UserError

DATA = "/work/shared/data/multi30k"
HYP = os.path.join(DATA, "test2016.opus-mt-en-de.hyp.de")
REF = os.path.join(DATA, "test2016.de")


def brute_force_bleu(hyps, refs):
  """multi-bleu.perl from the BLEU paper: clipped counts, no smoothing."""
  correct, total = [0] * 4, [0] * 4
  sys_len = ref_len = 0
  for h, r in zip(hyps, refs):
    h, r = h.split(), r.split()
    sys_len, ref_len = sys_len + len(h), ref_len + len(r)
    for n in range(1, 5):
      hc = collections.Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
      rc = collections.Counter(tuple(r[i:i + n]) for i in range(len(r) - n + 1))
      total[n - 1] += sum(hc.values())
      correct[n - 1] += sum(min(c, rc[g]) for g, c in hc.items())
  precisions = [c / t if t else 0.0 for c, t in zip(correct, total)]
  bp = 1.0 if sys_len >= ref_len else math.exp(1 - ref_len / sys_len)
  if min(precisions) == 0:
    return 0.0, precisions, sys_len, ref_len
  score = bp * math.exp(sum(math.log(p) for p in precisions) / 4)
  return 100 * score, precisions, sys_len, ref_len


@pytest.mark.skipif(not (os.path.exists(HYP) and os.path.exists(REF)),
                    reason="shared multi30k data not available")
def test_opus_mt_multi30k_matches_published_sacrebleu():
  scores = bleu.score_files(HYP, REF)
  s = scores["sacrebleu"]
  # Published by Helsinki-NLP/OPUS-MT-leaderboard (sacreBLEU 2.0.0).
  assert round(s["bleu"], 2) == 36.25
  assert [round(p, 1) for p in s["precisions"]] == [67.1, 42.6, 29.3, 20.6]
  assert (s["sys_len"], s["ref_len"]) == (12627, 12106)
  assert round(s["chrf"], 2) == 64.26
  assert s["signature"].startswith(
      "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp")
  assert scores["segments"] == 1000
  t = scores["tokenized"]
  assert t["compound_split"] and 30 < t["bleu"] < 45
  assert t["sys_len"] > s["sys_len"]  # ##AT## splitting adds tokens.
  report = bleu.format_scores(scores)
  assert "36.25" in report and "comparable with the paper" in report
  assert "tok:13a" in report and "1000" in report


@pytest.mark.parametrize("line,expected", [
    ("Ein Test-Fall", "Ein Test ##AT##-##AT## Fall"),
    # perl s///g does not overlap: the second hyphen's left char is consumed.
    ("a-b-c", "a ##AT##-##AT## b-c"),
    ("a-b-c-d", "a ##AT##-##AT## b-c ##AT##-##AT## d"),
    ("x - y", "x - y"),
    ("-links rechts-", "-links rechts-"),
    ("a--b", "a ##AT##-##AT## -b"),
    ("Mutter-Kind-Kur", "Mutter ##AT##-##AT## Kind ##AT##-##AT## Kur"),
    ("Straßen-Café", "Straßen ##AT##-##AT## Café"),
    # perl works on bytes: a no-break space is not \s to it.
    ("a\u00a0-b", "a\u00a0 ##AT##-##AT## b"),
])
def test_split_compounds(line, expected):
  assert bleu.split_compounds(line) == expected


def test_moses_tokenize_german():
  # replace-unicode-punctuation turns “ into ", tokenizer.perl escapes it.
  assert (bleu.moses_tokenize("„Das ist ein Test-Fall“, sagte er.") ==
          "„ Das ist ein Test-Fall &quot; , sagte er .")


# Plain lowercase/uppercase words: Moses leaves them as they are, so the
# brute force can split on whitespace. Covers clipping, case, BP < 1.
HYPS = [
    "der der der der Hund",
    "die Katze sitzt auf der Matte",
    "Ein Mann fährt mit dem Fahrrad durch die Stadt",
    "zwei kleine Kinder spielen im Sand am Strand",
]
REFS = [
    "der Hund bellt laut",
    "die Katze saß auf der Matte neben dem Hund",
    "ein Mann fährt mit einem Fahrrad durch die Stadt",
    "zwei Kinder spielen im Sand am Strand und lachen laut",
]


def test_tokenized_bleu_matches_brute_force():
  assert [bleu.moses_tokenize(x) for x in HYPS + REFS] == HYPS + REFS
  got = bleu.tokenized_bleu(HYPS, REFS)
  want, precisions, sys_len, ref_len = brute_force_bleu(HYPS, REFS)
  assert sys_len < ref_len  # Exercises the brevity penalty.
  assert got["bleu"] == pytest.approx(want, abs=1e-9)
  assert got["precisions"] == pytest.approx([100 * p for p in precisions])
  assert (got["sys_len"], got["ref_len"]) == (sys_len, ref_len)


def test_tokenized_bleu_splits_compounds_and_tokenizes():
  hyps = ["Ein schöner Test-Fall für alle hier."]
  refs = ["Ein schöner Test-Spiel für alle hier."]
  split = bleu.tokenized_bleu(hyps, refs)
  want = brute_force_bleu(
      ["Ein schöner Test ##AT##-##AT## Fall für alle hier ."],
      ["Ein schöner Test ##AT##-##AT## Spiel für alle hier ."])
  assert split["bleu"] == pytest.approx(want[0], abs=1e-9)
  assert split["sys_len"] == 9
  plain = bleu.tokenized_bleu(hyps, refs, compound_split=False)
  want = brute_force_bleu(["Ein schöner Test-Fall für alle hier ."],
                          ["Ein schöner Test-Spiel für alle hier ."])
  assert plain["bleu"] == pytest.approx(want[0], abs=1e-9)
  assert plain["sys_len"] == 7 and 0 < plain["bleu"] < split["bleu"]


def test_tokenized_bleu_perfect_and_unsmoothed_zero():
  assert bleu.tokenized_bleu(REFS, REFS)["bleu"] == pytest.approx(100.0)
  # No 4-gram matches: multi-bleu gives 0 (sacreBLEU's exp smoothing would not).
  got = bleu.tokenized_bleu(["der Hund bellt heute"], ["der Hund bellt laut"])
  assert got["bleu"] == 0 and got["precisions"][2] == 50


def test_line_count_mismatch_raises():
  with pytest.raises(UserError, match="2 lines.*1"):
    bleu.tokenized_bleu(["a", "b"], ["a"])
  with pytest.raises(UserError, match="1 lines.*2"):
    bleu.sacrebleu_scores(["a"], ["a", "b"])


def test_score_files_errors(tmp_path):
  hyp, ref = tmp_path / "hyp.de", tmp_path / "ref.de"
  ref.write_text("eins\nzwei\n", encoding="utf-8")
  with pytest.raises(UserError, match="not found"):
    bleu.score_files(str(hyp), str(ref))
  hyp.write_bytes(b"eins\nzw\xe4i\n")  # Latin-1 umlaut.
  with pytest.raises(UserError, match=":2: not valid UTF-8"):
    bleu.score_files(str(hyp), str(ref))
  hyp.write_text("eins\nzwei\ndrei\n", encoding="utf-8")
  with pytest.raises(UserError, match="3 lines.*has 2"):
    bleu.score_files(str(hyp), str(ref))
  hyp.write_text("eins\nzwei\n", encoding="utf-8")
  assert bleu.score_files(str(hyp), str(ref))["segments"] == 2
