"""Before/after for a whole benchmark: the same command at two git revisions, run alternately.

    python benchmarks/revisions_ab.py --before 32835d9 [--after ""] [--rounds 3] -- \
        benchmarks/decode.py --config gpt2_small --batch 1 --prompt-len 128 --new-tokens 64

Each revision is checked out (git archive; "" = the working tree) into a temporary
directory and the command runs there in its own process, A B A B ... (--rounds pairs), so a
machine whose speed drifts slows both alike. The command's table rows (a name, then
numbers, columns separated by two or more spaces, as `decode.py` prints them) are collected;
printed per row: each revision's median of every numeric column and after/before of the
column chosen by --column (default: the second number, decode.py's "median s").
Use it where `ab_function.py` cannot swap one function (the signature changed between the
revisions) and `same_program.py` does not cover the program (decode).
"""

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
_NUMBER = re.compile(r"^-?[\d,]*\.?\d+(e-?\d+)?$|^nan$")


def checkout(rev):
  """A directory holding revision `rev` ("" = the working tree itself)."""
  if not rev:
    return ROOT
  tree = tempfile.mkdtemp(prefix="revisions_ab_")
  archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
  subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
  return tree


def rows(text):
  """{row name: [numbers]} for the lines that are a name followed by numeric columns."""
  out = {}
  for line in text.splitlines():
    fields = [f for f in re.split(r"\s{2,}", line.strip()) if f]
    numbers = []
    for field in fields[1:]:
      if not _NUMBER.match(field):
        break
      numbers.append(float(field.replace(",", "")))
    if len(numbers) >= 2:
      out[fields[0]] = numbers
  return out


def run(tree, command):
  """The command's stdout, run in `tree` with that tree's package first on the path."""
  out = subprocess.run([sys.executable, *command], cwd=tree, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")})
  if out.returncode:
    sys.exit(f"error: {' '.join(command)} failed in {tree}:\n{out.stderr[-2000:]}")
  return out.stdout


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--before", required=True, help="git revision (before)")
  parser.add_argument("--after", default="", help='git revision (after); "" = the working tree')
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--column", type=int, default=1, help="which number of a row the ratio is of (0-based)")
  parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark and its arguments")
  args = parser.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    parser.error("give the benchmark command after --")
  trees = {"before": checkout(args.before), "after": checkout(args.after)}
  series = {k: collections.defaultdict(list) for k in trees}
  for r in range(args.rounds):
    for label, tree in trees.items():
      table = rows(run(tree, command))
      for name, numbers in table.items():
        series[label][name].append(numbers)
      print(f"round {r + 1}/{args.rounds} {label} done (load {os.getloadavg()[0]:.2f}): "
            + "; ".join(f"{name} {' '.join(f'{x:g}' for x in xs)}" for name, xs in table.items()), flush=True)
  print(f"\n{' '.join(command)}\nbefore = {args.before}, after = {args.after or 'working tree'}; "
        f"{args.rounds} alternating runs each; medians")
  for name in series["before"]:
    if name not in series["after"]:
      continue
    before, after = (np.median(np.asarray(series[k][name]), axis=0) for k in ("before", "after"))
    fmt = lambda xs: " ".join(f"{x:10.4g}" for x in xs)
    ratio = after[args.column] / before[args.column] if before[args.column] else float("nan")
    print(f"{name:30s} before {fmt(before)} | after {fmt(after)} | after/before {ratio:.3f}")


if __name__ == "__main__":
  main()
