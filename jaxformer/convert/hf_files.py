"""safetensors folders as Hugging Face writes them: a reader of one file or a sharded index, and a shard writer."""

import json
import os

from jaxformer.convert.common import read_json
from jaxformer.errors import UserError


class SafetensorsReader:
  """The tensors of an HF folder: `model.safetensors`, or shards listed in `model.safetensors.index.json`."""

  def __init__(self, directory):
    from safetensors import safe_open  # Lazy: only conversion needs it.
    self._open = safe_open
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
      weight_map = read_json(index, "the shard index")["weight_map"]
      files = sorted(set(weight_map.values()))
    else:
      files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
      if not files:
        hint = (" (only pytorch_model.bin: save it as safetensors first, e.g. transformers'"
                " model.save_pretrained(dir, safe_serialization=True))"
                if os.path.isfile(os.path.join(directory, "pytorch_model.bin")) else "")
        raise UserError(f"{directory} has no *.safetensors weights{hint}")
      weight_map = {}
    self.directory = directory
    self.location = {}
    for name in files:
      path = os.path.join(directory, name)
      if not os.path.isfile(path):
        raise UserError(f"{path} is listed in the shard index but missing")
      with safe_open(path, framework="np") as f:
        for key in f.keys():
          self.location[key] = path
    for key, name in weight_map.items():
      if key not in self.location:
        raise UserError(f"{os.path.join(directory, name)} lacks {key}, which the shard index lists there")

  def shape(self, name):
    with self._open(self.location[name], framework="np") as f:
      return tuple(f.get_slice(name).get_shape())

  def get(self, name):
    """One tensor as numpy, in its stored dtype (bf16 through ml_dtypes)."""
    with self._open(self.location[name], framework="np") as f:
      return f.get_tensor(name)


def write_shards(out, tensors_iter, max_shard_mb):
  """Writes (name, array) pairs as safetensors shards of at most max_shard_mb each, in order.

  One shard is `model.safetensors`; more are `model-0000k-of-0000n.safetensors` plus
  `model.safetensors.index.json`, as transformers writes them. Only the shard being written is
  held (safetensors serialises a whole file at once).
  """
  from safetensors.numpy import save_file
  written, current, size = [], {}, 0

  def flush():
    path = os.path.join(out, f".shard-{len(written)}.tmp")
    save_file(current, path, metadata={"format": "pt"})
    written.append((path, list(current), sum(v.nbytes for v in current.values())))

  for name, value in tensors_iter:
    if current and size + value.nbytes > max_shard_mb * 2**20:
      flush()
      current, size = {}, 0
    current[name] = value
    size += value.nbytes
  flush()
  current = None
  if len(written) == 1:
    os.replace(written[0][0], os.path.join(out, "model.safetensors"))
    return
  weight_map = {}
  for i, (path, names, _) in enumerate(written):
    fname = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
    os.replace(path, os.path.join(out, fname))
    weight_map.update({n: fname for n in names})
  with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": sum(w[2] for w in written)}, "weight_map": weight_map}, f, indent=2)
