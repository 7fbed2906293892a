"""Evaluate: `python eval.py --workdir DIR [--split test] [--average-last K]`, score a system output with
`python eval.py --hyp FILE --ref FILE`, or run lm-evaluation-harness tasks with
`python eval.py --workdir DIR --tasks hellaswag,arc_easy` (jaxformer.harness)."""

import sys

if __name__ == "__main__":
  if any(a == "--tasks" or a.startswith("--tasks=") for a in sys.argv[1:]):
    from jaxformer.harness import main  # lm-eval is imported only for --tasks
  else:
    from jaxformer.evaluate import main
  main()
