"""Optimizer-state shardings derived from parameter shardings.

Under SPMD every array of the optimizer state needs a sharding, and it should
follow the parameter it belongs to: an expert bank sharded over the ``expert``
mesh axis wants its momentum and second moment sharded the same way, or every
device ends up holding every expert's state. :func:`state_shardings` derives
them all from the parameters' shardings, without allocating anything
(``jax.eval_shape(tx.init, params)``).

Every optax state that is shaped like the parameters (SkewAdam's fields,
``optax.adamw``'s ``mu``/``nu``, ``MultiSteps`` accumulators) is found with
``optax.tree.map_params``, and each of its leaves follows its parameter axis
for axis. With ``spec`` the parameter's ``PartitionSpec``:

| state array | shape | spec |
|---|---|---|
| exact ``v``, fp32/bf16 ``m``, int8 codes | the parameter's | ``spec`` |
| factored ``nu_row`` / ``nu_col``, sign ``mu_row`` / ``mu_col`` | one matrix axis reduced to 1 | ``spec`` with that axis replicated |
| int8 ``mu_scale``, sign bits | one axis shortened (blocks, 8 bits a byte) | ``spec``; the shortened axis keeps its entry only if it still divides evenly |
| a group's stacked state (``group_leaves="stacked"``, at its first leaf) | one more leading axis | ``None``, then as above for the rest |
| placeholders ``bool[1]``, counts, scalars, anything of another rank | | replicated |

The rule reads only shapes: an axis as long as the parameter's keeps its
entry, an axis of length 1 (reduced) is replicated, a shortened axis keeps its
entry where a ``NamedSharding`` can still split it. It is the sharding the
same arrays get under explicit sharding (sharding in types), where JAX derives
it from the operations themselves.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

import optax

from skewadam_jax import labels as labels_lib

Spec = tuple  # a PartitionSpec as a tuple with one entry per array axis


class _Param(NamedTuple):
  """What the state rules need to know about one parameter."""
  shape: tuple
  spec: Spec
  sharding: Any  # the parameter's own NamedSharding or PartitionSpec


def _is_sharding(x) -> bool:
  return isinstance(x, (NamedSharding, PartitionSpec))


def _axis_size(entry, axis_sizes) -> int:
  """Devices an array axis is split over: the product of its mesh axes."""
  names = entry if isinstance(entry, tuple) else (entry,)
  names = [n for n in names if isinstance(n, str)]  # None, P.UNCONSTRAINED: 1
  unknown = [n for n in names if n not in axis_sizes]
  if unknown:
    raise ValueError(f"Mesh axes {unknown} are not in the mesh {dict(axis_sizes)}.")
  return math.prod(axis_sizes[name] for name in names)


def _as_spec(sharding, shape, path: str) -> Spec:
  """The sharding's PartitionSpec with exactly one entry per axis of ``shape``."""
  spec = tuple(sharding.spec if isinstance(sharding, NamedSharding) else sharding)
  if len(spec) > len(shape):
    raise ValueError(
        f"Parameter {path!r} has shape {tuple(shape)} but its sharding has "
        f"{len(spec)} entries: {PartitionSpec(*spec)}.")
  # Trailing axes a PartitionSpec leaves out are replicated.
  return spec + (None,) * (len(shape) - len(spec))


def _flatten_params(params, param_shardings) -> tuple[list[str], list[_Param]]:
  """Paths and (shape, spec, sharding) of the parameters, checking the two trees agree."""
  paths, leaves, _ = labels_lib.flatten_with_paths(params)
  shard_leaves = jax.tree.leaves(param_shardings, is_leaf=_is_sharding)
  shard_paths = [labels_lib.path_to_str(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(
                     param_shardings, is_leaf=_is_sharding)[0]]
  if shard_paths != paths:
    missing = sorted(set(paths) - set(shard_paths))
    extra = sorted(set(shard_paths) - set(paths))
    detail = (f"no sharding for {missing[:3]}" if missing else
              f"shardings for paths not in the parameters {extra[:3]}" if extra
              else "leaves are in a different order")
    raise ValueError("param_shardings does not match the parameter tree: "
                     f"{detail} ({len(shard_leaves)} shardings for "
                     f"{len(leaves)} parameters).")
  out = []
  for path, leaf, sharding in zip(paths, leaves, shard_leaves):
    if not _is_sharding(sharding):
      raise ValueError(
          f"Parameter {path!r} has sharding {sharding!r}; expected a "
          "jax.sharding.NamedSharding or PartitionSpec.")
    shape = tuple(leaf.shape)
    out.append(_Param(shape, _as_spec(sharding, shape, path), sharding))
  return paths, out


def _mesh_sizes(params: list[_Param], mesh) -> dict:
  kinds = {type(p.sharding) for p in params}
  if len(kinds) > 1:
    raise ValueError("param_shardings mixes NamedSharding and PartitionSpec "
                     "leaves; use one kind.")
  if mesh is None and kinds == {NamedSharding}:
    mesh = params[0].sharding.mesh
  if mesh is None and params:
    raise ValueError("PartitionSpec shardings need mesh= (a Mesh or "
                     "AbstractMesh) for the sizes of its axes.")
  return dict(mesh.shape) if mesh is not None else {}


def _follow(leaf, param: _Param, sizes: dict, path: str) -> Spec:
  """The spec of a state array that belongs to ``param`` (see the module docstring)."""
  shape = tuple(leaf.shape)
  placeholder = shape == (1,) and getattr(leaf, "dtype", None) == jnp.bool_
  if (not placeholder and len(shape) == len(param.shape) + 1  # a group stacked on axis 0
      and all(s <= p for s, p in zip(shape[1:], param.shape))):
    return (None,) + _follow(jax.ShapeDtypeStruct(shape[1:], leaf.dtype), param, sizes, path)
  if placeholder or len(shape) != len(param.shape) or math.prod(shape) == 0:
    return ()
  if any(s > p for s, p in zip(shape, param.shape)):
    raise ValueError(
        f"State array {shape} for parameter {path!r} {param.shape} has an axis "
        "longer than the parameter's; the state was not made for these params.")
  return tuple(
      entry if size == full else
      None if size == 1 else
      entry if size % _axis_size(entry, sizes) == 0 else None
      for entry, size, full in zip(param.spec, shape, param.shape))


def state_shardings(tx, params, param_shardings, *, mesh=None):
  """Shardings for the whole state of ``tx``, derived from the parameters'.

  Every state array in a tree shaped like the parameters follows its
  parameter axis for axis (reduced axes replicated, shortened axes split only
  where they still divide evenly); counts, scalars and everything else are
  replicated. See the module docstring for the table. Nothing is allocated:
  the state's shapes come from ``jax.eval_shape(tx.init, params)``.

  Args:
    tx: any optax ``GradientTransformation``: SkewAdam, optax's optimizers, or
      chains and wrappers (``MultiSteps``, ``inject_hyperparams``, ...)
      containing them.
    params: the parameters ``tx`` is initialised with, or a matching tree of
      ``jax.ShapeDtypeStruct``.
    param_shardings: a tree with the structure of ``params`` whose leaves are
      all ``NamedSharding`` or all ``PartitionSpec``.
    mesh: a ``Mesh`` or ``AbstractMesh`` giving the axis sizes; required for
      ``PartitionSpec`` leaves, taken from the first ``NamedSharding``
      otherwise.

  Returns:
    A tree with the structure of ``tx.init(params)``, ready for
    ``jax.jit(..., out_shardings=...)``: ``NamedSharding`` leaves (each on its
    parameter's mesh and memory kind), or ``PartitionSpec`` leaves when
    ``param_shardings`` holds ``PartitionSpec`` s.

  Raises:
    ValueError: if ``param_shardings`` does not match ``params`` (naming the
      first missing path), a spec has more entries than its parameter has
      axes (naming the path), ``PartitionSpec`` s come without ``mesh``, or a
      state array has an axis longer than its parameter's (naming the path).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
    >>> import skewadam_jax
    >>> mesh = AbstractMesh((2, 4), ("data", "expert"))
    >>> params = {"embed": jax.ShapeDtypeStruct((32, 8), jnp.float32),
    ...           "experts": jax.ShapeDtypeStruct((2, 4, 8, 16), jnp.float32)}
    >>> shardings = {"embed": NamedSharding(mesh, P()),
    ...              "experts": NamedSharding(mesh, P(None, "expert"))}
    >>> tx = skewadam_jax.skewadam(1e-3)
    >>> out = skewadam_jax.state_shardings(tx, params, shardings)
    >>> tuple(out[0].nu_row["experts"].spec)   # [2, 4, 8, 1]
    (None, 'expert', None, None)
    >>> tuple(out[0].count.spec)
    ()
  """
  paths, param_list = _flatten_params(params, param_shardings)
  sizes = _mesh_sizes(param_list, mesh)
  named = bool(param_list) and isinstance(param_list[0].sharding, NamedSharding)
  default_mesh = mesh if mesh is not None else (param_list[0].sharding.mesh if named else None)
  if not param_list and mesh is not None:
    named = True

  def make(spec: Spec, param: Optional[_Param] = None):
    spec = PartitionSpec(*spec)
    if not named:
      return spec
    if param is not None:  # keep the parameter's mesh and memory kind
      return NamedSharding(param.sharding.mesh, spec, memory_kind=param.sharding.memory_kind)
    return NamedSharding(default_mesh, spec)

  _, treedef = jax.tree.flatten(params)
  index_tree = treedef.unflatten(range(len(param_list)))
  abstract_state = jax.eval_shape(tx.init, params)

  def follow(leaf, index):
    if isinstance(leaf, optax.MaskedNode):  # optax.masked / partition: no state here
      return leaf
    param = param_list[index]
    return make(_follow(leaf, param, sizes, paths[index]), param)

  return optax.tree.map_params(
      tx, follow, abstract_state, index_tree,
      transform_non_params=lambda subtree: jax.tree.map(lambda _: make(()), subtree),
      is_leaf=lambda x: isinstance(x, optax.MaskedNode))
