"""Mistral 7B v0.1 (mistralai/Mistral-7B-v0.1), its published shape: a Llama with GQA and a 4,096-token
sliding window in every layer (a local layer's decode cache is a ring of 4,096 slots), RoPE theta 1e4 and
untied embeddings: 7,241,732,096 parameters.

From mistralai/Mistral-7B-v0.1's config.json: vocab_size 32000, hidden_size 4096, num_hidden_layers 32,
num_attention_heads 32, num_key_value_heads 8 (head_dim 4096 / 32 = 128), intermediate_size 14336,
hidden_act silu, rms_norm_eps 1e-05, rope_theta 10000.0, sliding_window 4096, max_position_embeddings 32768,
tie_word_embeddings false, bos_token_id 1, eos_token_id 2 (no pad_token_id: it pads with EOS, as
jaxformer.convert does).

The vocabulary is the model's own (data.tokenizer=hf reads its tokenizer.json; `python -m jaxformer.convert`
writes one into the workdir); its tokenizer adds a BOS. Trains at 4,096 tokens a row.
"""

from jaxformer.config import replace
from jaxformer.configs import llama_7b


def get_config():
  return replace(llama_7b.get_config(), name="mistral_7b", **{
      "model.vocab_size": 32000, "model.d_model": 4096, "model.num_layers": 32, "model.num_heads": 32,
      "model.num_kv_heads": 8, "model.d_ff": 14336, "model.activation": "swiglu", "model.norm_eps": 1e-5,
      "model.use_bias": False, "model.rope_theta": 10000.0, "model.sliding_window": 4096,
      "model.attention_pattern": "", "model.max_len": 32768, "model.tie_output": False, "model.bos_id": 1,
      "model.eos_id": 2, "model.pad_id": 2, "data.tokenizer": "hf", "data.add_bos": True,
      "data.block_size": 4096, "data.batch_size": 512})
