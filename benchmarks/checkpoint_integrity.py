"""What checkpoint checksums cost: save and restore of a full train state with and without them.

    python benchmarks/checkpoint_integrity.py [--config gpt2_small] [--rounds 3] [--dir DIR] [overrides ...]

The state is the config's own train state (params + optimizer moments, as `train.py` builds it),
filled with random numbers (zeros would compress to nothing). `on` is `Checkpointer` as it is:
`save` computes the checksums of every array (where it lives) before the asynchronous write and
`restore` recomputes and compares them. `off` replaces `checksum.fingerprint` with a no-op, which
is exactly the save and restore of before (a checkpoint restored without checksums). The two run
interleaved (on, off, on, off, ...) and the figures are medians over rounds. Timed:

- checksum: `checksum.fingerprint(state)` alone (one read of every array);
- save, blocking: `Checkpointer.save` returning (device->host copy + checksums): what the
  training loop waits for;
- save, total: until the write is on disk (`wait`);
- restore: `Checkpointer.restore` of the newest step, verification included for `on`.
"""

import argparse
import functools
import os
import shutil
import statistics
import sys
import tempfile
import time

import flax.linen as nn
import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxformer import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
from jaxformer import checksum
from jaxformer import config as config_lib
from jaxformer import model as model_lib
from jaxformer import optim
from jaxformer import train


def random_state(cfg):
  """The config's train state (`train.init_state` shapes), every float filled with N(0, 0.02)."""
  model = model_lib.build_model(cfg.model)
  tx, _ = optim.build_optimizer(cfg)
  length = 8
  inputs = [jnp.ones((1, length), jnp.int32)] * (2 if cfg.model.arch == "encoder_decoder" else 1)
  abstract = nn.unbox(jax.eval_shape(functools.partial(train.init_state, model, tx, inputs), jax.random.PRNGKey(0)))
  leaves, treedef = jax.tree.flatten(abstract)
  keys = jax.random.split(jax.random.PRNGKey(0), len(leaves))
  fill = jax.jit(lambda k, s: 0.02 * jax.random.normal(k, s.shape, s.dtype) if jnp.issubdtype(s.dtype, jnp.floating)
                 else jnp.zeros(s.shape, s.dtype), static_argnums=1)
  return jax.tree.unflatten(treedef, [fill(k, jax.ShapeDtypeStruct(s.shape, s.dtype)) for k, s in zip(keys, leaves)])


def no_checksums(tree):
  return {}, []


def one_round(state, abstract, directory, step, verify):
  """(save blocking s, save total s, restore s) of one save + restore in `directory`."""
  real = checksum.fingerprint
  checksum.fingerprint = real if verify else no_checksums
  try:
    with checkpoint_lib.Checkpointer(directory, max_to_keep=1) as ckpt:
      jax.block_until_ready(state)
      start = time.perf_counter()
      ckpt.save(step, state, {"step": step})
      blocking = time.perf_counter() - start
      ckpt.wait()
      total = time.perf_counter() - start
    with checkpoint_lib.Checkpointer(directory, max_to_keep=1) as ckpt:
      start = time.perf_counter()
      jax.block_until_ready(ckpt.restore(abstract, step=step)[0])
      restore = time.perf_counter() - start
  finally:
    checksum.fingerprint = real
  return blocking, total, restore


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="gpt2_small")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args()
  cfg = config_lib.load_config(args.config, args.overrides)
  state = random_state(cfg)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  n_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
  print(f"{args.config}: {n_params:,} parameters, train state {n_bytes / 2**30:.2f} GiB in "
        f"{len(jax.tree.leaves(state))} arrays; backend {jax.default_backend()}, {os.cpu_count()} CPUs")
  checksum.fingerprint(state)  # compile
  sums = []
  for _ in range(args.rounds):
    start = time.perf_counter()
    checksum.fingerprint(state)
    sums.append(time.perf_counter() - start)
  root = args.dir or tempfile.mkdtemp(prefix="ckpt_integrity_")
  times = {True: [], False: []}
  try:
    one_round(state, abstract, os.path.join(root, "warmup"), 0, True)  # orbax's first-call costs
    for r in range(args.rounds):
      for verify in (True, False):
        directory = os.path.join(root, f"{'on' if verify else 'off'}{r}")
        times[verify].append(one_round(state, abstract, directory, r + 1, verify))
        shutil.rmtree(directory)
  finally:
    if not args.dir:
      shutil.rmtree(root, ignore_errors=True)
  med = lambda xs: statistics.median(xs)
  print(f"checksum pass alone: {med(sums):.2f} s ({n_bytes / med(sums) / 2**30:.2f} GiB/s), "
        f"rounds: {', '.join(f'{t:.2f}' for t in sums)}")
  print(f"{'checksums':10s} {'save blocking s':>16s} {'save total s':>13s} {'restore s':>10s}")
  for verify in (True, False):
    rows = list(zip(*times[verify]))
    print(f"{'on' if verify else 'off':10s} {med(rows[0]):16.2f} {med(rows[1]):13.2f} {med(rows[2]):10.2f}"
          f"   (rounds: {'; '.join(' '.join(f'{t:.2f}' for t in round_) for round_ in times[verify])})")


if __name__ == "__main__":
  main()
