"""Tests for jaxformer.bleu against published scores and a brute-force BLEU."""

import collections
import math
import os
import shutil
import subprocess

import pytest

from jaxformer import bleu
from jaxformer.data import read_lines
from jaxformer.errors import UserError

DATA = "/work/shared/data/multi30k"
HYP = os.path.join(DATA, "test2016.opus-mt-en-de.hyp.de")
REF = os.path.join(DATA, "test2016.de")
NEWSTEST = "/work/shared/data/wmt14/newstest2014.de"

# get_ende_bleu.sh's compound split, verbatim.
ATAT_ONE_LINER = r"s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g"
needs_perl = pytest.mark.skipif(shutil.which("perl") is None, reason="perl not installed")


def perl_atat(lines):
  """Runs `perl -ple ATAT_ONE_LINER` on UTF-8 lines, as get_ende_bleu.sh does.

  A clean environment: PERL_UNICODE or PERL5OPT (e.g. -CS) would make perl read
  characters instead of the bytes the script sees.
  """
  data = "".join(l + "\n" for l in lines).encode("utf-8")
  out = subprocess.run(["perl", "-ple", ATAT_ONE_LINER], input=data, capture_output=True, check=True,
                       env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C"}).stdout
  return out.decode("utf-8").split("\n")[:-1]


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
  if shutil.which("perl"):
    # The same number from perl's split and a brute-force multi-bleu on the
    # Moses-tokenized files; 36.30 is the figure issue 19 asks to keep.
    hyps, refs = read_lines(HYP), read_lines(REF)
    want = brute_force_bleu(perl_atat([bleu.moses_tokenize(h) for h in hyps]),
                            perl_atat([bleu.moses_tokenize(r) for r in refs]))
    assert t["bleu"] == pytest.approx(want[0], abs=1e-9)
    assert (t["sys_len"], t["ref_len"]) == want[2:]
    assert round(t["bleu"], 2) == 36.30
  report = bleu.format_scores(scores)
  assert "36.25" in report and "comparable with the paper" in report
  assert "tok:13a" in report and "1000" in report


SPLIT_CASES = [
    ("Ein Test-Fall", "Ein Test ##AT##-##AT## Fall"),
    # perl s///g does not overlap: the second hyphen's left char is consumed.
    ("a-b-c", "a ##AT##-##AT## b-c"),
    ("a-b-c-d", "a ##AT##-##AT## b-c ##AT##-##AT## d"),
    ("3-4", "3 ##AT##-##AT## 4"),
    ("x - y", "x - y"),
    ("-links rechts-", "-links rechts-"),
    ("a--b", "a ##AT##-##AT## -b"),
    ("Mutter-Kind-Kur", "Mutter ##AT##-##AT## Kind ##AT##-##AT## Kur"),
    ("Straßen-Café", "Straßen ##AT##-##AT## Café"),
    # perl works on bytes: a one-character middle of two bytes is not consumed
    # by the first match (its first byte is), so the second hyphen splits too.
    ("Pointe-à-Pitre", "Pointe ##AT##-##AT## à ##AT##-##AT## Pitre"),
    ("Dos-à-dos", "Dos ##AT##-##AT## à ##AT##-##AT## dos"),
    ("a-ä-b-c", "a ##AT##-##AT## ä ##AT##-##AT## b-c"),
    ("a-€-b", "a ##AT##-##AT## € ##AT##-##AT## b"),
    # Only ASCII bytes are \s to perl: U+00A0 (C2 A0) is two \S bytes.
    ("a\u00a0-b", "a\u00a0 ##AT##-##AT## b"),
    ("a-\u00a0b", "a ##AT##-##AT## \u00a0b"),
    ("x\u00a0-\u00a0y", "x\u00a0 ##AT##-##AT## \u00a0y"),
    ("a\t-b", "a\t-b"),
]


@pytest.mark.parametrize("line,expected", SPLIT_CASES)
def test_split_compounds(line, expected):
  assert bleu.split_compounds(line) == expected


@needs_perl
def test_split_compounds_equals_perl_one_liner():
  # The cases above, and every character class around and between hyphens:
  # ASCII whitespace, Latin-1 (whose UTF-8 continuation bytes include 0x85 and
  # 0xA0, whitespace to Unicode but not to perl on bytes), Unicode spaces, 3-
  # and 4-byte characters.
  chars = ([chr(i) for i in range(1, 128) if i != 10] + [chr(i) for i in range(0x80, 0x100)] +
           ["\u2009", "\u202f", "\u3000", "\u2028", "–", "—", "„", "“", "‚", "‘", "’", "»", "«", "中", "😀"])
  lines = [line for line, _ in SPLIT_CASES]
  lines += [f"x{c}-{c}y-{c}-z {c}-{c}-{c}" for c in chars]
  assert [bleu.split_compounds(l) for l in lines] == perl_atat(lines)


def test_moses_tokenize_german():
  # tokenizer.perl -l de only: typographic quotes stay, ASCII ones are escaped.
  assert (bleu.moses_tokenize("„Das ist ein Test-Fall“, sagte er.") ==
          "„ Das ist ein Test-Fall “ , sagte er .")
  assert bleu.moses_tokenize('"Hallo"') == "&quot; Hallo &quot;"


# Hypotheses and references with differing quote styles, hyphen chains with
# ASCII and non-ASCII middles, numbers and no-break spaces.
PIPELINE_HYPS = [
    '"Hallo", sagte er.',
    "Er sagte: 'Nein' und ging nach Pointe-à-Pitre.",
    "Die „Dos-à-dos“-Bänke, Reihe 3-4, a-b-c.",
    "Preis:\u00a0100-200\u00a0Euro « ja » - Mutter-Kind-Kur.",
    "Es ist 9-10 Uhr, sagt ‚er‘ – wie immer.",
]
PIPELINE_REFS = [
    "„Hallo“, sagte er.",
    "Er sagte: ‚Nein‘ und ging nach Pointe-à-Pitre.",
    'Die "Dos-à-dos"-Bänke, Reihe 3-4, a-ä-c.',
    "Preis: 100-200 Euro » ja « – Mutter-Kind-Kur.",
    "Es ist 9-10 Uhr, sagt ’er’ - wie immer.",
]


@needs_perl
def test_tokenized_bleu_equals_perl_pipeline():
  hyps = perl_atat([bleu.moses_tokenize(h) for h in PIPELINE_HYPS])
  refs = perl_atat([bleu.moses_tokenize(r) for r in PIPELINE_REFS])
  assert "nach Pointe ##AT##-##AT## à ##AT##-##AT## Pitre" in hyps[1]
  for lines in (PIPELINE_HYPS, PIPELINE_REFS):
    assert [bleu.split_compounds(bleu.moses_tokenize(l)) for l in lines] == perl_atat(
        [bleu.moses_tokenize(l) for l in lines])
  got = bleu.tokenized_bleu(PIPELINE_HYPS, PIPELINE_REFS)
  want, precisions, sys_len, ref_len = brute_force_bleu(hyps, refs)
  assert got["bleu"] == pytest.approx(want, abs=1e-9) and want > 0
  assert got["precisions"] == pytest.approx([100 * p for p in precisions])
  assert (got["sys_len"], got["ref_len"]) == (sys_len, ref_len)


def normalised_bleu(hyps, refs):
  """The old scorer: replace-unicode-punctuation on both sides before tokenizing."""
  import sacremoses
  norm = sacremoses.MosesPunctNormalizer(lang="de")
  prep = lambda l: bleu.split_compounds(bleu.moses_tokenize(norm.replace_unicode_punct(l)))
  return brute_force_bleu([prep(h) for h in hyps], [prep(r) for r in refs])[0]


def test_quote_style_counts_as_error():
  # A hypothesis identical to its reference but for the quote style loses
  # BLEU, as with get_ende_bleu.sh; normalising punctuation hid some of that.
  refs = ["„Das ist“, sagte er, „ein ‚kleiner‘ Test.“", "Er rief: »Halt!« und ‚lief‘ weg.",
          "„Gut“ – sagte sie – „sehr gut“."]
  hyps = ['"Das ist", sagte er, "ein \'kleiner\' Test."', "Er rief: \"Halt!\" und 'lief' weg.",
          '"Gut" - sagte sie - "sehr gut".']
  assert bleu.tokenized_bleu(refs, refs)["bleu"] == pytest.approx(100.0)
  got = bleu.tokenized_bleu(hyps, refs)["bleu"]
  assert 0 < got < normalised_bleu(hyps, refs) - 10  # 14.7 vs 33.6


@pytest.mark.skipif(not os.path.exists(NEWSTEST), reason="shared wmt14 data not available")
def test_quote_style_on_newstest2014():
  # The reference against a copy of itself with ASCII quotes (issue 19).
  ascii_quotes = str.maketrans({"„": '"', "“": '"', "”": '"', "»": '"', "«": '"', "‚": "'", "‘": "'", "’": "'"})
  refs = read_lines(NEWSTEST)[:600]
  hyps = [r.translate(ascii_quotes) for r in refs]
  assert sum(h != r for h, r in zip(hyps, refs)) > 30
  got = bleu.tokenized_bleu(hyps, refs)["bleu"]
  assert got < normalised_bleu(hyps, refs) - 0.3  # 98.78 vs 99.41 on these 600 lines


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
