"""Factored (rank-one) statistics over the last two axes of a tensor.

For a tensor ``x`` of shape ``[..., R, C]`` the row statistic is the mean over
the last axis and the column statistic the mean over the second-to-last axis::

    row[..., i] = mean_j x[..., i, j]        col[..., j] = mean_i x[..., i, j]

and the rank-one reconstruction is::

    x̂[..., i, j] = row[..., i] * col[..., j] / mean_i row[..., i]

which is exact when ``x`` is a non-negative rank-one matrix, and always has the
same row and column means as ``x``. Every leading axis (layer, expert) is a
batch axis: each ``[R, C]`` matrix is factored on its own. This is the
estimator of Adafactor (Shazeer & Stern, 2018) restricted to *explicit* axes;
optax's Adafactor instead factors the two largest axes, which for an expert
bank ``[E, d_in, d_out]`` with ``E`` among the two largest mixes experts.

:func:`row_col_means` computes the statistics as two plain reductions, which
XLA:GPU and XLA:TPU fuse with the elementwise work that produces ``x``.
:func:`row_col_means_grouped` computes the same means in two passes over any
number of same-shape tensors (plus sums over groups of 8 along the last axis,
the shape of packed sign bits): XLA:CPU does not fuse a producer into a plain
reduction, so there the grouped form saves materialising each ``x`` and
reading it twice.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp

# A floor for the normaliser mean_i row: all-zero statistics reconstruct to 0.
_TINY = 1e-30
# Partial sums are taken over groups of this many rows or columns; 8 is also
# the number of sign bits in a packed byte.
GROUP = 8


class FactoredMoment(NamedTuple):
  """Row and column statistics of a ``[..., R, C]`` tensor.

  Attributes:
    row: shape ``[..., R]``.
    col: shape ``[..., C]``.
  """
  row: jax.Array
  col: jax.Array


def factored_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Shapes of the row and column statistics of a tensor of ``shape``."""
  if len(shape) < 2:
    raise ValueError(f"Factoring needs at least 2 dimensions, got shape {shape}.")
  return tuple(shape[:-1]), tuple(shape[:-2]) + (shape[-1],)


def row_col_means(x: jax.Array) -> FactoredMoment:
  """Row and column means of ``x`` over its last two axes."""
  return FactoredMoment(row=jnp.mean(x, axis=-1), col=jnp.mean(x, axis=-2))


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
) -> tuple[list[FactoredMoment], list[jax.Array]]:
  """Row and column means of several tensors, in two passes over them.

  The first pass sums every ``x`` (and every tensor of
  ``last_axis_group_sums``) over groups of 8 consecutive columns, the second
  over groups of 8 consecutive rows; small reductions of those partial sums
  give the means. Equal to ``[row_col_means(x) for x in xs]`` up to the order
  of summation.

  Args:
    xs: float tensors, all of one shape ``[..., R, C]``.
    last_axis_group_sums: tensors of the same shape whose sums over groups of 8
      along the last axis are wanted as well (zero-padded to a multiple of 8).

  Returns:
    ``(means, group_sums)``: a :class:`FactoredMoment` per ``x``, and an
    ``[..., R, ceil(C / 8)]`` array per tensor of ``last_axis_group_sums``.
  """
  rows, cols = xs[0].shape[-2:]
  extras = tuple(last_axis_group_sums)
  by_columns = _sum_groups(tuple(xs) + extras, axis=-1)
  by_rows = _sum_groups(tuple(xs), axis=-2)
  means = [FactoredMoment(row=partial_row.sum(-1) / cols, col=partial_col.sum(-2) / rows)
           for partial_row, partial_col in zip(by_columns, by_rows)]
  return means, list(by_columns[len(xs):])


def rank_one(row: jax.Array, col: jax.Array) -> jax.Array:
  """Rank-one reconstruction ``row[..., :, None] * col[..., None, :] / mean(row)``."""
  norm = jnp.maximum(jnp.mean(row, axis=-1, keepdims=True), _TINY)
  return (row / norm)[..., :, None] * col[..., None, :]


def init_factored(shape: tuple[int, ...], dtype=jnp.float32) -> FactoredMoment:
  """Zero row and column statistics for a tensor of ``shape``."""
  row_shape, col_shape = factored_shapes(shape)
  return FactoredMoment(row=jnp.zeros(row_shape, dtype), col=jnp.zeros(col_shape, dtype))


def ema_factored(state: FactoredMoment, means: FactoredMoment, decay) -> FactoredMoment:
  """Exponential moving average of row and column means (of ``x``, say).

  ``row ← decay·row + (1 − decay)·mean_j x``, and likewise for ``col``, with
  ``means`` from :func:`row_col_means` or :func:`row_col_means_grouped`.
  """
  return FactoredMoment(
      row=(decay * state.row + (1 - decay) * means.row).astype(state.row.dtype),
      col=(decay * state.col + (1 - decay) * means.col).astype(state.col.dtype))
