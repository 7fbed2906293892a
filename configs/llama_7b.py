"""LLaMA-1 7B (Touvron et al. 2023): 32 layers, 32 heads, d_model 4096, d_ff 11008,
RMSNorm (pre), SwiGLU, RoPE (theta 10k), no biases, untied embeddings, vocab 32,000."""

from jaxformer.config import Config, DataConfig, ModelConfig, OptimConfig, TrainConfig


def get_config():
  return Config(
      name="llama_7b",
      model=ModelConfig(arch="decoder_only", vocab_size=32000, d_model=4096, num_heads=32, num_layers=32,
                        d_ff=11008, activation="swiglu", norm="rmsnorm", norm_position="pre", norm_eps=1e-6,
                        use_bias=False, position="rope", rope_theta=10000.0, max_len=2048,
                        share_embeddings=False, tie_output=False, scale_embeddings=False,
                        kernel_init="normal", init_std=0.02, dropout_rate=0.0, dtype="bfloat16"),
      data=DataConfig(task="lm", source="hub", hub_name="wikitext", hub_config="wikitext-103-raw-v1",
                      block_size=2048, batch_size=1024),
      optim=OptimConfig(optimizer="adamw", schedule="cosine", learning_rate=3e-4, min_learning_rate=3e-5,
                        warmup_steps=2000, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0,
                        label_smoothing=0.0),
      train=TrainConfig(num_steps=250000, eval_every=2000, checkpoint_every=1000, keep_checkpoints=3,
                        eval_batches=20),  # an estimate every 2000 steps; 0 = all of val
  )
