"""nanoGPT's full Shakespeare-char recipe (a GPU run): 6 layers, 6 heads, d_model 384,
block 256, batch 64, 5,000 iterations, dropout 0.2."""

from jaxformer.config import replace
from jaxformer.configs import shakespeare_char


def get_config():
  return replace(shakespeare_char.get_config(), name="shakespeare_char_gpu", **{
      "model.d_model": 384, "model.num_heads": 6, "model.num_layers": 6, "model.d_ff": 1536,
      "model.max_len": 256, "model.dropout_rate": 0.2, "data.block_size": 256, "data.batch_size": 64,
      "optim.warmup_steps": 100, "train.num_steps": 5000, "train.eval_every": 250,
      "train.eval_batches": 200})
