"""WMT14 En->De, Transformer big (Vaswani et al. 2017, Table 3 "big"): d_model 1024,
16 heads, d_ff 4096, dropout 0.3, 300k steps; otherwise as `wmt_base`."""

from jaxformer.config import replace
from jaxformer.configs import wmt_base


def get_config():
  return replace(wmt_base.get_config(), name="wmt_big", **{
      "model.d_model": 1024, "model.num_heads": 16, "model.d_ff": 4096, "model.dropout_rate": 0.3,
      "train.num_steps": 300000})
