"""Tests for LoRA (jaxformer.lora): adapted = merged, only adapters train and are saved, resume, scan, export."""

import concurrent.futures
import glob
import json
import hashlib
import os
import pathlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import checkpoint as checkpoint_lib
from jaxformer import config as config_lib
from jaxformer import convert
from jaxformer import evaluate
from jaxformer import lora
from jaxformer import model as model_lib
from jaxformer import train
from jaxformer.errors import UserError

from conftest import hf_tensors

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
QUIET = {"log": lambda *a, **k: None}


def _lora_cfg(name="gpt2_tiny", *overrides):
  return config_lib.load_config(name, ["train.lora_rank=4", "train.lora_alpha=8", "train.init_from=unused",
                                       *overrides])


def _init(cfg, model, ids):
  """The LoRA model's params (base and adapters in one tree), jitted: eager flax init is slow."""
  def init(ids):
    with lora.adapters_active(cfg):
      return nn.unbox(model.init(jax.random.PRNGKey(0), ids)["params"])
  return jax.jit(init)(ids)


def _apply(cfg, model, params, ids, adapted=True):
  def apply(params, ids):
    with lora.adapters_active(cfg) if adapted else __import__("contextlib").nullcontext():
      return model.apply({"params": params}, ids)
  return np.asarray(jax.jit(apply)(params, ids))


def _random_adapters(cfg, ids):
  """(base, adapters) with A and B random (B is zero at init, which would make every comparison trivial)."""
  model = model_lib.build_model(cfg.model)
  base, adapters = lora.split(_init(cfg, model, ids))
  rng = np.random.default_rng(1)
  adapters = jax.tree.map(lambda x: (0.1 * rng.standard_normal(x.shape)).astype(np.float32), adapters)
  return model, base, adapters


MOE = ("model.moe_experts=4", "model.moe_top_k=2")


@pytest.mark.parametrize("name,scan,extra", [
    ("gpt2_tiny", False, ()), ("llama_tiny", True, ()),
    # MoE: the experts' per-expert adapters through each dispatch path (CPU blocks, ragged_dot, capacity)
    ("llama_tiny", True, MOE + ("model.num_layers=1", "model.moe_shared_experts=1")),
    ("llama_tiny", False, MOE + ("model.num_layers=1", "ragged_dot")),
    ("gpt2_tiny", False, MOE + ("model.num_layers=1", "model.moe_capacity_factor=1.0"))])
def test_adapted_model_equals_the_merged_model(name, scan, extra, monkeypatch):
  from jaxformer import moe  # pylint: disable=g-import-not-at-top
  if "ragged_dot" in extra:
    monkeypatch.setattr(moe, "DROPLESS_IMPL", "ragged_dot")
  cfg = _lora_cfg(name, f"model.scan_layers={scan}", f"model.remat={'full' if scan or not extra else 'none'}",
                  *(e for e in extra if "=" in e))
  ids = jnp.asarray(np.random.default_rng(0).integers(3, cfg.model.vocab_size, (2, 12)))
  model, base, adapters = _random_adapters(cfg, ids)
  if extra:  # the experts are adapted: only their adapters on, the merged model still moves
    def experts_only(path, x):
      return x if any(str(getattr(k, "key", "")).endswith(lora.EXPERT_SUFFIX) for k in path) else 0 * x
    adapters = jax.tree_util.tree_map_with_path(experts_only, adapters)

  def all_three(base, adapters, ids):  # one compile: adapted (x W + s x A B), merged (W + s A B), base
    with lora.adapters_active(cfg):
      adapted = model.apply({"params": lora.combine(base, adapters)}, ids)
    return (adapted, model.apply({"params": lora.merge(base, adapters, cfg)}, ids),
            model.apply({"params": base}, ids))
  adapted, merged, plain = map(np.asarray, jax.jit(all_three)(base, adapters, ids))
  np.testing.assert_allclose(adapted, merged, atol=1e-5, rtol=0)
  assert np.abs(adapted - plain).max() > 0.1  # the adapters do change the model


def test_merge_is_w_plus_scaled_a_b_in_numpy():
  cfg = _lora_cfg("llama_tiny", "model.scan_layers=true")
  ids = jnp.ones((1, 4), jnp.int32)
  _, base, adapters = _random_adapters(cfg, ids)
  merged = lora.merge(base, adapters, cfg)
  s = cfg.train.lora_alpha / cfg.train.lora_rank
  for module in ("query", "out"):  # [L, d, h, k] kernels, and out's [L, h, k, d] with two input axes
    w = np.asarray(base["decoder"]["layers"]["self_attention"][module]["kernel"], np.float64)
    a = np.asarray(adapters["decoder"]["layers"]["self_attention"][module][lora.A], np.float64)
    b = np.asarray(adapters["decoder"]["layers"]["self_attention"][module][lora.B], np.float64)
    n_in = a.ndim - 2
    want = np.stack([w[i] + s * np.tensordot(a[i], b[i], axes=([n_in], [0])) for i in range(w.shape[0])])
    got = np.asarray(merged["decoder"]["layers"]["self_attention"][module]["kernel"])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  # Everything that is not an adapted kernel is the base's, bitwise.
  np.testing.assert_array_equal(merged["embed"]["embedding"], base["embed"]["embedding"])


def test_adapters_start_at_zero_with_logical_names():
  cfg = _lora_cfg("llama_tiny", "model.scan_layers=true")
  boxed_base, boxed = lora.abstract(cfg)
  query = boxed["decoder"]["layers"]["self_attention"]["query"]
  assert query[lora.A].names == ("layers", "embed", "lora")
  assert query[lora.B].names == ("layers", "lora", "heads", "kv")
  assert set(jax.tree.leaves(jax.tree.map(lambda x: x.names[-1] if x.names[-1] == "lora" else "b",
                                          boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)))) \
      == {"lora", "b"}
  m = cfg.model
  per_layer = 4 * ((m.d_model + m.num_heads * m.dim_per_head) + 2 * (m.d_model + m.kv_heads * m.dim_per_head)
                   + (m.num_heads * m.dim_per_head + m.d_model) + 3 * (m.d_model + m.d_ff))
  assert lora.count(boxed) == m.num_layers * per_layer  # r (in + out) per adapted kernel
  assert "lora_a" not in json.dumps(jax.tree.map(lambda x: 0, nn.unbox(boxed_base)))
  model = model_lib.build_model(m)
  ids = jnp.ones((1, 6), jnp.int32)
  params = _init(cfg, model, ids)
  base, adapters = lora.split(params)
  b_leaves = [x for p, x in jax.tree_util.tree_leaves_with_path(adapters) if p[-1].key == lora.B]
  a_leaves = [x for p, x in jax.tree_util.tree_leaves_with_path(adapters) if p[-1].key == lora.A]
  assert b_leaves and not any(np.any(np.asarray(b)) for b in b_leaves)  # B = 0: training starts at the base
  assert all(np.asarray(a).std() > 0 for a in a_leaves)
  np.testing.assert_array_equal(_apply(cfg, model, params, ids), _apply(cfg, model, base, ids, adapted=False))


def test_default_targets_adapt_moe_experts_per_expert():
  """On model.moe_experts=4 the default targets adapt the stacked expert weights (wi_gate, wi_up, wo
  of each MoE layer) besides attention, with per-expert A [experts, in, r] and B [experts, r, out];
  merge gives W_e + (alpha / r) A_e B_e expert by expert (numpy); the router is not adapted."""
  cfg = _lora_cfg("llama_tiny", "model.scan_layers=true", *MOE)
  m = cfg.model
  paths = lora.target_paths(cfg)
  assert [p for p in paths if "/moe/" in p] == [f"decoder/layers/moe/{w}" for w in ("wi_gate", "wi_up", "wo")]
  assert lora.num_adapted(cfg) == m.num_layers * (4 + 3) and lora.num_adapted(cfg, experts_only=True) == m.num_layers * 3
  _, boxed = lora.abstract(cfg)
  moe_adapters = boxed["decoder"]["layers"]["moe"]
  assert sorted(moe_adapters) == ["wi_gate_lora", "wi_up_lora", "wo_lora"]  # no router adapter
  r, e = cfg.train.lora_rank, m.moe_experts
  gate, wo = moe_adapters["wi_gate_lora"], moe_adapters["wo_lora"]
  assert gate[lora.A].value.shape == (m.num_layers, e, m.d_model, r) and gate[lora.B].value.shape == (m.num_layers, e, r, m.d_ff)
  assert gate[lora.A].names == ("layers", "expert", "embed", "lora") and gate[lora.B].names == ("layers", "expert", "lora", "mlp")
  assert wo[lora.A].names == ("layers", "expert", "mlp", "lora") and wo[lora.B].names == ("layers", "expert", "lora", "embed")
  rng = np.random.default_rng(0)  # random arrays of the abstract shapes: no model is compiled
  base, adapters = (jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), nn.unbox(t))
                    for t in lora.abstract(cfg))
  merged = jax.device_get(lora.merge(base, adapters, cfg))
  s = cfg.train.lora_alpha / r
  for name in ("wi_gate", "wo"):
    w = np.asarray(base["decoder"]["layers"]["moe"][name], np.float64)  # [layers, experts, in, out]
    a = np.asarray(adapters["decoder"]["layers"]["moe"][name + "_lora"][lora.A], np.float64)
    b = np.asarray(adapters["decoder"]["layers"]["moe"][name + "_lora"][lora.B], np.float64)
    want = np.stack([np.stack([w[l, x] + s * a[l, x] @ b[l, x] for x in range(e)]) for l in range(m.num_layers)])
    np.testing.assert_allclose(merged["decoder"]["layers"]["moe"][name], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(merged["decoder"]["layers"]["moe"]["router"]["kernel"],
                                base["decoder"]["layers"]["moe"]["router"]["kernel"])


def test_lora_moe_steps_train_only_the_adapters():
  """Two LoRA steps on an MoE model: the state holds the adapters alone (the experts' among them), Adam's
  moments are theirs, the expert adapters' B leaves zero, and the base passed to the step is unchanged."""
  from jaxformer import optim, tasks  # pylint: disable=g-import-not-at-top
  cfg = _lora_cfg("llama_tiny", "model.num_layers=1", *MOE, "optim.schedule=constant", "optim.learning_rate=0.02")
  ids = np.random.default_rng(0).integers(3, cfg.model.vocab_size, (2, 9))
  batch = {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:])}
  model = model_lib.build_model(cfg.model)
  tx, schedule = optim.build_optimizer(cfg)
  state = jax.jit(lambda r: nn.unbox(train.init_state(model, tx, (batch["inputs"],), r, cfg=cfg)))(jax.random.PRNGKey(0))
  base, _ = lora.split(_init(cfg, model, batch["inputs"]))
  before = jax.device_get(base)
  assert {p[-1].key for p, _ in jax.tree_util.tree_leaves_with_path(state["params"])} == {lora.A, lora.B}
  assert sum(x.size for x in jax.tree.leaves(state["opt_state"]) if np.ndim(x) > 0) == 2 * lora.count(state["params"])
  step = jax.jit(train.make_train_step(model, tasks.LMTask, cfg, tx, schedule))
  for _ in range(2):
    state, metrics = step(state, batch, base)
  assert bool(metrics["finite"])
  experts = state["params"]["decoder"]["layer_0"]["moe"]
  for name in ("wi_gate_lora", "wi_up_lora", "wo_lora"):
    assert float(np.abs(np.asarray(experts[name][lora.B])).max()) > 1e-4, name  # trained from B = 0
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(base), before)


def _floating_dtypes(tree):
  return {str(x.dtype) for x in jax.tree.leaves(nn.unbox(tree)) if jnp.issubdtype(x.dtype, jnp.floating)}


def test_bfloat16_base_is_stored_bf16_and_gives_the_float32_logits_within_bf16_rounding():
  """train.lora_base_dtype=bfloat16: every floating base param is bfloat16 (the abstract tree the
  trainer restores onto, and a cast base), the adapters float32; the adapted logits on it match the
  float32 base's within bfloat16 rounding (and do differ: the rounded weights are the ones used),
  and a LoRA step on it trains the float32 adapters with float32 Adam moments."""
  from jaxformer import optim, tasks  # pylint: disable=g-import-not-at-top
  cfg32 = _lora_cfg("llama_tiny", "model.num_layers=1", "optim.schedule=constant", "optim.learning_rate=0.02")
  cfg = config_lib.replace(cfg32, **{"train.lora_base_dtype": "bfloat16"})
  boxed_base, boxed_adapters = lora.abstract(cfg)
  assert _floating_dtypes(boxed_base) == {"bfloat16"} and _floating_dtypes(boxed_adapters) == {"float32"}
  assert _floating_dtypes(lora.abstract(cfg32)[0]) == {"float32"}
  assert lora.count(boxed_base) == lora.count(lora.abstract(cfg32)[0])
  ids = np.random.default_rng(0).integers(3, cfg.model.vocab_size, (2, 13))
  batch = {"inputs": jnp.asarray(ids[:, :-1]), "targets": jnp.asarray(ids[:, 1:])}
  model, base32, adapters = _random_adapters(cfg32, batch["inputs"])
  base16 = lora.cast_base(base32, cfg)
  assert _floating_dtypes(base16) == {"bfloat16"}

  def logits(base, adapters):
    with lora.adapters_active(cfg):
      return model.apply({"params": lora.combine(base, adapters)}, batch["inputs"])
  run = jax.jit(logits)
  want, got = np.asarray(run(base32, adapters)), np.asarray(run(base16, adapters))
  assert got.dtype == np.float32
  err = np.abs(got - want).max()
  assert 0 < err < 0.02 * np.abs(want).max(), (err, np.abs(want).max())  # bf16 keeps 8 bits: ~0.4% a weight
  # model.dtype=bfloat16 (llama3_8b's) already multiplies bf16 copies of the weights: the same logits, bitwise.
  bf16_model = model_lib.build_model(config_lib.replace(cfg.model, dtype="bfloat16"))
  def bf16_logits(base, adapters):
    with lora.adapters_active(cfg):
      return bf16_model.apply({"params": lora.combine(base, adapters)}, batch["inputs"])
  run = jax.jit(bf16_logits)
  np.testing.assert_array_equal(np.asarray(run(base16, adapters)), np.asarray(run(base32, adapters)))
  tx, schedule = optim.build_optimizer(cfg)
  state = jax.jit(lambda r: nn.unbox(train.init_state(model, tx, (batch["inputs"],), r, cfg=cfg)))(jax.random.PRNGKey(0))
  step = jax.jit(train.make_train_step(model, tasks.LMTask, cfg, tx, schedule))
  state, metrics = step(state, batch, base16)
  state, metrics = step(state, batch, base16)
  assert bool(metrics["finite"])
  assert _floating_dtypes(state["params"]) == {"float32"} and _floating_dtypes(state["opt_state"]) == {"float32"}
  assert float(np.abs(np.asarray(state["params"]["decoder"]["layer_0"]["ffn"]["wo"][lora.B])).max()) > 1e-4


def test_bfloat16_base_is_read_from_a_float32_checkpoint_in_verified_groups(tmp_path, monkeypatch):
  """A float32 base checkpoint (unrolled, as convert writes) restored for train.lora_base_dtype=bfloat16
  with model.scan_layers=true: read a few leaves at a time at float32 (each group's checksums checked),
  cast, stacked: bitwise the float32 params rounded to bfloat16, and a tampered checksum is still caught."""
  cfg = _lora_cfg("llama_tiny", "model.scan_layers=true", "train.lora_base_dtype=bfloat16")
  unrolled = config_lib.replace(cfg, **{"model.scan_layers": False, "train.lora_base_dtype": "float32"})
  rng = np.random.default_rng(0)
  base32 = jax.tree.map(lambda x: rng.standard_normal(x.shape).astype(np.float32), nn.unbox(lora.abstract(unrolled)[0]))
  checkpoint_lib.save_params(str(tmp_path / "base"), base32, step=3, meta={"step": 3})
  reads = []
  original = checkpoint_lib.Checkpointer._read
  monkeypatch.setattr(checkpoint_lib.Checkpointer, "_read", lambda self, *a, **k: reads.append(1) or original(self, *a, **k))
  monkeypatch.setattr(checkpoint_lib, "NARROW_GROUP_BYTES", 4 * lora.count(base32) // 8)  # ~8 groups
  abstract = nn.unbox(lora.abstract(cfg)[0])
  params, where, _ = train.restore_params(cfg, str(tmp_path / "base"), abstract, **QUIET)
  assert where.endswith("/3") and len(reads) >= 1 + 6  # the metadata, then the groups
  assert _floating_dtypes(params) == {"bfloat16"}
  want = model_lib.convert_layers(jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.bfloat16), base32), True)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(want))
  meta_files = glob.glob(str(tmp_path / "base" / "checkpoints" / "3" / "meta" / "*"))
  meta_file = next(f for f in meta_files if os.path.isfile(f) and "checksums" in pathlib.Path(f).read_text())
  record = json.loads(pathlib.Path(meta_file).read_text())
  key = next(k for k in record["checksums"]["arrays"] if k.endswith("ffn/wo/kernel"))
  record["checksums"]["arrays"][key] = "0" * len(record["checksums"]["arrays"][key])
  pathlib.Path(meta_file).write_text(json.dumps(record))
  with pytest.raises(checkpoint_lib.DamagedCheckpoint, match="wo/kernel does not match its checksum"):
    train.restore_params(cfg, str(tmp_path / "base"), abstract, **QUIET)


def test_bad_lora_settings_are_one_line_errors():
  cfg = _lora_cfg("llama_tiny", "train.lora_targets=qproj")
  with pytest.raises(UserError) as e:
    lora.target_paths(cfg)
  message = str(e.value)
  assert "\n" not in message and "matches no parameter path" in message
  assert "decoder/layer_<i>/self_attention/query/kernel" in message and "decoder/layer_<i>/ffn/wi_gate/kernel" in message
  assert lora.target_paths(_lora_cfg("llama_tiny", "train.lora_targets=ffn/wo/")) == [
      "decoder/layer_0/ffn/wo/kernel", "decoder/layer_1/ffn/wo/kernel"]
  with pytest.raises(UserError, match="needs train.init_from"):
    train.train_and_evaluate(config_lib.load_config("gpt2_tiny", ["train.lora_rank=8"]), "/nonexistent/x", **QUIET)  # before the workdir is made
  with pytest.raises(UserError, match="not a regular expression"):
    _lora_cfg("gpt2_tiny", "train.lora_targets=(query")
  with pytest.raises(UserError, match="lora_rank=-1"):
    config_lib.load_config("gpt2_tiny", ["train.lora_rank=-1"])
  with pytest.raises(UserError, match="train.lora_base_dtype='float16': choose float32 or bfloat16"):
    _lora_cfg("gpt2_tiny", "train.lora_base_dtype=float16")


# ---------------------------------------------------------------------------
# Whole runs: a tiny base trained here, LoRA on it.


def _files_digest(directory):
  h = hashlib.sha256()
  for path in sorted(glob.glob(os.path.join(directory, "**"), recursive=True)):
    if os.path.isfile(path):
      h.update(path.encode())
      h.update(pathlib.Path(path).read_bytes())
  return h.hexdigest()


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("lora")
  rng = np.random.default_rng(0)
  words = "the cat dog sat on a mat and ran to big red house".split()
  (tmp / "text.txt").write_text("\n".join(" ".join(rng.choice(words, 8)) + "." for _ in range(300)))
  common = [f"data.text_path={tmp / 'text.txt'}", "model.num_layers=2", "train.log_every=1", "train.eval_every=1000",
            "train.eval_batches=1", "train.sample_every_eval=false", "optim.schedule=constant",
            "optim.learning_rate=3e-3"]
  base = str(tmp / "base")
  train.train_and_evaluate(config_lib.load_config("gpt2_tiny", common + ["train.num_steps=2",
                                                                         "train.checkpoint_every=2"]), base, **QUIET)
  lora_overrides = common + [f"train.init_from={base}", "train.lora_rank=4", "optim.learning_rate=2e-2",
                             "train.checkpoint_every=3"]
  make_cfg = lambda *extra: config_lib.load_config("gpt2_tiny", lora_overrides + list(extra))
  make_cfg.overrides = lora_overrides
  return tmp, base, make_cfg


# Run in a process of its own with 4 simulated devices: prints the losses and the adapters' shards.
_MESH_RUN = r"""
import json, sys, jax
from jaxformer import config, train
cfg = config.load_config("gpt2_tiny", json.loads(sys.argv[1]))
result = train.train_and_evaluate(cfg, sys.argv[2], log=lambda *a, **k: None)
query = result["state"]["params"]["decoder"]["layer_0"]["self_attention"]["query"]
base = result["lora_base"]["decoder"]["layer_0"]["self_attention"]["query"]["kernel"]
shard = lambda x: [list(x.shape), list(x.addressable_shards[0].data.shape)]
print(json.dumps({"devices": jax.device_count(), "lora_a": shard(query["lora_a"]), "lora_b": shard(query["lora_b"]),
                  "base": shard(base)}))
"""


@pytest.mark.slow
def test_lora_on_a_mesh_gives_the_one_device_losses_with_sharded_adapters(base_run):
  """fsdp=2 x tensor=2 on 4 simulated devices (a separate process): adapters and the frozen base laid out
  by the rule table (embed over fsdp, heads over tensor, the rank replicated), the 1-device losses."""
  import subprocess, sys  # pylint: disable=g-import-not-at-top,multiple-imports
  tmp, _, make_cfg = base_run
  one = str(tmp / "one_device")
  train.train_and_evaluate(make_cfg("train.num_steps=3"), one, **QUIET)
  overrides = [*make_cfg.overrides, "train.num_steps=3", "mesh.data=1", "mesh.fsdp=2", "mesh.tensor=2"]
  from conftest import FAST_XLA  # pylint: disable=g-import-not-at-top  (the codegen of the one-device run here)
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count=4 {FAST_XLA}"}
  out = subprocess.run([sys.executable, "-c", _MESH_RUN, json.dumps(overrides), str(tmp / "mesh")], env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  shards = json.loads(out.stdout.strip().splitlines()[-1])
  assert shards["devices"] == 4
  (d_model, r), (_, heads, kv) = shards["lora_a"][0], shards["lora_b"][0]
  assert shards["lora_a"][1] == [d_model // 2, r]            # [embed/fsdp, lora]
  assert shards["lora_b"][1] == [r, heads // 2, kv]          # [lora, heads/tensor, kv]
  assert shards["base"][1] == [d_model // 2, heads // 2, kv]  # the frozen base, sharded like a trained one
  one_losses, mesh_losses = _losses(one), _losses(str(tmp / "mesh"))
  assert [s for s, _ in mesh_losses] == [s for s, _ in one_losses] == [1, 2, 3]
  np.testing.assert_allclose([l for _, l in mesh_losses], [l for _, l in one_losses], rtol=1e-5)


@pytest.mark.slow
def test_lora_trains_only_adapters_and_resumes_exactly(base_run):
  tmp, base, make_cfg = base_run
  before = _files_digest(base)
  full = train.train_and_evaluate(make_cfg("train.num_steps=6"), str(tmp / "a"), **QUIET)
  # Only adapters are trained, held by the optimizer and written to checkpoints.
  adapters = full["state"]["params"]
  assert {p[-1].key for p, _ in jax.tree_util.tree_leaves_with_path(adapters)} == {lora.A, lora.B}
  n_adapters = lora.count(adapters)
  moments = [x for x in jax.tree.leaves(full["state"]["opt_state"]) if np.ndim(x) > 0]
  assert sum(x.size for x in moments) == 2 * n_adapters  # Adam's mu and nu, the adapters' shapes
  with checkpoint_lib.Checkpointer(str(tmp / "a"), max_to_keep=None, async_save=False) as ckpt:
    stored = [p for p in ckpt.stored_paths() if p.startswith(("params/", "opt_state/"))]
  assert [p for p in stored if p.startswith("params/")] and \
      all(p.endswith(("/lora_a", "/lora_b")) for p in stored if p.startswith("params/"))
  assert not [p for p in stored if p.endswith(("/kernel", "/embedding", "/scale", "/bias", "/position_embedding"))]
  # The base is read, never written: its workdir is byte for byte as it was, and the run's base is its params.
  assert _files_digest(base) == before
  _, _, base_params, _, _ = evaluate.load_run(base, **QUIET)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(full["lora_base"]), base_params)
  assert float(np.abs(np.asarray(adapters["decoder"]["layer_0"]["ffn"]["wo"][lora.B])).max()) > 1e-3  # B trained
  losses = _losses(str(tmp / "a"))
  # Resume mid-run: 3 steps, then the same command to 6, gives the same losses and state bitwise.
  resumed_dir = str(tmp / "b")
  train.train_and_evaluate(make_cfg("train.num_steps=3"), resumed_dir, **QUIET)
  logs = []
  again = train.train_and_evaluate(make_cfg("train.num_steps=6"), resumed_dir, log=logs.append)
  assert any(line.startswith("resumed from") for line in logs)
  assert _losses(resumed_dir) == losses
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(again["state"]), jax.device_get(full["state"]))
  # eval's load_run of the LoRA workdir: the base with the adapters merged in (a plain model).
  cfg, model, merged, _, meta = evaluate.load_run(str(tmp / "a"), **QUIET)
  assert cfg.train.lora_rank == 0 and meta["lora_base_step"] == 2
  jax.tree.map(np.testing.assert_array_equal, merged,
               jax.device_get(lora.merge(full["lora_base"], adapters, make_cfg())))
  # model.scan_layers with model.remat from the same (unrolled) base: its layers are stacked on the way in.
  # (Its adapters start from other random A's, nn.scan drawing one per layer; same-start equality is below.)
  scanned = train.train_and_evaluate(make_cfg("train.num_steps=2", "model.scan_layers=true", "model.remat=full"),
                                     str(tmp / "scan"), **QUIET)
  assert "layers" in scanned["state"]["params"]["decoder"]
  assert _losses(str(tmp / "scan"))[0][1] == pytest.approx(losses[0][1], rel=1e-5)  # B = 0: the base's loss


@pytest.mark.slow
def test_lora_steps_with_scan_layers_and_remat_equal_the_unrolled_ones():
  """The same adapters, optimizer state and base, stacked for model.scan_layers (+ remat): the same losses."""
  from jaxformer import optim, tasks  # pylint: disable=g-import-not-at-top
  cfgs = [_lora_cfg("llama_tiny", "model.scan_layers=false", "optim.schedule=constant", "optim.learning_rate=0.02"),
          _lora_cfg("llama_tiny", "model.scan_layers=true", "model.remat=full", "optim.schedule=constant",
                    "optim.learning_rate=0.02")]
  rng = np.random.default_rng(0)
  ids = rng.integers(3, cfgs[0].model.vocab_size, (4, 17))
  batches = [{"inputs": jnp.asarray(np.roll(ids, i, 0)[:, :-1]), "targets": jnp.asarray(np.roll(ids, i, 0)[:, 1:])}
             for i in range(3)]
  model0 = model_lib.build_model(cfgs[0].model)
  tx, schedule = optim.build_optimizer(cfgs[0])
  state = jax.jit(lambda r: nn.unbox(train.init_state(model0, tx, (batches[0]["inputs"],), r, cfg=cfgs[0])))(
      jax.random.PRNGKey(0))
  base, _ = lora.split(_init(cfgs[0], model0, batches[0]["inputs"]))
  runs = []
  for cfg in cfgs:
    s, b = (state, base) if not cfg.model.scan_layers else (model_lib.convert_layers(state, True),
                                                            model_lib.convert_layers(base, True))
    step = jax.jit(train.make_train_step(model_lib.build_model(cfg.model), tasks.LMTask, cfg, tx, schedule))
    losses = []
    for batch in batches:
      s, metrics = step(s, batch, b)
      losses.append(float(metrics["loss_sum"]))
    runs.append(losses)
  assert runs[0][0] != runs[0][-1]  # the adapters did train
  np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name,targets", [("gpt2", r"(query|value|wo)/kernel$"), ("llama", ""), ("phi3", "")])
def test_merged_and_peft_exports_agree(name, targets, tmp_path):
  """The PEFT adapter, applied in numpy as peft merges it (W + alpha / r B A, per HF module, with
  rank_pattern / alpha_pattern), gives the merged export's tensors; the base's other tensors are unchanged."""
  base = str(tmp_path / "base")
  convert.from_hf(str(FIXTURES / name), base, **QUIET)
  text = tmp_path / "text.txt"
  text.write_text(" ".join(["A man in an orange hat starring at something."] * 40) + "\n")
  cfg = config_lib.load_config(os.path.join(base, "config.json"), [
      f"train.init_from={base}", "train.lora_rank=2", "train.lora_alpha=6", "data.block_size=16",
      f"data.text_path={text}", "data.batch_size=2", "train.num_steps=2", "train.log_every=1",
      "train.eval_every=2", "train.checkpoint_every=2", "train.eval_batches=1", "train.sample_every_eval=false",
      "optim.schedule=constant", "optim.learning_rate=0.05", *([f"train.lora_targets={targets}"] if targets else [])])
  run = str(tmp_path / "run")
  train.train_and_evaluate(cfg, run, **QUIET)
  convert.to_hf(run, str(tmp_path / "merged"), **QUIET)
  convert.to_peft(run, str(tmp_path / "peft"), **QUIET)
  original, merged = hf_tensors(FIXTURES / name), hf_tensors(tmp_path / "merged")
  adapter = hf_tensors(tmp_path / "peft")
  config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
  assert config["peft_type"] == "LORA" and config["r"] == 2 and config["fan_in_fan_out"] == (name == "gpt2")
  changed = set()
  for module in config["target_modules"]:
    a = adapter[f"base_model.model.{module}.lora_A.weight"].astype(np.float64)
    b = adapter[f"base_model.model.{module}.lora_B.weight"].astype(np.float64)
    key = next((k for k in config["rank_pattern"] if __import__("re").fullmatch(k, module)), None)
    r, alpha = (config["rank_pattern"][key], config["alpha_pattern"][key]) if key else (config["r"], config["lora_alpha"])
    assert a.shape[0] == b.shape[1] == r
    delta = alpha / r * (b @ a)  # [out, in], torch's Linear layout
    weight = original[f"{module}.weight"].astype(np.float64)
    if config["fan_in_fan_out"]:
      delta = delta.T  # GPT-2's Conv1D holds [in, out]
    np.testing.assert_allclose(merged[f"{module}.weight"], weight + delta, rtol=1e-5, atol=1e-6, err_msg=module)
    assert np.abs(delta).max() > 1e-4, module
    changed.add(f"{module}.weight")
  for key, value in original.items():  # the rest: the base's, unchanged by the export
    if key not in changed:
      np.testing.assert_array_equal(merged[key], value, err_msg=key)
  # gpt2: c_attn (query, value), mlp.c_proj; phi3: the fused qkv_proj and gate_up_proj, o_proj, down_proj
  want = {"gpt2": 2, "llama": 7, "phi3": 4, "gemma3": 7}[name] * cfg.model.num_layers
  assert len(config["target_modules"]) == want
  with pytest.raises(UserError, match="not a LoRA run"):
    convert.to_peft(base, str(tmp_path / "nope"), **QUIET)


def test_the_harness_reads_a_lora_workdir_as_its_merged_model(base_run):
  """lm-eval's `jaxformer` model on a LoRA workdir scores with W + (alpha / r) A B (jaxformer.harness)."""
  from jaxformer import harness  # pylint: disable=g-import-not-at-top
  tmp, _, make_cfg = base_run
  run = train.train_and_evaluate(make_cfg("train.num_steps=3"), str(tmp / "harness"), **QUIET)
  lm = harness.JaxformerLM(str(tmp / "harness"), batch_size=2)
  merged = jax.device_get(lora.merge(run["lora_base"], run["state"]["params"], make_cfg()))
  context, conts = lm.tok.encode("the cat sat on a"), [" mat.", " red house.", " dog"]
  requests = [(None, context, lm.tok.encode(c)) for c in conts]
  got = lm._loglikelihood_tokens(requests)
  want = harness.JaxformerLM(run=(lm.cfg, lm.model, merged, lm.tok), batch_size=2)._loglikelihood_tokens(requests)
  base = harness.JaxformerLM(run=(lm.cfg, lm.model, jax.device_get(run["lora_base"]), lm.tok),
                             batch_size=2)._loglikelihood_tokens(requests)
  assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=1e-5)
  assert max(abs(g[0] - b[0]) for g, b in zip(got, base)) > 1e-3  # the adapters count


@pytest.mark.slow  # a server process; the merged model's equality stays in the quick suite
def test_a_lora_workdir_is_served_as_its_merged_model(base_run):
  """`jaxformer.serve` on a LoRA workdir serves W + (alpha / r) A B as merged here (lora.merge): concurrent greedy
  completions equal `jaxformer.generate`'s text on those weights, and each first token's logprob equals the
  merged model's (not the base model's: the adapters count)."""
  import openai  # pylint: disable=g-import-not-at-top
  from jaxformer import generate  # pylint: disable=g-import-not-at-top
  from test_serve import _start, _stop  # pylint: disable=g-import-not-at-top
  tmp, _, make_cfg = base_run
  workdir = str(tmp / "served")
  run = train.train_and_evaluate(make_cfg("train.num_steps=3"), workdir, **QUIET)
  cfg, model, _, tok, _ = evaluate.load_run(workdir, log=lambda *a: None)
  merged = jax.device_get(lora.merge(run["lora_base"], run["state"]["params"], make_cfg()))
  base = jax.device_get(run["lora_base"])
  prompts = ["the cat sat", "a big red", "dog ran to"]
  flags = ("--max-batch", "4", "--max-seq-len", "64")
  want = [generate.generate_text(model, merged, tok, cfg, [p], max_new_tokens=10, temperature=0.0, top_k=0,
                                 top_p=1.0, log=lambda *a: None)[0] for p in prompts]
  proc, url = _start(workdir, *flags)  # one server for both checks (test_serve._served_greedy's requests)
  try:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    name = client.models.list().data[0].id
    ask = lambda p: client.completions.create(model=name, prompt=p, max_tokens=10, temperature=0).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # concurrent, as _served_greedy sends them
      assert list(pool.map(ask, prompts)) == want
    for p in prompts:
      got = client.completions.create(model=client.models.list().data[0].id, prompt=p, max_tokens=1, temperature=0,
                                      logprobs=1).choices[0].logprobs.token_logprobs[0]
      ids = jnp.asarray([tok.encode(p)])
      logp = lambda w: jax.nn.log_softmax(model.apply({"params": w}, ids)[0, -1])
      token = int(jnp.argmax(logp(merged)))
      assert got == pytest.approx(float(logp(merged)[token]), abs=1e-4)
      assert abs(got - float(logp(base)[token])) > 1e-3
  finally:
    _stop(proc)
