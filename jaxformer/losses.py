"""Losses: label-smoothed cross-entropy (what is optimised) and the true NLL (what is reported)."""

import functools

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
  loss, nll = _token_losses(logits.astype(jnp.float32), targets, float(label_smoothing))
  return jnp.sum(loss * weights), jnp.sum(nll * weights), jnp.sum(weights)


def token_log_probs(logits, targets):
  """log p(target) [batch, length] of logits [batch, length, vocab] (float32), with the
  written-out gradient of `_token_losses`."""
  return -_token_losses(logits.astype(jnp.float32), targets, 0.0)[1]


def dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta):
  """Direct Preference Optimization (Rafailov et al. 2023, eq. 7), per pair.

  Inputs [pairs]: summed log-probabilities of each response's tokens under the policy and the
  frozen reference. Returns (loss, chosen reward, rejected reward), each [pairs]: the rewards
  are beta * (policy - reference), and the loss -log sigmoid(chosen - rejected), so beta
  multiplies the log-ratio margin once (MaxText's issue 1530 scaled it twice).
  """
  chosen = beta * (policy_chosen - reference_chosen)
  rejected = beta * (policy_rejected - reference_rejected)
  return -jax.nn.log_sigmoid(chosen - rejected), chosen, rejected


# The gradient is written out: d loss / d logits = softmax(logits) - smoothed targets.
# Autodiff of the formula keeps log-probabilities and products the size of the logits for
# the backward pass; this keeps only the logits, and the forward pass never builds a
# one-hot. For `wmt_base` shapes (64 x 24 target tokens, 37k vocabulary) the step's
# temporaries go from 2,298 to 1,865 MiB and its time down 5-6% on a CPU (BENCHMARKS.md).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _token_losses(logits, targets, label_smoothing):
  """(smoothed loss, NLL) per token, [batch, length] each."""
  return _token_losses_fwd(logits, targets, label_smoothing)[0]


def _token_losses_fwd(logits, targets, label_smoothing):
  vocab = logits.shape[-1]
  lse = jax.nn.logsumexp(logits, axis=-1)
  nll = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  if label_smoothing > 0:
    # -sum_v q_v log p_v with q = smoothed_targets: the target's term plus eps/(V-1) of all.
    confidence = 1.0 - label_smoothing
    low = label_smoothing / (vocab - 1)
    entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
    loss = (confidence - low) * nll + low * (vocab * lse - jnp.sum(logits, axis=-1)) - entropy
  else:
    loss = nll
  return (loss, nll), (logits, lse, targets)


def _token_losses_bwd(label_smoothing, residuals, cotangents):
  logits, lse, targets = residuals
  g_loss, g_nll = (g[..., None] for g in cotangents)
  probs = jnp.exp(logits - lse[..., None])
  one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype)
  soft = smoothed_targets(targets, logits.shape[-1], label_smoothing) if label_smoothing > 0 else one_hot
  return (g_loss + g_nll) * probs - g_loss * soft - g_nll * one_hot, None


_token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)


# model.logits_chunk=0 chunks by itself when one device's float32 logits would pass this
# size (Llama 3's 128k vocabulary at 8k tokens: 4 GiB); each chunk then holds about
# AUTO_CHUNK_BYTES of them per device. The recipes' own batches stay under it on one device.
AUTO_LOGITS_BYTES = 2 * 2**30
AUTO_CHUNK_BYTES = 256 * 2**20


def logits_chunk(setting, tokens, vocab_size, batch_shards=1):
  """Tokens per chunk for `chunked_cross_entropy`, or 0 for the whole logits at once.

  setting: model.logits_chunk (> 0: that many; 0: automatic, see AUTO_LOGITS_BYTES);
  tokens: target tokens in the (micro-)batch, split over `batch_shards` devices.
  """
  if setting > 0:
    return setting if setting < tokens else 0
  if tokens / batch_shards * vocab_size * 4 <= AUTO_LOGITS_BYTES:
    return 0
  return max(1, AUTO_CHUNK_BYTES // (4 * vocab_size)) * batch_shards


def chunked_cross_entropy(hidden, weight, targets, weights, label_smoothing, chunk, project):
  """`cross_entropy(project(hidden, weight), ...)`, with the logits built `chunk` tokens at a time.

  hidden [batch, length, d_model] (the final hidden states); weight: the output layer's,
  turned into logits [tokens, vocab] (float32) by `project(h [tokens, d_model], weight)`;
  targets, weights [batch, length]. The rows go through in pieces of [batch, c] positions,
  c = max(1, chunk // batch) (the length padded with weight-0 slots to a multiple of c), in
  a `lax.scan` whose body is rematerialised: the forward pass keeps only each piece's loss
  sums, and the backward pass rebuilds the piece's logits, applies the written-out
  gradient of `_token_losses` and accumulates the weight's gradient across pieces. So
  the logits and their gradient exist for one piece at a time, for the cost of computing
  the logits twice. Returns what `cross_entropy` returns (same values up to float32
  rounding: the sums run in another order).
  """
  batch, length, d_model = hidden.shape
  c = max(1, min(chunk // batch, length))
  pieces = -(-length // c)
  pad = pieces * c - length

  def split(x):  # [batch, length, ...] -> [pieces, batch, c, ...]
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.swapaxes(x.reshape(batch, pieces, c, *x.shape[2:]), 0, 1)

  @functools.partial(jax.checkpoint, prevent_cse=False)  # in a scan, nothing to protect from CSE
  def piece(h, t, w):
    logits = project(h.reshape(-1, d_model), weight)
    loss, nll = _token_losses(logits, t.reshape(-1), float(label_smoothing))
    w = w.reshape(-1)
    return jnp.sum(loss * w), jnp.sum(nll * w)

  def body(sums, xs):
    return jax.tree.map(jnp.add, sums, piece(*xs)), None

  zero = jnp.zeros((), jnp.float32)
  xs = (split(hidden), split(targets), split(weights.astype(jnp.float32)))
  (loss, nll), _ = jax.lax.scan(body, (zero, zero), xs)
  return loss, nll, jnp.sum(weights)
