"""The offline demo: English number phrases -> German (needs no download, no ../shared).

German says the units before the tens ("twenty-one" -> "einundzwanzig"), so the model
must learn to reorder. A small post-LN Transformer learns it on 2 CPU cores in a few
minutes; training ends with sample translations and the BLEU of held-out pairs.
"""

from jaxformer.config import replace
from jaxformer.configs import wmt_base


def get_config():
  return replace(wmt_base.get_config(), name="default", **{
      "model.vocab_size": 400, "model.d_model": 128, "model.num_heads": 4, "model.num_layers": 2,
      "model.d_ff": 256, "model.dropout_rate": 0.0, "model.max_len": 64,
      "data.source": "synthetic", "data.synthetic_size": 20000, "data.tokens_per_batch": 1024,
      "data.max_len": 48,
      "optim.learning_rate": 1.0, "optim.warmup_steps": 200,
      "train.num_steps": 1000, "train.log_every": 100, "train.eval_every": 500,
      "train.checkpoint_every": 500, "train.keep_checkpoints": 3,
      "train.eval_bleu_sentences": 200, "train.final_eval_split": "test",
      "decode.beam_size": 4, "decode.batch_size": 256})
