"""A tiny encoder-decoder for tests: the paper's architecture at toy size."""

from jaxformer.config import replace
from jaxformer.configs import wmt_base


def get_config():
  return replace(wmt_base.get_config(), name="tiny_encdec", **{
      "model.vocab_size": 64, "model.d_model": 32, "model.num_heads": 4, "model.num_layers": 2,
      "model.d_ff": 64, "model.dropout_rate": 0.0, "model.max_len": 64,
      "data.source": "synthetic", "data.tokens_per_batch": 512, "data.max_len": 32,
      "optim.warmup_steps": 10, "train.num_steps": 20, "train.log_every": 5, "train.eval_every": 10,
      "train.checkpoint_every": 10, "train.keep_checkpoints": 3})
