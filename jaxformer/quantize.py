"""Quantize a run's weights to int8 or int4 (weight-only) into a new workdir that eval/generate read as any other.

    python -m jaxformer.quantize --workdir W --out Q --bits 8|4 [--group-size 128] [--step N] \
        [--activations int16|int8|float]

Every dense projection's kernel (attention q/k/v/out, FFN, cross-attention) and every MoE
expert weight is stored as `jaxformer.qmatmul` describes: int8 with a float32 scale per output
channel, or int4 (two per byte) with a float32 scale per `--group-size` inputs of an output.
The token embeddings and an untied output layer become int8 with a scale per vocabulary row
(`--embedding int4`: int4 in groups along d_model, as the kernels; `--embedding float` keeps them float32); position tables, MoE routers, norms and biases stay float32. The new workdir holds
the run's config and tokenizer, a params-only checkpoint and `quantization.json` (the scheme and
the quantized paths); `eval.py`, `python -m jaxformer.generate` and `jaxformer.evaluate.load_run`
read it through the same model code (the Dense layers multiply by the quantized kernel).
`--activations` (default int16) is how that product treats its inputs on a CPU with AVX-512 VNNI when a call has
many rows (prefill, eval): quantized per 32 inputs to int16 for an integer product (`qmatmul.matmul`); decode steps
of few sequences and other devices keep them float.
Written here rather than with qwix/AQT: neither is a dependency, and weight-only PTQ is ~40 lines.
"""

import argparse
import json
import os
import shutil

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from jaxformer import checkpoint as checkpoint_lib
from jaxformer import config as config_lib
from jaxformer import evaluate
from jaxformer import model as model_lib
from jaxformer import qmatmul
from jaxformer.errors import UserError, cli

# Which weights are quantized: `model.quantizable` (there so that `inspect` can count their bytes).
quantizable = model_lib.quantizable


def _get(tree, path):
  for p in path.split("/"):
    tree = tree[p]
  return tree


def quantize_params(params, model_cfg, bits, group_size=128, embedding="int8"):
  """(quantized params, manifest): `params` (unrolled layers) with every `quantizable` weight replaced:
  the projections in `bits`, the token embeddings and the untied output layer as `embedding` says: "int8"
  (a scale per vocabulary row), "int4" (groups of `group_size` along d_model) or "float" (left as they are).

  manifest: {"bits", "group_size", "embedding", "kernels": {path: {"k", "n"[, "bits"][, "experts"]}}},
  as `quantization.json` holds it."""
  params = jax.tree.map(np.asarray, nn.unbox(params))  # (model.init's params are boxed with their axis names)
  found = quantizable(model_cfg)
  shapes = {"/".join(path): x.shape for path, x in traverse_util.flatten_dict(params).items()}
  manifest = qmatmul.plan_manifest(shapes, found, bits, group_size, embedding)  # (checks the scheme)

  def quant(w2, bits=bits):  # [K, N] -> (q, scale)
    if bits == 8:
      return qmatmul.quantize_int8(w2)
    return qmatmul.quantize_int4(w2, qmatmul.group_for(w2.shape[0], group_size))

  for path, entry in manifest["kernels"].items():
    kind = found[path][1]
    *parents, leaf = path.split("/")
    node = _get(params, "/".join(parents))
    w = node.pop(leaf)
    if kind == "embedding":  # [vocab, d_model]: the rows are the outputs of `attend`
      node["qkernel"], node["qscale"] = quant(w.T, entry["bits"])
    elif kind == "output":
      node["qkernel"], node["qscale"] = quant(w, entry["bits"])
    elif kind == "dense":
      node["qkernel"], node["qscale"] = quant(w.reshape(entry["k"], -1))
    else:  # [experts, in, out]
      pairs = [quant(w[e]) for e in range(w.shape[0])]
      node[f"{leaf}_qkernel"] = np.stack([p[0] for p in pairs])
      node[f"{leaf}_qscale"] = np.stack([p[1] for p in pairs])
  return params, manifest


def roundtrip_params(params, model_cfg, bits, group_size=128, embedding="int8"):
  """Float params with every `quantizable` weight replaced by dequantize(quantize(w)), in its own shape:
  the float model a quantized one stands for (to compare logits, or NLL without the kernels)."""
  qparams, manifest = quantize_params(params, model_cfg, bits, group_size, embedding)
  out = jax.tree.map(np.asarray, params)
  for path, entry in manifest["kernels"].items():
    q, scale = _quantized_leaves(qparams, path)
    *parents, leaf = path.split("/")
    node = _get(out, "/".join(parents))
    if "experts" in entry:
      w = np.stack([np.asarray(qmatmul.dequantize(jnp.asarray(a), jnp.asarray(b))).T for a, b in zip(q, scale)])
    else:
      w = np.asarray(qmatmul.dequantize(jnp.asarray(q), jnp.asarray(scale)))
      w = w if leaf == "embedding" else w.T  # a table is stored as it is used, [vocab, d_model]
    node[leaf] = w.reshape(node[leaf].shape)
  return out


def tree_bytes(tree):
  """Bytes of the arrays in a params tree."""
  return sum(np.asarray(x).nbytes for x in jax.tree.leaves(tree))


def quantize_run(workdir, out, bits, group_size=128, step=None, embedding="int8", log=print, activations=None):
  """Writes the quantized copy of `workdir`'s checkpoint `step` (default: latest) to `out`; returns the manifest.

  activations: the new workdir's `model.quant_activations` ("int8" / "int16": its prefill and eval products on
  integer activations, `qmatmul.matmul`; "float"); None: int16, or float for int4 groups that are not a multiple of
  32 inputs (the integer product's blocks)."""
  if activations is None:
    activations = "float" if bits == 4 and group_size % 32 else "int16"
  if activations != "float" and bits == 4 and group_size % 32:  # (a kernel smaller than a group: logged at run time)
    raise UserError(f"--activations {activations} with int4 takes a --group-size that is a multiple of 32, "
                    f"not {group_size}")
  if qmatmul.read_manifest(workdir) is not None:
    raise UserError(f"--workdir {workdir} is already quantized: quantize the float run it came from")
  if os.path.exists(os.path.join(out, "config.json")) or os.path.isdir(os.path.join(out, "checkpoints")):
    raise UserError(f"--out {out} already holds a run: choose a new directory")
  cfg, _, params, _, meta = evaluate.load_run(workdir, step=step, log=lambda *_: None, scan_layers=False)
  float_bytes = tree_bytes(params)
  qparams, manifest = quantize_params(params, cfg.model, bits, group_size, embedding)
  paths = manifest["kernels"]
  kernel_float = sum(np.asarray(_get(params, p)).nbytes for p in paths)
  kernel_q = sum(np.asarray(x).nbytes for p in paths for x in _quantized_leaves(qparams, p))
  os.makedirs(out, exist_ok=True)
  tok = evaluate.tasks.tokenizer_path(cfg, workdir)
  if tok != "byte" and os.path.exists(tok) and os.path.dirname(os.path.abspath(tok)) == os.path.abspath(workdir):
    shutil.copy2(tok, os.path.join(out, os.path.basename(tok)))
  for name in ("hf_config.json", "hf_generation_config.json"):
    if os.path.exists(os.path.join(workdir, name)):
      shutil.copy2(os.path.join(workdir, name), os.path.join(out, name))
  manifest.update(source=os.path.abspath(workdir), step=meta.get("step"))
  qmeta = {k: v for k, v in meta.items() if k not in ("lora_base", "lora_base_step")}
  checkpoint_lib.save_params(out, qparams, step=meta.get("step") or 0, meta={**qmeta, "quantized": f"int{bits}"})
  qcfg = config_lib.replace(cfg, **{"model.scan_layers": False, "train.lora_rank": 0,
                                    "model.quant_activations": activations})
  with open(os.path.join(out, "config.json"), "w") as f:
    f.write(config_lib.to_json(qcfg))
  with open(os.path.join(out, qmatmul.MANIFEST), "w") as f:
    json.dump(manifest, f, indent=1)
  log(f"quantized {len(paths)} weights of {workdir} (step {meta.get('step')}) to int{bits}"
      + (f" (group {group_size})" if bits == 4 else "") + f" -> {out}: those weights "
      f"{kernel_float / 2**20:.1f} -> {kernel_q / 2**20:.1f} MiB ({kernel_q / kernel_float:.3f}x), all params "
      f"{float_bytes / 2**20:.1f} -> {tree_bytes(qparams) / 2**20:.1f} MiB; model.quant_activations={activations}")
  return manifest


def _quantized_leaves(qparams, path):
  *parents, leaf = path.split("/")
  node = _get(qparams, "/".join(parents))
  prefix = "" if leaf in ("kernel", "embedding") else f"{leaf}_"
  return [node[prefix + "qkernel"], node[prefix + "qscale"]]


@cli
def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m jaxformer.quantize", description=__doc__.split("\n")[0])
  parser.add_argument("--workdir", required=True, help="a training (or converted) workdir")
  parser.add_argument("--out", required=True, help="the new, quantized workdir")
  parser.add_argument("--bits", type=int, required=True, choices=(8, 4))
  parser.add_argument("--group-size", type=int, default=128, help="int4: inputs per scale (default 128)")
  parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
  parser.add_argument("--embedding", default="int8", choices=qmatmul.EMBEDDINGS,
                      help="the token embeddings and an untied output layer: int8 per row (default), int4 in groups "
                           "of --group-size along d_model, or float32")
  parser.add_argument("--activations", default=None, choices=("float", "int8", "int16"),
                      help="how the new workdir's prefill and eval products (16-20+ rows) multiply on a CPU with "
                           "AVX-512 VNNI: int16 / int8 quantize their activations in blocks of 32 inputs for an "
                           "integer product (int16: the weight-only results to ~1e-5; int8: faster, coarser), float "
                           "keeps them float32 (model.quant_activations; default int16, float for int4 groups not a "
                           "multiple of 32; other devices: float)")
  args = parser.parse_args(argv)
  quantize_run(args.workdir, args.out, args.bits, args.group_size, args.step, args.embedding,
               activations=args.activations)


if __name__ == "__main__":
  main()
