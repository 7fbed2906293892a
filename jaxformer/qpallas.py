"""The int4 weight-only product as a Pallas TPU kernel: the nibbles unpacked in VMEM, never in HBM.

XLA's TPU compiler fuses an int8 weight's conversion into its dot, but unpacks an int4 kernel and
broadcasts its group scales into bf16 buffers in HBM before the dot (BENCHMARKS.md, "Quantized decode
step on the TPU compiler"). This kernel reads the packed bytes (`jaxformer.qmatmul`'s int4 layout:
uint8 [N, K / 2], even inputs in the low nibbles, float32 scales [N, K / group]) block by block, sign-
extends both nibbles, and multiplies each group's bytes against the even and odd inputs on the MXU,
scaling the group's [rows, outputs] sums. `qmatmul.matmul` takes it on TPU where `blocks` fits the shapes.
Compiled by the TPU compiler here without a TPU (`benchmarks/aot_compile.py --decode --quantize 4`) and run
in Pallas' TPU interpreter by the tests; never run on a TPU.
"""

import functools

import jax
import jax.numpy as jnp

MAX_ROWS = 512      # rows held whole in VMEM (decode, short prefill); more take the XLA path


def blocks(rows, q_shape, scale_shape):
  """(outputs per block, groups per block) for an int4 product of `rows` rows, or None when it does not fit
  the TPU's (8, 128) tiling: outputs in blocks of 512/256/128, groups in blocks of 8 (a multiple of 128 bytes)."""
  n, half = q_shape
  groups = scale_shape[1]
  if rows > MAX_ROWS or groups % 8 or half % groups:
    return None
  bn = next((b for b in (512, 256, 128) if n % b == 0), None)
  if bn is None or (half // groups * 8) % 128:
    return None
  return bn, 8


def _kernel(xe_ref, xo_ref, q_ref, s_ref, o_ref, acc_ref, *, groups_per_block, group_bytes):
  """One (outputs, inputs) block: acc [M, bn] += sum over its groups of s_g * (xe_g . lo_g + xo_g . hi_g)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  @pl.when(pl.program_id(1) == 0)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)
  q = q_ref[...].astype(jnp.int32)                          # [bn, bytes]
  lo = jnp.right_shift(jnp.left_shift(q, 28), 28)           # even inputs, sign-extended
  hi = jnp.right_shift(jnp.left_shift(q, 24), 28)           # odd inputs
  xe, xo = xe_ref[...], xo_ref[...]                         # [M, bytes]
  dims = (((1,), (1,)), ((), ()))
  total = acc_ref[...]
  for g in range(groups_per_block):
    part = slice(g * group_bytes, (g + 1) * group_bytes)
    dot = lambda x, w: jax.lax.dot_general(x[:, part], w[:, part].astype(x.dtype), dims,
                                           preferred_element_type=jnp.float32)
    total = total + (dot(xe, lo) + dot(xo, hi)) * s_ref[g:g + 1, :]
  acc_ref[...] = total

  @pl.when(pl.program_id(1) == pl.num_programs(1) - 1)
  def _():
    o_ref[...] = acc_ref[...]


def int4_matmul(x, q, scale, interpret=False):
  """x [M, K] . the int4 kernel (q uint8 [N, K / 2], scale [N, K / group]) -> [M, N] float32, by the Pallas TPU
  kernel (`blocks` must fit). interpret: Pallas' TPU interpreter (CPU tests)."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  rows = x.shape[0]
  n, half = q.shape
  bn, per_block = blocks(rows, q.shape, scale.shape)
  group_bytes = half // scale.shape[1]
  width = group_bytes * per_block                           # bytes of a row per block
  call = pl.pallas_call(
      functools.partial(_kernel, groups_per_block=per_block, group_bytes=group_bytes),
      grid=(n // bn, half // width),
      in_specs=[pl.BlockSpec((rows, width), lambda i, k: (0, k)), pl.BlockSpec((rows, width), lambda i, k: (0, k)),
                pl.BlockSpec((bn, width), lambda i, k: (i, k)), pl.BlockSpec((per_block, bn), lambda i, k: (k, i))],
      out_specs=pl.BlockSpec((rows, bn), lambda i, k: (0, i)),
      out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
      scratch_shapes=[pltpu.VMEM((rows, bn), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
      interpret=pltpu.InterpretParams() if interpret else False)
  return call(x[:, 0::2], x[:, 1::2], q, scale.T)
