"""Device mesh and the logical-axis rule table.

Model code names axes (`batch`, `embed`, `heads`, ...); this table maps them to the
mesh axes `data`, `fsdp`, `tensor`, `expert`. FSDP shards parameters and optimizer state over
`fsdp`; tensor parallelism splits heads and the FFN hidden dimension over `tensor`;
expert parallelism splits MoE experts over `expert`; the batch is split over
`data` x `fsdp` x `expert`.

Parameters get their shardings from `logical_sharding`; activations are pinned by
`nn.with_logical_constraint` in the model, which binds only while `use_mesh` is
active when a step is traced.
"""

import contextlib

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxformer.config import MeshConfig
from jaxformer.errors import UserError

MESH_AXES = ("data", "fsdp", "tensor", "expert")

RULES = (
    ("batch", ("data", "fsdp", "expert")),  # outside the MoE layers the expert axis is data parallel
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("kv", None),
    ("length", None),
    ("norm", None),
    ("expert", "expert"),  # MoE: each device of the expert axis holds its share of the experts
    ("layers", None),  # model.scan_layers: the stacked layer axis; each device holds its share of every layer
)


def make_mesh(cfg: MeshConfig, devices=None, experts: int = 0) -> Mesh:
  """A (data, fsdp, tensor, expert) mesh over `devices` (default: all); one -1 axis takes the rest.

  `experts` (model.moe_experts, 0 for a dense model) must divide over the expert axis once it is
  resolved: config validation can only check a literal mesh.expert, not the -1 that takes the rest."""
  devices = jax.devices() if devices is None else devices
  sizes = [cfg.data, cfg.fsdp, cfg.tensor, cfg.expert]
  fixed = int(np.prod([s for s in sizes if s != -1]))
  if sizes.count(-1) > 1:
    raise UserError("at most one of mesh.data/mesh.fsdp/mesh.tensor/mesh.expert may be -1")
  if -1 in sizes:
    if len(devices) % fixed:
      raise UserError(f"{len(devices)} devices cannot be split into mesh axes of size {sizes}")
    sizes[sizes.index(-1)] = len(devices) // fixed
  if int(np.prod(sizes)) != len(devices):
    raise UserError(f"mesh data={sizes[0]} x fsdp={sizes[1]} x tensor={sizes[2]} x expert={sizes[3]} needs "
                    f"{int(np.prod(sizes))} devices; {len(devices)} are available")
  if experts and experts % sizes[3]:
    given = "mesh.expert=-1 resolves to " if cfg.expert == -1 else "mesh.expert="
    raise UserError(f"model.moe_experts={experts} must be a multiple of {given}{sizes[3]} (on {len(devices)} "
                    f"devices): set mesh.expert to a divisor of {experts}")
  return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES)


def logical_sharding(boxed_tree, mesh: Mesh):
  """NamedShardings for a tree of boxed (logically named) arrays or ShapeDtypeStructs.

  A dimension that the mesh axis does not divide evenly is replicated instead (e.g. a
  50,257-token vocabulary over 2 tensor devices): correct, just less sharded.
  """
  specs = nn.get_partition_spec(boxed_tree)
  shardings = nn.logical_to_mesh_sharding(specs, mesh, RULES)
  shapes = nn.unbox(boxed_tree)

  def fit(sharding, leaf):
    spec = list(sharding.spec) + [None] * (len(leaf.shape) - len(sharding.spec))
    for i, axes in enumerate(spec):
      names = axes if isinstance(axes, tuple) else (axes,) if axes else ()
      size = int(np.prod([mesh.shape[a] for a in names])) if names else 1
      if leaf.shape[i] % size:
        spec[i] = None
    return NamedSharding(mesh, P(*spec))

  return jax.tree.map(fit, shardings, shapes, is_leaf=lambda x: isinstance(x, NamedSharding))


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Leading (batch) axis over data x fsdp x expert; everything else replicated."""
  return NamedSharding(mesh, P(("data", "fsdp", "expert")))


@contextlib.contextmanager
def use_mesh(mesh: Mesh):
  """Makes `mesh` and RULES current, so `nn.with_logical_constraint` emits real constraints.

  Enter it around calls of jitted steps (it cannot be entered inside `jit`); outside it
  the constraints are no-ops, which is what decoding with small batches wants.
  """
  with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
    yield


def batch_part(sharding: NamedSharding):
  """(first, stop, parts): this process's devices hold parts [first, stop) of the batch axis,
  which `sharding` splits into `parts` equal parts ((0, parts, parts) on one process).

  Tasks read only these rows of each batch (`data.row_range`); `global_batch` copies the
  same rows, so what a process does not read it never sends.
  """
  spec = sharding.spec[0] if len(sharding.spec) else None
  names = spec if isinstance(spec, tuple) else (spec,) if spec else ()
  parts = int(np.prod([sharding.mesh.shape[a] for a in names])) if names else 1
  rows = [idx[0].indices(parts)[:2] for idx in sharding.addressable_devices_indices_map((parts,)).values()]
  return min(r[0] for r in rows), max(r[1] for r in rows), parts


def global_batch(batch, sharding: NamedSharding):
  """A global jax.Array from a numpy batch that every process holds in full.

  Each process copies only the rows its own devices hold (on one process, all of
  them); hosts that are replicas along the batch axis take the same rows.
  """
  def one(x):
    x = np.asarray(x)
    rows = [idx[0].indices(x.shape[0])[:2]
            for idx in sharding.addressable_devices_indices_map(x.shape).values()]
    start, stop = min(r[0] for r in rows), max(r[1] for r in rows)
    return jax.make_array_from_process_local_data(sharding, x[start:stop], x.shape)
  return jax.tree.map(one, batch)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
