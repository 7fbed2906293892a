"""Llama-3.1-8B: vocab 128,256, d_model 4096, 32 layers, 32 heads with 8 kv heads (GQA),
d_ff 14,336, RoPE theta 500,000 with Llama 3.1's scaling (x8 from 8k), untied embeddings."""

from jaxformer.config import replace
from jaxformer.configs import llama_7b


def get_config():
  return replace(llama_7b.get_config(), name="llama3_8b", **{
      "model.vocab_size": 128256, "model.num_kv_heads": 8, "model.d_ff": 14336, "model.norm_eps": 1e-5,
      "model.rope_theta": 500000.0, "model.rope_scaling": "llama3", "model.rope_scaling_factor": 8.0,
      "model.rope_original_max_len": 8192, "model.max_len": 8192, "data.block_size": 8192,
      "data.batch_size": 512})
