"""MoE training through train.py on 8 simulated CPU devices with the experts sharded over the
`expert` mesh axis: the same losses as on one device (rel 1e-5), with data, FSDP and tensor axes,
under the compiler's dispatch (gspmd) and the shard_map all-to-all (model.moe_dispatch=all_to_all),
the latter also under scan over layers and full remat."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import FAST_XLA

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCAN = ("model.scan_layers=true", "model.remat=full")  # scanned layers initialise differently: own reference
MESHES = {"1dev": (1, ()), "1dev_scan": (1, SCAN), "expert4_data2": (8, ("mesh.expert=4", "mesh.data=2")),
          "expert8_all_to_all": (8, ("mesh.expert=8", "mesh.data=1", "model.moe_dispatch=all_to_all")),
          "expert2_fsdp2_tensor2": (8, ("mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.data=1")),
          # all_to_all beside FSDP and tensor axes (data shards the batch as fsdp does), under scan and remat
          "expert2_fsdp2_tensor2_all_to_all_scan": (8, ("mesh.expert=2", "mesh.fsdp=2", "mesh.tensor=2", "mesh.data=1",
                                                      "model.moe_dispatch=all_to_all", *SCAN))}


@pytest.mark.slow
def test_expert_parallel_meshes_train_with_the_one_device_losses(tmp_path):
  text = tmp_path / "text.txt"
  text.write_text("the quick brown fox jumps over the lazy dog.\nsphinx of black quartz, judge my vow.\n" * 40)
  procs = {}
  for name, (devices, mesh) in MESHES.items():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXFORMER_COMPILATION_CACHE": "off",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {FAST_XLA}"}
    args = [sys.executable, os.path.join(ROOT, "train.py"), "--config", "llama_tiny", "--workdir",
            str(tmp_path / name), "model.moe_experts=8", "model.moe_top_k=2", "optim.moe_z_loss=0.001",
            f"data.text_path={text}", "data.batch_size=8", "data.block_size=16", "train.num_steps=3",
            "train.log_every=1", "train.eval_every=1000", "train.checkpoint_every=1000",
            "train.sample_every_eval=false", *mesh]
    procs[name] = subprocess.Popen(args, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
  losses = {}
  for name, proc in procs.items():
    log, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, f"{name}:\n{log[-3000:]}"
    rows = [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")]
    losses[name] = [(r["loss"], r["nll"], r["moe_load_balancing"]) for r in rows if "loss" in r]
    if not name.startswith("1dev"):  # train.py logs the mesh it built
      expert = dict(m.split("=") for m in MESHES[name][1])["mesh.expert"]
      assert f"'expert': {expert}}}" in log, log[-2000:]
  for name in ("1dev", "1dev_scan"):
    reference = np.array(losses[name])
    assert reference.shape == (3, 3) and reference[-1, 0] < reference[0, 0], name  # it trains
  compared = [name for name in MESHES if not name.startswith("1dev")]  # a reference is not compared with itself
  assert {"1dev", "1dev_scan"} == {"1dev_scan" if "scan" in name else "1dev" for name in compared}
  for name in compared:
    reference = np.array(losses["1dev_scan" if "scan" in name else "1dev"])
    np.testing.assert_allclose(losses[name], reference, rtol=1e-5, err_msg=name)
