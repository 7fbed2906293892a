"""Peak memory of preparing one big text file (`data.doc_per=file`) and time of reading one long line.

    python benchmarks/single_file_memory.py [--dir /tmp/jaxformer_single_file] [--mb 30,120]
        [--root CHECKOUT] [--line-mb 4,8,16]

1. For each size in --mb: a generated text file of that many MB (seeded random words, lines of
   3-40 words, in --dir, never in the repository), then
   `python -m jaxformer.prepare --config shakespeare_char data.text_path=FILE` (char tokenizer, the
   recipe's data.num_proc workers) in a fresh process; its peak RSS (VmHWM) and that of its largest
   worker, from getrusage of the waited-for processes. Streaming keeps both flat in the file's size;
   reading the document whole grows them ~13x the file.
2. For each size in --line-mb: `sources.lines` over a file of ONE line of that many MB, read in
   64 KiB blocks: seconds (best of 3). Linear: doubles with the size; the old reader's
   `rest + block` and `rfind` over the growing buffer quadruple.

--root runs another checkout's jaxformer (e.g. `git worktree add /tmp/old <commit>`) for an A/B.
Everything under --dir is deleted at the end.
"""

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
WORDS = ("the king queen of a and to in my thy lord love sweet death night day heart heaven hand "
         "eyes sir good come go speak hear me you him her").split()


def make_text(path, mb, seed=0):
  """About `mb` MB of lines of random words (a 1 MB seeded block, varied by a line number)."""
  rng = np.random.default_rng(seed)
  lines = [" ".join(rng.choice(WORDS, rng.integers(3, 40))) for _ in range(6000)]
  block = "\n".join(lines) + "\n"
  reps = max(1, int(mb * 1e6 / len(block)))
  with open(path, "w") as f:
    for i in range(reps):
      f.write(f"{i}: " + block)


def peak_rss(cmd, env, cwd):
  """(seconds, peak RSS in MiB of the largest process the command ran: itself or a worker)."""
  code = ("import resource, subprocess, sys, json, time; t = time.perf_counter(); "
          "r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
          "print(json.dumps([r.returncode, time.perf_counter() - t, "
          "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss]))")
  out = subprocess.run([sys.executable, "-c", code, *cmd], env=env, cwd=cwd, capture_output=True, text=True,
                       check=True)
  rc, seconds, maxrss_kib = json.loads(out.stdout.strip().splitlines()[-1])
  assert rc == 0, out.stderr
  return seconds, maxrss_kib / 1024


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dir", default="/tmp/jaxformer_single_file")
  parser.add_argument("--mb", default="30,120")
  parser.add_argument("--line-mb", default="4,8,16")
  parser.add_argument("--root", default=ROOT, help="the jaxformer checkout to run")
  parser.add_argument("--num-proc", type=int, default=None, help="data.num_proc (default: the recipe's)")
  args = parser.parse_args()
  root = os.path.abspath(args.root)
  os.makedirs(args.dir, exist_ok=True)
  env = {**os.environ, "PYTHONPATH": root}
  print(f"checkout {root}; load average {os.getloadavg()[0]:.2f}")
  try:
    for mb in [float(x) for x in args.mb.split(",") if x]:
      path = os.path.join(args.dir, f"text_{mb:g}mb.txt")
      make_text(path, mb)
      workdir = os.path.join(args.dir, f"run_{mb:g}")
      shutil.rmtree(workdir, ignore_errors=True)
      cmd = [sys.executable, "-m", "jaxformer.prepare", "--config", "shakespeare_char", "--workdir", workdir,
             f"data.text_path={path}"] + ([f"data.num_proc={args.num_proc}"] if args.num_proc else [])
      seconds, rss = peak_rss(cmd, env, root)  # run in the checkout: `-m` imports from the working directory
      size = os.path.getsize(path) / 2**20
      print(f"prepare one {size:.0f} MiB file (doc_per=file, char): peak RSS {rss:.0f} MiB "
            f"({rss / size:.2f} x the file), {seconds:.0f} s; load {os.getloadavg()[0]:.2f}")
      shutil.rmtree(workdir)
      os.remove(path)
    for mb in [float(x) for x in args.line_mb.split(",") if x]:
      path = os.path.join(args.dir, "line.txt")
      with open(path, "w") as f:
        f.write("x" * int(mb * 2**20) + "\n")
      code = ("import sys, time; from jaxformer import sources; best = 1e9\n"
              "for _ in range(3):\n  t = time.perf_counter(); n = sum(map(len, sources.lines(sys.argv[1], 1 << 16)))\n"
              "  best = min(best, time.perf_counter() - t)\nprint(best, n)")
      out = subprocess.run([sys.executable, "-c", code, path], env=env, cwd=root, capture_output=True, text=True,
                           check=True)
      seconds, n = out.stdout.split()
      print(f"sources.lines on one line of {mb:g} MiB (64 KiB blocks): {float(seconds):.3f} s "
            f"({int(n):,} characters); load {os.getloadavg()[0]:.2f}")
      os.remove(path)
  finally:
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
  main()
