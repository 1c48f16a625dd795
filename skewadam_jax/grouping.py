"""Leaf grouping and the state's layout: stacked groups, a leaf's state at step 0, its checks.

Leaves of one plan, shape and dtype are stepped together, stacked
(:func:`leaf_groups`, :func:`_step_group`), and with
``group_leaves="stacked"`` their state is kept stacked at the group's first
leaf (:func:`_init_parts`). A leaf's state at step 0 is made by the step's
own operations under ``jax.eval_shape`` (:func:`_fresh_parts`), and
``update`` checks the state it is given against it (:func:`_check_parts`,
:func:`_check_group_parts`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skewadam_jax import _explicit
from skewadam_jax import axes as axes_lib
from skewadam_jax import encodings
from skewadam_jax import factored
from skewadam_jax import orthogonal
from skewadam_jax.moments import _is_masked
from skewadam_jax.moments import _square
from skewadam_jax.moments import is_placeholder
from skewadam_jax.tiers import FIELDS
from skewadam_jax.tiers import LeafPlan
from skewadam_jax.tiers import _is_complex


# Leaves of one plan, shape and dtype are stepped together, stacked on a new
# leading axis, in groups of at most this many entries (64 MB of float32, the
# Newton–Schulz chunk's bound): the compiled program then grows with the
# number of distinct plans, not of leaves (a Hugging Face tree holds one leaf
# per expert matrix), while the stacked copy a group costs stays bounded.
GROUP_MAX_ELEMENTS = orthogonal.AUTO_CHUNK_ELEMENTS

# ``scale_by_skewadam(group_leaves=STACKED)``: groups stepped stacked, their state kept so.
STACKED = "stacked"


def _init_stacks_state(group_leaves) -> bool:
  """Whether ``init`` keeps each group's state stacked: ``"stacked"`` or ``"auto"``, on every backend."""
  return group_leaves in (STACKED, "auto")


def _holds_stacked_groups(groups: list[list[int]], parts: list[dict]) -> bool:
  """Whether a state was laid out with each group stacked at its first leaf.

  Such a state holds ``optax.MaskedNode`` in a group's later leaves, which a
  per-leaf state never does (a field a leaf does not use is a ``bool[1]``
  placeholder there); whether the rest agrees is checked leaf by leaf after.
  """
  return any(_is_masked(parts[indices[1]][name])
             for indices in groups if len(indices) > 1 for name in FIELDS)


def leaf_groups(plans, leaves, max_elements: Optional[int] = GROUP_MAX_ELEMENTS
                ) -> list[list[int]]:
  """Indices of the leaves :func:`scale_by_skewadam` steps together, in order of first leaf.

  A group's leaves share their :class:`LeafPlan`, shape and dtype and hold at
  most ``max_elements`` entries together; a leaf larger than half of it, or
  explicitly sharded (its stack could not keep its sharding), is a group of
  its own. ``max_elements=None``: every leaf alone.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import skewadam_jax
    >>> tree = {"a": jnp.zeros((4, 4)), "b": jnp.zeros((4, 4)), "c": jnp.zeros((4, 8))}
    >>> plans = skewadam_jax.leaf_plans(tree, param_labels="expert")
    >>> skewadam_jax.transform.leaf_groups(plans, jax.tree.leaves(tree))
    [[0, 1], [2]]
  """
  groups: dict[Any, list[list[int]]] = {}
  order: list[list[int]] = []
  for i, (plan, leaf) in enumerate(zip(plans, leaves)):
    size = math.prod(leaf.shape)
    if (max_elements is None or 2 * size > max_elements
        or _explicit.explicit_spec(leaf) is not None):
      order.append([i])
      continue
    runs = groups.setdefault((plan, tuple(leaf.shape), jnp.dtype(leaf.dtype)), [])
    if not runs or (len(runs[-1]) + 1) * size > max_elements:
      runs.append([])
      order.append(runs[-1])
    runs[-1].append(i)
  return order


def _stacked_plan(plan: LeafPlan) -> LeafPlan:
  """``plan`` for its leaves stacked on a new leading (batch) axis."""
  if plan.axes is None:
    return plan
  shift = lambda side: side + 1 if isinstance(side, int) else tuple(a + 1 for a in side)  # noqa: E731
  axes = plan.axes
  encoding = plan.encoding
  if isinstance(encoding, encodings.LowRankEncoding):  # each leaf's own starting subspace
    encoding = dataclasses.replace(encoding, stacked=encoding.stacked + 1)
  return plan._replace(encoding=encoding, axes=axes_lib.MatrixAxes(
      shift(axes.rows), shift(axes.cols), None if axes.layer is None else axes.layer + 1))


def _unstack(stacked, n: int, anchor: jax.Array) -> list:
  """``[tree_map(lambda x: x[j], stacked) for j in range(n)]``, sliced as each compiler prefers.

  XLA:CPU compiles a slice at a constant offset as a kernel of its own (2.1 s
  for the 96 slices of one ``[96, 64, 128]`` array), but slices at offsets it
  only knows at run time as one kernel, compiled once and reused (0.3 s). So
  on the CPU the offsets come out of a sort whose keys depend on ``anchor``
  (any traced integer scalar) but are ascending whatever its value: exact,
  and opaque to constant folding. XLA:GPU compiles the sort slowly (2.8 s
  for 96 offsets) and constant slices well, so it gets those.
  """
  def at_runtime_offsets():
    keys = jnp.minimum(anchor.astype(jnp.int32), 0) + jnp.arange(2, dtype=jnp.int32)
    offsets = []
    for start in range(0, n, 32):  # sorts of 32 offsets: one kernel, however many groups
      payloads = tuple(np.full((2,), j, np.int32) for j in range(start, min(n, start + 32)))
      offsets += [p[0] for p in jax.lax.sort((keys, *payloads), num_keys=1)[1:]]
    take = lambda x, o: jax.lax.dynamic_index_in_dim(  # noqa: E731
        x, o, keepdims=False, allow_negative_indices=False)  # the offsets are in range
    return [jax.tree.map(lambda x, o=o: take(x, o), stacked) for o in offsets]
  return jax.lax.platform_dependent(
      cpu=at_runtime_offsets,
      default=lambda: [jax.tree.map(lambda x, j=j: x[j], stacked) for j in range(n)])


def _step_group(indices: list[int], grads, plans, parts, step, anchor,
                state_stacked: bool = False) -> dict:
  """``{i: step(plans[i], grads[i], parts[i])}`` for a group, in one stacked step.

  ``anchor``: a traced integer scalar (the step count), for :func:`_unstack`.
  ``state_stacked``: the group's state is already stacked, in its first
  leaf's parts (``group_leaves="stacked"``), and its new state stays so: only
  the gradients are stacked and only the updates sliced.
  """
  if len(indices) == 1:
    i = indices[0]
    return {i: step(plans[i], grads[i], parts[i])}
  first = parts[indices[0]]
  stacked = first if state_stacked else {
      name: first[name] if is_placeholder(first[name])
      else jnp.stack([parts[i][name] for i in indices]) for name in FIELDS}
  # Barriers on both sides keep XLA from fusing the stacking into, and the
  # step into, each of the group's slices (XLA:GPU, 126-leaf tree: 32.4 s to
  # trace and compile without them, 16.0 s with them, 28.8 s ungrouped).
  g, stacked = jax.lax.optimization_barrier(
      (jnp.stack([grads[i] for i in indices]), stacked))
  update, new = jax.lax.optimization_barrier(
      step(_stacked_plan(plans[indices[0]]), g, stacked))
  if state_stacked:
    updates = _unstack(update, len(indices), anchor)
    return {i: (u, new if i == indices[0] else {}) for i, u in zip(indices, updates)}
  return dict(zip(indices, _unstack((update, new), len(indices), anchor)))


def _stacked_leaf(indices: list[int], leaves) -> jax.ShapeDtypeStruct:
  """The shape and dtype of a group's leaves stacked on a new leading axis."""
  first = leaves[indices[0]]
  return jax.ShapeDtypeStruct((len(indices),) + tuple(first.shape), first.dtype)


def _init_parts(plans, leaves, state_stacked: bool) -> list[dict]:
  """Each leaf's state at step 0; with ``state_stacked`` each group's in its first leaf's place."""
  if not state_stacked:
    return [_init_leaf(plan, leaf) for plan, leaf in zip(plans, leaves)]
  # The group's other leaves hold nothing: optax.MaskedNode, as under optax.masked.
  # A bool[1] placeholder in each of their fields would be a program input and an
  # output (a copy) each, seven a leaf: on the bench's 501-leaf tree they cost XLA
  # about as much compile time again as the whole of AdamW's update.
  per_leaf = [dict.fromkeys(FIELDS, optax.MaskedNode()) for _ in leaves]
  for indices in leaf_groups(plans, leaves):
    i = indices[0]
    per_leaf[i] = (_init_leaf(plans[i], leaves[i]) if len(indices) == 1 else
                   _init_leaf(_stacked_plan(plans[i]), _stacked_leaf(indices, leaves)))
  return per_leaf


def _check_group_parts(paths, indices, plans, grads, parts) -> None:
  """:func:`_check_parts` for a group whose state is stacked in its first leaf's place."""
  first = indices[0]
  _check_parts(f"{paths[first]} (stacked with the {len(indices) - 1} leaves after it)",
               _stacked_plan(plans[first]), _stacked_leaf(indices, grads), parts[first])
  for i in indices[1:]:
    held = [name for name in FIELDS if not _is_masked(parts[i][name])]
    if held:
      raise ValueError(
          f"SkewAdam state for {paths[i]!r} holds {held}, but with "
          f"group_leaves='stacked' its group's state is stacked at {paths[first]!r} "
          "and it holds optax.MaskedNode: the state was made with another "
          "group_leaves, or the tree changed between init and update.")


def _fresh_parts(plan: LeafPlan, leaf) -> dict:
  """The leaf's state at step 0, computed by the step's own operations.

  Used under ``jax.eval_shape`` only: the result's shapes, dtypes and (under
  explicit sharding) shardings are exactly those ``update`` produces.
  """
  zeros = jnp.zeros_like(leaf, jnp.complex64 if _is_complex(leaf) else jnp.float32)
  parts = {}
  if plan.encoding is not None:
    parts.update(plan.encoding.encode(zeros, plan.axes))
  if plan.factored:
    row, col = factored.row_col_means(_square(zeros), plan.axes)
    parts.update(nu_row=row.astype(plan.nu_dtype), nu_col=col.astype(plan.nu_dtype))
  elif plan.neuron_b2 is not None:  # one value per output column of each matrix
    parts["nu_col"] = factored.row_col_means(_square(zeros), plan.axes)[1].astype(jnp.float32)
  elif not plan.orthogonal:
    parts["nu"] = _square(zeros).astype(plan.nu_dtype)
  return parts


def _zeros_like_abstract(x: jax.ShapeDtypeStruct) -> jax.Array:
  sharding = getattr(x, "sharding", None)
  if sharding is not None and _explicit.explicit_spec(x) is not None:
    return jnp.zeros(x.shape, x.dtype, out_sharding=sharding)
  return jnp.zeros(x.shape, x.dtype)


def _abstract_leaf(leaf):
  """A ``ShapeDtypeStruct`` of ``leaf`` with its sharding type (for eval_shape)."""
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return leaf
  return jax.typeof(leaf) if isinstance(leaf, jax.Array) else jax.ShapeDtypeStruct(
      leaf.shape, leaf.dtype)


def _init_leaf(plan: LeafPlan, leaf) -> dict:
  abstract = jax.eval_shape(lambda p: _fresh_parts(plan, p), _abstract_leaf(leaf))
  return {name: _zeros_like_abstract(x) for name, x in abstract.items()}


@functools.lru_cache(maxsize=4096)
def _expected_parts(plan: LeafPlan, shape: tuple, dtype) -> dict:
  return jax.eval_shape(lambda p: _fresh_parts(plan, p), jax.ShapeDtypeStruct(shape, dtype))


def _check_parts(path: str, plan: LeafPlan, leaf, parts: dict) -> None:
  """Raises if a leaf's state is not what ``plan`` makes for it (naming the path)."""
  if _explicit.explicit_spec(leaf) is None:  # one eval_shape per plan, shape and dtype
    expected = _expected_parts(plan, tuple(leaf.shape), jnp.dtype(leaf.dtype))
  else:
    expected = jax.eval_shape(lambda p: _fresh_parts(plan, p), _abstract_leaf(leaf))
  for name in FIELDS:
    got = parts[name]
    want = expected.get(name)
    if _is_masked(got):
      raise ValueError(
          f"SkewAdam state for {path!r} holds optax.MaskedNode in field {name!r}, as a "
          "state made with group_leaves='stacked' does for a group's later leaves, but "
          "this update steps the leaf with its own state: group_leaves and the tree must "
          "not change between init and update.")
    want_shape, want_dtype = ((1,), jnp.dtype(jnp.bool_)) if want is None else (
        tuple(want.shape), jnp.dtype(want.dtype))
    if want is None and tuple(got.shape) == (1,):
      continue  # a placeholder, passed through whatever its dtype
    if tuple(got.shape) != want_shape or jnp.dtype(got.dtype) != want_dtype:
      second = ("per-neuron (normalized orthogonal)" if plan.neuron_b2 is not None else
                "none (orthogonal direction)" if plan.orthogonal else
                f"{'factored' if plan.factored else 'exact'} ({plan.nu_dtype.name})")
      what = (f"momentum {plan.encoding.name if plan.encoding else 'none'}, "
              f"second moment {second}, matrix axes {plan.axes}")
      raise ValueError(
          f"SkewAdam state for {path!r} does not match its configuration "
          f"({what}) and the update's shape {tuple(leaf.shape)}: field {name!r} "
          f"is {jnp.dtype(got.dtype).name}{list(got.shape)}, expected "
          f"{want_dtype.name}{list(want_shape)}. Labels, matrix axes, tier "
          "configs, group_leaves='stacked' (or not) and the tree must not change "
          "between init and update.")
