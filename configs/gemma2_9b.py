"""Gemma 2 9B (google/gemma-2-9b), its published shape: (1 + w) RMSNorms before and after attention and
the FFN, embeddings scaled by sqrt(d_model) and tied to the output, GeGLU, logits scaled by
query_pre_attn_scalar^-0.5, tanh soft-capping of attention (50) and output (30) logits, and local layers
(a 4,096-token window) alternating with global ones from layer 0: 9,241,705,984 parameters.

From google/gemma-2-9b's config.json: vocab_size 256000, hidden_size 3584, num_hidden_layers 42,
num_attention_heads 16, num_key_value_heads 8, head_dim 256, intermediate_size 14336, hidden_activation
gelu_pytorch_tanh, query_pre_attn_scalar 256, attn_logit_softcapping 50.0, final_logit_softcapping 30.0,
sliding_window 4096, rms_norm_eps 1e-06, rope_theta 10000.0, max_position_embeddings 8192, attention_bias
false, bos_token_id 2, eos_token_id 1, pad_token_id 0. Tied embeddings, the sqrt(hidden_size) embedding
scale, the (1 + w) norms and the post-norms are Gemma 2's architecture (Gemma2Config's
tie_word_embeddings default true); transformers 4.x alternates sliding (even) and full (odd) layers.

The vocabulary is the model's own (data.tokenizer=hf reads its tokenizer.json; `python -m jaxformer.convert`
writes one into the workdir); its tokenizer adds a BOS. Trains at 4,096 tokens a row. Local and global
layers differ, so model.scan_layers stays false.
"""

from jaxformer.config import replace
from jaxformer.configs import llama_7b


def get_config():
  return replace(llama_7b.get_config(), name="gemma2_9b", **{
      "model.vocab_size": 256000, "model.d_model": 3584, "model.num_layers": 42, "model.num_heads": 16,
      "model.num_kv_heads": 8, "model.head_dim": 256, "model.d_ff": 14336, "model.activation": "geglu",
      "model.norm_eps": 1e-6, "model.norm_unit_offset": True, "model.post_norms": True, "model.use_bias": False,
      "model.query_pre_attn_scalar": 256.0, "model.attn_softcap": 50.0, "model.final_softcap": 30.0,
      "model.sliding_window": 4096, "model.attention_pattern": "local,global", "model.rope_theta": 10000.0,
      "model.max_len": 8192, "model.tie_output": True, "model.scale_embeddings": True, "model.bos_id": 2,
      "model.eos_id": 1, "model.pad_id": 0, "data.tokenizer": "hf", "data.add_bos": True,
      "data.block_size": 4096, "data.batch_size": 512})
