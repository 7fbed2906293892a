"""Evaluate: `python eval.py --workdir DIR [--split test] [--average-last K]`, or score a
system output with `python eval.py --hyp FILE --ref FILE`."""

from jaxformer.evaluate import main

if __name__ == "__main__":
  main()
