"""The models: `EncoderDecoder` (Vaswani et al. 2017) and `DecoderOnly` (GPT-2, Llama).

Both are assembled from the blocks in `jaxformer.layers` by config. Inputs use the
conventions of `jaxformer.data`: token id `cfg.pad_id` (0 by default) is padding, segment
ids mark real tokens (0 = pad; several segments in a row = packed sequences), positions
count from 0.
"""

import flax.linen as nn
import jax.numpy as jnp

from jaxformer.config import ModelConfig
from jaxformer import layers


def _default_segments(ids, segment, pad_id=0):
  return (ids != pad_id).astype(jnp.int32) if segment is None else segment


def _logits_bias(module, cfg):
  """The optional trained output bias [vocab] (Marian's final_logits_bias), or None."""
  if not cfg.logits_bias:
    return None
  return module.param("logits_bias", layers._param(nn.initializers.zeros, ("vocab",)), (cfg.vocab_size,), jnp.float32)


def _default_positions(ids, position):
  if position is not None:
    return position
  return jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)


class Block(nn.Module):
  """One layer: self-attention, optional cross-attention, FFN; each a residual sublayer.

  Post-norm (paper): x = norm(x + dropout(f(x))). Pre-norm (GPT-2, Llama):
  x = x + dropout(f(norm(x))). x [batch, length, d_model] -> same shape.
  """
  cfg: ModelConfig
  causal: bool = False
  cross: bool = False

  @nn.compact
  def __call__(self, x, segment, position, encoded=None, encoded_segment=None,
               deterministic=True, decode=False):
    cfg = self.cfg

    def sublayer(x, fn, name):
      drop = nn.Dropout(cfg.dropout_rate)
      if cfg.norm_position == "pre":
        return x + drop(fn(layers.norm(cfg, f"{name}_norm")(x)), deterministic=deterministic)
      return layers.norm(cfg, f"{name}_norm")(x + drop(fn(x), deterministic=deterministic))

    self_attention = layers.Attention(cfg, causal=self.causal, name="self_attention")
    x = sublayer(x, lambda y: self_attention(y, segment, position, deterministic=deterministic,
                                             decode=decode), "self_attention")
    if self.cross:
      cross_attention = layers.Attention(cfg, name="cross_attention")
      # Packed rows: decoder segment i attends to encoder segment i only.
      x = sublayer(x, lambda y: cross_attention(y, segment, position, encoded, encoded_segment,
                                                None, deterministic=deterministic), "cross_attention")
    ffn = layers.FeedForward(cfg, name="ffn")
    x = sublayer(x, lambda y: ffn(y, deterministic), "ffn")
    return nn.with_logical_constraint(x, ("batch", "length", "embed"))


class Stack(nn.Module):
  """Embedded input -> `num_layers` blocks (-> final norm when pre-norm)."""
  cfg: ModelConfig
  num_layers: int
  causal: bool = False
  cross: bool = False

  @nn.compact
  def __call__(self, x, segment, position, encoded=None, encoded_segment=None,
               deterministic=True, decode=False):
    cfg = self.cfg
    if cfg.position == "sinusoidal":
      x = x + layers.sinusoidal(position, cfg.d_model, cfg.sinusoidal_layout).astype(x.dtype)
    elif cfg.position == "learned":
      table = self.param("position_embedding", layers._param(nn.initializers.normal(cfg.init_std),
                                                             ("length", "embed")), (cfg.max_len, cfg.d_model))
      table = nn.with_logical_constraint(table, ("length", None))  # all-gathered, as in Embed
      x = x + jnp.take(table, position, axis=0).astype(x.dtype)
    # The paper applies dropout to the sum of embeddings and positional encodings.
    x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
    for i in range(self.num_layers):
      x = Block(cfg, self.causal, self.cross, name=f"layer_{i}")(
          x, segment, position, encoded, encoded_segment, deterministic, decode)
    if cfg.norm_position == "pre":
      x = layers.norm(cfg, "final_norm")(x)
    return x


class EncoderDecoder(nn.Module):
  """The Transformer of "Attention Is All You Need".

  inputs [batch, src_len] and decoder_inputs [batch, tgt_len] (BOS + target shifted
  right) -> logits [batch, tgt_len, vocab] (float32).
  """
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embed = layers.Embed(cfg, name="embed")
    self.decoder_embed = self.embed if cfg.share_embeddings else layers.Embed(cfg, name="decoder_embed")
    self.encoder = Stack(cfg, cfg.encoder_layers, name="encoder")
    self.decoder = Stack(cfg, cfg.num_layers, causal=True, cross=True, name="decoder")
    if not cfg.tie_output:
      self.logits = layers.dense(cfg, cfg.vocab_size, ("embed", "vocab"), use_bias=False, name="logits")
    self.logits_bias = _logits_bias(self, cfg)

  def encode(self, inputs, inputs_segmentation=None, inputs_position=None, deterministic=True):
    """inputs [batch, src_len] -> encoded [batch, src_len, d_model]."""
    segment = _default_segments(inputs, inputs_segmentation, self.cfg.pad_id)
    position = _default_positions(inputs, inputs_position)
    return self.encoder(self.embed(inputs), segment, position, deterministic=deterministic)

  def decode(self, encoded, inputs_segmentation, decoder_inputs, targets_segmentation=None,
             targets_position=None, deterministic=True, decode=False):
    """Decoder pass -> logits [batch, tgt_len, vocab]. With decode=True it uses the KV cache."""
    if targets_segmentation is None and self.cfg.bos_id == self.cfg.pad_id:
      # The decoder starts with the pad token (Marian): like HF, no padding mask by default;
      # with right padding a causal query never sees a pad key anyway.
      targets_segmentation = jnp.ones_like(decoder_inputs, jnp.int32)
    segment = _default_segments(decoder_inputs, targets_segmentation, self.cfg.pad_id)
    position = _default_positions(decoder_inputs, targets_position)
    x = self.decoder(self.decoder_embed(decoder_inputs), segment, position, encoded,
                     inputs_segmentation, deterministic, decode)
    logits = self.decoder_embed.attend(x) if self.cfg.tie_output else self.logits(x).astype(jnp.float32)
    return logits if self.logits_bias is None else logits + self.logits_bias

  def __call__(self, inputs, decoder_inputs, inputs_segmentation=None, targets_segmentation=None,
               inputs_position=None, targets_position=None, deterministic=True, decode=False):
    """Teacher-forced forward pass -> logits [batch, tgt_len, vocab]."""
    inputs_segmentation = _default_segments(inputs, inputs_segmentation, self.cfg.pad_id)
    encoded = self.encode(inputs, inputs_segmentation, inputs_position, deterministic)
    return self.decode(encoded, inputs_segmentation, decoder_inputs, targets_segmentation,
                       targets_position, deterministic, decode)


class DecoderOnly(nn.Module):
  """A causal language model (GPT-2 or Llama style, by config).

  inputs [batch, length] -> logits [batch, length, vocab] (float32). `segment_ids`
  keep packed documents apart; with decode=True the call appends to the KV cache.
  """
  cfg: ModelConfig

  def setup(self):
    cfg = self.cfg
    self.embed = layers.Embed(cfg, name="embed")
    self.decoder = Stack(cfg, cfg.num_layers, causal=True, name="decoder")
    if not cfg.tie_output:
      self.logits = layers.dense(cfg, cfg.vocab_size, ("embed", "vocab"), use_bias=False, name="logits")
    self.logits_bias = _logits_bias(self, cfg)

  def __call__(self, inputs, segment_ids=None, positions=None, deterministic=True, decode=False,
               last_only=False):
    """-> logits [batch, length, vocab]; last_only: the last position's only, [batch, 1, vocab]."""
    # Token 0 may be a real token (e.g. a character) for LMs, so segments default to all ones.
    segment = jnp.ones_like(inputs, jnp.int32) if segment_ids is None else segment_ids
    position = _default_positions(inputs, positions)
    x = self.decoder(self.embed(inputs), segment, position, deterministic=deterministic, decode=decode)
    if last_only:  # sampling needs the next token's logits only; XLA does not push the slice into the matmul
      x = x[:, -1:]
    logits = self.embed.attend(x) if self.cfg.tie_output else self.logits(x).astype(jnp.float32)
    return logits if self.logits_bias is None else logits + self.logits_bias


def build_model(cfg: ModelConfig):
  """The model class the config names."""
  return EncoderDecoder(cfg) if cfg.arch == "encoder_decoder" else DecoderOnly(cfg)
