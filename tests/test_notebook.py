"""Runs notebooks/colab_tpu.ipynb top to bottom on CPU with a tiny config (4 simulated devices)."""

import os

import nbformat
from nbclient import NotebookClient

NOTEBOOK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "notebooks", "colab_tpu.ipynb")


def test_colab_notebook_trains_samples_and_evaluates(tmp_path, monkeypatch):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # Papermill-style: a cell after the tagged parameters cell overrides them.
  at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
  nb.cells.insert(at + 1, nbformat.v4.new_code_cell(
      f'CONFIG = "gpt2_tiny"\nSTEPS = 3\nBATCH_PER_DEVICE = 2\nTEXT = "builtin"\nWORKDIR = {str(tmp_path / "run")!r}\n'
      'OVERRIDES = ["model.num_layers=1", "train.log_every=1", "train.eval_batches=1", '
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
  assert "4 devices" in out
  assert "step 3: train loss" in out
  assert "PartitionSpec" in out or "spec=P(" in out
  assert "perplexity per token" in out
  sample = next(text(i) for i, c in enumerate(nb.cells) if "generate_text" in c.source)
  assert sample.startswith("ROMEO:") and len(sample.strip()) > len("ROMEO:")
