"""Factored (rank-one) statistics over two declared axes of a tensor.

For a tensor ``x`` whose matrix axes are ``(rows, cols)`` (see
:class:`~skewadam_jax.axes.MatrixAxes`; every other axis is a batch axis) the
row statistic is the mean over the columns and the column statistic the mean
over the rows, both kept with the reduced axis as length 1::

    row[..., i, 0] = mean_j x[..., i, j]        col[..., 0, j] = mean_i x[..., i, j]

(drawn for ``rows, cols = -2, -1``), and the rank-one reconstruction is::

    x̂[..., i, j] = row[..., i, 0] * col[..., 0, j] / mean_i row[..., i, 0]

which is exact when ``x`` is a non-negative rank-one matrix, and always has the
same row and column means as ``x``. Each matrix on the batch axes is factored
on its own. This is Adafactor's estimator (Shazeer & Stern, 2018) restricted
to *declared* axes; optax's Adafactor instead factors the two largest axes,
which for an expert bank ``[E, d_in, d_out]`` with ``E`` among the two largest
mixes experts. Keeping the reduced axis makes every statistic the same rank as
its parameter, so its sharding follows the parameter's axis for axis
(:mod:`skewadam_jax.sharding`), and the reconstruction is plain broadcasting.

:func:`row_col_means` computes the statistics as two plain reductions, which
XLA:GPU and XLA:TPU fuse with the elementwise work that produces ``x``.
:func:`row_col_means_grouped` computes the same means in two passes over any
number of same-shape tensors (plus sums over groups of 8 along the last axis,
the shape of packed sign bits): XLA:CPU does not fuse a producer into a plain
reduction, so there the grouped form saves materialising each ``x`` and
reading it twice. It covers matrices over the last two axes.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp

from skewadam_jax.axes import MatrixAxes

# A floor for the normaliser mean_i row: all-zero statistics reconstruct to 0.
_TINY = 1e-30
# Partial sums are taken over groups of this many rows or columns; 8 is also
# the number of sign bits in a packed byte.
GROUP = 8


def factored_shapes(shape, axes: MatrixAxes) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Shapes of the row and column statistics of a tensor of ``shape``."""
  row, col = list(shape), list(shape)
  for a in axes.col_axes:
    row[a] = 1
  for a in axes.row_axes:
    col[a] = 1
  return tuple(row), tuple(col)


def _mean(x: jax.Array, axis) -> jax.Array:
  """Mean over ``axis`` (an int or a tuple); 0, not NaN, over an empty axis."""
  count = x.shape[axis] if isinstance(axis, int) else math.prod(x.shape[a] for a in axis)
  return jnp.sum(x, axis=axis) / max(1, count)


def row_col_means(x: jax.Array, axes: MatrixAxes) -> tuple[jax.Array, jax.Array]:
  """Row and column means of ``x`` over its matrix axes (reduced axes kept as 1)."""
  row, col = squeezed_means(x, axes)
  return jnp.expand_dims(row, axes.cols), jnp.expand_dims(col, axes.rows)


def squeezed_means(x: jax.Array, axes: MatrixAxes) -> tuple[jax.Array, jax.Array]:
  """Row and column means of ``x`` with the reduced axes dropped.

  The step works on the statistics in this form and reshapes them only to
  store them: XLA:GPU fuses a reduction with what consumes it, and a reshape
  right after the reduction changed that choice enough to keep a full-size
  fp32 copy of the momentum alive (``moe-6.78b``: 9.1 against 2.2 GB of temp
  for one expert bank's update).
  """
  return _mean(x, axes.cols), _mean(x, axes.rows)  # ints, or tuples of axes


def squeeze(row: jax.Array, col: jax.Array, axes: MatrixAxes) -> tuple[jax.Array, jax.Array]:
  """Stored (keep-dims) statistics in the squeezed form of :func:`squeezed_means`."""
  return jnp.squeeze(row, axes.cols), jnp.squeeze(col, axes.rows)


def rank_one(row: jax.Array, col: jax.Array, axes: MatrixAxes, *,
             root: bool = False) -> jax.Array:
  """Rank-one reconstruction ``row * col / mean_rows(row)`` of stored statistics.

  ``root=True`` gives its square root, taken on the two small factors before
  they are spread (``√(row/mean) · √col``): a full-size square root stops
  XLA:CPU from fusing the reconstruction into what reads it (the ``sign``
  decode's temporaries grew from 252 to 666 MB on the bench's tree).

  Examples:
    >>> import jax.numpy as jnp
    >>> from skewadam_jax import MatrixAxes
    >>> v = jnp.outer(jnp.array([1.0, 4.0]), jnp.array([2.0, 3.0, 1.0]))
    >>> axes = MatrixAxes(0, 1)   # normalised (non-negative), as the optimizer passes them
    >>> row, col = row_col_means(v, axes)   # what the state keeps
    >>> bool(jnp.allclose(rank_one(row, col, axes), v))  # exact on rank one
    True
  """
  return rank_one_squeezed(*squeeze(row, col, axes), axes, root=root)


def rank_one_squeezed(row: jax.Array, col: jax.Array, axes: MatrixAxes, *,
                      root: bool = False) -> jax.Array:
  """:func:`rank_one` from squeezed statistics (row lacks ``cols``, col lacks ``rows``)."""
  factor = jnp.sqrt if root else (lambda x: x)
  if isinstance(axes.rows, int) and isinstance(axes.cols, int):
    rows_in_row = axes.rows - (axes.rows > axes.cols)
    norm = jnp.maximum(jnp.expand_dims(_mean(row, rows_in_row), rows_in_row), _TINY)
    ndim = row.ndim + 1
    shape = list(row.shape)
    shape.insert(axes.cols, col.shape[axes.cols - (axes.cols > axes.rows)])
    spread = lambda stat, axis: jax.lax.broadcast_in_dim(
        stat, tuple(shape), tuple(d for d in range(ndim) if d != axis))
    return spread(factor(row / norm), axes.cols) * spread(factor(col), axes.rows)
  # Several axes a side: the same, each side's axes removed from the other's statistic.
  rows, cols = axes.row_axes, axes.col_axes
  ndim = row.ndim + len(cols)
  rows_in_row = tuple(r - sum(c < r for c in cols) for r in rows)
  norm = jnp.maximum(jnp.expand_dims(_mean(row, rows_in_row), rows_in_row), _TINY)
  row_dims = tuple(d for d in range(ndim) if d not in cols)
  col_dims = tuple(d for d in range(ndim) if d not in rows)
  shape = [0] * ndim
  for d, n in zip(row_dims, row.shape):
    shape[d] = n
  for d, n in zip(col_dims, col.shape):
    shape[d] = n
  return (jax.lax.broadcast_in_dim(factor(row / norm), tuple(shape), row_dims)
          * jax.lax.broadcast_in_dim(factor(col), tuple(shape), col_dims))


def ema(old: jax.Array, mean: jax.Array, decay, complement=None) -> jax.Array:
  """``decay·old + (1 − decay)·mean``, stored in ``old``'s dtype.

  ``complement`` is ``1 − decay`` when the caller has it more exactly than
  ``1 − decay`` in float32 (a Python float's complement, rounded once).
  """
  compute = jnp.promote_types(jnp.float32, old.dtype)  # float64 statistics stay float64
  complement = 1 - decay if complement is None else complement
  return (complement * mean + decay * old.astype(compute)).astype(old.dtype)


def _sum_groups(xs: Sequence[jax.Array], axis: int) -> tuple[jax.Array, ...]:
  """Sums each x over consecutive groups of :data:`GROUP` along ``axis`` (< 0).

  One variadic reduction, so one pass over the inputs however many there are.
  The axis is zero-padded to a multiple of :data:`GROUP`.
  """
  ndim, size = xs[0].ndim, xs[0].shape[axis]
  padded = GROUP * math.ceil(size / GROUP)
  grouped = []
  for x in xs:
    if padded != size:
      pad = [(0, 0)] * x.ndim
      pad[axis] = (0, padded - size)
      x = jnp.pad(x, pad)
    axis_pos = x.ndim + axis
    grouped.append(x.reshape(x.shape[:axis_pos] + (padded // GROUP, GROUP)
                             + x.shape[axis_pos + 1:]))
  group_axis = ndim + axis + 1
  if len(grouped) == 1:
    # XLA:CPU passes a single-operand reduction to a library kernel that does
    # not fuse the producer of x (so x is materialised); two operands (each
    # half of every group) keep it in XLA's own fused loop.
    (x,) = grouped
    half = GROUP // 2
    low, high = _variadic_sum(
        (jax.lax.slice_in_dim(x, 0, half, axis=group_axis),
         jax.lax.slice_in_dim(x, half, GROUP, axis=group_axis)), group_axis)
    return (low + high,)
  return _variadic_sum(tuple(grouped), group_axis)


def _variadic_sum(grouped: tuple[jax.Array, ...], axis: int) -> tuple[jax.Array, ...]:
  """Sums of each operand over ``axis``, as one reduction with many operands."""
  zeros = tuple(jnp.zeros((), x.dtype) for x in grouped)
  return tuple(jax.lax.reduce(grouped, zeros,
                              lambda a, b: tuple(u + v for u, v in zip(a, b)),
                              (axis,)))


def row_col_means_grouped(
    xs: Sequence[jax.Array], last_axis_group_sums: Sequence[jax.Array] = (),
) -> tuple[list[tuple[jax.Array, jax.Array]], list[jax.Array]]:
  """Row and column means of several ``[..., R, C]`` tensors, in two passes.

  The first pass sums every ``x`` (and every tensor of
  ``last_axis_group_sums``) over groups of 8 consecutive columns, the second
  over groups of 8 consecutive rows; small reductions of those partial sums
  give the means. Equal to ``[row_col_means(x, MatrixAxes(-2, -1)) ...]`` up
  to the order of summation (axes given as non-negative, like theirs).

  Args:
    xs: float tensors, all of one shape ``[..., R, C]``.
    last_axis_group_sums: tensors of the same shape whose sums over groups of 8
      along the last axis are wanted as well (zero-padded to a multiple of 8).

  Returns:
    ``(means, group_sums)``: a ``(row, col)`` pair per ``x`` (shapes
    ``[..., R, 1]`` and ``[..., 1, C]``), and an ``[..., R, ceil(C / 8)]``
    array per tensor of ``last_axis_group_sums``.
  """
  rows, cols = xs[0].shape[-2:]
  extras = tuple(last_axis_group_sums)
  by_columns = _sum_groups(tuple(xs) + extras, axis=-1)
  by_rows = _sum_groups(tuple(xs), axis=-2)
  means = [(partial_row.sum(-1, keepdims=True) / max(1, cols),
            partial_col.sum(-2, keepdims=True) / max(1, rows))
           for partial_row, partial_col in zip(by_columns, by_rows)]
  return means, list(by_columns[len(xs):])
