"""GPT-2 small (124M) on OpenWebText, as nanoGPT's train_gpt2.py: 12 layers, 12 heads, d_model 768,
learned positions (1024), pre-LayerNorm, GELU, tied embeddings, biases; AdamW + cosine, bf16 compute.

Data: OpenWebText streamed from the Hugging Face hub (no full download first) and prepared once into
uint16 token shards (~8M documents, ~9B tokens, ~18 GB; `python -m jaxformer.prepare --config gpt2_small`,
README); 0.05% of the documents validate, as nanoGPT's split; nanoGPT's random 1,024-token windows.
"""

from jaxformer.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig


def get_config():
  return Config(
      name="gpt2_small",
      model=ModelConfig(arch="decoder_only", vocab_size=50257, d_model=768, num_heads=12, num_layers=12,
                        d_ff=3072, activation="gelu", norm="layernorm", norm_position="pre", norm_eps=1e-5,
                        position="learned", max_len=1024, scale_embeddings=False, kernel_init="normal",
                        init_std=0.02, dropout_rate=0.0, dtype="bfloat16"),
      data=DataConfig(task="lm", source="hub", hub_name="Skylion007/openwebtext", hub_config="", streaming=True,
                      train_fraction=0.9995, tokenizer="sentencepiece", tokenizer_sample_docs=50_000,
                      block_size=1024, batch_size=480, packing="random_windows", num_proc=8),
      optim=OptimConfig(optimizer="adamw", schedule="cosine", learning_rate=6e-4, min_learning_rate=6e-5,
                        warmup_steps=2000, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0,
                        label_smoothing=0.0),
      train=TrainConfig(num_steps=600000, eval_every=2000, checkpoint_every=2000, keep_checkpoints=3,
                        eval_batches=20),  # an estimate (nanoGPT's eval_iters) every 2000 steps; 0 = all of val
  )
