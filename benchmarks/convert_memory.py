"""Peak memory of `python -m jaxformer.convert` on a random Llama-format checkpoint (BENCHMARKS.md).

    python benchmarks/convert_memory.py [--d-model 1024] [--layers 8] [--vocab 32000] [--keep DIR]

Writes a random bfloat16 Llama checkpoint in Hugging Face's layout (config.json, two safetensors
shards and their index, the test fixture's tiny tokenizer.model) with numpy alone, then runs the
import (--from-hf) and the export (--to-hf) each in a fresh process and reads its peak resident
memory from the kernel (ru_maxrss). The same commands on a 2-layer d_model-64 model give the fixed
cost (Python, JAX, Orbax), so "peak - fixed" is what the model's size costs: compare it with the
bfloat16 source and the float32 parameter tree the workdir holds.
"""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

ROOT = pathlib.Path(__file__).resolve().parent.parent


def write_llama(out, d_model, layers, vocab, d_ff, heads=16, kv_heads=4, seed=0):
  """A random bf16 LlamaForCausalLM folder; returns (parameter count, bytes on disk)."""
  rng = np.random.default_rng(seed)
  hd = d_model // heads
  shapes = {"model.embed_tokens.weight": (vocab, d_model), "model.norm.weight": (d_model,),
            "lm_head.weight": (vocab, d_model)}
  for i in range(layers):
    p = f"model.layers.{i}"
    shapes.update({f"{p}.self_attn.q_proj.weight": (heads * hd, d_model),
                   f"{p}.self_attn.k_proj.weight": (kv_heads * hd, d_model),
                   f"{p}.self_attn.v_proj.weight": (kv_heads * hd, d_model),
                   f"{p}.self_attn.o_proj.weight": (d_model, heads * hd),
                   f"{p}.mlp.gate_proj.weight": (d_ff, d_model), f"{p}.mlp.up_proj.weight": (d_ff, d_model),
                   f"{p}.mlp.down_proj.weight": (d_model, d_ff), f"{p}.input_layernorm.weight": (d_model,),
                   f"{p}.post_attention_layernorm.weight": (d_model,)})
  os.makedirs(out, exist_ok=True)
  names = list(shapes)
  shards = [names[: len(names) // 2], names[len(names) // 2:]]
  weight_map = {}
  for k, part in enumerate(shards):
    fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file({n: (0.02 * rng.standard_normal(shapes[n], np.float32)).astype(ml_dtypes.bfloat16) for n in part},
              os.path.join(out, fname))
    weight_map.update({n: fname for n in part})
  with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab, "hidden_size": d_model,
            "intermediate_size": d_ff, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(config, f)
  shutil.copy(ROOT / "tests" / "fixtures" / "hf" / "llama" / "tokenizer.model", out)
  n = sum(int(np.prod(s)) for s in shapes.values())
  return n, sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))


def peak_rss_mb(argv):
  """Runs `python -m jaxformer.convert argv` -> its peak resident memory in MB."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
  proc = subprocess.Popen([sys.executable, "-m", "jaxformer.convert", *argv], cwd=ROOT, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  _, status, usage = os.wait4(proc.pid, 0)
  if status != 0:
    raise SystemExit(f"convert {' '.join(argv)} failed: {proc.stderr.read().decode()[-2000:]}")
  return usage.ru_maxrss / 1024  # KiB on Linux


def measure(tmp, name, d_model, layers, vocab, d_ff):
  hf = os.path.join(tmp, f"{name}_hf")
  n, disk = write_llama(hf, d_model, layers, vocab, d_ff, heads=max(d_model // 64, 1), kv_heads=max(d_model // 256, 1))
  imp = peak_rss_mb(["--from-hf", hf, "--workdir", os.path.join(tmp, f"{name}_w")])
  exp = peak_rss_mb(["--to-hf", os.path.join(tmp, f"{name}_w"), "--out", os.path.join(tmp, f"{name}_out"),
                    "--max-shard-mb", "128"])
  return {"params": n, "source_mb": disk / 2**20, "float32_mb": 4 * n / 2**20, "import_peak_mb": imp,
          "export_peak_mb": exp}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--d-model", type=int, default=1024)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--d-ff", type=int, default=2816)
  parser.add_argument("--keep", help="keep the folders here (default: a temporary directory)")
  args = parser.parse_args()
  tmp = args.keep or tempfile.mkdtemp(prefix="convert_memory_")
  try:
    base = measure(tmp, "tiny", 64, 2, 512, 128)
    big = measure(tmp, "big", args.d_model, args.layers, args.vocab, args.d_ff)
  finally:
    if not args.keep:
      shutil.rmtree(tmp, ignore_errors=True)
  print(f"fixed cost (2 layers, d_model 64): import {base['import_peak_mb']:.0f} MB, "
        f"export {base['export_peak_mb']:.0f} MB")
  print(f"model: {big['params']:,} parameters, {big['source_mb']:.0f} MB bfloat16 safetensors, "
        f"{big['float32_mb']:.0f} MB as float32 params")
  for step in ("import", "export"):
    extra = big[f"{step}_peak_mb"] - base[f"{step}_peak_mb"]
    print(f"{step}: peak {big[f'{step}_peak_mb']:.0f} MB, {extra:.0f} MB above the fixed cost = "
          f"{extra / big['float32_mb']:.2f} x the float32 params, {extra / big['source_mb']:.2f} x the source")


if __name__ == "__main__":
  main()
