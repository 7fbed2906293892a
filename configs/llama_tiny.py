"""A tiny Llama-style model for tests: RMSNorm, SwiGLU, RoPE, GQA (4 heads, 2 kv heads)."""

from jaxformer.config import replace
from jaxformer.configs import llama3_8b


def get_config():
  return replace(llama3_8b.get_config(), name="llama_tiny", **{
      "model.vocab_size": 68, "model.d_model": 32, "model.num_heads": 4, "model.num_kv_heads": 2,
      "model.num_layers": 2, "model.d_ff": 96, "model.max_len": 64, "model.dtype": "float32",
      "model.rope_scaling": "none", "model.rope_theta": 10000.0,
      "data.source": "local", "data.tokenizer": "char", "data.block_size": 32, "data.batch_size": 4,
      "optim.warmup_steps": 5, "train.num_steps": 20, "train.log_every": 5, "train.eval_every": 10,
      "train.checkpoint_every": 10, "train.keep_checkpoints": 3})
