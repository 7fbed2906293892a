"""Phi-3-mini-4k-instruct (microsoft/Phi-3-mini-4k-instruct), its published shape: a Llama with full
multi-head attention (32 kv heads), a 2,047-token sliding window in every layer, RoPE theta 1e4 and untied
embeddings: 3,821,079,552 parameters. (Its checkpoint fuses q/k/v in one qkv_proj and gate/up in one
gate_up_proj: the same parameters as separate projections.)

From microsoft/Phi-3-mini-4k-instruct's config.json: vocab_size 32064, hidden_size 3072, num_hidden_layers
32, num_attention_heads 32, num_key_value_heads 32 (head_dim 3072 / 32 = 96), intermediate_size 8192,
hidden_act silu, attention_bias false, rms_norm_eps 1e-05, rope_theta 10000.0, rope_scaling null,
sliding_window 2047, max_position_embeddings 4096 (= original_max_position_embeddings), tie_word_embeddings
false, bos_token_id 1, eos_token_id 32000, pad_token_id 32000, resid_pdrop = embd_pdrop = 0.0.

The vocabulary is the model's own (data.tokenizer=hf reads its tokenizer.json; `python -m jaxformer.convert`
writes one into the workdir); its tokenizer adds a BOS. Trains at its 4,096-token context.
"""

from jaxformer.config import replace
from jaxformer.configs import llama_7b


def get_config():
  return replace(llama_7b.get_config(), name="phi3_mini", **{
      "model.vocab_size": 32064, "model.d_model": 3072, "model.num_layers": 32, "model.num_heads": 32,
      "model.num_kv_heads": 32, "model.d_ff": 8192, "model.activation": "swiglu", "model.norm_eps": 1e-5,
      "model.use_bias": False, "model.rope_theta": 10000.0, "model.sliding_window": 2047,
      "model.attention_pattern": "", "model.max_len": 4096, "model.tie_output": False, "model.bos_id": 1,
      "model.eos_id": 32000, "model.pad_id": 32000, "data.tokenizer": "hf", "data.add_bos": True,
      "data.block_size": 4096, "data.batch_size": 512})
