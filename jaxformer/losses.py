"""Losses: label-smoothed cross-entropy (what is optimised) and the true NLL (what is reported)."""

import jax
import jax.numpy as jnp


def smoothed_targets(targets, vocab_size, label_smoothing):
  """The smoothed distribution [..., vocab]: 1 - eps on the target, eps / (V - 1) elsewhere.

  This is the tensor2tensor / Flax-WMT convention (Szegedy et al. 2016, as the paper uses).
  """
  confidence = 1.0 - label_smoothing
  low = label_smoothing / (vocab_size - 1)
  return jax.nn.one_hot(targets, vocab_size) * (confidence - low) + low


def cross_entropy(logits, targets, weights, label_smoothing=0.0):
  """Label-smoothed cross-entropy, summed over weighted tokens.

  logits [batch, length, vocab] (float32), targets [batch, length] int, weights
  [batch, length] (1 for real target tokens, 0 for padding). The constant entropy of
  the smoothed distribution is subtracted, so the minimum of the loss is 0 and it is
  reached exactly when softmax(logits) equals the smoothed distribution.

  Returns (smoothed loss sum, NLL sum, weight sum): the NLL is -log p(target), the
  quantity behind perplexity, reported alongside the smoothed training loss.
  """
  vocab = logits.shape[-1]
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  nll = -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
  if label_smoothing > 0:
    soft = smoothed_targets(targets, vocab, label_smoothing)
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1)
    entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
    loss = -jnp.sum(soft * log_probs, axis=-1) - entropy
  else:
    loss = nll
  return jnp.sum(loss * weights), jnp.sum(nll * weights), jnp.sum(weights)
