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
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# A floor for the normaliser mean_i row: all-zero statistics reconstruct to 0.
_TINY = 1e-30


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


def rank_one(row: jax.Array, col: jax.Array) -> jax.Array:
  """Rank-one reconstruction ``row[..., :, None] * col[..., None, :] / mean(row)``."""
  norm = jnp.maximum(jnp.mean(row, axis=-1, keepdims=True), _TINY)
  return (row / norm)[..., :, None] * col[..., None, :]


def init_factored(shape: tuple[int, ...], dtype=jnp.float32) -> FactoredMoment:
  """Zero row and column statistics for a tensor of ``shape``."""
  row_shape, col_shape = factored_shapes(shape)
  return FactoredMoment(row=jnp.zeros(row_shape, dtype), col=jnp.zeros(col_shape, dtype))


def ema_factored(state: FactoredMoment, x: jax.Array, decay) -> FactoredMoment:
  """Exponential moving average of the row and column means of ``x``.

  ``row ← decay·row + (1 − decay)·mean_j x``, and likewise for ``col``.
  """
  means = row_col_means(x)
  return FactoredMoment(
      row=(decay * state.row + (1 - decay) * means.row).astype(state.row.dtype),
      col=(decay * state.col + (1 - decay) * means.col).astype(state.col.dtype))
