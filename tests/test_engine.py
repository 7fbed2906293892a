"""Tests for jaxformer.engine and jaxformer.kv_pool: the serving engine against decode.generate, no server."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import decode
from jaxformer import engine as engine_lib
from jaxformer import kv_pool
from jaxformer.config import load_config
from jaxformer.errors import UserError
from jaxformer.model import build_model


@functools.lru_cache(None)
def _setup(name, overrides=()):
  """A tiny model with random N(0, 0.2) weights and a scaled last norm (peaky logits: argmax never hinges
  on float noise), as tests/test_decode.py builds them."""
  cfg = load_config(name, ["model.dropout_rate=0", *overrides]).model
  model = build_model(cfg)
  shapes = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32)))["params"])
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map_with_path(
      lambda path, s: {"scale": jnp.ones, "bias": jnp.zeros}.get(path[-1].key, lambda shape: jnp.asarray(
          rng.normal(0.0, 0.2, shape), jnp.float32))(s.shape), shapes)
  params["decoder"]["final_norm"]["scale"] = params["decoder"]["final_norm"]["scale"] * 5.0
  return model, params


def _reference(model, params, prompts, n, stop_ids=None, temperature=0.0, seed=0, top_k=0):
  """decode.generate's n tokens for a batch of prompts (one program), each row cut after its stop id
  (generate pads after it). Sampled rows depend on the batch: compare a batch of one there."""
  rows = np.asarray(decode.generate(model, params, prompts, n, jax.random.PRNGKey(seed), temperature=temperature,
                                    top_k=top_k, eos_id=stop_ids)).tolist()
  stops = [] if stop_ids is None else np.atleast_1d(stop_ids).tolist()
  return [next((row[:k + 1] for k, t in enumerate(row) if t in stops), row) for row in rows]


def _prompts(vocab, lengths, seed=1):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, vocab, n).tolist() for n in lengths]


MODELS = {"gpt2-learned-mha": ("gpt2_tiny", ()), "llama-rope-gqa-scan": ("llama_tiny", ("model.scan_layers=true",))}


@pytest.mark.parametrize("name", MODELS)
def test_greedy_equals_generate_alone_and_batched(name):
  """Greedy tokens equal decode.generate's token for token, a request alone and 10 of mixed lengths
  (chunked prompts, more requests than slots) at once; no program is compiled after warm-up."""
  model, params = _setup(*MODELS[name])
  eng = engine_lib.Engine(model, params, max_batch=4, block_size=8, max_seq_len=64, prefill_chunk=16)
  eng.warm_up()
  # The gather path copies 32, 48 or 64 slots per row; the paged kernel reads only what a row holds.
  assert eng.history_buckets == ([4, 6, 8] if eng.paged_fallback else [8])
  compiled = engine_lib.compilations()
  lengths = (5, 17, 30, 1, 40, 9, 23, 3, 33, 12)
  prompts = _prompts(model.cfg.vocab_size, lengths)
  new = [12, 7, 20, 15, 9, 24, 5, 11, 16, 8]
  alone = eng.submit(prompts[2], engine_lib.SamplingParams(max_tokens=new[2]))
  eng.run_until_done()
  requests = [eng.submit(p, engine_lib.SamplingParams(max_tokens=n)) for p, n in zip(prompts, new)]
  eng.run_until_done()
  assert engine_lib.compilations() == compiled
  assert eng.stats["steps"] > max(new)      # more requests than slots: they joined as others left
  assert eng.stats["prefill_pieces"] > eng.stats["prefill_calls"]   # some calls packed several prompts
  # With the paged kernel, prompts joining a running batch share its decode call; without, they never do.
  assert (eng.stats["mixed_calls"] > 0) == (eng.paged_fallback is None)
  assert eng.pool.used() == 0
  expected = [row[:n] for row, n in zip(_reference(model, params, prompts, max(new)), new)]
  assert alone.output == expected[2]
  assert [r.output for r in requests] == expected
  assert all(r.finish_reason == "length" for r in requests)


def test_stop_ids_sampling_and_logprobs():
  """A stop id ends a request (kept as its last token); a sampled request follows its seed as a batch of one
  does in decode.generate, whatever else runs; logprobs are the log-softmax of the model's logits."""
  model, params = _setup("gpt2_tiny")
  eng = engine_lib.Engine(model, params, max_batch=3, block_size=8, max_seq_len=64, prefill_chunk=16)
  prompt = _prompts(model.cfg.vocab_size, [11])[0]
  greedy = _reference(model, params, [prompt], 16)[0]
  stop = greedy[5]
  r_stop = eng.submit(prompt, engine_lib.SamplingParams(max_tokens=16, stop_ids=(stop,)))
  params_s = engine_lib.SamplingParams(max_tokens=16, temperature=0.8, top_k=5, seed=7, logprobs=3)
  r_sample = eng.submit(prompt, params_s)
  other = eng.submit(_prompts(model.cfg.vocab_size, [20], seed=5)[0], engine_lib.SamplingParams(max_tokens=9))
  eng.run_until_done()
  assert r_stop.finish_reason == "stop" and r_stop.output == greedy[:greedy.index(stop) + 1]
  assert r_sample.output == _reference(model, params, [prompt], 16, temperature=0.8, seed=7, top_k=5)[0]
  assert other.finish_reason == "length" and len(other.output) == 9
  # logprobs: the chosen token's log-prob and the top 3, from a full forward pass (no cache) in numpy.
  seq = prompt + r_sample.output
  logits = np.asarray(model.apply({"params": params}, jnp.asarray([seq])))[0, len(prompt) - 1:-1]
  logp = logits - logits.max(-1, keepdims=True)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  for k, (chosen, top) in enumerate(r_sample.logprobs):
    np.testing.assert_allclose(chosen, logp[k, r_sample.output[k]], atol=1e-4)
    assert [t for t, _ in top] == np.argsort(-logp[k])[:3].tolist()
    np.testing.assert_allclose([v for _, v in top], np.sort(logp[k])[::-1][:3], atol=1e-4)


def test_prefix_cache_hit_equals_miss():
  """A request sharing a 33-token prefix with a finished one reads its 4 full blocks from the cache, prefills
  only the rest, and gives exactly the tokens of a cold run (a fresh engine)."""
  model, params = _setup("llama_tiny")
  make = lambda: engine_lib.Engine(model, params, max_batch=2, block_size=8, max_seq_len=64, prefill_chunk=16)
  system, a, b, c = _prompts(model.cfg.vocab_size, [33, 6, 9, 4])
  warm = make()
  warm.submit(system + a, engine_lib.SamplingParams(max_tokens=10))
  warm.run_until_done()
  before, calls = warm.stats["prefilled_tokens"], warm.stats["prefill_calls"]
  # Both hits prefill their rest in one call, their 32-slot histories side by side in one row.
  hit, hit_c = (warm.submit(system + x, engine_lib.SamplingParams(max_tokens=10)) for x in (b, c))
  warm.run_until_done()
  assert hit.cached_tokens == hit_c.cached_tokens == 32
  assert warm.stats["prefilled_tokens"] - before == len(system + b) + len(system + c) - 64
  assert warm.stats["prefill_calls"] - calls == 1
  cold = make()
  miss = cold.submit(system + b, engine_lib.SamplingParams(max_tokens=10))
  cold.run_until_done()
  assert miss.cached_tokens == 0 and cold.stats["prefilled_tokens"] == len(system + b)
  assert hit.output == miss.output == _reference(model, params, [system + b], 10)[0]
  assert hit_c.output == _reference(model, params, [system + c], 10)[0]


def test_eviction_under_a_small_pool():
  """A pool of 12 blocks serving prompts of 5 blocks each: cached prefixes are evicted least recently used
  first, an evicted block is recomputed (a shorter hit), and every answer stays exact."""
  model, params = _setup("gpt2_tiny")
  eng = engine_lib.Engine(model, params, max_batch=2, kv_blocks=12, block_size=8, max_seq_len=64, prefill_chunk=32)
  prompts = _prompts(model.cfg.vocab_size, [36, 36, 36], seed=3)
  outs = []
  for p in prompts + prompts[:1]:      # the third needs more blocks than are free: it evicts
    r = eng.submit(p, engine_lib.SamplingParams(max_tokens=4))
    eng.run_until_done()
    outs.append((r.cached_tokens, r.output))
  assert eng.pool.evictions > 0
  assert [c for c, _ in outs] == [0, 0, 0, 24]   # the third took the first's tail block (evicted before its head)
  again = eng.submit(prompts[0], engine_lib.SamplingParams(max_tokens=4))   # just cached: a hit
  eng.run_until_done()
  assert again.cached_tokens == 32
  assert [out for _, out in outs] == _reference(model, params, prompts + prompts[:1], 4)
  assert again.output == outs[0][1]


@pytest.mark.parametrize("name", MODELS)
def test_preemption_when_the_pool_runs_short(name):
  """Blocks are taken as tokens arrive, so a 14-block pool runs 4 requests that would hold 6-7 blocks each at
  their end; when it runs short the newest is preempted (its full blocks kept in the prefix cache), then
  resumed where it stopped: every answer, greedy or sampled, is the one of an unhurried run, and nothing
  compiles after warm-up."""
  model, params = _setup(*MODELS[name])
  eng = engine_lib.Engine(model, params, max_batch=4, kv_blocks=14, block_size=8, max_seq_len=64, prefill_chunk=16)
  eng.warm_up()
  compiled = engine_lib.compilations()
  prompts = _prompts(model.cfg.vocab_size, [12, 20, 9, 17, 14], seed=4)
  new = [36, 30, 40, 28, 34]
  greedy = [eng.submit(p, engine_lib.SamplingParams(max_tokens=n)) for p, n in zip(prompts[:4], new)]
  sampled_params = engine_lib.SamplingParams(max_tokens=new[4], temperature=0.8, top_k=5, seed=11)
  sampled = eng.submit(prompts[4], sampled_params)
  peak = 0
  while eng.has_work():
    eng.step()
    peak = max(peak, eng.running())
    assert eng.pool.used() <= eng.pool.num_blocks
  assert engine_lib.compilations() == compiled
  assert peak == 4                  # held for their whole length (6-7 blocks each), two at a time would fit
  assert eng.stats["preemptions"] > 0 and eng.stats["resumed_cached_tokens"] > 0
  assert sum(r.preemptions for r in greedy + [sampled]) == eng.stats["preemptions"]
  assert eng.pool.used() == 0
  expected = [row[:n] for row, n in zip(_reference(model, params, prompts[:4], max(new[:4])), new)]
  assert [r.output for r in greedy] == expected
  assert all(r.finish_reason == "length" for r in greedy + [sampled])
  assert sampled.output == _reference(model, params, [prompts[4]], new[4], temperature=0.8, seed=11, top_k=5)[0]


def test_cancel_frees_slot_and_blocks():
  """A cancelled request leaves at the next step: its slot goes to the waiting request, its blocks return."""
  model, params = _setup("gpt2_tiny")
  eng = engine_lib.Engine(model, params, max_batch=1, kv_blocks=20, block_size=8, max_seq_len=64, prefill_chunk=16)
  first, second = _prompts(model.cfg.vocab_size, [10, 12])
  r1 = eng.submit(first, engine_lib.SamplingParams(max_tokens=40))
  r2 = eng.submit(second, engine_lib.SamplingParams(max_tokens=5))
  for _ in range(3):
    eng.step()
  # Blocks are held as tokens arrive, not for the whole length (that would be ceil((10 + 40 - 1) / 8) = 7).
  assert eng.slots[0] is r1 and len(r1.output) == 4 and eng.pool.used() == 2   # 13 tokens in, the 14th's block
  eng.cancel(r1)
  eng.step()
  assert r1.finish_reason == "cancelled" and r1.blocks == [] and eng.slots[0] is r2
  eng.run_until_done()
  assert r2.output == _reference(model, params, [second], 5)[0] and eng.pool.used() == 0


def test_limits():
  """Requests that can never fit are refused with one line naming the limit; a full queue raises QueueFull."""
  model, params = _setup("gpt2_tiny")
  eng = engine_lib.Engine(model, params, max_batch=1, kv_blocks=4, block_size=8, max_seq_len=64, max_waiting=2)
  with pytest.raises(UserError, match="past the context of 64 tokens"):
    eng.submit([5] * 60, engine_lib.SamplingParams(max_tokens=10))
  with pytest.raises(UserError, match="needs 5 KV blocks, the pool has 4"):
    eng.submit([5] * 30, engine_lib.SamplingParams(max_tokens=10))
  with pytest.raises(UserError, match="max_tokens must be at least 1"):
    eng.submit([5], engine_lib.SamplingParams(max_tokens=0))
  eng.submit([5], engine_lib.SamplingParams(max_tokens=2))
  eng.submit([6], engine_lib.SamplingParams(max_tokens=2))
  with pytest.raises(engine_lib.QueueFull):
    eng.submit([7], engine_lib.SamplingParams(max_tokens=2))


def test_block_pool_refcounts_and_lru():
  """Shared blocks are counted per reader; unread cached blocks are evicted oldest first, tails before heads."""
  pool = kv_pool.BlockPool(4, block_size=2)
  keys = kv_pool.block_hashes([1, 2, 3, 4, 5], 2)
  assert len(keys) == 2 and keys != kv_pool.block_hashes([9, 2, 3, 4], 2)
  assert kv_pool.block_hashes([9, 2, 3, 4], 2)[1] != keys[1]          # chained: the second key sees the first block
  a = pool.allocate(3)
  pool.register(a[0], keys[0])
  pool.register(a[1], keys[1])
  assert pool.lookup(keys) == a[:2] and pool.refs[a[0]] == 2
  pool.release(reversed(a))                   # a's reader leaves; the lookup's reader still holds a[0], a[1]
  assert pool.used() == 2
  pool.release(reversed(a[:2]))
  assert pool.used() == 0 and pool.available() == 4
  b = pool.allocate(3)                        # 2 free blocks, then the LRU cached one: the prefix's tail
  assert pool.evictions == 1 and pool.lookup(keys) == [a[0]]
  assert pool.allocate(1) is None and len(b) == 3


@pytest.mark.parametrize("path", ["kernel", "xla"])
@pytest.mark.parametrize("name", ["gpt2_tiny", "llama_tiny"])
def test_float_weights_served_output_major_through_the_kernel(name, path, monkeypatch):
  """On one CPU device the engine lays a float model's dense kernels out output-major once (w^T exactly; a tied
  table kept as it is, the caller's params untouched) and its programs multiply through the float32 kernel;
  JAXFORMER_DENSE=xla keeps the model's layout and XLA's products. Both give decode.generate's greedy tokens
  (GPT-2: tied table, learned positions; Llama: untied output layer, GQA)."""
  from flax import traverse_util  # pylint: disable=g-import-not-at-top
  from jaxformer import model as model_lib, qkernel  # pylint: disable=g-import-not-at-top
  if path == "kernel" and qkernel.unavailable() is not None:
    pytest.skip(f"no C++ kernel: {qkernel.unavailable()}")
  if path == "xla":
    monkeypatch.setenv("JAXFORMER_DENSE", "xla")
  engine_lib._step_program.cache_clear()
  model, params = _setup(name)
  eng = engine_lib.Engine(model, params, max_batch=4, block_size=8, max_seq_len=64, prefill_chunk=16)
  assert eng.dense_fallback == (None if path == "kernel" else "JAXFORMER_DENSE=xla")
  flat = traverse_util.flatten_dict(params, sep="/")
  served = traverse_util.flatten_dict(jax.device_get(eng.params), sep="/")
  found = model_lib.quantizable(model.cfg)
  assert any(kind == "output" for _, kind in found.values()) == (name == "llama_tiny")
  for where, (n_in, kind) in found.items():
    assert where in flat  # the caller's tree keeps its float kernels
    prefix = where.rsplit("/", 1)[0]
    if path == "xla":
      assert where in served and prefix + "/qkernel" not in served
      continue
    w = np.asarray(flat[where])
    expected = w if kind == "embedding" else w.reshape(int(np.prod(w.shape[:n_in])), -1).T
    np.testing.assert_array_equal(served[prefix + "/qkernel"], expected)
    np.testing.assert_array_equal(served[prefix + "/qscale"], np.ones(expected.shape[0], np.float32))
  for rows, chunk in ((eng.max_batch, 1), (1, eng.max_batch + eng.buckets[-1])):  # decode and mixed programs
    layout = eng._layout([[]] * rows, chunk, eng.history_buckets[0], 1)[0]
    text = eng._step_fn.lower(eng.params, eng.kv, *layout, *eng._sampling_rows([None] * rows), True, False).as_text()
    assert ("jaxformer_matmul_f32" in text) == (path == "kernel")
  prompts = _prompts(model.cfg.vocab_size, (5, 17, 30, 9, 23, 12, 40, 3), seed=5)
  new = [12, 7, 20, 15, 9, 11, 6, 14]
  requests = [eng.submit(p, engine_lib.SamplingParams(max_tokens=n)) for p, n in zip(prompts, new)]
  eng.run_until_done()
  assert [r.output for r in requests] == [row[:n] for row, n in zip(_reference(model, params, prompts, max(new)), new)]
  engine_lib._step_program.cache_clear()


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_model_serves_the_tokens_generate_gives_it(bits):
  """Weights quantized by jaxformer.quantize (int8 per channel, int4 in groups) go through the same layers in
  the engine as in decode.generate: the same greedy tokens, several requests at once."""
  from jaxformer import quantize  # pylint: disable=g-import-not-at-top
  model, params = _setup("llama_tiny")
  qparams, manifest = quantize.quantize_params(jax.device_get(params), model.cfg, bits, group_size=32)
  assert manifest["kernels"]
  qparams = jax.tree.map(jnp.asarray, qparams)
  eng = engine_lib.Engine(model, qparams, max_batch=3, block_size=8, max_seq_len=64, prefill_chunk=16)
  prompts = _prompts(model.cfg.vocab_size, (7, 19, 3, 26))
  requests = [eng.submit(p, engine_lib.SamplingParams(max_tokens=10)) for p in prompts]
  eng.run_until_done()
  assert [r.output for r in requests] == _reference(model, qparams, prompts, 10)
  assert "qkernel" in qparams["decoder"]["layer_0"]["ffn"]["wo"]  # the layers read int weights, not float ones


SHARDED_WORKER = r'''
import json, sys
import jax
sys.path.insert(0, sys.argv[1])
from test_engine import _prompts, _reference, _setup
from jaxformer import engine as engine_lib, sharding
from jaxformer.config import MeshConfig

model, params = _setup("llama_tiny")
prompts = _prompts(model.cfg.vocab_size, (5, 17, 30, 9, 23, 12))
new = [12, 7, 20, 15, 9, 11]

def serve(mesh):
  eng = engine_lib.Engine(model, params, max_batch=4, block_size=8, max_seq_len=64, prefill_chunk=16, mesh=mesh)
  eng.warm_up()
  compiled = engine_lib.compilations()
  requests = [eng.submit(p, engine_lib.SamplingParams(max_tokens=n)) for p, n in zip(prompts, new)]
  eng.run_until_done()
  # one device: the kernels laid out output-major for the CPU kernel (`qkernel`); a mesh: the model's own
  wq = eng.params["decoder"]["layer_0"]["self_attention"]["query"]["qkernel" if mesh is None else "kernel"]
  return {"tokens": [r.output for r in requests], "recompiled": engine_lib.compilations() - compiled,
          "query_spec": str(wq.sharding.spec) if mesh else None, "query_shard": list(wq.addressable_shards[0].data.shape),
          "pool_shard": list(eng.kv[0].addressable_shards[0].data.shape), "pool": list(eng.kv[0].shape)}

out = {"devices": jax.device_count(), "one": serve(None),
       "reference": [row[:n] for row, n in zip(_reference(model, params, prompts, max(new)), new)]}
for fsdp, tensor in ((1, 2), (2, 2)):
  mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=fsdp, tensor=tensor), jax.devices()[:fsdp * tensor])
  out[f"fsdp{fsdp}_tensor{tensor}"] = serve(mesh)
print("RESULT " + json.dumps(out))
'''


@pytest.mark.slow  # a process on 4 simulated devices
def test_sharded_serving_gives_the_tokens_of_one_device(tmp_path):
  """On 4 simulated CPU devices: the engine over a (tensor 2) and an (fsdp 2 x tensor 2) mesh, weights sharded by
  the training rule table and the KV pool over kv heads, gives the greedy tokens of one device (and of
  decode.generate), with no program compiled after warm-up."""
  import json, os, subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  from conftest import FAST_XLA  # pylint: disable=g-import-not-at-top  (the tests' cheap codegen, as in-process)
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count=4 {FAST_XLA}")
  script = tmp_path / "worker.py"
  script.write_text(SHARDED_WORKER)
  run = subprocess.run([sys.executable, str(script), os.path.dirname(__file__)], env=env, capture_output=True,
                       text=True, timeout=600)
  line = next((l for l in run.stdout.splitlines() if l.startswith("RESULT ")), None)
  assert line, run.stdout[-2000:] + run.stderr[-4000:]
  out = json.loads(line[7:])
  assert out["devices"] == 4
  assert out["one"]["tokens"] == out["reference"]
  for name in ("fsdp1_tensor2", "fsdp2_tensor2"):
    got = out[name]
    assert got["tokens"] == out["reference"], name
    assert got["recompiled"] == 0, name
    assert "tensor" in got["query_spec"], got["query_spec"]
    # llama_tiny: 2 kv heads, 1 per tensor device; the query kernel [d_model 32, heads 4, head_dim 8].
    assert got["pool_shard"] == [got["pool"][0] // 2, got["pool"][1]], got
  assert out["fsdp1_tensor2"]["query_shard"] == [32, 2, 8]
  assert out["fsdp2_tensor2"]["query_shard"] == [16, 2, 8]


def _check_prompt_logprobs(model, params, request, prompt, k):
  """A request's prompt log-probs against one forward over its prompt: values to 1e-4, top-k ids in order."""
  from conftest import forward_logp  # pylint: disable=g-import-not-at-top  (not at the top: SHARDED_WORKER imports us)
  assert request.prompt_logprobs[0] is None and all(x is not None for x in request.prompt_logprobs[1:])
  want, rows = forward_logp(model, params, prompt)
  np.testing.assert_allclose([lp for lp, _ in request.prompt_logprobs[1:]], want, atol=1e-4)
  for (_, top), row in zip(request.prompt_logprobs[1:], rows):
    ids, values = zip(*top)
    assert list(ids) == np.argsort(-row)[:k].tolist()
    np.testing.assert_allclose(values, row[list(ids)], atol=1e-4)


@pytest.mark.parametrize("name", MODELS)
def test_prompt_logprobs_equal_one_forward_over_the_prompt(name):
  """Prompt log-probs (echo's): every prompt token after the first scored as a forward over the whole prompt
  scores it, with its top-k alternatives, for prompts split over several chunks, packed with others, sharing a
  cached prefix with an earlier request (recomputed, not read: the cache holds no log-probs), with max_tokens 0
  (only scored: no token, finish 'length'), a prompt as long as the context with max_tokens 1, and requests
  preempted by a small pool after their prompt was scored; no program compiled after warm-up; the generated
  tokens stay generate's."""
  model, params = _setup(*MODELS[name])
  make = lambda: engine_lib.Engine(model, params, max_batch=4, kv_blocks=14, block_size=8, max_seq_len=64,
                                   prefill_chunk=16)   # test_preemption_when_the_pool_runs_short's programs
  eng = make()
  eng.warm_up()
  compiled = engine_lib.compilations()
  prompts = _prompts(model.cfg.vocab_size, (37, 5, 23, 64, 2, 30), seed=7)
  prompts[5] = prompts[0][:24] + prompts[5][:6]                  # 3 full blocks shared with prompt 0
  new = [0, 6, 3, 1, 0, 9]
  warm = eng.submit(prompts[0], engine_lib.SamplingParams(max_tokens=2))   # puts prompt 0's blocks in the cache
  eng.run_until_done()
  before = eng.stats["cached_tokens"]
  requests = [eng.submit(p, engine_lib.SamplingParams(max_tokens=n, logprobs=3, prompt_logprobs=True))
              for p, n in zip(prompts, new)]
  eng.run_until_done()
  assert engine_lib.compilations() == compiled
  assert eng.stats["cached_tokens"] == before      # the scored prompts read nothing from the cache
  for r, p, n in zip(requests, prompts, new):
    assert r.finish_reason == "length" and len(r.output) == n
    _check_prompt_logprobs(model, params, r, p, 3)
  expected = _reference(model, params, [prompts[k] for k in (1, 2, 5)], 9)
  assert [requests[k].output for k in (1, 2, 5)] == [row[:new[k]] for row, k in zip(expected, (1, 2, 5))]
  assert warm.prompt_logprobs is None
  # Long generations in a 14-block pool (as test_preemption_when_the_pool_runs_short): preempted and resumed.
  eng = make()
  prompts = _prompts(model.cfg.vocab_size, [12, 20, 9, 17], seed=4)
  new = [36, 30, 40, 28]
  requests = [eng.submit(p, engine_lib.SamplingParams(max_tokens=n, logprobs=2, prompt_logprobs=True))
              for p, n in zip(prompts, new)]
  eng.run_until_done()
  assert eng.stats["preemptions"] > 0 and eng.pool.used() == 0
  for r, p in zip(requests, prompts):
    _check_prompt_logprobs(model, params, r, p, 2)
  assert [r.output for r in requests] == [row[:n] for row, n in zip(_reference(model, params, prompts, 40), new)]
  with pytest.raises(UserError, match="max_tokens must be at least 1"):   # 0 only with prompt log-probs
    eng.submit([5], engine_lib.SamplingParams(max_tokens=0))
