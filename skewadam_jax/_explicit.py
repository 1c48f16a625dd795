"""Reshapes and slices that keep explicit sharding (sharding in types) valid.

Under ``jax.sharding.AxisType.Explicit`` every array's type carries its
``PartitionSpec``, and JAX refuses a reshape or slice of a sharded axis whose
result sharding it cannot infer. The encodings split an axis into blocks and
cut padding off; these helpers say what sharding the result has: a split axis
keeps its mesh axes on the outer part when that still divides evenly, and is
replicated otherwise; a shortened axis is gathered before it is cut. Without
explicit axes (the usual, automatic mode) they are plain ``reshape`` and
slicing.
"""

from __future__ import annotations

import math
from typing import Optional

import jax
from jax.sharding import PartitionSpec


def explicit_spec(x) -> Optional[tuple]:
  """``x``'s spec (one entry per axis) if its mesh has explicit axes, else ``None``."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not any(t == jax.sharding.AxisType.Explicit
                             for t in getattr(mesh, "axis_types", ())):
    return None
  return tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))


def _devices(entry, mesh) -> int:
  names = entry if isinstance(entry, tuple) else (entry,)
  return math.prod(mesh.shape[n] for n in names if n is not None)


def split_axis(x, axis: int, groups: int, size: int):
  """Reshapes ``x``'s ``axis`` (length ``groups * size``) into ``(groups, size)``."""
  shape = x.shape[:axis] + (groups, size) + x.shape[axis + 1:]
  spec = explicit_spec(x)
  if spec is None:
    return x.reshape(shape)
  mesh = jax.typeof(x).sharding.mesh
  entry = spec[axis]
  outer = entry if entry is not None and groups % _devices(entry, mesh) == 0 else None
  out = spec[:axis] + (outer, None) + spec[axis + 1:]
  return jax.lax.reshape(x, shape, out_sharding=PartitionSpec(*out))


def gather_axis(x, axis: int):
  """``x`` with ``axis`` replicated (a no-op unless it is explicitly sharded)."""
  spec = explicit_spec(x)
  if spec is None or spec[axis] is None:
    return x
  return jax.sharding.reshard(x, PartitionSpec(*(spec[:axis] + (None,) + spec[axis + 1:])))


def replicated(x):
  """``x`` with every axis replicated (a no-op unless it is explicitly sharded)."""
  spec = explicit_spec(x)
  if spec is None or all(entry is None for entry in spec):
    return x
  return jax.sharding.reshard(x, PartitionSpec())


def take(x, axis: int, start: int, stop: int):
  """``x`` restricted to ``start:stop`` along ``axis`` (gathered first if sharded)."""
  if (start, stop) == (0, x.shape[axis]):
    return x
  return jax.lax.slice_in_dim(gather_axis(x, axis), start, stop, axis=axis)


def like(x, ref):
  """``x`` resharded to ``ref``'s explicit sharding (no-op when it has none)."""
  spec = explicit_spec(ref)
  if spec is None or explicit_spec(x) == spec:
    return x
  return jax.sharding.reshard(x, PartitionSpec(*spec))
