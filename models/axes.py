"""Logical axes: the model's one declaration of what each parameter axis means.

Every parameter is created with a name per axis, as Flax NNX sharding
metadata (``out_sharding``, set through ``nnx.with_partitioning``; the layer
stack adds ``"layers"`` in front through ``nnx.vmap``'s ``transform_metadata``):

| parameter | logical axes |
|---|---|
| ``embed/embedding`` | ``("vocab", "embed")`` |
| ``layers/*_norm/scale`` | ``("layers", "embed")`` |
| ``layers/attn/{query,key,value}/kernel`` | ``("layers", "embed", "heads")`` |
| ``layers/attn/out/kernel`` | ``("layers", "heads", "embed")`` |
| ``layers/moe/router/kernel`` | ``("layers", "embed", "experts")`` |
| ``layers/moe/experts/{w_gate,w_up}`` | ``("layers", "experts", "embed", "mlp")`` |
| ``layers/moe/experts/w_down`` | ``("layers", "experts", "mlp", "embed")`` |
| ``final_norm/scale`` | ``("embed",)`` |
| ``unembed/kernel`` | ``("embed", "vocab")`` |

Everything the training code needs to know about a parameter follows from
its names by the small rules below, so no code matches paths or guesses from
``ndim``:

* **Stacked axes.** A leading run of :data:`STACKED_AXES` (``layers``,
  ``experts``) indexes independent copies; the axes after it form the
  parameter itself. Two of them make a matrix (rows, then columns, as in
  ``x @ W``); one makes a vector. :func:`matrix_dims`.
* **Tier.** A parameter stacked over ``experts`` is an expert bank; a matrix
  whose columns are ``experts`` is a router; everything else is backbone.
  :func:`tier`.
* **Mesh.** :data:`MESH_RULES` maps logical names to mesh axes (``experts``
  to ``expert``); with FSDP the larger matrix axis that divides evenly is
  also split over ``data``. :func:`partition_spec`.

The optimizers' tier labels, matrix axes, weight-decay masks and Muon's
dimension numbers are built from :func:`matrix_dims` and :func:`tier` in
``experiments.training.optimizers``; the parameter shardings from
:func:`partition_spec` in ``experiments.parallel``.

Example::

  params = nnx.state(Transformer(get_preset('tiny'), rngs=nnx.Rngs(0)), nnx.Param)
  axes = logical_axes(params)
  axes['layers/attn_norm/scale']   # ('layers', 'embed')
  matrix_dims(axes['layers/attn_norm/scale'])   # None: a stacked vector
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence, Union

import jax
from flax import nnx

LAYERS, EXPERTS = "layers", "experts"
EMBED, HEADS, MLP, VOCAB = "embed", "heads", "mlp", "vocab"
STACKED_AXES = (LAYERS, EXPERTS)
LOGICAL_AXES = (LAYERS, EXPERTS, EMBED, HEADS, MLP, VOCAB)

# Tier names, equal to skewadam_jax's (the model does not import the optimizer).
BACKBONE, EXPERT, ROUTER = "backbone", "expert", "router"

# Logical axis -> mesh axis. Names absent here stay replicated.
MESH_RULES: Mapping[str, str] = {EXPERTS: "expert"}

Names = tuple[Optional[str], ...]


def partitioned(init, *names: str):
  """``init`` declaring ``names`` as its parameter's logical axes.

  No sharding is applied when the parameter is created (``eager_sharding``
  off): the names are logical, mapped to a mesh only by :func:`partition_spec`.
  """
  return nnx.with_partitioning(init, names, eager_sharding=False)


def param_with_axes(value: jax.Array, *names: str) -> nnx.Param:
  """An ``nnx.Param`` holding ``value`` with logical axes ``names``."""
  return nnx.Param(value, out_sharding=names, eager_sharding=False)


def path_to_str(key_path) -> str:
  """'/'-joined names of a jax key path, without a trailing ``value``."""
  names = []
  for key in key_path:
    for attr in ("key", "name", "idx"):
      if hasattr(key, attr):
        names.append(str(getattr(key, attr)))
        break
    else:
      names.append(str(key))
  if names and names[-1] == "value":
    names.pop()
  return "/".join(names)


def logical_axes(params) -> dict[str, Names]:
  """The declared logical axes of every parameter, by ``/``-joined path.

  Args:
    params: an ``nnx.State`` of ``nnx.Param`` s (concrete or from
      ``nnx.eval_shape``), e.g. ``nnx.split(model, nnx.Param, ...)[1]``.

  Returns:
    ``{path: names}`` in the flattening order of ``params``.

  Raises:
    ValueError: naming the path, for a parameter that declares no axes or
      whose number of names is not its rank.
  """
  is_var = lambda x: isinstance(x, nnx.Variable)
  out = {}
  for path, var in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]:
    name = path_to_str(path)
    names = var.get_metadata().get("out_sharding") if is_var(var) else None
    shape = tuple(getattr(var, "shape", ()))
    if names is None:
      raise ValueError(f"parameter {name!r} (shape {shape}) declares no logical "
                       "axes; create it with models.axes.partitioned or "
                       "param_with_axes.")
    names = tuple(names)
    if len(names) != len(shape):
      raise ValueError(f"parameter {name!r} declares axes {names} for shape {shape}.")
    out[name] = names
  return out


def stacked_prefix(names: Sequence[Optional[str]]) -> int:
  """How many leading axes are stacked (in :data:`STACKED_AXES`)."""
  n = 0
  while n < len(names) and names[n] in STACKED_AXES:
    n += 1
  return n


def matrix_dims(names: Sequence[Optional[str]]) -> Optional[tuple[int, int]]:
  """``(rows, cols)`` of a parameter's matrix, or ``None`` for a vector.

  Example:
    >>> matrix_dims(("layers", "experts", "embed", "mlp"))
    (2, 3)
    >>> matrix_dims(("layers", "embed")) is None
    True

  Raises:
    ValueError: for more than two unstacked axes (no rule says which two
      form the matrix).
  """
  start = stacked_prefix(names)
  own = len(names) - start
  if own > 2:
    raise ValueError(f"axes {tuple(names)}: {own} unstacked axes; a parameter "
                     f"is a vector or a matrix after its {STACKED_AXES} axes.")
  return (start, start + 1) if own == 2 else None


def tier(names: Sequence[Optional[str]]) -> str:
  """``"expert"``, ``"router"`` or ``"backbone"`` from the logical axes.

  Example:
    >>> tier(("layers", "experts", "embed", "mlp")), tier(("layers", "embed", "experts"))
    ('expert', 'router')
  """
  start = stacked_prefix(names)
  if EXPERTS in names[:start]:
    return EXPERT
  dims = matrix_dims(names)
  if dims is not None and names[dims[1]] == EXPERTS:
    return ROUTER
  return BACKBONE


def partition_spec(names: Sequence[Optional[str]], shape: Sequence[int],
                   mesh_sizes: Mapping[str, int], *,
                   fsdp_axis: Optional[Union[str, tuple[str, ...]]] = None,
                   fsdp_experts: bool = False
                   ) -> tuple[Optional[Union[str, tuple[str, ...]]], ...]:
  """Mesh axis per parameter axis (a ``PartitionSpec`` 's entries).

  Each logical name in :data:`MESH_RULES` goes to its mesh axis. With
  ``fsdp_axis`` (e.g. ``"data"``, or ``("data", "expert")`` when the batch is
  split over both) the larger matrix axis still unsplit whose size divides by
  those mesh axes is split over them too, leaving out a mesh axis the leaf
  already uses (an expert bank is split over ``expert`` by its experts, so
  FSDP adds only ``data``): never a stacked axis (the layers are scanned
  over), never a vector (too small to be worth the gathers). With
  ``fsdp_experts`` an expert bank whose ``experts`` axis is still unsplit and
  divides is split along its experts instead: each expert's matrices stay
  whole on a device (the orthogonal direction then iterates them where they
  live), at the same bytes a device.

  Raises:
    ValueError: naming the axis, when a size does not divide by its mesh axis.

  Example:
    >>> partition_spec(("layers", "experts", "embed", "mlp"), (2, 4, 8, 16),
    ...                {"data": 2, "expert": 4}, fsdp_axis="data")
    (None, 'expert', None, 'data')
    >>> partition_spec(("layers", "experts", "embed", "mlp"), (2, 4, 8, 16),
    ...                {"data": 2, "expert": 1}, fsdp_axis="data", fsdp_experts=True)
    (None, 'data', None, None)
  """
  spec = [None] * len(names)
  for i, name in enumerate(names):
    mesh_axis = MESH_RULES.get(name)
    if mesh_axis is None or mesh_axis not in mesh_sizes:
      continue
    if shape[i] % mesh_sizes[mesh_axis]:
      raise ValueError(f"axis {i} ({name!r}, size {shape[i]}) of shape "
                       f"{tuple(shape)} does not divide by the mesh's "
                       f"{mesh_axis}={mesh_sizes[mesh_axis]}")
    spec[i] = mesh_axis
  wanted = (fsdp_axis,) if isinstance(fsdp_axis, str) else tuple(fsdp_axis or ())
  fsdp = tuple(a for a in wanted if a not in spec and mesh_sizes.get(a, 1) > 1)
  size = math.prod(mesh_sizes[a] for a in fsdp)
  if size > 1 and matrix_dims(names) is not None:
    # An experts axis on a mesh axis of size 1 is still whole.
    experts = [i for i in range(stacked_prefix(names)) if names[i] == EXPERTS
               and (spec[i] is None or mesh_sizes[spec[i]] == 1)
               and shape[i] % size == 0] if fsdp_experts else []
    free = experts or [i for i in range(stacked_prefix(names), len(names))
                       if spec[i] is None and shape[i] % size == 0]
    if free:
      spec[max(free, key=lambda i: (shape[i], i))] = fsdp[0] if len(fsdp) == 1 else fsdp
  return tuple(spec)
