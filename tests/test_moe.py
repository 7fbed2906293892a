"""The MoE FFN (jaxformer.moe) against references that run every expert on every token."""

import dataclasses
import functools
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxformer import config as config_lib
from jaxformer import layers
from jaxformer import model as model_lib
from jaxformer import moe
from jaxformer import sharding
from jaxformer import tasks
from jaxformer.errors import UserError


def _cfg(*overrides):
  return config_lib.load_config("llama_tiny", ["model.moe_experts=4", "model.dropout_rate=0", *overrides]).model


def _init(cfg, x, seed=0):
  params = nn.unbox(moe.MoEFeedForward(cfg).init(jax.random.key(seed), x))["params"]
  # A router with a spread of logits, so the top-k choice is clear-cut and varied.
  params["router"]["kernel"] = params["router"]["kernel"] * 20.0
  return params


@functools.partial(jax.jit, static_argnums=(0, 3))
def _apply(cfg, params, x, deterministic=False):
  """The layer as training runs it (deterministic=False: capacity mode applies)."""
  y, sown = moe.MoEFeedForward(cfg).apply({"params": params}, x, deterministic, mutable=["intermediates"])
  return y, moe.aux_losses(sown["intermediates"])


@pytest.mark.parametrize("overrides", [(), ("model.moe_top_k=1",), ("model.activation=gelu", "model.moe_top_k=3")])
def test_dropless_equals_all_experts_dense_reference_outputs_and_gradients(overrides):
  cfg = _cfg(*overrides)
  x = jax.random.normal(jax.random.key(1), (3, 7, cfg.d_model))
  params = _init(cfg, x)
  # Outputs, and gradients of a loss that weights each output differently, w.r.t. every parameter
  # and x: one compile for the layer, one for the reference.
  w = jax.random.normal(jax.random.key(2), x.shape)

  def grads_of(fn):
    return jax.jit(jax.value_and_grad(lambda p, x: (lambda y: (jnp.sum(y * w), y))(fn(p, x)), argnums=(0, 1),
                                      has_aux=True))(params, x)
  (_, y), grads = grads_of(lambda p, x: _apply(cfg, p, x)[0])
  (_, ref), ref_grads = grads_of(lambda p, x: moe.dense_reference(p, cfg, x))
  np.testing.assert_allclose(y, ref, atol=1e-5, rtol=1e-5)
  for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
    np.testing.assert_allclose(g, r, atol=1e-5, rtol=1e-5)
  assert float(jnp.abs(grads[0]["router"]["kernel"]).max()) > 0  # the router learns through the weights


def _kept_by_rule(top_e, num_experts, cap):
  """The documented rule, brute force: first choices of all tokens in order, then second choices ..."""
  kept = np.zeros(top_e.shape, bool)
  taken = [0] * num_experts
  for j in range(top_e.shape[1]):
    for t in range(top_e.shape[0]):
      e = int(top_e[t, j])
      if taken[e] < cap:
        kept[t, j] = True
      taken[e] += 1
  return kept


@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_mode_drops_exactly_the_copies_its_rule_names(factor):
  cfg = _cfg(f"model.moe_capacity_factor={factor}")
  x = jax.random.normal(jax.random.key(3), (2, 6, cfg.d_model))
  params = _init(cfg, x, seed=4)
  tokens = np.asarray(x.reshape(-1, cfg.d_model))
  weights, top_e, _ = moe.route(tokens @ params["router"]["kernel"], cfg.moe_top_k)
  cap = math.ceil(factor * 12 * cfg.moe_top_k / cfg.moe_experts)
  assert moe.capacity(cfg, 12) == cap
  kept = _kept_by_rule(np.asarray(top_e), cfg.moe_experts, cap)
  assert 0 < kept.sum() < kept.size or factor == 1.25  # the small factors do drop some
  np.testing.assert_array_equal(moe.capacity_slots(top_e, cfg.moe_experts, cap)[1], kept)
  # The output: each token's kept copies, run through their expert alone, weighted, not renormalised.
  want = np.zeros_like(tokens)
  for t in range(tokens.shape[0]):
    for j in range(cfg.moe_top_k):
      if kept[t, j]:
        e = int(top_e[t, j])
        one = {k: v[e:e + 1] for k, v in params.items() if k != "router"}
        hidden = [tokens[t] @ one[n][0] for n in ("wi_gate", "wi_up")]
        want[t] += float(weights[t, j]) * np.asarray(layers.ffn_activation(cfg, hidden) @ one["wo"][0])
  y, stats = _apply(cfg, params, x)
  np.testing.assert_allclose(np.asarray(y).reshape(tokens.shape), want, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(stats["dropped_fraction"], 1 - kept.mean(), rtol=1e-6)  # logged by training
  # Evaluation and decoding (deterministic) route dropless: every expert's share, nothing dropped.
  y, stats = _apply(cfg, params, x, deterministic=True)
  np.testing.assert_allclose(y, moe.dense_reference(params, cfg, x), atol=1e-5, rtol=1e-5)
  assert "dropped_fraction" not in stats


def test_router_statistics_match_their_formulas():
  cfg = _cfg("model.moe_top_k=2")
  x = jax.random.normal(jax.random.key(5), (2, 8, cfg.d_model))
  params = _init(cfg, x)
  _, stats = _apply(cfg, params, x)
  logits = np.asarray(x.reshape(-1, cfg.d_model) @ params["router"]["kernel"], np.float64)
  probs = np.exp(logits - logits.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  top = np.argsort(-probs, axis=-1)[:, :2]
  f = np.bincount(top.ravel(), minlength=4) / top.size
  np.testing.assert_allclose(stats["expert_fraction"], f, rtol=1e-6)
  np.testing.assert_allclose(stats["load_balancing"], 4 * 2 * np.sum(f * probs.mean(0)), rtol=1e-5)
  lse = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(stats["z_loss"], np.mean(lse ** 2), rtol=1e-5)
  # A uniform router: the loss is top_k whatever the tie-broken choice (Switch's balanced value).
  params["router"]["kernel"] = jnp.zeros_like(params["router"]["kernel"])
  np.testing.assert_allclose(_apply(cfg, params, x)[1]["load_balancing"], 2.0, rtol=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (("model.moe_top_k=5",), "moe_top_k=5"),
    (("model.moe_every=2", "model.scan_layers=true"), "moe_every=1"),
    (("model.moe_every=3",), "moe_every=3"),
    (("mesh.expert=3",), "mesh.expert=3"),
    (("model.moe_dispatch=all_to_all", "model.moe_capacity_factor=1.25"), "moe_capacity_factor=0"),
    (("model.moe_dispatch=shard_map",), "gspmd, all_to_all"),
])
def test_bad_moe_settings_are_one_line_errors(overrides, message):
  with pytest.raises(UserError, match=message) as err:
    config_lib.load_config("llama_tiny", ["model.moe_experts=4", *overrides])
  assert "\n" not in str(err.value)
  with pytest.raises(UserError, match="decoder_only"):
    config_lib.load_config("tiny_encdec", ["model.moe_experts=4"])


@pytest.mark.parametrize("dispatch", ["gspmd", "all_to_all"])
def test_expert_axis_of_minus_one_is_resolved_before_the_divisibility_check(dispatch):
  # 6 experts over 4 devices: config validation sees mesh.expert=-1 and cannot check it; the mesh does.
  cfg = config_lib.load_config("llama_tiny", ["model.moe_experts=6", "mesh.data=1", "mesh.expert=-1",
                                              f"model.moe_dispatch={dispatch}"])
  four = jax.devices()[:1] * 4  # stand-ins: the check runs before a Mesh is built from them
  with pytest.raises(UserError, match=r"model.moe_experts=6 must be a multiple of mesh.expert=-1 resolves to 4"
                     ) as err:
    sharding.make_mesh(cfg.mesh, four, cfg.model.moe_experts)
  assert "\n" not in str(err.value)
  assert sharding.make_mesh(cfg.mesh, jax.devices()[:1], cfg.model.moe_experts).shape["expert"] == 1


@functools.partial(jax.jit, static_argnums=0)
def _lm_loss(cfg, params, ids, coefs=(0.01, 0.001)):
  model = model_lib.build_model(cfg)
  batch = {"inputs": ids[:, :-1], "targets": ids[:, 1:]}
  return tasks.LMTask.loss(model, params, batch, {}, True, 0.0, coefs)


def _loss_and_grad(cfg, params, ids):
  """(_lm_loss's outputs, d loss / d params) from one compile."""
  (_, out), grads = jax.jit(jax.value_and_grad(lambda p: (lambda o: (o[0], o))(_lm_loss(cfg, p, ids)),
                                               has_aux=True))(params)
  return out, grads


def test_scan_remat_and_interleaving_give_the_unrolled_loss():
  cfg = _cfg("model.num_layers=2")
  ids = jax.random.randint(jax.random.key(6), (2, 9), 0, cfg.vocab_size)
  params = nn.unbox(model_lib.build_model(cfg).init(jax.random.key(0), ids[:, :-1]))["params"]
  assert "moe" in params["decoder"]["layer_0"] and "moe" in params["decoder"]["layer_1"]
  (loss, nll, weight, stats), g_ref_unrolled = _loss_and_grad(cfg, params, ids)
  # The aux losses enter per token: loss - nll = (0.01 load balancing + 0.001 z) x tokens.
  np.testing.assert_allclose(loss - nll, (0.01 * stats["load_balancing"] + 0.001 * stats["z_loss"]) * weight,
                             rtol=1e-4)
  for change in ({"scan_layers": True}, {"scan_layers": True, "remat": "full"}):
    other = dataclasses.replace(cfg, **change)
    scanned = model_lib.convert_layers(params, other.scan_layers)
    if change.get("remat") != "full":
      got = _lm_loss(other, scanned, ids)
    else:
      got, g = _loss_and_grad(other, scanned, ids)
      g_ref = model_lib.convert_layers(g_ref_unrolled, other.scan_layers)
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(got[0], loss, rtol=1e-6)
    np.testing.assert_allclose(got[3]["expert_fraction"], stats["expert_fraction"], rtol=1e-6)
  # moe_every=2: layer 0 dense, layer 1 MoE.
  every = _cfg("model.num_layers=2", "model.moe_every=2")
  p2 = nn.unbox(jax.eval_shape(lambda: model_lib.build_model(every).init(jax.random.key(0), ids[:, :-1])))[
      "params"]["decoder"]  # the layout only: shapes, not values
  assert "ffn" in p2["layer_0"] and "moe" in p2["layer_1"]


@pytest.mark.slow
def test_train_logs_the_aux_losses_and_fractions_and_checkpoints_restore_in_either_layout(tmp_path):
  from jaxformer import evaluate, train
  text = tmp_path / "text.txt"
  text.write_text("the quick brown fox jumps over the lazy dog.\n" * 100)
  cfg = config_lib.load_config("llama_tiny", [
      "model.moe_experts=4", f"data.text_path={text}", "train.num_steps=4", "train.log_every=2",
      "train.eval_every=4", "train.sample_every_eval=false", "optim.label_smoothing=0", "optim.moe_aux_loss=0.1"])
  out = train.train_and_evaluate(cfg, str(tmp_path / "run"), log=lambda *a: None)
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  logged = [r for r in rows if "moe_load_balancing" in r]
  assert len(logged) == 2
  for r in logged:
    assert abs(sum(r[f"moe_fraction_{e}"] for e in range(4)) - 1.0) < 1e-5
    # loss = nll + 0.1 x load balancing (every step has the same token count).
    assert abs(r["loss"] - r["nll"] - 0.1 * r["moe_load_balancing"]) < 1e-4 * r["loss"]
  # The last checkpoint holds the trained experts bitwise, unrolled as trained or stacked for scan.
  trained = nn.unbox(out["state"]["params"])
  for scan in (False, True):
    _, _, params, _, _ = evaluate.load_run(str(tmp_path / "run"), log=lambda *a: None, scan_layers=scan)
    want = model_lib.convert_layers(trained, True) if scan else trained
    assert jax.tree.structure(params) == jax.tree.structure(want)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_inspect_counts_mixtral_8x7b_total_and_active_parameters():
  from jaxformer import inspect
  cfg = config_lib.load_config("mixtral_8x7b")
  assert inspect.count_parameters(cfg)["total"] == 46_702_792_704
  assert inspect.active_parameters(cfg) == 12_879_925_248
  # FLOPs count the active matmul weights: all of them but the input embedding table (a lookup).
  p = inspect.matmul_parameters(cfg)
  assert p["decoder"] + p["output"] == 12_879_925_248 - 32000 * 4096 - (2 * 32 + 1) * 4096
  dense = config_lib.load_config("mixtral_8x7b", ["model.moe_experts=0"])
  assert inspect.active_parameters(dense) == inspect.count_parameters(dense)["total"]


@pytest.mark.parametrize("sizes", [(5, 0, 40, 3), (0, 0, 48, 0), (12, 12, 12, 12), (1, 2, 3, 4, 5, 6, 7, 8)])
def test_block_layout_gives_each_expert_whole_blocks_in_token_order(sizes):
  num_e, b, k = len(sizes), 8, 2
  top_e = np.random.default_rng(0).permutation(np.repeat(np.arange(num_e), sizes)).reshape(-1, k)
  dest, block_group, blocks = jax.jit(moe.block_layout, static_argnums=(1, 2))(top_e, num_e, b)
  dest, block_group, flat = np.asarray(dest), np.asarray(block_group), top_e.reshape(-1)
  assert blocks == -(-flat.size // b) + num_e
  assert len(set(dest.tolist())) == flat.size and dest.max() < blocks * b  # every copy has its own row
  np.testing.assert_array_equal(block_group[dest // b], flat)  # ... in a block of its expert
  for e in range(num_e):
    rows = dest[flat == e]
    if rows.size:  # consecutive rows from a block's first row, in token order
      assert rows[0] % b == 0
      np.testing.assert_array_equal(rows, rows[0] + np.arange(rows.size))


def test_block_rows_keep_padding_within_half_the_rows():
  for rows in (16, 1536, 4096, 6144, 8192, 10**6):
    b = moe.block_rows(rows, 8)
    assert b in (32, 64, 128, 256, 512)
    assert b == 32 or b * 8 <= rows / 2  # padding (<= 8 blocks) within half the rows ...
    assert b == 512 or 2 * b * 8 > rows / 2  # ... and the largest such block


def test_ragged_dot_and_cpu_blocks_give_the_same_layer(monkeypatch):
  cfg = _cfg()
  x = jax.random.normal(jax.random.key(1), (3, 7, cfg.d_model))
  params = _init(cfg, x)
  w = jax.random.normal(jax.random.key(2), x.shape)
  out = {}
  for impl in ("ragged_dot", "blocks"):
    monkeypatch.setattr(moe, "DROPLESS_IMPL", impl)
    loss = lambda p, x: jnp.sum(moe.MoEFeedForward(cfg).apply({"params": p}, x) * w)  # noqa: E731
    out[impl] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(params, x)
  for a, r in zip(jax.tree.leaves(out["blocks"]), jax.tree.leaves(out["ragged_dot"])):
    np.testing.assert_allclose(a, r, atol=1e-5, rtol=1e-5)
