"""A tiny GPT-2-style model for tests."""

from jaxformer.config import replace
from jaxformer.configs import gpt2_small


def get_config():
  return replace(gpt2_small.get_config(), name="gpt2_tiny", **{
      "model.vocab_size": 68, "model.d_model": 32, "model.num_heads": 4, "model.num_layers": 2,
      "model.d_ff": 128, "model.max_len": 64, "model.dtype": "float32",
      "data.source": "local", "data.tokenizer": "char", "data.block_size": 32, "data.batch_size": 4,
      "data.train_fraction": 0.9, "data.num_proc": 2,
      "optim.warmup_steps": 5, "train.num_steps": 20, "train.log_every": 5, "train.eval_every": 10,
      "train.checkpoint_every": 10, "train.keep_checkpoints": 3})
