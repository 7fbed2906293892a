"""Does a change leave the compiled train step alone? Compares XLA's optimized program at two revisions.

    python benchmarks/same_program.py --before 962bb54 [--config shakespeare_char] [overrides ...]
        [--batch 12,64]

Each revision is checked out (git archive) into a temporary directory and, in its own
process, compiles the train step (`train.make_train_step`, one CPU device, abstract inputs)
for the same config and batch shape; the optimized HLO is compared after dropping what
only names source lines (metadata, stack frames) and instruction numbering. The same
program means the same step time, so this stands in for a timed A/B where it can.
"""

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")

_DUMP = r"""
import sys, jax, jax.numpy as jnp, flax.linen as nn
from jaxformer import config, model as model_lib, optim, tasks, train
name, shape, overrides = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], sys.argv[3:]
cfg = config.load_config(name, overrides)
model = model_lib.build_model(cfg.model)
tx, schedule = optim.build_optimizer(cfg)
lm = cfg.data.task == "lm"
keys = ["inputs", "targets"] if lm else ["inputs", "decoder_inputs", "targets", "inputs_segmentation",
                                         "targets_segmentation", "inputs_position", "targets_position"]
rows, lengths = shape[0], shape[1:]
length = lambda k: lengths[0] if (lm or k.startswith("inputs")) else lengths[-1]
batch = {k: jax.ShapeDtypeStruct((rows, length(k)), jnp.int32) for k in keys}
ids = jnp.ones((1, 4), jnp.int32)
state = jax.eval_shape(lambda: nn.unbox(train.init_state(model, tx, (ids,) if lm else (ids, ids), jax.random.key(0))))
task = tasks.LMTask if lm else tasks.TranslationTask
print(jax.jit(train.make_train_step(model, task, cfg, tx, schedule)).lower(state, batch).compile().as_text())
"""


def normalized(text):
  """Optimized HLO without source locations and instruction/constant numbering."""
  lines = []
  for line in text.splitlines()[1:]:  # the first line lists the entry layout, with parameter names
    if re.match(r"^\d+ ", line) or line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      continue
    line = re.sub(r", metadata=\{[^}]*\}|stack_frame_id=\d+", "", line)
    lines.append(re.sub(r"(%[A-Za-z_][\w\-]*)\.\d+", r"\1", line))
  return [line for line in lines if line.strip()]


def program(rev, config, batch, overrides):
  """The normalized program at git revision `rev` ("" = the working tree)."""
  if rev:
    tree = tempfile.mkdtemp(prefix="same_program_")
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tree], input=archive, check=True)
  else:
    tree = ROOT
  out = subprocess.run([sys.executable, "-c", _DUMP, config, batch, *overrides], cwd=tree, capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu"})
  if out.returncode:
    sys.exit(f"error: compiling at {rev or 'the working tree'} failed:\n{out.stderr[-2000:]}")
  return normalized(out.stdout)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--before", required=True, help="git revision to compare the working tree with")
  parser.add_argument("--config", default="shakespeare_char")
  parser.add_argument("overrides", nargs="*")
  parser.add_argument("--batch", default="12,64", help="ROWS,LEN (LM) or ROWS,SRC,TGT (translation)")
  args = parser.parse_args(argv)
  before = program(args.before, args.config, args.batch, args.overrides)
  after = program("", args.config, args.batch, args.overrides)
  diff = [d for d in difflib.unified_diff(before, after, lineterm="", n=0) if not d.startswith(("@@", "---", "+++"))]
  print(f"{args.config} {' '.join(args.overrides)} batch {args.batch}: {len(before):,} HLO lines at {args.before}, "
        f"{len(after):,} now; {'the same program' if not diff else f'{len(diff)} lines differ'}")
  for line in diff[:20]:
    print("  " + line[:200])
  return not diff


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
