"""The PyTorch peer for wmt_base shapes: `torch.nn.Transformer` train steps on the CPU.

    # in a venv with torch (not a jaxformer dependency): pip install torch==2.13.0
    python benchmarks/torch_transformer.py [--batch 64] [--src-len 24] [--tgt-len 24] [--vocab 37000]
        [--steps 10] [--threads N]

The same model as `configs/wmt_base` (post-LN, d_model 512, 8 heads, 6 + 6 layers,
d_ff 2048, dropout 0.1, one shared [vocab, d_model] embedding scaled by sqrt(d_model)
that is also the output projection, sinusoidal positions), label smoothing 0.1,
Adam(0.9, 0.98, 1e-9), eager mode, float32. The layers are PyTorch's own
`nn.Transformer`; this file only adds embeddings and the loss around it. Batches are
random tokens with no padding, like `benchmarks/train_step.py --batch`. Model FLOPs per
step use jaxformer.inspect's count (2 x matmul weights per token, 4 x d_model per key
attended, causal self-attention at half the square, train = 3 x forward), written out
here so this script needs no JAX.
"""

import argparse
import math
import os
import statistics
import time

import torch
from torch import nn
import torch.nn.functional as F


class Seq2Seq(nn.Module):
  """Shared embedding + sinusoidal positions around `nn.Transformer`; tied output layer."""

  def __init__(self, vocab, d_model=512, heads=8, layers=6, d_ff=2048, dropout=0.1, max_len=512):
    super().__init__()
    self.d_model = d_model
    self.embed = nn.Embedding(vocab, d_model)
    nn.init.normal_(self.embed.weight, std=d_model ** -0.5)
    pos = torch.arange(max_len)[:, None] * torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model)
    table[:, 0::2], table[:, 1::2] = torch.sin(pos), torch.cos(pos)
    self.register_buffer("positions", table)
    self.drop = nn.Dropout(dropout)
    self.transformer = nn.Transformer(d_model, heads, layers, layers, d_ff, dropout, batch_first=True)

  def _embed(self, tokens):
    return self.drop(self.embed(tokens) * self.d_model ** 0.5 + self.positions[:tokens.shape[1]])

  def forward(self, src, tgt_in):
    mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1])
    out = self.transformer(self._embed(src), self._embed(tgt_in), tgt_mask=mask, tgt_is_causal=True)
    return out @ self.embed.weight.T


def model_flops_per_step(batch, src_len, tgt_len, vocab, d=512, layers=6, d_ff=2048):
  """Training FLOPs for one step (jaxformer.inspect's convention, see the module docstring)."""
  enc, dec = layers * (4 * d * d + 2 * d * d_ff), layers * (8 * d * d + 2 * d * d_ff)
  per_key = 4 * d
  forward = batch * (src_len * (2 * enc + per_key * layers * src_len)
                     + tgt_len * (2 * (dec + vocab * d) + per_key * layers * ((tgt_len + 1) / 2 + src_len)))
  return 3 * forward


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--batch", type=int, default=64)
  parser.add_argument("--src-len", type=int, default=24)
  parser.add_argument("--tgt-len", type=int, default=24)
  parser.add_argument("--vocab", type=int, default=37000)
  parser.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
  parser.add_argument("--threads", type=int, default=os.cpu_count())
  args = parser.parse_args(argv)
  torch.set_num_threads(args.threads)
  torch.manual_seed(0)

  model = Seq2Seq(args.vocab)
  opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
  src = torch.randint(3, args.vocab, (args.batch, args.src_len))
  tgt = torch.randint(3, args.vocab, (args.batch, args.tgt_len + 1))

  def step():
    logits = model(src, tgt[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, args.vocab), tgt[:, 1:].reshape(-1), label_smoothing=0.1)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()

  model.train()
  for _ in range(2):
    step()
  times = []
  for _ in range(args.steps):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)

  ms = statistics.median(times)
  flops = model_flops_per_step(args.batch, args.src_len, args.tgt_len, args.vocab)
  params = sum(p.numel() for p in model.parameters())
  print(f"torch {torch.__version__}, {torch.get_num_threads()} threads | nn.Transformer wmt_base shapes, "
        f"{params:,} parameters | batch {args.batch} x ({args.src_len} + {args.tgt_len}) tokens, vocab {args.vocab}")
  print(f"median {1e3 * ms:.1f} ms/step (min {1e3 * min(times):.1f}) over {args.steps} steps | "
        f"{args.batch * (args.src_len + args.tgt_len) / ms:,.0f} tokens/s (source + target), "
        f"{args.batch * args.tgt_len / ms:,.0f} target tokens/s | {flops / 1e9:.1f} GFLOP/step, "
        f"{flops / ms / 1e9:.1f} GFLOP/s")


if __name__ == "__main__":
  main()
