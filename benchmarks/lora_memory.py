"""LoRA's memory: XLA's figures for the compiled train step, forward-pass adapters vs merging, vs full fine-tuning.

    python benchmarks/lora_memory.py [--config llama_tiny] [--rows 8] [--length 256] [overrides ...]

Compiles (never runs) three train steps for the same model and batch with `aot.compile_train_step`
and prints `compiled.memory_analysis()`: arguments, outputs, aliased (donated) and temporary bytes:
- full:    plain fine-tuning, every parameter trained (train.lora_rank=0);
- forward: jaxformer's LoRA, (alpha / r) (x A) B added to each adapted projection's output;
- merge:   the alternative, W + (alpha / r) A B formed inside the loss and the plain model run on it.
Also the checkpointed state (params + optimizer state, what a checkpoint holds) of full vs LoRA, and
`inspect.memory_plan`'s estimate of the LoRA step. Load-independent: nothing is timed.
"""

import argparse
import math

import jax

from jaxformer import aot
from jaxformer import config as config_lib
from jaxformer import inspect
from jaxformer import lora
from jaxformer import tasks


class MergeTask(tasks.LMTask):
  """The merge variant: the step hands the loss base + adapters in one tree; merge them into W + s A B first."""
  lora_cfg = None

  @classmethod
  def loss(cls, model, params, *args, **kwargs):
    base, adapters = lora.split(params)
    return tasks.LMTask.loss(model, lora.merge(base, adapters, cls.lora_cfg), *args, **kwargs)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--config", default="llama_tiny")
  parser.add_argument("--rows", type=int, default=8)
  parser.add_argument("--length", type=int, default=256)
  parser.add_argument("overrides", nargs="*")
  args = parser.parse_args()
  plain = config_lib.load_config(args.config, ["mesh.data=1", *args.overrides])
  cfg = config_lib.load_config(args.config, ["mesh.data=1", "train.lora_rank=16", "train.lora_alpha=32",
                                             *args.overrides])
  devices = jax.devices()[:1]
  m = cfg.model
  n_base, n_adapters = lora.count(lora.abstract(cfg)[0]), lora.count(lora.abstract(cfg)[1])
  print(f"{args.config} {' '.join(args.overrides)}: d_model {m.d_model}, {m.num_layers} layers, d_ff {m.d_ff}, "
        f"vocab {m.vocab_size}; {n_base:,} base params, {n_adapters:,} adapter params (rank 16, "
        f"{lora.num_adapted(cfg)} kernels); batch {args.rows} x {args.length}; remat {m.remat}, "
        f"scan_layers {m.scan_layers}")
  mib = lambda b: f"{b / 2**20:9.2f}"
  print(f"{'step':<9}{'argument':>10}{'output':>10}{'alias':>10}{'temp':>10}{'total':>10}  MiB (XLA memory_analysis)")
  results = {}
  MergeTask.lora_cfg = cfg
  # merge: LoRA's state and base (train_step(state, batch, base)) but no interception: the loss merges.
  merge_cfg = config_lib.replace(cfg, **{"train.lora_rank": 0})
  for name, c in (("full", plain), ("forward", cfg), ("merge", cfg)):
    if name == "merge":
      compiled = _compile_merge(cfg, merge_cfg, devices, args.rows, args.length)
    else:
      compiled, _, _ = aot.compile_train_step(c, devices, args.rows, (args.length,))
    mem = aot.memory(compiled)
    results[name] = mem
    print(f"{name:<9}" + "".join(f"{mib(mem[k]):>10}" for k in ("argument", "output", "alias", "temp", "total")))
  plan = inspect.memory_plan(cfg, "data=1", args.rows, (args.length,))
  print(f"inspect.memory_plan of the LoRA step: total {mib(plan['total'])} MiB "
        f"(params {mib(plan['params'])}, adapters+grads+optimizer {mib(plan['adapters'] * 4)}, "
        f"activations {mib(plan['activations'])}, logits {mib(plan['logits'])})")
  # What a checkpoint holds, measured: each state (random values: no compression gain) saved by the
  # trainer's Checkpointer, and the bytes of its step directory on disk.
  sizes = {name: _checkpoint_bytes(c) for name, c in (("full", plain), ("LoRA", cfg))}
  print(f"checkpoint on disk: full fine-tune {sizes['full'] / 2**20:.2f} MiB, LoRA {sizes['LoRA'] / 2**20:.3f} MiB "
        f"(ratio {sizes['LoRA'] / sizes['full']:.4f}; adapters / params {n_adapters / n_base:.4f}); "
        f"optimizer state (XLA argument bytes minus params): see the argument column")
  print(f"temporaries, merge / forward: {results['merge']['temp'] / max(results['forward']['temp'], 1):.2f}x; "
        f"total, merge - forward: {(results['merge']['total'] - results['forward']['total']) / 2**20:.2f} MiB")


def _checkpoint_bytes(cfg):
  """Bytes on disk of a train state of cfg (LoRA: adapters + their Adam moments) saved by checkpoint.Checkpointer."""
  import functools, os, tempfile  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jaxformer import checkpoint as checkpoint_lib, model as model_lib, optim, train  # pylint: disable=g-import-not-at-top
  model = model_lib.build_model(cfg.model)
  tx, _ = optim.build_optimizer(cfg)
  ids = jax.numpy.ones((1, 4), jax.numpy.int32)
  extra = {"cfg": cfg} if lora.enabled(cfg) else {}
  abstract = nn.unbox(jax.eval_shape(functools.partial(train.init_state, model, tx, (ids,), **extra), jax.random.key(0)))
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda a: rng.standard_normal(a.shape).astype(a.dtype) if a.ndim else np.zeros((), a.dtype),
                       abstract)
  with tempfile.TemporaryDirectory() as tmp:
    with checkpoint_lib.Checkpointer(tmp, async_save=False) as ckpt:
      ckpt.save(1, state, {"step": 1})
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(tmp, "checkpoints", "1"))
               for f in fs)


def _compile_merge(cfg, merge_cfg, devices, rows, length):
  """aot.compile_train_step of the LoRA state and base with a step built from merge_cfg (no interception)."""
  import functools  # pylint: disable=g-import-not-at-top
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  from jaxformer import model as model_lib, optim, sharding, train  # pylint: disable=g-import-not-at-top
  mesh = sharding.make_mesh(cfg.mesh, list(devices))
  model = model_lib.build_model(cfg.model)
  tx, schedule = optim.build_optimizer(cfg)
  ids = jax.numpy.ones((1, 4), jax.numpy.int32)
  abstract = jax.eval_shape(functools.partial(train.init_state, model, tx, (ids,), cfg=cfg), jax.random.key(0))
  state_sharding = sharding.logical_sharding(abstract, mesh)
  struct = lambda tree, sh: jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                         nn.unbox(tree), sh)
  boxed_base, _ = lora.abstract(cfg)
  base_sharding = sharding.logical_sharding(boxed_base, mesh)
  batch_sharding = sharding.batch_sharding(mesh)
  step = jax.jit(train.make_train_step(model, MergeTask, merge_cfg, tx, schedule),
                 in_shardings=(state_sharding, batch_sharding, base_sharding),
                 out_shardings=(state_sharding, None), donate_argnums=0)
  state, base = struct(abstract, state_sharding), struct(boxed_base, base_sharding)  # unboxed outside the mesh
  with sharding.use_mesh(mesh):
    lowered = step.lower(state, aot.abstract_batch(cfg, rows, (length,), batch_sharding), base)
  return lowered.compile()


if __name__ == "__main__":
  main()
