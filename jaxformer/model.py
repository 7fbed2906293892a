"""The models: `EncoderDecoder` (Vaswani et al. 2017) and `DecoderOnly` (GPT-2, Llama).

Both are assembled from the blocks in `jaxformer.layers` by config. Inputs use the
conventions of `jaxformer.data`: token id `cfg.pad_id` (0 by default) is padding, segment
ids mark real tokens (0 = pad; several segments in a row = packed sequences), positions
count from 0.
"""

import re

import flax.linen as nn
from flax import traverse_util
import jax
import jax.numpy as jnp

from jaxformer.config import ModelConfig
from jaxformer import layers
from jaxformer import moe as moe_lib
from jaxformer import qmatmul


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
  x = x + dropout(f(norm(x))); with model.post_norms (Gemma 2/3) x + dropout(norm'(f(norm(x)))).
  `local`: self-attention within model.sliding_window. x [batch, length, d_model] -> same shape, or
  (x, None) with `scan_body` (the carry and per-layer outputs `nn.scan` expects).
  """
  cfg: ModelConfig
  causal: bool = False
  cross: bool = False
  scan_body: bool = False
  moe: bool = False  # the FFN is `moe.MoEFeedForward` (see moe.is_moe_layer)
  local: bool = False  # sliding-window self-attention (see ModelConfig.layer_is_local)

  @nn.compact
  def __call__(self, x, segment, position, encoded=None, encoded_segment=None,
               deterministic=True, decode=False):
    cfg = self.cfg

    def sublayer(x, fn, name):
      drop = nn.Dropout(cfg.dropout_rate)
      if cfg.norm_position == "pre":
        y = fn(layers.norm(cfg, f"{name}_norm")(x))
        if cfg.post_norms:
          y = layers.norm(cfg, f"{name}_post_norm")(y)
        return x + drop(y, deterministic=deterministic)
      return layers.norm(cfg, f"{name}_norm")(x + drop(fn(x), deterministic=deterministic))

    self_attention = layers.Attention(cfg, causal=self.causal, local=self.local, name="self_attention")
    x = sublayer(x, lambda y: self_attention(y, segment, position, deterministic=deterministic,
                                             decode=decode), "self_attention")
    if self.cross:
      cross_attention = layers.Attention(cfg, cross=True, name="cross_attention")
      # Packed rows: decoder segment i attends to encoder segment i only. Decoding passes
      # encoded=None after a sentence's first step: its keys and values are in the cache.
      x = sublayer(x, lambda y: cross_attention(y, segment, position, encoded, encoded_segment,
                                                None, deterministic=deterministic, decode=decode),
                   "cross_attention")
    ffn = moe_lib.MoEFeedForward(cfg, name="moe") if self.moe else layers.FeedForward(cfg, name="ffn")
    x = sublayer(x, lambda y: ffn(y, deterministic), "ffn")
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    return (x, None) if self.scan_body else x


# model.remat -> what a block keeps for the backward pass (the rest is recomputed there).
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,  # only the block's inputs
    "dots_saveable": jax.checkpoint_policies.dots_saveable,  # every matmul output
    # The projections' outputs, not attention's batched q.k and p.v products [b, h, q, k].
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def block_class(cfg: ModelConfig):
  """Block, wrapped in `nn.remat` with the policy `cfg.remat` names (none: Block itself)."""
  if cfg.remat == "none":
    return Block
  # deterministic and decode (arguments 6 and 7, counting self) steer Python control flow.
  # Inside nn.scan the loop already keeps XLA from merging the recomputation away.
  return nn.remat(Block, policy=REMAT_POLICIES[cfg.remat], prevent_cse=not cfg.scan_layers, static_argnums=(6, 7))


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
    args = (segment, position, encoded, encoded_segment, deterministic, decode)
    if cfg.scan_layers:
      # One traced block, run num_layers times: its parameters (and KV cache) are stacked
      # on a leading `layers` axis; every argument but x is the same for all layers.
      # (intermediates: the MoE router statistics of each layer, see moe.aux_losses.)
      layer_stack = nn.scan(block_class(cfg), variable_axes={"params": 0, "cache": 0, "intermediates": 0},
                            split_rngs={"params": True, "dropout": True}, in_axes=(nn.broadcast,) * len(args),
                            length=self.num_layers, metadata_params={nn.PARTITION_NAME: "layers"})
      x, _ = layer_stack(cfg, self.causal, self.cross, scan_body=True, moe=moe_lib.is_moe_layer(cfg, 0),
                         local=cfg.layer_is_local(0), name="layers")(x, *args)
    else:
      for i in range(self.num_layers):
        x = block_class(cfg)(cfg, self.causal, self.cross, moe=moe_lib.is_moe_layer(cfg, i),
                             local=cfg.layer_is_local(i), name=f"layer_{i}")(x, *args)
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
             targets_position=None, deterministic=True, decode=False, project=True):
    """Decoder pass -> logits [batch, tgt_len, vocab]. With decode=True it uses the KV cache;
    then `encoded` [batch, src_len, d_model] fills the cache's cross-attention keys and
    values, and encoded=None reuses them (every step after a sentence's first).

    project=False returns the final hidden states [batch, tgt_len, d_model] instead (the
    chunked loss projects them itself, see `output_weight`).
    """
    if targets_segmentation is None and self.cfg.bos_id == self.cfg.pad_id:
      # The decoder starts with the pad token (Marian): like HF, no padding mask by default;
      # with right padding a causal query never sees a pad key anyway.
      targets_segmentation = jnp.ones_like(decoder_inputs, jnp.int32)
    segment = _default_segments(decoder_inputs, targets_segmentation, self.cfg.pad_id)
    position = _default_positions(decoder_inputs, targets_position)
    x = self.decoder(self.decoder_embed(decoder_inputs), segment, position, encoded,
                     inputs_segmentation, deterministic, decode)
    if not project:
      return x
    logits = self.decoder_embed.attend(x) if self.cfg.tie_output else self.logits(x).astype(jnp.float32)
    return layers.finish_logits(logits, self.logits_bias, self.cfg)

  def output_weight(self):
    """The vocabulary projection: ((weight, logits bias or None), einsum spec) for `layers.project_logits`."""
    return _output_weight(self.cfg, self.decoder_embed, self)

  def __call__(self, inputs, decoder_inputs, inputs_segmentation=None, targets_segmentation=None,
               inputs_position=None, targets_position=None, deterministic=True, decode=False, project=True):
    """Teacher-forced forward pass -> logits [batch, tgt_len, vocab] (project=False: hidden states)."""
    inputs_segmentation = _default_segments(inputs, inputs_segmentation, self.cfg.pad_id)
    encoded = self.encode(inputs, inputs_segmentation, inputs_position, deterministic)
    return self.decode(encoded, inputs_segmentation, decoder_inputs, targets_segmentation,
                       targets_position, deterministic, decode, project)


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
               last_only=False, project=True):
    """-> logits [batch, length, vocab]; last_only: the last position's only, [batch, 1, vocab];
    project=False: the final hidden states [batch, length, d_model] (`project_hidden` projects them)."""
    # Token 0 may be a real token (e.g. a character) for LMs, so segments default to all ones.
    segment = jnp.ones_like(inputs, jnp.int32) if segment_ids is None else segment_ids
    position = _default_positions(inputs, positions)
    x = self.decoder(self.embed(inputs), segment, position, deterministic=deterministic, decode=decode)
    if last_only:  # sampling needs the next token's logits only; XLA does not push the slice into the matmul
      x = x[:, -1:]
    if not project:
      return x
    return self.project_hidden(x)

  def project_hidden(self, x):
    """Final hidden states x [batch, length, d_model] -> logits [batch, length, vocab] (the serving engine
    projects the positions it samples and, for prompt log-probs, every position of a prefill chunk)."""
    logits = self.embed.attend(x) if self.cfg.tie_output else self.logits(x).astype(jnp.float32)
    return layers.finish_logits(logits, self.logits_bias, self.cfg)

  def output_weight(self):
    """The vocabulary projection: ((weight, logits bias or None), einsum spec) for `layers.project_logits`."""
    return _output_weight(self.cfg, self.embed, self)


def _output_weight(cfg, embed, model):
  """The tied embedding table [vocab, d_model] or the `logits` kernel [d_model, vocab], with the
  logits bias [vocab] (None without one) and the einsum spec."""
  if cfg.tie_output:
    return (embed.table(), model.logits_bias), "nd,vd->nv"
  head = model.logits.variables["params"]
  if "qkernel" in head:  # a quantized workdir's output layer, dequantized: [vocab, d_model]
    return (qmatmul.dequantize(head["qkernel"], head["qscale"]), model.logits_bias), "nd,vd->nv"
  return (head["kernel"], model.logits_bias), "nd,dv->nv"


def build_model(cfg: ModelConfig):
  """The model class the config names."""
  return EncoderDecoder(cfg) if cfg.arch == "encoder_decoder" else DecoderOnly(cfg)


# Weight-only quantization (jaxformer.quantize): which weights it quantizes. Here, below `quantize`
# (a command), because `inspect` (model arithmetic, imported by the training loop) counts their bytes too.
QUANT_SKIPPED = ("router",)  # float on purpose: routing decisions
QUANT_OUTPUT = ("logits",)   # the untied output layer: int8 with the embeddings (embedding="int8"), else float


def quantizable(cfg: ModelConfig):
  """{param path: (n_in, kind)} of the model's quantizable weights, in call order: each dense
  module's kernel ('.../query/kernel', n_in = its contracted axes; the output layer's kind 'output'),
  each MoE expert weight ('.../moe/wi', kind 'experts') and each token embedding table
  ('embed/embedding', kind 'embedding'). Recorded by running the model's init abstractly (nothing
  allocated); paths are those of `cfg` as given (unrolled layers unless cfg.scan_layers)."""
  model = build_model(cfg)
  seen = {}

  def record(next_fun, args, kwargs, context):
    fn = getattr(context.orig_method, "func", context.orig_method)
    module = context.module
    if isinstance(module, layers.TokenDense) and getattr(fn, "__qualname__", "") == "TokenDense.__call__":
      if module.name not in QUANT_SKIPPED:
        n_in = len(module.axis) if isinstance(module.axis, tuple) else 1
        seen["/".join(module.path) + "/kernel"] = (n_in, "output" if module.name in QUANT_OUTPUT else "dense")
    elif isinstance(module, layers.Embed) and context.method_name in ("__call__", "attend"):
      seen["/".join(module.path) + "/embedding"] = (1, "embedding")
    elif isinstance(module, moe_lib.MoEFeedForward) and context.method_name == "expert_weight":
      seen["/".join(module.path) + "/" + args[0]] = (1, "experts")
    return next_fun(*args, **kwargs)

  dummy = jnp.ones((1, 8), jnp.int32)
  args = (dummy, dummy) if cfg.arch == "encoder_decoder" else (dummy,)
  with nn.intercept_methods(record):
    jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), *args))
  return seen


def convert_layers(tree, scan_layers):
  """A tree of parameters (or of anything laid out like them: optimizer moments, a train
  state) in the unrolled layout, `layer_0` ... `layer_{n-1}` under each stack, or in the
  `model.scan_layers` one, a single `layers` entry whose leaves are stacked on a leading
  [n] axis: whichever `scan_layers` asks for. A tree already in that layout comes back as it is."""
  if isinstance(tree, dict):
    tree = {k: convert_layers(v, scan_layers) for k, v in tree.items()}
    unrolled = sorted((int(k[6:]), k) for k in tree if re.fullmatch(r"layer_\d+", k))
    if scan_layers and unrolled:
      stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[tree.pop(k) for _, k in unrolled])
      return {**tree, "layers": stacked}
    if not scan_layers and "layers" in tree:
      stacked = tree.pop("layers")
      n = jax.tree.leaves(stacked)[0].shape[0]
      return {**tree, **{f"layer_{i}": jax.tree.map(lambda x, i=i: x[i], stacked) for i in range(n)}}
    return tree
  if isinstance(tree, (tuple, list)):  # optax states are (named) tuples
    items = [convert_layers(v, scan_layers) for v in tree]
    return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
  return tree


def stack_layers_consuming(params):
  """convert_layers(params, True) for a params tree of dicts, emptying `params` on the way: each
  stacked leaf's per-layer arrays are dropped as soon as it is built, so the peak is the params
  plus one stacked leaf, not both layouts whole (loading an unrolled bfloat16 Llama 3.1 8B base
  into model.scan_layers on a 24 GB GPU: 16 GB, not 32). The caller must hold no other reference."""
  for key in list(params):
    if isinstance(params[key], dict):
      params[key] = stack_layers_consuming(params[key])
  unrolled = sorted((int(k[6:]), k) for k in params if re.fullmatch(r"layer_\d+", k))
  if not unrolled:
    return params
  flats = [traverse_util.flatten_dict(params.pop(k)) for _, k in unrolled]
  stacked = {}
  for path in list(flats[0]):
    stacked[path] = jnp.stack([f.pop(path) for f in flats])
  params["layers"] = traverse_util.unflatten_dict(stacked)
  return params
