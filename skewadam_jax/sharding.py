"""Optimizer-state shardings derived from parameter shardings.

Under SPMD every array of the optimizer state needs a sharding, and it should
follow the parameter it belongs to: an expert bank sharded over the ``expert``
mesh axis wants its momentum and second moment sharded the same way, or every
device ends up holding every expert's state. :func:`state_shardings` derives
them all from the parameters' shardings, without allocating anything
(``jax.eval_shape(tx.init, params)``).

For SkewAdam's state, whose tiers keep each moment under its parameter's path,
the rule follows the encoding. With ``spec`` the parameter's
``PartitionSpec`` over ``[..., R, C]``:

| state array | shape | spec |
|---|---|---|
| exact ``v``, fp32/bf16 ``m``, int8 codes | the parameter's | ``spec`` |
| factored ``row`` (also sign magnitude) | ``[..., R]`` | ``spec[:-1]`` |
| factored ``col`` (also sign magnitude) | ``[..., C]`` | ``spec[:-2] + spec[-1:]`` |
| int8 ``scale`` | ``[..., ceil(C / block)]`` | ``spec``; a shortened axis keeps its entry only if it still divides evenly |
| sign ``bits`` | the parameter's, one axis packed 8 to a byte | ``spec``; a shortened axis keeps its entry only if it still divides evenly |
| ``count``, scalars | ``[]`` | replicated |

A factored statistic drops exactly the axis it reduces over. Blocked and
packed arrays (int8 scales, sign bits) keep the parameter's axes; the axis they
shorten is found by comparing shapes, so the rule does not depend on which axis
an encoding packs. That is what
``optax.tree_map_params`` cannot do: it hands the parameter's sharding to any
state array in the parameter's place, whatever its shape.

Any other optax state (``optax.adamw``'s, the parts of a chain around SkewAdam,
``MultiSteps`` accumulators) is matched by path: an array whose path ends with a
parameter's path and which has that parameter's shape takes its sharding
(``0/mu/layers/moe/experts/w_up`` → ``layers/moe/experts/w_up``). Everything
else — scalars, step counts, injected hyperparameters, statistics of other
shapes such as Adafactor's — is replicated.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from skewadam_jax import encodings
from skewadam_jax import factored
from skewadam_jax import labels as labels_lib
from skewadam_jax import transform

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


def _flatten_params(params, param_shardings) -> dict[str, _Param]:
  """Parameter path → (shape, spec, sharding), checking the two trees agree."""
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
  out = {}
  for path, leaf, sharding in zip(paths, leaves, shard_leaves):
    if not _is_sharding(sharding):
      raise ValueError(
          f"Parameter {path!r} has sharding {sharding!r}; expected a "
          "jax.sharding.NamedSharding or PartitionSpec.")
    shape = tuple(leaf.shape)
    out[path] = _Param(shape, _as_spec(sharding, shape, path), sharding)
  return out


class _Rules:
  """Turns specs into shardings of the requested kind, with the mesh's sizes."""

  def __init__(self, params: dict[str, _Param], mesh):
    kinds = {type(p.sharding) for p in params.values()}
    if len(kinds) > 1:
      raise ValueError("param_shardings mixes NamedSharding and PartitionSpec "
                       "leaves; use one kind.")
    named = kinds == {NamedSharding}
    if mesh is None and named:
      mesh = next(iter(params.values())).sharding.mesh
    if mesh is None and params:
      raise ValueError("PartitionSpec shardings need mesh= (a Mesh or "
                       "AbstractMesh) for the sizes of its axes.")
    self.named = named or (not params and mesh is not None)
    self.mesh = mesh
    self.axis_sizes = dict(mesh.shape) if mesh is not None else {}

  def make(self, spec: Spec, param: Optional[_Param] = None):
    spec = PartitionSpec(*spec)
    if not self.named:
      return spec
    if param is not None:  # keep the parameter's mesh and memory kind
      return NamedSharding(param.sharding.mesh, spec,
                           memory_kind=param.sharding.memory_kind)
    return NamedSharding(self.mesh, spec)

  def replicated(self):
    return self.make(())

  def shortened(self, param: _Param, shape) -> Spec:
    """The spec of an array shaped like ``param`` but with shorter axes.

    An axis the array shares with the parameter keeps its entry; a shortened
    one (int8 blocks, packed sign bits) keeps it only where it still splits
    evenly, since a ``NamedSharding`` must divide every axis it splits.
    """
    sizes = (dict(param.sharding.mesh.shape) if self.named else self.axis_sizes)
    return tuple(
        entry if size == full or size % _axis_size(entry, sizes) == 0 else None
        for entry, size, full in zip(param.spec, shape, param.shape))


def _check_shape(path: str, what: str, got, expected) -> None:
  if tuple(got) != tuple(expected):
    raise ValueError(
        f"SkewAdam state for {path!r}: {what} has shape {tuple(got)}, expected "
        f"{tuple(expected)}; the state was not made for these params.")


def _shortened(path, what: str, array, param: _Param, rules: _Rules):
  """Sharding of a blocked or packed array: no axis longer than the parameter's."""
  shape = tuple(array.shape)
  if len(shape) != len(param.shape) or any(
      s > p for s, p in zip(shape, param.shape)):
    raise ValueError(
        f"SkewAdam state for {path!r}: {what} has shape {shape}, which does "
        f"not fit the parameter's {param.shape} (same rank, no axis longer); "
        "the state was not made for these params.")
  return rules.make(rules.shortened(param, shape), param)


def _factored_shardings(path, moment: factored.FactoredMoment, param: _Param,
                        rules: _Rules) -> factored.FactoredMoment:
  row_shape, col_shape = factored.factored_shapes(param.shape)
  _check_shape(path, "factored row", moment.row.shape, row_shape)
  _check_shape(path, "factored col", moment.col.shape, col_shape)
  spec = param.spec
  # Each statistic is a mean over one axis, so it drops that axis's sharding.
  return factored.FactoredMoment(row=rules.make(spec[:-1], param),
                                 col=rules.make(spec[:-2] + spec[-1:], param))


def _moment_shardings(path: str, moment, param: _Param, rules: _Rules):
  """Shardings for one encoded moment of SkewAdam (``mu[path]`` or ``nu[path]``)."""
  if isinstance(moment, factored.FactoredMoment):
    return _factored_shardings(path, moment, param, rules)
  if isinstance(moment, encodings.Int8Momentum):
    _check_shape(path, "int8 codes", moment.codes.shape, param.shape)
    return encodings.Int8Momentum(
        codes=param.sharding,
        scale=_shortened(path, "int8 scale", moment.scale, param, rules))
  if isinstance(moment, encodings.SignMomentum):
    return encodings.SignMomentum(
        bits=_shortened(path, "sign bits", moment.bits, param, rules),
        magnitude=_factored_shardings(path, moment.magnitude, param, rules))
  if hasattr(moment, "shape") and hasattr(moment, "dtype"):
    _check_shape(path, "dense moment", moment.shape, param.shape)
    return param.sharding
  raise ValueError(f"SkewAdam state for {path!r} has an unknown type "
                   f"{type(moment).__name__}; cannot derive its sharding.")


def _tier_shardings(tier: str, tier_state: transform.TierState, params, rules):
  def per_path(moments: dict) -> dict:
    out = {}
    for path, moment in moments.items():
      if path not in params:
        raise ValueError(
            f"SkewAdam's {tier!r} tier holds state for {path!r}, which is not "
            "a parameter path; pass the params the optimizer was initialised "
            "with.")
      out[path] = _moment_shardings(path, moment, params[path], rules)
    return out
  return transform.TierState(mu=per_path(tier_state.mu),
                             nu=per_path(tier_state.nu))


def _matching_param(path: str, leaf, params: dict[str, _Param]):
  """The parameter whose path ends ``path`` (longest first) with ``leaf``'s shape."""
  parts = path.split("/")
  for start in range(len(parts)):
    param = params.get("/".join(parts[start:]))
    if param is not None and param.shape == tuple(leaf.shape):
      return param
  return None


def state_shardings(tx, params, param_shardings, *, mesh=None):
  """Shardings for the whole state of ``tx``, derived from the parameters'.

  SkewAdam's moments follow their parameter according to their encoding
  (factored statistics drop the axis they reduce over; int8 scales and packed
  sign bits keep the sharding of an axis they shorten only where it still
  divides evenly); the states of other optax transformations follow by path
  and shape; scalars and everything else are replicated. See the module
  docstring for the table. Nothing is allocated: the state's shapes come from
  ``jax.eval_shape(tx.init, params)``.

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
      SkewAdam state holds a path that is not a parameter or an array of the
      wrong shape for its parameter (naming the path).

  Example:
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
    >>> nu = out[0].expert.nu["experts"]   # factored: row [2, 4, 8], col [2, 4, 16]
    >>> nu.row.spec, nu.col.spec
    (P(None, 'expert', None), P(None, 'expert', None))
    >>> out[0].count.spec
    P()
  """
  param_info = _flatten_params(params, param_shardings)
  rules = _Rules(param_info, mesh)
  abstract_state = jax.eval_shape(tx.init, params)
  is_skew = lambda x: isinstance(x, transform.ScaleBySkewAdamState)

  def leaf_sharding(path, leaf):
    if is_skew(leaf):
      return transform.ScaleBySkewAdamState(
          count=rules.replicated(),
          **{tier: _tier_shardings(tier, getattr(leaf, tier), param_info, rules)
             for tier in labels_lib.TIERS})
    param = _matching_param(labels_lib.path_to_str(path), leaf, param_info)
    if param is None or not param.shape:
      return rules.replicated()
    return param.sharding

  return jax.tree_util.tree_map_with_path(leaf_sharding, abstract_state,
                                          is_leaf=is_skew)
