"""Gemma 3 4B, text model (the language_model of google/gemma-3-4b-pt), its published shape: Gemma 2's layout
with (1 + w) RMSNorms over each head's q and k instead of soft-capping, five local layers (a 1,024-token
window, RoPE base 10,000 unscaled) per global one (RoPE base 1,000,000, linearly scaled by 8), embeddings
scaled by sqrt(d_model) and tied: 3,880,263,168 parameters. (The checkpoint's published 4,300,079,472 adds
the SigLIP vision tower, 416,866,032, and the multimodal projector, 2,950,272: not part of this recipe.)

From google/gemma-3-4b-pt's config.json, text_config: hidden_size 2560, intermediate_size 10240,
num_hidden_layers 34, sliding_window 1024, rope_scaling {"factor": 8.0, "rope_type": "linear"}; the rest
are Gemma3TextConfig's defaults (transformers), which that config.json leaves out: vocab_size 262208,
num_attention_heads 8, num_key_value_heads 4, head_dim 256, query_pre_attn_scalar 256, hidden_activation
gelu_pytorch_tanh, rms_norm_eps 1e-06, rope_theta 1000000.0, rope_local_base_freq 10000.0,
sliding_window_pattern 6 (layer i is global when (i + 1) % 6 == 0), attn_logit_softcapping and
final_logit_softcapping None, attention_bias false, tie_word_embeddings true, max_position_embeddings
131072, bos_token_id 2, eos_token_id 1, pad_token_id 0.

The vocabulary is the model's own (data.tokenizer=hf reads its tokenizer.json; `python -m jaxformer.convert`
writes one into the workdir); its tokenizer adds a BOS. Trains at 4,096 tokens a row. Local and global
layers differ, so model.scan_layers stays false.
"""

from jaxformer.config import replace
from jaxformer.configs import llama_7b


def get_config():
  return replace(llama_7b.get_config(), name="gemma3_4b", **{
      "model.vocab_size": 262208, "model.d_model": 2560, "model.num_layers": 34, "model.num_heads": 8,
      "model.num_kv_heads": 4, "model.head_dim": 256, "model.d_ff": 10240, "model.activation": "geglu",
      "model.norm_eps": 1e-6, "model.norm_unit_offset": True, "model.post_norms": True, "model.qk_norm": True,
      "model.use_bias": False, "model.query_pre_attn_scalar": 256.0, "model.attn_softcap": 0.0,
      "model.final_softcap": 0.0, "model.sliding_window": 1024,
      "model.attention_pattern": "local,local,local,local,local,global", "model.rope_theta": 1e6,
      "model.rope_scaling": "linear", "model.rope_scaling_factor": 8.0, "model.rope_local_theta": 10000.0,
      "model.max_len": 131072, "model.tie_output": True, "model.scale_embeddings": True, "model.bos_id": 2,
      "model.eos_id": 1, "model.pad_id": 0, "data.tokenizer": "hf", "data.add_bos": True,
      "data.block_size": 4096, "data.batch_size": 512})
