"""Tests for jaxformer.inspect: parameter counts, FLOPs, KV cache, roofline and the CLI."""

import math
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from jaxformer import inspect
from jaxformer.config import load_config
from jaxformer.model import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["tiny_encdec", "gpt2_tiny", "llama_tiny"]


def _inputs(m, length):
  ids = jnp.ones((1, length), jnp.int32)
  return (ids, ids) if m.arch == "encoder_decoder" else (ids,)


def _abstract_forward(cfg, length):
  """(forward fn of params, abstract params): tracing needs shapes only, and a real
  init costs ~80 small XLA compiles."""
  model = build_model(cfg.model)
  args = _inputs(cfg.model, length)
  params = jax.eval_shape(model.init, jax.random.key(0), *args)
  return (lambda p: model.apply(p, *args)), params


@pytest.mark.parametrize("name, total", [
    ("wmt_base", 63_082_496), ("wmt_big", 214_245_376), ("gpt2_small", 124_439_808),
    ("llama_7b", 6_738_415_616), ("llama3_8b", 8_030_261_248),
    # The open models below: sources in test_open_model_counts_by_closed_form.
    ("qwen2_5_7b", 7_615_616_512), ("qwen3_8b", 8_190_735_360), ("mistral_7b", 7_241_732_096),
    ("gemma2_9b", 9_241_705_984), ("gemma3_4b", 3_880_263_168), ("phi3_mini", 3_821_079_552)])
def test_published_parameter_counts(name, total):
  counts = inspect.count_parameters(load_config(name))
  assert counts["total"] == total
  assert sum(v for k, v in counts.items() if k != "total") == total


def _decoder_parameters(vocab, d, layers, heads, kv_heads, head_dim, d_ff, tied, qkv_bias=False, qk_norm=False,
                        norms_per_layer=2):
  """A gated-FFN, bias-free decoder-only LM's parameters, in closed form from its config.json numbers."""
  q, kv = heads * head_dim, kv_heads * head_dim
  attention = d * q + 2 * d * kv + q * d           # q, k, v, o projections
  attention += (q + 2 * kv) if qkv_bias else 0     # Qwen2: biases on q, k, v only
  attention += 2 * head_dim if qk_norm else 0      # one RMSNorm gain vector over a head's q, one over its k
  ffn = 3 * d * d_ff                               # gate, up, down
  layer = attention + ffn + norms_per_layer * d    # 2 pre-norms (+ 2 post-norms: Gemma 2/3)
  return vocab * d + layers * layer + d + (0 if tied else vocab * d)  # embedding, layers, final norm, head


# (recipe, config.json shape, published total). The shapes are the hub repos' config.json values (the recipes'
# docstrings list them); the totals are the checkpoints' safetensors parameter counts (the Hub's metadata, as
# public code quotes it), each also in keras-hub's preset metadata (keras_hub/src/models/*/..._presets.py):
#   Qwen/Qwen2.5-7B 7,615,616,512: keras-hub qwen2.5_math_7b_en (Qwen2.5-Math-7B, the same shape); the Qwen2.5-7B
#     model card rounds it to 7.61B, 6.53B without the two embedding tables.
#   Qwen/Qwen3-8B 8,190,735,360: keras-hub qwen3_8b_en.
#   mistralai/Mistral-7B-v0.1 7,241,732,096: keras-hub mistral_7b_en.
#   google/gemma-2-9b 9,241,705,984: keras-hub gemma2_9b_en.
#   google/gemma-3-4b-pt, text model, 3,880,263,168: its language_model (Gemma3TextModel); the checkpoint's published
#     4,300,079,472 includes the vision tower: see test_gemma3_4b_text_count_against_the_multimodal_checkpoint.
#   microsoft/Phi-3-mini-4k-instruct 3,821,079,552: keras-hub phi3_mini_4k_instruct_en.
OPEN_MODELS = [
    ("qwen2_5_7b", dict(vocab=152064, d=3584, layers=28, heads=28, kv_heads=4, head_dim=128, d_ff=18944, tied=False,
                        qkv_bias=True), 7_615_616_512),
    ("qwen3_8b", dict(vocab=151936, d=4096, layers=36, heads=32, kv_heads=8, head_dim=128, d_ff=12288, tied=False,
                      qk_norm=True), 8_190_735_360),
    ("mistral_7b", dict(vocab=32000, d=4096, layers=32, heads=32, kv_heads=8, head_dim=128, d_ff=14336, tied=False),
     7_241_732_096),
    ("gemma2_9b", dict(vocab=256000, d=3584, layers=42, heads=16, kv_heads=8, head_dim=256, d_ff=14336, tied=True,
                       norms_per_layer=4), 9_241_705_984),
    ("gemma3_4b", dict(vocab=262208, d=2560, layers=34, heads=8, kv_heads=4, head_dim=256, d_ff=10240, tied=True,
                       qk_norm=True, norms_per_layer=4), 3_880_263_168),
    ("phi3_mini", dict(vocab=32064, d=3072, layers=32, heads=32, kv_heads=32, head_dim=96, d_ff=8192, tied=False),
     3_821_079_552),
]


@pytest.mark.parametrize("name, shape, published", OPEN_MODELS, ids=[n for n, _, _ in OPEN_MODELS])
def test_open_model_counts_by_closed_form(name, shape, published):
  cfg = load_config(name)
  m = cfg.model
  assert (m.vocab_size, m.d_model, m.num_layers, m.num_heads, m.kv_heads, m.dim_per_head, m.d_ff, m.tie_output) == \
      tuple(shape[k] for k in ("vocab", "d", "layers", "heads", "kv_heads", "head_dim", "d_ff", "tied"))
  assert (m.qkv_bias, m.qk_norm, m.post_norms) == (shape.get("qkv_bias", False), shape.get("qk_norm", False),
                                                   shape.get("norms_per_layer", 2) == 4)
  assert inspect.count_parameters(cfg)["total"] == _decoder_parameters(**shape) == published


def test_gemma3_4b_text_count_against_the_multimodal_checkpoint():
  """Gemma 3 4B's published 4,300,079,472 (google/gemma-3-4b-pt's safetensors; keras-hub gemma3_presets.py gives
  it for medgemma_4b, the same shape) is the text model plus the SigLIP vision tower (416,866,032) and the multimodal projector
  (2,950,272: a 1152 x 2560 projection and a 1152 norm), as transformers' module tree of
  Gemma3ForConditionalGeneration lists them (language_model: Gemma3TextModel, 3,880,263,168). keras-hub's
  text-only preset gemma3_4b_text, 3,880,099,328, has a vocabulary of 262,144 (MaxText's gemma3-4b.yml too) instead
  of the checkpoint's 262,208: the same shape otherwise."""
  shape = dict(OPEN_MODELS[4][1])
  text = inspect.count_parameters(load_config("gemma3_4b"))["total"]
  assert text == 3_880_263_168
  projector = 1152 * 2560 + 1152
  assert projector == 2_950_272
  assert text + 416_866_032 + projector == 4_300_079_472
  assert _decoder_parameters(**{**shape, "vocab": 262144}) == 3_880_099_328  # keras-hub gemma3_4b_text
  assert 3_880_099_328 + 416_866_032 + projector == 4_299_915_632              # keras-hub gemma3_4b (vision + text)


def test_open_model_layer_patterns():
  """Which layers are local (sliding window) in each recipe: Mistral's and Phi-3's every one, Gemma 2's even
  ones (HF layer_types: sliding, full, ...), Gemma 3's all but every sixth ((i + 1) % 6 == 0 is full)."""
  models = {name: load_config(name).model for name, _, _ in OPEN_MODELS}
  local = {name: [m.layer_is_local(i) for i in range(m.num_layers)] for name, m in models.items()}
  assert all(local["mistral_7b"]) and all(local["phi3_mini"])
  assert local["gemma2_9b"] == [i % 2 == 0 for i in range(42)]
  assert local["gemma3_4b"] == [(i + 1) % 6 != 0 for i in range(34)] and sum(local["gemma3_4b"]) == 29
  assert not any(local["qwen2_5_7b"]) and not any(local["qwen3_8b"])
  windows = {name: m.sliding_window for name, m in models.items()}
  assert windows == {"mistral_7b": 4096, "phi3_mini": 2047, "gemma2_9b": 4096, "gemma3_4b": 1024, "qwen2_5_7b": 0,
                     "qwen3_8b": 0}


@pytest.mark.parametrize("name, total", [(n, t) for n, _, t in OPEN_MODELS])
def test_open_model_report(name, total):
  """The CLI's report (parameters, FLOPs, KV cache, decode roofline) for each recipe, without a subprocess."""
  text = inspect.report(load_config(name))
  for part in (f"{total:,}", "FLOPs per token at sequence length 4,096", "KV cache (bfloat16)", "Decode roofline"):
    assert part in text


@pytest.mark.parametrize("name", TINY)
def test_counts_match_real_init(name):
  cfg = load_config(name)
  params = build_model(cfg.model).init(jax.random.key(0), *_inputs(cfg.model, 4))["params"]
  real = sum(x.size for x in jax.tree.leaves(nn.unbox(params)))
  counts = inspect.count_parameters(cfg)
  assert counts["total"] == real
  assert sum(v for k, v in counts.items() if k != "total") == real
  assert counts["ffn"] > 0 and counts["attention"] > 0 and counts["norms"] > 0


def test_component_split_llama_7b():
  counts = inspect.count_parameters(load_config("llama_7b"))
  # Untied: 32000 x 4096 in each of the input table and the output projection.
  assert counts["embeddings"] == counts["output"] == 32000 * 4096
  assert counts["attention"] == 32 * 4 * 4096 * 4096
  assert counts["ffn"] == 32 * 3 * 4096 * 11008


def test_kv_cache_bytes():
  llama = load_config("llama_7b")
  per_token = inspect.kv_cache_bytes_per_token(llama, "float16")
  assert per_token == 524_288
  assert per_token * 4096 == 2 * 2**30 and per_token * 32768 == 16 * 2**30
  assert inspect.kv_cache_bytes_per_token(load_config("llama3_8b"), "bfloat16") == 131_072
  assert inspect.kv_cache_bytes_per_token(llama, "float32") == 2 * per_token


def test_decode_roofline_llama_7b_a100():
  # ~13.5 GB of fp16 weights + 1 GiB of KV cache at its 2k context over 2.039 TB/s.
  a100 = inspect.decode_roofline(load_config("llama_7b"), "float16", batch=1, context=2048)["A100"]
  assert 6e-3 <= a100["seconds"] <= 7.5e-3
  assert a100["bound"] == "memory"
  # A large enough batch becomes compute-bound.
  big = inspect.decode_roofline(load_config("llama_7b"), "float16", batch=4096, context=16)["A100"]
  assert big["bound"] == "compute"


def _dot_flops(jaxpr):
  """2 x M x N x K summed over every dot_general in a jaxpr, including nested ones."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
      lhs = eqn.invars[0].aval.shape
      out = eqn.outvars[0].aval.shape
      total += 2 * math.prod(out) * math.prod(lhs[d] for d in lhs_contract)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(sub, "eqns"):
          total += _dot_flops(sub)
        elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
          total += _dot_flops(sub.jaxpr)
  return total


def _full_square(cfg, length):
  """flops_per_token's forward with causal attention over all L keys, as the einsum computes it."""
  m = cfg.model
  masked = m.num_layers * (length - (length + 1) / 2)
  return inspect.flops_per_token(cfg, length)["forward"] + 4 * m.num_heads * m.dim_per_head * masked


@pytest.mark.parametrize("name", TINY)
def test_forward_flops_equal_traced_matmuls(name):
  # Exact: every matmul of the traced forward pass, counted from its shapes. The einsum
  # attention computes the masked half of the causal square too, hence _full_square.
  cfg = load_config(name, ["model.attention_impl=einsum"])
  length = 16
  forward, params = _abstract_forward(cfg, length)
  jaxpr = jax.make_jaxpr(forward)(params).jaxpr
  assert _dot_flops(jaxpr) == _full_square(cfg, length) * length


@pytest.mark.parametrize("name", ["tiny_encdec", "llama_tiny"])
def test_forward_flops_close_to_xla_cost_analysis(name):
  # XLA also counts softmax, norms and activations; at d_model 256 they stay under 10%.
  cfg = load_config(name, ["model.attention_impl=einsum", "model.d_model=256", "model.d_ff=1024",
                           "model.vocab_size=1024"])
  length = 32
  forward, params = _abstract_forward(cfg, length)
  cost = jax.jit(forward).lower(params).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  xla = cost["flops"] / length
  assert xla == pytest.approx(_full_square(cfg, length), rel=0.10)


def test_memory_plan_and_flops_follow_the_attention_kernel():
  """On CPU `auto` runs the tiled kernel from 2048 tokens: the plan's activations then grow
  linearly (the dense path's by ~x3.5 per doubling), and the executed FLOPs add its
  backward's recompute of q.k (half the attention's forward FLOPs)."""
  base = ["model.position=rope", "model.num_layers=2", "model.d_model=64", "model.d_ff=256"]
  auto, dense = (load_config("shakespeare_char", base + [f"model.attention_impl={impl}"]) for impl in ("auto", "einsum"))
  acts = {(c.model.attention_impl, n): inspect.memory_plan(c, {"data": 1}, 1, (n,))["activations"]
          for c in (auto, dense) for n in (2048, 4096)}
  assert acts["auto", 4096] / acts["auto", 2048] <= 2.3
  assert acts["einsum", 4096] / acts["einsum", 2048] > 3
  assert acts["einsum", 4096] > 4 * acts["auto", 4096]
  assert inspect.attention_kernel(auto, 4096, "cpu")[0] == "tiled"
  f = inspect.flops_per_token(auto, 4096, backend="cpu")
  attention = 4 * 4 * 16 * 2 * (4096 + 1) / 2  # 4 FLOP x heads x head_dim per key, 2 layers
  assert f["train_executed"] == pytest.approx(f["train"] + attention / 2)
  short = inspect.flops_per_token(auto, 1024, backend="cpu")
  assert short["train_executed"] == short["train"]  # the dense path there recomputes nothing


def test_flops_formula_by_hand():
  cfg = load_config("llama_7b")
  f = inspect.flops_per_token(cfg, 2048, context=4096)
  matmul = 6_738_415_616 - 32000 * 4096 - 2 * 32 * 4096 - 4096  # no embedding lookup, no norms
  assert f["forward"] == 2 * matmul + 4 * 4096 * 32 * (2048 + 1) / 2
  assert f["train"] == 3 * f["forward"]
  assert f["decode"] == 2 * matmul + 4 * 4096 * 32 * 4096
  # Tied output: the projection is still a matmul, though its weights are the embedding's.
  gpt2 = inspect.matmul_parameters(load_config("gpt2_small"))
  assert gpt2["output"] == 50257 * 768


def test_peak_flops():
  assert inspect.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
  assert inspect.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
  assert inspect.peak_flops("NVIDIA H200") == 989e12
  assert inspect.peak_flops("TPU v4") == 275e12
  assert inspect.peak_flops("TPU v5 lite") == 197e12
  assert inspect.peak_flops("TPU v5") == 459e12
  assert inspect.peak_flops("TPU v5p") == 459e12
  assert inspect.peak_flops("TPU v6 lite") == 918e12
  assert inspect.peak_flops("NVIDIA H100 PCIe") is None
  assert inspect.peak_flops("cpu") is None


def test_cli_llama_7b():
  out = subprocess.run([sys.executable, "-m", "jaxformer.inspect", "--config", "llama_7b", "--dtype", "float16"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  for text in ("6,738,415,616", "524,288 bytes/token", "2.00 GiB", "16.00 GiB", "memory", "(L+1)/2"):
    assert text in out.stdout
  a100 = next(line for line in out.stdout.splitlines() if line.strip().startswith("A100"))
  assert 6.0 <= float(a100.split()[-2]) <= 7.5


def test_cli_unknown_config_exits_2(capsys):
  with pytest.raises(SystemExit) as exit_info:
    inspect.main(["--config", "no_such_config"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: unknown config") and "\n" not in err


_XLA_CHECK = r"""
import os
# Compile only: LLVM codegen effort buys nothing (buffer assignment, hence memory_analysis, is before it).
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8 " + os.environ["JAXFORMER_TEST_FAST_XLA"]  # conftest
import jax
from jaxformer import aot, config
LLAMA = ["model.d_model=128", "model.num_heads=4", "model.num_kv_heads=2", "model.d_ff=384", "model.num_layers=4",
         "model.vocab_size=512", "model.scan_layers=true"]
ENCDEC = ["model.d_model=128", "model.d_ff=512", "model.num_layers=3", "model.vocab_size=512", "model.scan_layers=true"]
CASES = [("llama_tiny", LLAMA, 32, (128,), ["mesh.data=8"]),
         ("llama_tiny", LLAMA, 32, (128,), ["mesh.data=1", "mesh.fsdp=8", "model.remat=dots_saveable"]),
         ("tiny_encdec", ENCDEC, 32, (48, 48), ["mesh.data=1", "mesh.fsdp=8"]),
         ("tiny_encdec", ENCDEC, 32, (48, 48), ["mesh.data=1", "mesh.fsdp=8", "model.remat=full"])]
for name, overrides, rows, lengths, extra in CASES:
  plan, xla, _ = aot.plan_vs_xla(config.load_config(name, overrides + extra), jax.devices(), rows, lengths)
  print(name, " ".join(extra), plan["total"], xla["total"], xla["temp"])
"""


@pytest.mark.slow  # compiles train steps for 8 simulated devices
def test_memory_plan_within_15_percent_of_xla_on_8_simulated_devices():
  """The real train step, compiled (not run) for 8 CPU devices: XLA's per-device bytes against the plan's."""
  out = subprocess.run([sys.executable, "-c", _XLA_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  rows = [line.rsplit(" ", 3) for line in out.stdout.strip().splitlines()]
  assert len(rows) == 4
  for case, plan, xla, temp in rows:
    plan, xla = int(plan), int(xla)
    assert abs(plan / xla - 1) <= 0.15, (case, plan / 2**20, xla / 2**20)
  # The remat policies really change what XLA keeps: full remat < none on the same mesh.
  by_case = {case: int(xla) for case, _, xla, _ in rows}
  assert by_case["tiny_encdec mesh.data=1 mesh.fsdp=8 model.remat=full"] < 0.6 * by_case["tiny_encdec mesh.data=1 mesh.fsdp=8"]


def test_memory_plan_parts_and_cli():
  cfg = load_config("llama3_8b", ["model.scan_layers=true", "model.remat=full"])
  plan = inspect.memory_plan(cfg, "fsdp=64", 64, (8192,))
  counts = inspect.count_parameters(cfg)
  # Every llama3_8b weight matrix has an `embed` axis that 64 divides; norm scales are replicated.
  assert plan["params"] == 4 * ((counts["total"] - counts["norms"]) // 64 + counts["norms"])
  assert plan["optimizer"] == 2 * plan["params"] and plan["grads"] == plan["params"]
  # Full remat keeps each layer's input [1, 8192, 4096] bf16 (+ what one layer recomputes).
  assert plan["activations"] > 32 * 8192 * 4096 * 2
  assert plan["total"] == sum(v for k, v in plan.items() if k != "total")
  assert inspect.largest_batch(cfg, "fsdp=64", (8192,), 1e9) == 0
  bigger = inspect.largest_batch(cfg, "fsdp=64", (8192,), 141e9)
  assert bigger >= 1 and inspect.memory_plan(cfg, "fsdp=64", 64 * bigger, (8192,))["total"] <= 141e9
  out = subprocess.run([sys.executable, "-m", "jaxformer.inspect", "--config", "gpt2_tiny", "--mesh", "data=2,fsdp=4",
                        "--batch", "16"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr
  assert "Training memory per device: mesh data=2 x fsdp=4 x tensor=1, batch 16" in out.stdout
  assert "TPU v5p" in out.stdout and "largest batch per device" in out.stdout
  bad = subprocess.run([sys.executable, "-m", "jaxformer.inspect", "--config", "gpt2_tiny", "--mesh", "fsdp"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert bad.returncode == 2 and "error: --mesh 'fsdp'" in bad.stderr


def test_lora_bfloat16_base_halves_the_base_and_fits_llama3_8b_on_24_gb():
  """train.lora_base_dtype=bfloat16: the frozen base's bytes are half the float32 base's, the adapters,
  their gradients and Adam's moments unchanged (float32); Llama 3.1 8B at rank 16, batch 1 x 2048 with
  remat then fits a 24 GB GPU (it does not with the float32 base)."""
  lora = ["train.lora_rank=4", "model.num_layers=1"]
  f32, bf16 = (inspect.memory_plan(load_config("llama_tiny", lora + [f"train.lora_base_dtype={d}"]), "data=1", 2, (64,))
               for d in ("float32", "bfloat16"))
  assert bf16["params"] * 2 == f32["params"] > 0  # every base parameter is floating: exactly half
  assert all(bf16[k] == f32[k] for k in ("adapters", "grads", "optimizer", "activations", "logits"))
  assert f32["total"] - bf16["total"] == bf16["params"]
  big = ["train.lora_rank=16", "model.remat=full", "model.scan_layers=true"]
  plans = {d: inspect.memory_plan(load_config("llama3_8b", big + [f"train.lora_base_dtype={d}"]), "data=1", 1, (2048,))
           for d in ("float32", "bfloat16")}
  assert plans["bfloat16"]["total"] <= 24e9 < plans["float32"]["total"]


@pytest.mark.parametrize("context", [5, 12, 40])
def test_kv_cache_bytes_and_attended_keys_count_local_layers_by_their_window(context):
  """Against brute force on a tiny model with a 12-token window on 3 of its 4 layers: the KV cache
  bytes equal the decode cache's own key/value arrays (local layers' rings hold min(window, context)),
  and the keys per query in the FLOPs equal the count of visible (query, key) pairs of the masks."""
  import numpy as np
  from jaxformer import decode, model as model_lib
  cfg = load_config("llama_tiny", ["model.num_layers=4", "model.sliding_window=12",
                                   "model.attention_pattern=local,local,global,local"])
  m = cfg.model
  cache = decode._cache_shapes(model_lib.DecoderOnly(m), 1, context, 1)
  arrays = [x for p, x in jax.tree_util.tree_leaves_with_path(cache) if p[-1].key in ("cached_key", "cached_value")]
  assert inspect.kv_cache_bytes(cfg, context, "float32") == sum(x.size * 4 for x in arrays)
  q, k = np.arange(context)[:, None], np.arange(context)[None]
  visible = sum(((k <= q) & ((q - k < m.sliding_window) if m.layer_is_local(i) else True)).sum()
                for i in range(m.num_layers))
  assert inspect._causal_keys(m, context) == pytest.approx(visible / context)
