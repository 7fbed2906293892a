"""Qwen3-8B (Qwen/Qwen3-8B), its published shape: a Llama with an RMSNorm over each head's q and k (before
RoPE), no biases, an explicit head_dim of 128, GQA, RoPE theta 1e6 and untied embeddings: 8,190,735,360
parameters.

From Qwen/Qwen3-8B's config.json: vocab_size 151936, hidden_size 4096, num_hidden_layers 36,
num_attention_heads 32, num_key_value_heads 8, head_dim 128, intermediate_size 12288, hidden_act silu,
attention_bias false, rms_norm_eps 1e-06, rope_theta 1000000, rope_scaling null, max_position_embeddings
40960, use_sliding_window false, tie_word_embeddings false, bos_token_id 151643, eos_token_id 151645 (no
pad_token_id: it pads with EOS, as jaxformer.convert does). Qwen3's attention always has q_norm and k_norm.

The vocabulary is the model's own (data.tokenizer=hf reads its tokenizer.json; `python -m jaxformer.convert`
writes one into the workdir), and Qwen's tokenizer adds no BOS. Trains at 4,096 tokens a row.
"""

from jaxformer.config import replace
from jaxformer.configs import llama_7b


def get_config():
  return replace(llama_7b.get_config(), name="qwen3_8b", **{
      "model.vocab_size": 151936, "model.d_model": 4096, "model.num_layers": 36, "model.num_heads": 32,
      "model.num_kv_heads": 8, "model.head_dim": 128, "model.d_ff": 12288, "model.activation": "swiglu",
      "model.norm_eps": 1e-6, "model.use_bias": False, "model.qk_norm": True, "model.rope_theta": 1e6,
      "model.max_len": 40960, "model.tie_output": False, "model.bos_id": 151643, "model.eos_id": 151645,
      "model.pad_id": 151645, "data.tokenizer": "hf", "data.add_bos": False, "data.block_size": 4096,
      "data.batch_size": 512})
