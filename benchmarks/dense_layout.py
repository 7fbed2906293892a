"""Whether output-major weights ([out, in]) would speed small-row float32 products on XLA:CPU.

    python benchmarks/dense_layout.py products            # GPT-2 124M's 48 decode products + LM head, rows 1..32
    python benchmarks/dense_layout.py kernel              # the same products through the float32 CPU kernel
                                                          # (qmatmul's output-major layout, as the engine serves)
                                                          # against XLA [in, out], rows 1..64
    python benchmarks/dense_layout.py engine --workdir W  # serve_load's 32 requests through engine.Engine, the
                                                          # dense kernels handed over output-major (transposed back
                                                          # inside the program) against as stored (XLA's dot
                                                          # both times: JAXFORMER_DENSE=xla)

A probe, not a feature: the model stores kernels [in, out] (flax), so `products` shows what storing them the other
way would buy, and `engine` whether XLA folds a transpose in the program into the dot (it copies the weights).
"""

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from block_matmul import median_ms  # pylint: disable=g-import-not-at-top,wrong-import-position


def _gpt2(x, ws, head, dot, head_dot=None):
  """12 layers of GPT-2's QKV, out, FFN in and out products, then the LM head: dot(activations, weight)
  (head_dot for the head, when its layout differs)."""
  h = x
  for i in range(0, len(ws), 4):
    q = dot(h, ws[i])
    h = h + dot(q[:, :768], ws[i + 1])
    h = h + dot(jax.nn.gelu(dot(h, ws[i + 2])), ws[i + 3])
  return (head_dot or dot)(h, head)


def _weights():
  """GPT-2 124M's 48 decode kernels [in, out] and the tied table [vocab, d_model] (N(0, 0.02))."""
  rng = np.random.default_rng(0)
  shapes = [(768, 2304), (768, 768), (768, 3072), (3072, 768)] * 12
  return ([jnp.asarray(rng.normal(0, 0.02, s), jnp.float32) for s in shapes],
          jnp.asarray(rng.normal(0, 0.02, (50257, 768)), jnp.float32))


def _dot(out_major):
  """a [M, K] . w, with w [K, N] (in, out) or [N, K] (out, in)."""
  return lambda a, w: jax.lax.dot_general(a, w, (((1,), (1 if out_major else 0,)), ((), ())))


def products():
  """The 48 products (+ the tied LM head), weights [in, out] or [out, in], through XLA's dot."""
  w_in_out, emb = _weights()
  w_out_in = [jnp.asarray(np.asarray(w).T.copy()) for w in w_in_out]
  for rows in (1, 4, 8, 16, 24, 32):
    x = jnp.full((rows, 768), 0.1, jnp.float32)
    print(f"{rows:3d} rows: weights [in, out] {median_ms(_in_out_run, x, w_in_out, emb, n=10):6.1f} ms, "
          f"[out, in] {median_ms(lambda x, w, e: _gpt2(x, w, e, _dot(True)), x, w_out_in, emb, n=10):6.1f} ms",
          flush=True)


def _in_out_run(x, w, emb):
  """The products on [in, out] kernels, the tied head on its [vocab, d_model] table (XLA's dot throughout)."""
  return _gpt2(x, w, emb, _dot(False), _dot(True))


ROWS = [1, 4, 8, 16, 24, 32, 48, 64]


def kernel():
  """The same products through `qmatmul.matmul` on the engine's float32 output-major layout (the C++ kernel up to
  kernel_max_rows(32) rows) against XLA's dot on the model's [in, out] kernels."""
  from jaxformer import qkernel, qmatmul  # pylint: disable=g-import-not-at-top
  if qkernel.unavailable():
    sys.exit(f"no C++ kernel: {qkernel.unavailable()}")
  w_in_out, emb = _weights()
  layout = [(jnp.asarray(np.asarray(w).T.copy()), jnp.ones((w.shape[1],), jnp.float32)) for w in w_in_out]
  head = (emb, jnp.ones((emb.shape[0],), jnp.float32))
  ours = lambda x, w, e: _gpt2(x, w, e, lambda a, b: qmatmul.matmul(a, *b))
  for rows in ROWS:
    x = jnp.full((rows, 768), 0.1, jnp.float32)
    print(f"{rows:3d} rows: XLA, weights [in, out] {median_ms(_in_out_run, x, w_in_out, emb, n=10):6.1f} ms; "
          f"float32 output-major through qmatmul.matmul {median_ms(ours, x, layout, head, n=10):6.1f} ms"
          f"{' (the kernel)' if rows <= qmatmul.kernel_max_rows(32) else ' (XLA)'}", flush=True)


def engine(workdir):
  """serve_load's 32 requests (16 in flight) through engine.Engine, kernels as stored, then handed output-major."""
  import serve_load  # pylint: disable=g-import-not-at-top
  from jaxformer import engine as engine_lib, evaluate  # pylint: disable=g-import-not-at-top
  _, model, params, _, _ = evaluate.load_run(workdir, log=lambda *a: None)
  # XLA's dot on both sides: with the float32 kernel on, the engine would lay out the kernels this probe turns
  os.environ["JAXFORMER_DENSE"] = "xla"
  moves = {"wi": (0, -1), "wo": (0, -1), "query": (0, -1), "key": (0, -1), "value": (0, -1), "out": (-1, 0)}

  def turn(path, x, back=False):
    keys = [k.key for k in path]
    if keys[-1] != "kernel" or keys[-2] not in moves:
      return x
    a, b = moves[keys[-2]]
    return jnp.moveaxis(x, b, a) if back else jnp.moveaxis(x, a, b)

  for layout in ("as stored", "output-major"):
    step = engine_lib._step
    if layout == "output-major":
      engine_lib._step = lambda model, p, *a: step(model, jax.tree_util.tree_map_with_path(
          lambda path, x: turn(path, x, back=True), p), *a)
      engine_lib._step_program.cache_clear()
      given = jax.tree.map(lambda x: jnp.asarray(np.ascontiguousarray(np.asarray(x))),
                           jax.tree_util.tree_map_with_path(turn, params))
    else:
      given = params
    eng = engine_lib.Engine(model, given, max_batch=16, max_seq_len=640, prefill_chunk=128, kv_blocks=512)
    eng.warm_up()
    args = argparse.Namespace(num_requests=32, prompt_len=64, output_len=48, spread=0.5, quantum=16, seed=0)
    queue, live = list(serve_load.requests(args)), []
    start = time.perf_counter()
    while queue or live:
      while queue and len(live) < 16:
        prompt, n = queue.pop(0)
        live.append(eng.submit(prompt, engine_lib.SamplingParams(max_tokens=n)))
      eng.step()
      live = [r for r in live if not r.finished]
    print(f"engine, weights {layout}: 32 requests in {time.perf_counter() - start:.2f}s", flush=True)
    engine_lib._step = step
    engine_lib._step_program.cache_clear()


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("mode", choices=["products", "kernel", "engine"])
  parser.add_argument("--rows", default="1,4,8,16,24,32,48,64", help="kernel: the row counts")
  parser.add_argument("--workdir", default="/tmp/gpt2_small_random")
  args = parser.parse_args()
  ROWS[:] = [int(r) for r in args.rows.split(",")]
  {"products": products, "kernel": kernel}.get(args.mode, lambda: engine(args.workdir))()


if __name__ == "__main__":
  main()
