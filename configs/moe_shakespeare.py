"""Tiny Shakespeare with MoE FFNs: `shakespeare_char` with 8 experts of d_ff 256, top 2, in
every layer, so a token passes through as many FFN weights as the dense recipe's d_ff 512
(active parameters equal up to the router, 8 x 128 per layer, and the dense FFN's biases).
BENCHMARKS.md compares the two (benchmarks/moe_vs_dense.py)."""

from jaxformer.config import replace
from jaxformer.configs import shakespeare_char


def get_config():
  return replace(shakespeare_char.get_config(), name="moe_shakespeare", **{
      "model.moe_experts": 8, "model.moe_top_k": 2, "model.d_ff": 256, "optim.moe_aux_loss": 0.01})
