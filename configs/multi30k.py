"""Multi30k En->De (Elliott et al. 2016) from ../shared/data/multi30k: train / val / test2016.

The small real benchmark: a post-LN Transformer sized for 29k short caption pairs.
"""

from jaxformer.config import replace
from jaxformer.configs import wmt_base
from jaxformer.configs._paths import data


def get_config():
  return replace(wmt_base.get_config(), name="multi30k", **{
      "model.vocab_size": 8000, "model.d_model": 256, "model.num_heads": 4, "model.num_layers": 3,
      "model.d_ff": 1024, "model.dropout_rate": 0.1, "model.max_len": 128,
      "data.source": "local",
      "data.train_src": data("multi30k/train.en"), "data.train_tgt": data("multi30k/train.de"),
      "data.dev_src": data("multi30k/val.en"), "data.dev_tgt": data("multi30k/val.de"),
      "data.test_src": data("multi30k/test2016.en"), "data.test_tgt": data("multi30k/test2016.de"),
      "data.max_len": 96, "data.tokens_per_batch": 2048,
      "optim.learning_rate": 1.0, "optim.warmup_steps": 800,
      "train.num_steps": 20000, "train.max_minutes": 80, "train.log_every": 100, "train.eval_every": 500,
      "train.eval_bleu_sentences": 200, "train.checkpoint_every": 250, "train.keep_checkpoints": 10})
