"""The full paper pipeline at toy scale: 10k real WMT pairs, newstest2013 dev, all 3,003
sentences of newstest2014 as test (joint BPE, token batching, beam 4, alpha 0.6,
max length source + 50, checkpoint averaging, both BLEU flavours)."""

from jaxformer.config import replace
from jaxformer.configs import wmt_base
from jaxformer.configs._paths import data


def get_config():
  return replace(wmt_base.get_config(), name="wmt14_sample", **{
      "model.vocab_size": 8000, "model.d_model": 256, "model.num_heads": 4, "model.num_layers": 2,
      "model.d_ff": 1024, "model.max_len": 512,
      "data.source": "local",
      "data.train_src": data("wmt14/train_sample.en"), "data.train_tgt": data("wmt14/train_sample.de"),
      "data.dev_src": data("wmt14/newstest2013.en"), "data.dev_tgt": data("wmt14/newstest2013.de"),
      "data.test_src": data("wmt14/newstest2014.en"), "data.test_tgt": data("wmt14/newstest2014.de"),
      "data.max_len": 128, "data.tokens_per_batch": 4096,
      "optim.warmup_steps": 400, "train.num_steps": 1000, "train.log_every": 50,
      "train.eval_every": 500, "train.eval_batches": 10, "train.checkpoint_every": 200,
      "train.keep_checkpoints": 5})
