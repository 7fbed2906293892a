"""Qwen2.5-7B (Qwen/Qwen2.5-7B), its published shape: a Llama with biases on the q/k/v projections (none on
o_proj or the FFN), GQA, RoPE theta 1e6 and untied embeddings: 7,615,616,512 parameters.

From Qwen/Qwen2.5-7B's config.json: vocab_size 152064, hidden_size 3584, num_hidden_layers 28,
num_attention_heads 28, num_key_value_heads 4 (head_dim 3584 / 28 = 128), intermediate_size 18944,
hidden_act silu, rms_norm_eps 1e-06, rope_theta 1000000.0, rope_scaling null, max_position_embeddings
131072, use_sliding_window false, tie_word_embeddings false, bos_token_id 151643, eos_token_id 151643 (no
pad_token_id: it pads with EOS, as jaxformer.convert does). Qwen2's attention always has the q/k/v biases.

The vocabulary is the model's own (data.tokenizer=hf reads its tokenizer.json; `python -m jaxformer.convert`
writes one into the workdir), and Qwen's tokenizer adds no BOS. Trains at 4,096 tokens a row.
"""

from jaxformer.config import replace
from jaxformer.configs import llama_7b


def get_config():
  return replace(llama_7b.get_config(), name="qwen2_5_7b", **{
      "model.vocab_size": 152064, "model.d_model": 3584, "model.num_layers": 28, "model.num_heads": 28,
      "model.num_kv_heads": 4, "model.d_ff": 18944, "model.activation": "swiglu", "model.norm_eps": 1e-6,
      "model.use_bias": False, "model.qkv_bias": True, "model.rope_theta": 1e6, "model.max_len": 131072,
      "model.tie_output": False, "model.bos_id": 151643, "model.eos_id": 151643, "model.pad_id": 151643,
      "data.tokenizer": "hf", "data.add_bos": False, "data.block_size": 4096, "data.batch_size": 512})
