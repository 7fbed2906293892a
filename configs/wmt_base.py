"""WMT14 En->De, Transformer base, as in Vaswani et al. 2017 (Table 3, "base").

Post-LN, sinusoidal positions (sin/cos interleaved), one 37k BPE vocabulary shared by
encoder input, decoder input and output projection, embeddings x sqrt(d_model),
dropout 0.1, label smoothing 0.1, Adam(0.9, 0.98, 1e-9), warmup 4000 then rsqrt,
~25k source + 25k target tokens per step, 100k steps; beam 4, alpha 0.6.
Data: the WMT14 de-en release on the Hugging Face hub (newstest2013 dev, newstest2014 test).
"""

from jaxformer.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig


def get_config():
  return Config(
      name="wmt_base",
      model=ModelConfig(),  # the defaults are the paper's base model
      data=DataConfig(source="hub", hub_name="wmt14", hub_config="de-en", src_lang="en", tgt_lang="de",
                      max_len=256, tokens_per_batch=25000),
      optim=OptimConfig(schedule="rsqrt", learning_rate=1.0, warmup_steps=4000, label_smoothing=0.1),
      train=TrainConfig(num_steps=100000, eval_every=5000, checkpoint_every=2000, keep_checkpoints=20),
  )
