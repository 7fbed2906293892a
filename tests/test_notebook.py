"""Runs notebooks/colab_tpu.ipynb top to bottom on CPU with a tiny config (4 simulated devices)."""

import json
import math
import os
import re

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "notebooks", "colab_tpu.ipynb")


@pytest.mark.slow  # a Jupyter kernel running the notebook end to end
def test_colab_notebook_trains_samples_and_evaluates(tmp_path, monkeypatch):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # Papermill-style: a cell after the tagged parameters cell overrides them.
  at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
  nb.cells.insert(at + 1, nbformat.v4.new_code_cell(
      f'CONFIG = "gpt2_tiny"\nSTEPS = 12\nBATCH_PER_DEVICE = 2\nTEXT = "builtin"\nWORKDIR = {str(tmp_path / "run")!r}\n'
      'OVERRIDES = ["model.num_layers=1", "optim.learning_rate=1e-2", "optim.warmup_steps=2", '
      '"train.log_every=1", "train.eval_batches=1", '
      '"train.sample_every_eval=false"]\nMAX_NEW_TOKENS = 20'))
  # The kernel inherits these: 4 CPU devices stand in for TPU cores; cheap codegen for tiny programs.
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0 "
                     "--xla_llvm_disable_expensive_passes=true")
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.chdir(tmp_path)  # the notebook writes its text file in the working directory
  # kernel "python3" runs `python`, which jupyter_client resolves to this interpreter (the venv).
  client = NotebookClient(nb, timeout=300, kernel_name="python3",
                          resources={"metadata": {"path": str(tmp_path)}})
  client.execute()

  def text(i):
    return "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                   for o in nb.cells[i].get("outputs", []))

  out = "\n".join(text(i) for i in range(len(nb.cells)))
  assert "cpu: 4 devices" in out
  # It trains: the loss starts at ln(vocabulary) (68 ids, near-uniform at init) and falls.
  losses = [r["loss"] for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "loss" in r]
  assert len(losses) == 12 and abs(losses[0] - math.log(68)) < 0.3, losses
  assert losses[-1] < losses[0] - 0.8, losses
  final = re.search(r"step 12: train loss ([\d.]+), val NLL ([\d.]+) \(perplexity ([\d.]+)\)", out)
  assert final and abs(float(final[1]) - losses[-1]) < 1e-3, out
  assert math.isclose(math.exp(float(final[2])), float(final[3]), rel_tol=1e-3)
  # The cell asked for data parallelism (mesh.data=-1): the batch over data=4, parameters replicated.
  train_out = next(text(i) for i, c in enumerate(nb.cells) if "train_and_evaluate" in c.source)
  sharding = re.search(r"NamedSharding\(mesh=Mesh\((.*?)\), spec=(?:PartitionSpec|P)\(([^)]*)\)", train_out)
  assert sharding, train_out
  mesh = {k: int(v) for k, v in re.findall(r"'(\w+)': (\d+)", sharding[1])}
  assert mesh == {"data": 4, "fsdp": 1, "tensor": 1, "expert": 1}, sharding[1]
  named = re.findall(r"'(\w+)'", sharding[2])  # the rule table's axes for [embed, mlp]: fsdp, tensor
  assert named == ["fsdp", "tensor"] and all(mesh[a] == 1 for a in named), sharding[2]  # so: replicated
  # The sample decodes: the prompt, then MAX_NEW_TOKENS characters of the text's alphabet.
  sample = next(text(i) for i, c in enumerate(nb.cells) if "generate_text" in c.source).removesuffix("\n")
  builtin = set(open(tmp_path / "builtin.txt").read())
  assert sample.startswith("ROMEO:") and len(sample) == len("ROMEO:") + 20 and set(sample) <= builtin, sample
  ppl = re.search(r"perplexity per token: ([\d.]+) \(NLL ([\d.]+) nats", out)
  assert ppl and math.isclose(math.exp(float(ppl[2])), float(ppl[1]), rel_tol=1e-3) and float(ppl[1]) < 68
