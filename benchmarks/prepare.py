"""Preparing and reading a corpus larger than one wants in memory: throughput, memory, kill -9.

    python benchmarks/prepare.py --dir /tmp/jaxformer_corpus [--gb 2] [--small-mb 50] [--keep]

--dir must be outside the repository (the corpus and its shards are gigabytes; never commit
them); everything there is deleted at the end unless --keep. Steps, all in one run:

1. A corpus of --gb gigabytes and one of --small-mb megabytes of plain text, a document per
   line, by seeded recombination of the lines of the small corpora in ../shared/data
   (JAXFORMER_DATA): each document joins 3-40 random lines.
2. sentencepiece (8k BPE) on the small corpus: `prepare` (data.num_proc workers) against the
   raw speed of the same tokenizer encoding the same documents from memory on as many threads
   (the limit), MB/s and tokens/s; and the memory (peak RSS) of prepare's main process and of
   its largest worker.
3. The byte tokenizer on the big corpus: the same comparison, and the same memory figures.
4. Training (`train.py --config gpt2_tiny`, bytes) from the big and from the small corpus's
   shards, random windows and packed rows: peak RSS, and anonymous vs file-backed RSS at the end.
5. The input pipeline from the big corpus's shards: tokens/s of batches (and from memory);
   random windows read through memory maps against positional reads (time, RSS).
6. kill -9 of `python -m jaxformer.prepare` on the big corpus after its 3rd shard, the same
   command again, and the sha256 of every file against the uninterrupted run's.
"""

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from jaxformer import data as data_lib  # pylint: disable=g-import-not-at-top
from jaxformer import shards
from jaxformer import tokenizer as tokenizer_lib

DEFAULT_DATA = os.environ.get("JAXFORMER_DATA", os.path.join(ROOT, "..", "shared", "data"))
SOURCES = ("tinyshakespeare/input.txt", "multi30k/train.en", "multi30k/train.de", "wmt14/train_sample.en",
           "wmt14/train_sample.de", "wikitext2/wiki.test.raw", "wikitext2/wiki.valid.tokens")
# prepare.main, then its own peak RSS (VmHWM: ru_maxrss would also count the image of the process
# that spawned it, which Linux carries over exec) and that of its largest worker (an upper bound:
# a waited-for child's ru_maxrss, its parent's image at the spawn included), in KiB.
PREPARE = """
import json, resource, sys
from jaxformer import prepare
prepare.main(sys.argv[1:])
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("RSS " + json.dumps({"main": int(status["VmHWM"].split()[0]),
                           "worker": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))
"""
# The tokenizer alone (argv: config, overrides..., path).
TOKENIZER = """
import sys
from jaxformer import config, prepare, sources
cfg = config.load_config(sys.argv[1], sys.argv[2:-1])
source = sources.make_source(cfg)
prepare.train_tokenizer(cfg, source, source.open(), sys.argv[-1], log=lambda *a: None)
print("RSS {}")
"""
# train.main, then its peak RSS (VmHWM) and its anonymous and file-backed RSS at the end, in KiB.
TRAIN = """
import json, sys
from jaxformer import train
result = train.main(sys.argv[1:])
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
kib = lambda k: int(status[k].split()[0])
print("RSS " + json.dumps({"peak": kib("VmHWM"), "anon": kib("RssAnon"), "file": kib("RssFile")}))
"""


def make_corpus(path, size, data_dir, seed=0):
  """A document per line, joining 3-40 random lines of the shared corpora, until `size` bytes."""
  if os.path.isfile(path) and os.path.getsize(path) >= size:
    return
  pool = []
  for name in SOURCES:
    with open(os.path.join(data_dir, name), encoding="utf-8") as f:
      pool += [line.strip() for line in f if line.strip()]
  pool = np.array(pool, dtype=object)
  rng, written = np.random.default_rng(seed), 0
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    while written < size:
      counts = rng.integers(3, 41, 10000)
      lines = pool[rng.integers(0, len(pool), counts.sum())]
      ends = np.cumsum(counts)
      text = "".join(" ".join(lines[e - c:e]) + "\n" for c, e in zip(counts, ends))
      f.write(text)
      written += len(text.encode("utf-8"))
  os.replace(path + ".tmp", path)


def digest(folder):
  """sha256 of every file under `folder` but the lock, by relative path."""
  out = {}
  for dirpath, _, names in os.walk(folder):
    for name in sorted(names):
      if name != ".lock":
        h = hashlib.sha256()
        with open(os.path.join(dirpath, name), "rb") as f:
          for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
        out[os.path.relpath(os.path.join(dirpath, name), folder)] = h.hexdigest()
  return out


def run_python(code, args, env=None):
  """Runs `code` with argv `args` in a fresh interpreter; (seconds, stdout's RSS line as a dict, stdout)."""
  t = time.perf_counter()
  proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True,
                        env={**os.environ, **(env or {})})
  dt = time.perf_counter() - t
  if proc.returncode:
    sys.exit(f"failed ({proc.returncode}): {' '.join(args)}\n{proc.stderr[-3000:]}")
  line = [l for l in proc.stdout.splitlines() if l.startswith("RSS ")][-1]
  return dt, json.loads(line[4:]), proc.stdout


def data_args(corpus, kind, data_dir, num_proc):
  vocab = 8000 if kind == "sentencepiece" else 259
  return ["--config", "gpt2_tiny", f"data.text_path={corpus}", "data.doc_per=line", f"data.tokenizer={kind}",
          f"model.vocab_size={vocab}", f"data.data_dir={data_dir}", f"data.num_proc={num_proc}",
          "data.tokenizer_sample_docs=20000", "data.train_fraction=0.999"]


def raw_speed(corpus, tokenizer, threads, max_bytes=None):
  """(MB/s, tokens/s) of the tokenizer alone on the corpus's documents, read into memory first
  (10,000 documents per call, as prepare's chunks), timing only the encoding."""
  seconds, n_bytes, n_tokens = 0.0, 0, 0
  with open(corpus, encoding="utf-8") as f:
    while True:
      docs = [line.rstrip("\n") for _, line in zip(range(10000), f)]
      if not docs or (max_bytes and n_bytes >= max_bytes):
        break
      t = time.perf_counter()
      if hasattr(tokenizer, "encode_array"):
        n_tokens += sum(len(tokenizer.encode_array(d)) for d in docs)
      else:
        n_tokens += sum(map(len, tokenizer.encode_batch(docs, num_threads=threads)))
      seconds += time.perf_counter() - t
      n_bytes += sum(len(d.encode("utf-8")) + 1 for d in docs)
  return n_bytes / seconds / 1e6, n_tokens / seconds


def load():
  """The 1-minute load average: other jobs on the machine (2 cores) slow every figure."""
  return f"load average {os.getloadavg()[0]:.1f}"


def compare(label, corpus, kind, data_dir, num_proc, raw_bytes=None):
  """prepare's throughput and memory next to the tokenizer's raw speed."""
  shutil.rmtree(data_dir, ignore_errors=True)  # from scratch (a corpus is only made once)
  args = data_args(corpus, kind, data_dir, num_proc)
  if kind == "sentencepiece":  # the tokenizer first, timed apart: prepare then only tokenizes
    path = data_dir + "-tokenizer.model"
    dt, _, _ = run_python(TOKENIZER, args[1:] + [path])
    print(f"  sentencepiece 8k BPE trained on a 20,000-document sample in {dt:.0f} s (process start included)")
    args.append(f"data.tokenizer_path={path}")
  dt, rss, _ = run_python(PREPARE, args)
  manifest = shards.read_manifest(data_dir)
  tokens = sum(sum(s["tokens"].values()) for s in manifest["splits"].values())
  mb = os.path.getsize(corpus) / 1e6
  tok = tokenizer_lib.load_tokenizer(manifest["tokenizer"]["path"])
  raw_mb, raw_tok = raw_speed(corpus, tok, num_proc, raw_bytes)
  print(f"{label}: {mb:,.0f} MB, {tokens:,} tokens ({kind}), data.num_proc={num_proc}; {load()}")
  print(f"  prepare: {dt:.1f} s (process start included) = {mb / dt:.2f} MB/s, {tokens / dt / 1e6:.2f}M tokens/s; "
        f"the tokenizer alone from memory on {num_proc} threads: {raw_mb:.2f} MB/s, {raw_tok / 1e6:.2f}M tokens/s "
        f"-> raw / prepare = {raw_mb / (mb / dt):.2f}x")
  print(f"  peak RSS: prepare's main process {rss['main'] / 1024:.0f} MiB, its largest worker "
        f"{rss['worker'] / 1024:.0f} MiB")
  return args


def train_rss(label, args, workdir, packing):
  train_args = [a for a in args if not a.startswith("data.num_proc")] + [
      "--workdir", workdir, f"data.packing={packing}", "train.num_steps=200", "train.log_every=50",
      "train.eval_every=100", "train.eval_batches=5", "train.sample_every_eval=false",
      "train.checkpoint_every=1000", "train.steps_per_call=1"]
  dt, rss, _ = run_python(TRAIN, train_args, env={"JAXFORMER_COMPILATION_CACHE": "off"})
  shutil.rmtree(workdir, ignore_errors=True)
  print(f"  train ({label}, {packing}, 200 steps, {dt:.0f} s, {load()}): peak RSS {rss['peak'] / 1024:.0f} MiB; at the end "
        f"{rss['anon'] / 1024:.0f} MiB anonymous + {rss['file'] / 1024:.0f} MiB file-backed")
  return rss


def pipeline(data_dir, steps):
  """tokens/s of batches from the shards on disk, and from an in-memory array (the first
  20M tokens, as the LM task held its whole stream before shards) for comparison."""
  stream = shards.TokenStream(data_dir, "train", "text")
  in_memory = stream.read(0, min(len(stream), 20_000_000))
  batchers = (("random windows, from shards", lambda L, B: data_lib.LMBatcher(stream, L, B)),
              ("random windows, in memory", lambda L, B: data_lib.LMBatcher(in_memory, L, B)),
              ("packed rows, from shards", lambda L, B: data_lib.PackedLMBatcher(stream, L, B)))
  for batch, block in ((12, 64), (64, 256), (480, 1024)):
    for name, make in batchers:
      b = make(block, batch)
      b.batch_at(0)
      rates = []
      for start in (1, 1 + steps, 1 + 2 * steps):
        t = time.perf_counter()
        for step in range(start, start + steps):
          b.batch_at(step)
        rates.append(steps * batch * block / (time.perf_counter() - t))
      print(f"  {batch} x {block}, {name}: {sorted(rates)[1] / 1e6:.1f}M tokens/s (median of 3 x {steps} batches)")


def read_methods(data_dir, windows=3000, length=33):
  """Random windows through memory maps of the shard files against positional reads (os.pread):
  microseconds per window and the growth of this process's file-backed RSS."""
  import mmap  # pylint: disable=g-import-not-at-top
  rss_file = lambda: int(dict(l.split(":", 1) for l in open("/proc/self/status"))["RssFile"].split()[0]) // 1024
  stream = shards.TokenStream(data_dir, "train", "text")
  rng = np.random.default_rng(0)
  picks = [(k, int(rng.integers(0, stream.token_counts[k] - length)))
           for k in rng.integers(0, len(stream.paths), windows).tolist()]
  maps = []
  for path in stream.paths:
    with open(path, "rb") as f:
      maps.append(np.frombuffer(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), stream.dtype))
  for name, read in (("memory map", lambda k, a: np.array(maps[k][a:a + length])),
                     ("os.pread", lambda k, a: stream._pread(k, a, a + length))):  # pylint: disable=protected-access
    before, t = rss_file(), time.perf_counter()
    for k, a in picks:
      read(k, a)
    print(f"  {windows} random {length}-token windows by {name}: {1e6 * (time.perf_counter() - t) / windows:.1f} us "
          f"each, file-backed RSS +{rss_file() - before} MiB")


def kill_and_resume(args, data_dir, clean):
  shutil.rmtree(data_dir)
  cmd = [sys.executable, "-m", "jaxformer.prepare", *args]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  marker = shards.marker_path(shards.shard_stem(data_dir, "train", 2))
  while not os.path.exists(marker) and proc.poll() is None:
    time.sleep(0.05)
  proc.send_signal(signal.SIGKILL)
  code = proc.wait()
  on_disk = sorted(os.listdir(os.path.join(data_dir, "train")))
  print(f"  kill -9 after shard 3 ({load()}): exit {code}; left {len(on_disk)} files in train/ "
        f"({sum(n.endswith('.tmp') for n in on_disk)} temporary)")
  t = time.perf_counter()
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
  resumed = digest(data_dir)
  same = resumed == clean
  print(f"  the same command again: {time.perf_counter() - t:.0f} s, "
        f"{[l for l in out.splitlines() if 'resuming' in l][:1]}")
  print(f"  sha256 of all {len(clean)} files equal to the uninterrupted run's: {same}")
  return same


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dir", required=True, help="scratch folder outside the repository (gigabytes)")
  parser.add_argument("--data", default=DEFAULT_DATA, help="the shared data folder")
  parser.add_argument("--gb", type=float, default=2.0, help="size of the big corpus (text), GB")
  parser.add_argument("--small-mb", type=float, default=50.0, help="size of the small corpus, MB")
  parser.add_argument("--num-proc", type=int, default=2, help="prepare's worker processes")
  parser.add_argument("--steps", type=int, default=100, help="batches per timed input-pipeline pass")
  parser.add_argument("--keep", action="store_true", help="keep the corpora and shards")
  args = parser.parse_args(argv)
  scratch = os.path.abspath(args.dir)
  if scratch.startswith(os.path.abspath(ROOT) + os.sep):
    sys.exit(f"--dir {scratch} is inside the repository; choose a folder outside it")
  os.makedirs(scratch, exist_ok=True)
  big, small = os.path.join(scratch, "big.txt"), os.path.join(scratch, "small.txt")
  t = time.perf_counter()
  make_corpus(small, int(args.small_mb * 1e6), args.data)
  make_corpus(big, int(args.gb * 1e9), args.data)
  print(f"corpora: {os.path.getsize(big) / 1e9:.2f} GB and {os.path.getsize(small) / 1e6:.0f} MB "
        f"({time.perf_counter() - t:.0f} s to make)")
  try:
    compare("small corpus, sentencepiece", small, "sentencepiece", os.path.join(scratch, "small-spm"),
            args.num_proc)
    shutil.rmtree(os.path.join(scratch, "small-spm"))
    small_args = compare("small corpus, bytes", small, "byte", os.path.join(scratch, "small-byte"), args.num_proc)
    big_args = compare("big corpus, bytes", big, "byte", os.path.join(scratch, "big-byte"), args.num_proc,
                       raw_bytes=int(2e8))
    clean = digest(os.path.join(scratch, "big-byte"))
    print("training memory, big against small corpus (the same model and steps; two rounds):")
    for packing in ("random_windows", "packed"):
      for _ in range(2):
        a = train_rss("small", small_args, os.path.join(scratch, "run"), packing)
        b = train_rss("big", big_args, os.path.join(scratch, "run"), packing)
        print(f"  -> big / small: peak RSS {b['peak'] / a['peak']:.3f}, anonymous RSS at the end "
              f"{b['anon'] / a['anon']:.3f}")
    print(f"input pipeline from the big corpus's shards ({load()}):")
    pipeline(os.path.join(scratch, "big-byte"), args.steps)
    print(f"reading rows from the big corpus's shards ({load()}):")
    read_methods(os.path.join(scratch, "big-byte"))
    kill_and_resume(big_args, os.path.join(scratch, "big-byte"), clean)
  finally:
    if not args.keep:
      shutil.rmtree(scratch)


if __name__ == "__main__":
  main()
