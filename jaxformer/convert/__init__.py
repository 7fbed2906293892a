"""Hugging Face checkpoints in and out: GPT-2, Llama (1, 2, 3, 3.1), Mixtral and Marian (OPUS-MT) <-> jaxformer workdirs.

    python -m jaxformer.convert --from-hf HF_DIR --workdir W        # config.json + Orbax checkpoint + tokenizer
    python -m jaxformer.convert --to-hf W --out HF_DIR [--step N] [--dtype bfloat16]
    python -m jaxformer.convert --to-hf LORA_W --out DIR --peft    # a LoRA run's adapters, as PEFT writes them

Import reads `config.json` (and `generation_config.json`), the `*.safetensors` weights (one
file or a sharded index) one tensor at a time, maps each onto jaxformer's parameter tree
(transposing torch's [out, in] Linear weights, splitting GPT-2's fused qkv, stacking Mixtral's
per-expert weights into our [experts, in, out] ones), checks every
shape against the model the config builds, and writes a params-only checkpoint at step 0
(`checkpoint.save_params`) with the tokenizer: W then works with eval.py,
`python -m jaxformer.generate` and `train.py --config W/config.json train.init_from=W`.
Export writes `config.json`, `model.safetensors` (the same tensor names HF saves) and the
tokenizer files, which transformers' `from_pretrained` loads. A LoRA run (train.lora_rank) exports
as the merged model W + (alpha / r) A B, or with `--peft` as its adapters alone:
`adapter_config.json` + `adapter_model.safetensors` with PEFT's names, for `PeftModel.from_pretrained`
on the base exported from train.init_from (GPT-2's fused c_attn gets one adapter of rank 3r whose B is
block-diagonal, with `rank_pattern`/`alpha_pattern` keeping the scale alpha / r: the same function).

Memory: tensors are read one at a time (safetensors maps the files; only the tensor being
converted is copied) and keep their dtype (bf16 for Llama: restoring widens them to float32
exactly), so the peak is the tree being written (the source's size) plus one tensor and Orbax's
write buffers, not the checkpoint plus a float32 copy (BENCHMARKS.md measures it). Export frees
each parameter as its HF tensor is made and writes one shard at a time.

Layout: one module per family (gpt2, llama, mixtral, marian: its tensor names, config.json fields and
export constraints) listed in `families.FAMILIES`; `common` (tensor mappings, tree paths, config
helpers) and `hf_files` (safetensors folders) are shared; `hf_in` imports, `hf_out` exports, `peft`
writes adapters, `cli` is the command line.
"""

from jaxformer.convert.cli import main, parse_args
from jaxformer.convert.common import get
from jaxformer.convert.families import FAMILIES
from jaxformer.convert.hf_files import SafetensorsReader
from jaxformer.convert.hf_in import config_from_hf, from_hf, read_params
from jaxformer.convert.hf_out import hf_config_for, infer_model_type, to_hf
from jaxformer.convert.peft import to_peft

SUPPORTED = tuple(FAMILIES)
__all__ = ["FAMILIES", "SUPPORTED", "SafetensorsReader", "config_from_hf", "from_hf", "get", "hf_config_for",
           "infer_model_type", "main", "parse_args", "read_params", "to_hf", "to_peft"]
