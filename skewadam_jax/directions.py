"""A leaf's update direction: the orthogonal direction's step, and the step that picks.

:func:`_step_leaf` steps one leaf (or a stacked group) in its plan's
direction: Adam's (:func:`skewadam_jax.moments._adam_step`, then update
clipping where the plan asks for it) or the orthogonal one
(:func:`_orthogonal_step`: the stored momentum's Nesterov mix through
Newton–Schulz, :mod:`skewadam_jax.orthogonal`, one layer slice and chunk of
matrices at a time, optionally spread over owner devices).

Examples:
  >>> import jax.numpy as jnp
  >>> from skewadam_jax import directions, grouping, moments, tiers
  >>> g = jnp.diag(jnp.array([3.0, 0.5]))
  >>> plan, = tiers.leaf_plans({"w": g}, param_labels="backbone",
  ...                          backbone={"direction": "orthogonal", "momentum": "fp32"})
  >>> parts = dict.fromkeys(tiers.FIELDS, moments._placeholder()) | grouping._init_leaf(plan, g)
  >>> update, new = directions._step_leaf(plan, g, parts, b1=(0.9, 0.1), count=1,
  ...                                     contain_nonfinite=True, clip=None)
  >>> float(g[0, 0] / g[1, 1]), 0.5 < float(update[0, 0] / update[1, 1]) < 2  # ~orthogonal
  (6.0, True)
  >>> sorted(new)  # the momentum only: an orthogonalised matrix stores no second moment
  ['mu']
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from skewadam_jax import _explicit
from skewadam_jax import axes as axes_lib
from skewadam_jax import encodings
from skewadam_jax import orthogonal
from skewadam_jax.moments import _adam_step
from skewadam_jax.moments import _decay
from skewadam_jax.moments import is_placeholder
from skewadam_jax.safety import LARGE_LEAF_ELEMENTS
from skewadam_jax.safety import _clip_rms
from skewadam_jax.safety import _leaf_clip_threshold
from skewadam_jax.safety import finite_entries
from skewadam_jax.tiers import THROUGH_FACTORS
from skewadam_jax.tiers import LeafPlan


def _step_leaf(plan: LeafPlan, g, parts: dict, *, clip_threshold=None, **step):
  """One leaf's step; returns (update in ``g``'s dtype, new parts).

  ``step``: :func:`_adam_step`'s other arguments. Where a large leaf's update
  is clipped (:func:`_leaf_clip_threshold`, :data:`LARGE_LEAF_ELEMENTS`), its
  RMS is taken, off the CPU, of a second computation of the update from the
  same inputs, behind an optimisation barrier: each pass then reads the
  gradient and the state again, where XLA:GPU would store the whole float32
  update between the RMS and the division (``moe-6.78b``'s update: 24.8
  bytes moved a parameter against 36.5; a [16, 1024, 1024] leaf: 19.1
  against 34.6; below about 4M entries XLA:GPU fuses the one computation,
  and a second would only add reads). XLA:CPU keeps the one computation.
  """
  if plan.orthogonal:
    return _orthogonal_step(plan, g, parts, b1=step["b1"], count=step["count"],
                            contain_nonfinite=step["contain_nonfinite"], clip=step["clip"])
  update, new = _adam_step(plan, g, parts, **step)
  threshold = _leaf_clip_threshold(plan, clip_threshold)
  if threshold is not None and math.prod(g.shape) >= LARGE_LEAF_ELEMENTS:
    def twice():
      probe, _ = _adam_step(plan, *jax.lax.optimization_barrier((g, parts)), **step)
      return _clip_rms(update, plan, threshold, rms_of=probe)
    # XLA:CPU's reductions are its slow loops: a second pass costs more there
    # than the stored update it saves.
    update = jax.lax.platform_dependent(
        update, cpu=lambda u: _clip_rms(u, plan, threshold), default=lambda u: twice())
  else:
    update = _clip_rms(update, plan, threshold)
  return update.astype(g.dtype), new


def _owner_devices(mesh_axes) -> int:
  """How many devices the context mesh has over ``mesh_axes`` (1 without a context mesh)."""
  if not mesh_axes:
    return 1
  mesh = jax.sharding.get_abstract_mesh()
  if mesh is None or mesh.empty:
    return 1
  missing = [a for a in mesh_axes if a not in mesh.axis_names]
  if missing:
    raise ValueError(f"orthogonal_owner_axes names mesh axes {missing} that the context mesh "
                     f"(axes {tuple(mesh.axis_names)}) does not have.")
  return math.prod(mesh.shape[a] for a in mesh_axes)


def _spread_over(x, *, axis: int, mesh_axes: tuple[str, ...]):
  """``x`` with ``axis`` split over ``mesh_axes`` and every other axis whole on a device."""
  spec = [None] * x.ndim
  spec[axis] = mesh_axes[0] if len(mesh_axes) == 1 else tuple(mesh_axes)
  if _explicit.explicit_spec(x) is not None:
    return jax.sharding.reshard(x, jax.sharding.PartitionSpec(*spec))
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*spec))


def _orthogonal_step(plan: LeafPlan, g, parts: dict, *, b1, count=None,
                     contain_nonfinite=False, clip=None):
  """An orthogonalised matrix's step: its momentum stored, Muon's direction returned.

  The Nesterov mix ``b1·m_t + (1 − b1)·g_t`` is not bias-corrected. The
  Newton–Schulz iteration normalises its input, so a common factor would not
  matter, but ``optax.contrib.muon`` corrects the two terms by different
  factors (``1 − b1^(t+1)`` and ``1 − b1^t``): the directions differ in the
  first steps (about 9 % at step 2 with b1 = 0.9) and agree once ``b1^t`` is
  negligible. A leaf stacked
  over two or more batch axes (layers × experts) is stepped one slice of its
  declared layer axis (``MatrixAxes.layer``; else its first batch axis) at a
  time, so that the iteration's float32 temporaries are one layer's bank,
  not the whole stack's (26 GB a copy at ``moe-6.78b``). Within a slice (or a
  leaf with one batch axis) the next batch axis is stepped in chunks of
  ``plan.orthogonal_chunk`` matrices (:func:`~skewadam_jax.orthogonal.map_in_chunks`:
  strided, so an expert-sharded bank is not gathered), the momentum's decode
  and encode inside the chunk too, so the working set is a chunk's.
  ``clip`` is applied inside the loops, so they read the raw gradient, not a
  clipped copy of the whole stack.
  """
  names = [] if plan.encoding is None else [
      n for n in encodings.MOMENTUM_FIELDS if not is_placeholder(parts[n])]
  if plan.neuron_b2 is not None:
    names.append("nu_col")
  b1, c1 = b1
  b2n, c2n = (None, None) if plan.neuron_b2 is None else _decay(plan.neuron_b2)

  def step(g_s, momentum, axes, spread=None):
    if clip is not None:
      g_s = clip(g_s)
    g32 = g_s.astype(jnp.float32)
    if contain_nonfinite:
      g32 = finite_entries(g32)
    new = {}
    if plan.encoding is None:
      nesterov = g32
    else:
      m = c1 * g32 + b1 * plan.encoding.decode(momentum, axes)
      nesterov = b1 * m + c1 * g32
      new = plan.encoding.encode(m, axes, salt=count, previous=momentum)
    if spread is not None:
      nesterov = spread(nesterov)
    if plan.lowrank_orthogonalise in THROUGH_FACTORS:
      update = plan.encoding.orthogonalise(new, nesterov, axes, dtype=plan.orthogonal_dtype)
      if plan.lowrank_orthogonalise == "factors_rms":
        rows, cols = orthogonal.matrix_sides(nesterov.shape, axes)
        update = update * math.sqrt(min(rows, cols) / min(plan.encoding.rank, rows, cols))
    else:
      update = orthogonal.newton_schulz(nesterov, axes, dtype=plan.orthogonal_dtype)
    if spread is not None:
      # Pinned on both sides, the iteration stays where the matrices are whole
      # (else XLA may reshard its input back to the consumers' layout first).
      update = spread(update)
    if plan.neuron_b2 is not None:
      update, new["nu_col"] = orthogonal.normalize_per_neuron(
          update, momentum["nu_col"], axes, b2n, c2n)
    if plan.lowrank_complement is not None and plan.lowrank_complement != 1.0:
      kept = plan.encoding.project(new, update, axes)
      update = kept + plan.lowrank_complement * (update - kept)
    update = update * (orthogonal.width_scale(g_s.shape, axes)
                       if plan.orthogonal_scale == "width"
                       else orthogonal.adam_rms_scale(g_s.shape, axes))
    return update.astype(g.dtype), new

  def chunked(g_s, momentum, axes):
    matrix = axes.row_axes + axes.col_axes
    inner_batch = [a for a in range(g_s.ndim) if a not in matrix]
    if not inner_batch:
      return step(g_s, momentum, axes)
    rows, cols = orthogonal.matrix_sides(g_s.shape, axes)
    owners = _owner_devices(plan.orthogonal_owner_axes)
    # The owners split the first batch axis they divide: a group of stacked banks
    # (grouping.py: a leading axis of 2 or 3 banks) is chunked along its experts.
    owned = [a for a in inner_batch if g_s.shape[a] % owners == 0] if owners > 1 else []
    axis, spread = (owned or inner_batch)[0], None
    count = g_s.shape[axis]
    if owned:
      # Each owner device whole matrices of every chunk (strided, so the chunk's
      # members are any of the stack's); the other batch axes come whole.
      along = math.prod(g_s.shape[a] for a in inner_batch if a != axis)
      size = owners * orthogonal.chunk_size(count // owners, rows * cols * along,
                                            plan.orthogonal_chunk)
      spread = functools.partial(_spread_over, axis=axis, mesh_axes=plan.orthogonal_owner_axes)
    else:
      size = orthogonal.chunk_size(count, rows * cols, plan.orthogonal_chunk)
    return orthogonal.map_in_chunks(lambda t: step(*t, axes, spread), (g_s, momentum),
                                    axis, size)

  matrix = plan.axes.row_axes + plan.axes.col_axes
  batch = [a for a in range(g.ndim) if a not in matrix]
  momentum = {n: parts[n] for n in names}
  if len(batch) < 2:
    return chunked(g, momentum, plan.axes)
  outer = batch[0] if plan.axes.layer is None else plan.axes.layer
  shift = lambda side: (side - (side > outer) if isinstance(side, int)  # noqa: E731
                        else tuple(a - (a > outer) for a in side))
  inner = axes_lib.MatrixAxes(shift(plan.axes.rows), shift(plan.axes.cols))
  to_front = lambda x: jnp.moveaxis(x, outer, 0)

  # The gradient stack is the loop's carry and each layer's update overwrites
  # its own gradient slice: XLA updates a carry in place, so the updates take
  # no bank-sized buffer of their own (lax.map's stacked output would: 4.4 GB
  # a bank at moe-6.78b, all of them live until the parameter write).
  def one_layer(stack, xs):
    index, momentum_slice = xs
    update_slice, new_slice = chunked(
        jax.lax.dynamic_index_in_dim(stack, index, keepdims=False), momentum_slice, inner)
    return jax.lax.dynamic_update_index_in_dim(stack, update_slice, index, 0), new_slice

  stack = to_front(g)
  update, new = jax.lax.scan(
      one_layer, stack,
      (jnp.arange(stack.shape[0]), {n: to_front(x) for n, x in momentum.items()}))
  back = lambda x: jnp.moveaxis(x, 0, outer)
  return back(update), {n: back(x) for n, x in new.items()}
