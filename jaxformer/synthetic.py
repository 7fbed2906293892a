"""Offline demo corpus: English -> German sentences with spelled-out numbers.

German writes units before tens in one word ("twenty-one" ->
"einundzwanzig", "three hundred and forty-five" ->
"dreihundertfünfundvierzig") and some templates move the verb to the end, so
a model has to reorder, not copy word by word. English uses ~60 words;
German numbers are single compound words, so use a subword (a ~200-piece
sentencepiece model splits them into drei/hundert/fünf/und/vierzig) or char
tokenizer. Sentences have at most 13 words, all lowercase with punctuation
split off: a tiny Transformer learns it on a CPU in minutes.
"""

import random

_EN_UNITS = ("", "one", "two", "three", "four", "five", "six", "seven",
             "eight", "nine", "ten", "eleven", "twelve", "thirteen",
             "fourteen", "fifteen", "sixteen", "seventeen", "eighteen",
             "nineteen")
_EN_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy",
            "eighty", "ninety")
_DE_UNITS = ("", "eins", "zwei", "drei", "vier", "fünf", "sechs", "sieben",
             "acht", "neun", "zehn", "elf", "zwölf", "dreizehn", "vierzehn",
             "fünfzehn", "sechzehn", "siebzehn", "achtzehn", "neunzehn")
_DE_TENS = ("", "", "zwanzig", "dreißig", "vierzig", "fünfzig", "sechzig",
            "siebzig", "achtzig", "neunzig")

# (English, German) with "{}" for the number. Every noun phrase is plural and
# the numbers exclude 1 and x01 (see `template_numbers`), so German never
# needs an inflected "ein/eine/einen". Adjectives take the strong plural "-e".
TEMPLATES = (  # detokenized and cased, as real test sets are (German nouns capitalised)
    ("I see {} red cars.", "Ich sehe {} rote Autos."),
    ("We have {} books.", "Wir haben {} Bücher."),
    ("There are {} birds in the tree.", "Im Baum sind {} Vögel."),
    ("She bought {} apples.", "Sie hat {} Äpfel gekauft."),
    ("Yesterday I saw {} dogs.", "Gestern habe ich {} Hunde gesehen."),
    ("The city has {} big parks.", "Die Stadt hat {} große Parks."),
    ("They read {} small books.", "Sie lesen {} kleine Bücher."),
    ("I have {} old friends.", "Ich habe {} alte Freunde."),
)


def english_number(n):
  """Returns British English words for 1 <= n <= 999 ("three hundred and
  forty-five")."""
  if not 1 <= n <= 999:
    raise ValueError(f"{n} is outside 1..999")
  hundreds, rest = divmod(n, 100)
  if rest < 20:
    tail = _EN_UNITS[rest]
  else:
    tens, units = divmod(rest, 10)
    tail = _EN_TENS[tens] + (f"-{_EN_UNITS[units]}" if units else "")
  if not hundreds:
    return tail
  head = f"{_EN_UNITS[hundreds]} hundred"
  return f"{head} and {tail}" if tail else head


def german_number(n):
  """Returns the German cardinal for 1 <= n <= 999, one word
  ("dreihundertfünfundvierzig"); 100 is "einhundert", 101 "einhunderteins"."""
  if not 1 <= n <= 999:
    raise ValueError(f"{n} is outside 1..999")
  hundreds, rest = divmod(n, 100)
  if rest < 20:
    tail = _DE_UNITS[rest]
  else:
    tens, units = divmod(rest, 10)
    # Units lead and "eins" loses its s: 21 = "ein-und-zwanzig".
    unit = "ein" if units == 1 else _DE_UNITS[units]
    tail = f"{unit}und{_DE_TENS[tens]}" if units else _DE_TENS[tens]
  # "einhundert", not "hundert": it mirrors "one hundred" word for word.
  head = ("ein" if hundreds == 1 else _DE_UNITS[hundreds]) + "hundert"
  return (head if hundreds else "") + tail


def template_numbers(max_number=999):
  """Numbers used in sentences: 2..max_number except those ending in 01.

  1 and x01 would need "ein"/"eine"/"eins" agreement with the noun (and "one
  car" is singular), which the plural templates avoid.
  """
  return [n for n in range(2, max_number + 1) if n % 100 != 1]


def numbers_corpus(n, seed=0, max_number=999):
  """Samples `n` sentence pairs (with repeats), deterministic in `seed`.

  Returns:
    (en_lines, de_lines), two lists of n str.
  """
  rng = random.Random(seed)
  numbers = template_numbers(max_number)
  en, de = [], []
  for _ in range(n):
    x = rng.choice(numbers)
    t_en, t_de = rng.choice(TEMPLATES)
    en.append(t_en.format(english_number(x)))
    de.append(t_de.format(german_number(x)))
  return en, de


def split_train_test(en, de, test_fraction=0.1, seed=0):
  """Holds out distinct pairs: no test pair occurs anywhere in train.

  Returns:
    ((train_en, train_de), (test_en, test_de)); test pairs are distinct,
    train keeps its repeats.
  """
  distinct = sorted(set(zip(en, de)))
  random.Random(seed).shuffle(distinct)
  test = distinct[:max(1, int(len(distinct) * test_fraction))]
  held = set(test)
  train = [p for p in zip(en, de) if p not in held]
  return ([e for e, _ in train], [d for _, d in train]), (
      [e for e, _ in test], [d for _, d in test])


# ----------------------------------------------------------------------------
# Fine-tuning: a generated instruction task ("reverse these words") in chat form, and preferences.

WORDS = ("cat", "dog", "sun", "map", "red", "big", "cup", "hat", "pen", "box", "sky", "owl", "fig", "jam",
         "kit", "log")


def reverse_words_records(n, seed=0, min_words=3, max_words=5):
  """`n` SFT records {"messages": [user, assistant]}: the user asks to reverse 3-5 words of WORDS,
  the assistant answers with them reversed (a seeded, reproducible set)."""
  rng = random.Random(seed)
  out = []
  for _ in range(n):
    words = [rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))]
    out.append({"messages": [{"role": "user", "content": "reverse: " + " ".join(words)},
                             {"role": "assistant", "content": " ".join(reversed(words))}]})
  return out


def reverse_words_preferences(n, seed=0):
  """`n` DPO records {"prompt", "chosen", "rejected"} (conversational prompt): chosen is the words
  reversed, rejected the words as given (a copy, the natural mistake)."""
  out = []
  for record in reverse_words_records(n, seed):
    user, answer = record["messages"]
    words = user["content"].removeprefix("reverse: ")
    if words == answer["content"]:  # a palindrome: no preference to learn
      continue
    out.append({"prompt": [user], "chosen": [answer], "rejected": [{"role": "assistant", "content": words}]})
  return out
