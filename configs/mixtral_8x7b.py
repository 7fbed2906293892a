"""Mixtral 8x7B (Jiang et al. 2024): vocab 32,000, d_model 4096, 32 layers, 32 heads with 8 kv
heads, an MoE FFN in every layer (8 SwiGLU experts of d_ff 14,336, top 2), RoPE theta 1e6,
RMSNorm eps 1e-5, untied embeddings: 46,702,792,704 parameters, 12,879,925,248 active per token."""

from jaxformer.config import replace
from jaxformer.configs import llama_7b


def get_config():
  return replace(llama_7b.get_config(), name="mixtral_8x7b", **{
      "model.num_kv_heads": 8, "model.d_ff": 14336, "model.norm_eps": 1e-5, "model.rope_theta": 1e6,
      "model.max_len": 32768, "model.moe_experts": 8, "model.moe_top_k": 2,
      "optim.moe_aux_loss": 0.02,  # HF MixtralConfig's router_aux_loss_coef
      # Under mesh.expert > 1 the compiler's own placement (gspmd) runs every expert's rows on every chip:
      # 100 GiB per v5p chip at 32 x 4,096, over budget; the all-to-all dispatch 46 GiB (BENCHMARKS.md).
      "model.moe_dispatch": "all_to_all",
      "data.block_size": 4096, "data.batch_size": 512})
