"""Sharded training on 8 simulated CPU devices: same losses as one device, parameters laid
out as the rule table says, checkpoints portable across meshes.

The device count is fixed when JAX starts, so `sharding_worker.py` does the work in
subprocesses (one per model, in parallel) and these tests read their JSON.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxformer import sharding

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = ("tiny_encdec", "gpt2_tiny")
# Cheaper LLVM codegen: these programs are tiny, compiling them is most of the time.
XLA_FLAGS = "--xla_force_host_platform_device_count=8 " + os.environ["JAXFORMER_TEST_FAST_XLA"]  # conftest.FAST_XLA


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  """{model: the worker's JSON}."""
  tmp = str(tmp_path_factory.mktemp("sharding"))
  env = {**os.environ, "XLA_FLAGS": XLA_FLAGS, "JAX_PLATFORMS": "cpu"}
  procs = {name: subprocess.Popen([sys.executable, os.path.join(HERE, "sharding_worker.py"), name, tmp],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for name in MODELS}
  out = {}
  for name, proc in procs.items():
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"{name} worker failed:\n{log[-4000:]}"
    with open(os.path.join(tmp, f"{name}.json")) as f:
      out[name] = json.load(f)
  return out


@pytest.mark.slow  # 8 simulated devices in 2 processes (the `results` fixture)
@pytest.mark.parametrize("model", MODELS)
def test_every_mesh_gives_the_one_device_losses(results, model):
  r = results[model]
  assert r["devices"] == 8
  reference = r["runs"]["1dev"]["losses"]
  assert reference[-1] < reference[0]  # it trains
  for mesh in ("data8", "fsdp4_data2", "tensor2_data4"):
    np.testing.assert_allclose(r["runs"][mesh]["losses"], reference, rtol=1e-5, err_msg=mesh)


@pytest.mark.slow  # the same processes
@pytest.mark.parametrize("model", MODELS)
def test_parameters_and_activations_are_sharded_by_the_rules(results, model):
  runs, d_ff = results[model]["runs"], {"tiny_encdec": 64, "gpt2_tiny": 128}[model]
  # query kernel [embed 32, heads 4, kv 8]: embed over fsdp, heads over tensor.
  assert runs["fsdp4_data2"]["shards"]["query"] == {"spec": ["fsdp", "tensor", None], "shape": [32, 4, 8],
                                                    "shard": [8, 4, 8]}
  assert runs["tensor2_data4"]["shards"]["query"]["shard"] == [32, 2, 8]
  # FFN wi kernel [embed, mlp]: mlp over tensor.
  assert runs["tensor2_data4"]["shards"]["wi"]["shard"] == [32, d_ff // 2]
  assert runs["fsdp4_data2"]["shards"]["wi"]["shard"] == [8, d_ff]
  assert runs["data8"]["shards"]["query"]["shard"] == [32, 4, 8]  # pure data parallel: replicated
  # with_logical_constraint binds only under sharding.use_mesh.
  assert results[model]["constraints"] == {"in_mesh": True, "outside": False}


@pytest.mark.slow  # the same processes
def test_checkpoint_restores_under_another_mesh_and_training_continues(results):
  r = results["tiny_encdec"]
  restore, reference = r["restore"], r["runs"]["1dev"]["losses"]
  # train_and_evaluate under fsdp=4 x data=2 (3 steps, saved) matches the one-device steps.
  np.testing.assert_allclose(restore["first_losses"], reference[:3], rtol=1e-5)
  for mesh in ("1dev", "tensor2_data4"):
    assert restore[mesh]["equal"], mesh
  assert restore["1dev"]["shards"]["query"]["shard"] == [32, 4, 8]
  assert restore["tensor2_data4"]["shards"]["query"]["shard"] == [32, 2, 8]
  # Resumed under tensor=2 x data=4: step 4 is the one-device step 4.
  assert restore["resumed"]["step"] == 4
  np.testing.assert_allclose(restore["resumed"]["losses"], reference, rtol=1e-5)


def _readme_rule_table():
  """{logical axis: mesh axes (a tuple, () = replicated)} from README's table of logical axes."""
  lines = open(os.path.join(HERE, "..", "README.md"), encoding="utf-8").read().splitlines()
  start = lines.index("| logical | mesh | | logical | mesh |")
  table = {}
  for line in lines[start + 2:]:
    if not line.startswith("|"):
      break
    cells = [c.strip() for c in line.strip("|").split("|")]
    for names, mesh in ((cells[0], cells[1]), (cells[3], cells[4])):
      names = names.split("(")[0]  # "expert (MoE experts)": a note after the name
      axes = () if mesh == "replicated" else tuple(a.strip() for a in mesh.split(" x "))
      table.update({name.strip(): axes for name in names.split(",") if name.strip()})
  return table


def test_each_logical_axis_shards_where_the_readme_says():
  """A parameter named by each logical axis, given its sharding on a mesh: the mesh axes it lands
  on are those of the README's table (and the table covers every axis the model uses)."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  table = _readme_rule_table()
  assert set(table) == {name for name, _ in sharding.RULES}
  mesh = sharding.make_mesh(sharding.MeshConfig(1, 1, 1), jax.devices()[:1])
  boxed = {name: nn.LogicallyPartitioned(jax.ShapeDtypeStruct((4, 6), np.float32), (name, None))
           for name in table}
  shardings = sharding.logical_sharding(boxed, mesh)
  for name, axes in table.items():
    spec = tuple(shardings[name].spec) + (None,) * 2
    got = spec[0] if isinstance(spec[0], tuple) else (spec[0],) if spec[0] else ()
    assert got == axes, (name, spec)
    assert spec[1] is None  # an unnamed dimension is replicated



def test_global_batch_on_one_process_is_the_batch():
  import jax
  mesh = sharding.make_mesh(sharding.MeshConfig(-1, 1, 1))
  batch = {"inputs": np.arange(24, dtype=np.int32).reshape(len(jax.devices()) * 3, -1)}
  out = sharding.global_batch(batch, sharding.batch_sharding(mesh))
  assert out["inputs"].sharding == sharding.batch_sharding(mesh)
  np.testing.assert_array_equal(np.asarray(out["inputs"]), batch["inputs"])


def test_single_process_runs_do_not_initialize_distributed(monkeypatch):
  from jaxformer import runtime
  monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
  assert not runtime.maybe_initialize_distributed(False)
