"""The orthogonalised update direction: Newton–Schulz over declared matrix axes.

Muon (Jordan et al., 2024) replaces Adam's elementwise direction ``m̂ / √v̂``
for a weight matrix by the orthogonal factor of its momentum: with
``M = U Σ Vᵀ``, the direction is ``U Vᵀ``, every singular value set to one.
It is computed without an SVD by the quintic Newton–Schulz iteration::

    X_0 = M / (‖M‖_F + eps)
    X_{k+1} = a·X_k + (b·A_k + c·A_k²)·X_k,     A_k = X_k X_kᵀ

with ``(a, b, c) = (3.4445, −4.7750, 2.0315)``, which drives the singular
values of ``X`` into roughly ``[0.7, 1.2]`` in five steps (all that the
direction needs; they do not converge to exactly one).

An orthogonal ``r × c`` matrix has RMS ``1 / √max(r, c)``; scaling it by
``rms · √max(r, c)`` gives an update of RMS ``rms`` whatever the matrix's
shape. With ``rms ≈ 0.2``, the RMS of a typical Adam update, the learning rate
and weight decay tuned for Adam carry over (Liu et al., 2025, "Muon is
scalable for LLM training").

The matrix is given by :class:`~skewadam_jax.MatrixAxes`; every other axis (a
stacked layer or expert axis) is a batch axis, so each layer's and each
expert's matrix is orthogonalised on its own.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from skewadam_jax.axes import MatrixAxes

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
# The update RMS an orthogonalised direction is scaled to: about Adam's.
ADAM_RMS = 0.2


def newton_schulz(x: jax.Array, axes: MatrixAxes = MatrixAxes(), *, steps: int = NS_STEPS,
                  coeffs: tuple[float, float, float] = NS_COEFFS,
                  eps: float = 1e-7) -> jax.Array:
  """The approximate orthogonal factor ``U Vᵀ`` of each matrix of ``x``, in float32.

  Args:
    x: a real array with at least two dimensions.
    axes: the axes forming each matrix (a side may be several axes, which
      are flattened); the others are batch axes.
    steps: Newton–Schulz iterations.
    coeffs: the iteration's ``(a, b, c)``.
    eps: added to the Frobenius norm, so a zero matrix stays zero.

  Returns:
    An array of ``x``'s shape whose matrices have the singular vectors of
    ``x``'s and singular values near one.

  Examples:
    >>> import jax.numpy as jnp
    >>> q = newton_schulz(jnp.array([[3.0, 0.0], [0.0, 0.5]]))
    >>> bool(jnp.all(jnp.abs(jnp.diag(q) - 1) < 0.35))
    True
  """
  axes = MatrixAxes(*axes)
  rows = tuple(r % x.ndim for r in axes.row_axes)
  cols = tuple(c % x.ndim for c in axes.col_axes)
  if len(rows) > 1 or len(cols) > 1:  # several axes a side: the flattened matrix
    moved = jnp.moveaxis(x, rows + cols, tuple(range(-len(rows) - len(cols), 0)))
    batch = moved.shape[:x.ndim - len(rows) - len(cols)]
    flat = moved.reshape(batch + (math.prod(x.shape[r] for r in rows),
                                  math.prod(x.shape[c] for c in cols)))
    out = newton_schulz(flat, MatrixAxes(), steps=steps, coeffs=coeffs, eps=eps)
    return jnp.moveaxis(out.reshape(moved.shape), tuple(range(-len(rows) - len(cols), 0)),
                        rows + cols)
  rows, cols = rows[0], cols[0]
  a, b, c = coeffs
  m = jnp.moveaxis(x.astype(jnp.float32), (rows, cols), (-2, -1))
  wide = m.shape[-2] <= m.shape[-1]
  if not wide:  # iterate on the side whose Gram matrix is smaller
    m = jnp.swapaxes(m, -1, -2)
  m = m / (jnp.sqrt(jnp.sum(m * m, axis=(-2, -1), keepdims=True)) + eps)
  for _ in range(steps):
    gram = m @ jnp.swapaxes(m, -1, -2)
    m = a * m + (b * gram + c * gram @ gram) @ m
  if not wide:
    m = jnp.swapaxes(m, -1, -2)
  return jnp.moveaxis(m, (-2, -1), (rows, cols))


# How an orthogonalised matrix is scaled (TierConfig.orthogonal_scale).
SCALES = ("adam_rms", "width")


def width_scale(shape, axes: MatrixAxes) -> float:
  """Muon's width scaling ``√max(1, cols / rows)`` (``optax.contrib.muon``'s default,
  ``consistent_rms=None``; Keller Jordan's Muon): a wide matrix's update grows with its
  aspect ratio, a tall or square one is left at RMS ``1 / √max(r, c)``.

  Examples:
    >>> from skewadam_jax import MatrixAxes
    >>> width_scale((256, 1024), MatrixAxes(0, 1)), width_scale((1024, 256), MatrixAxes(0, 1))
    (2.0, 1.0)
  """
  rows, cols = _matrix_sides(shape, axes)
  return math.sqrt(max(1.0, cols / rows))


def adam_rms_scale(shape, axes: MatrixAxes, rms: float = ADAM_RMS) -> float:
  """The factor that gives an orthogonal matrix over ``axes`` of ``shape`` the RMS ``rms``."""
  return rms * math.sqrt(max(_matrix_sides(shape, axes)))


def _matrix_sides(shape, axes: MatrixAxes) -> tuple[int, int]:
  """The number of rows and of columns of the matrix ``axes`` declares in ``shape``."""
  axes = MatrixAxes(*axes)
  return (math.prod(shape[a % len(shape)] for a in axes.row_axes),
          math.prod(shape[a % len(shape)] for a in axes.col_axes))


# NorMuon's guards: against a zero per-neuron statistic and a zero matrix.
NEURON_EPS = 1e-10


def normalize_per_neuron(o: jax.Array, second: jax.Array, axes: MatrixAxes, decay,
                         complement) -> tuple[jax.Array, jax.Array]:
  """NorMuon's step on an orthogonalised update ``o`` (Li et al., 2025).

  Each output neuron (column) keeps an EMA of its mean squared entry,
  ``s_t = decay·s_{t−1} + (1 − decay)·mean_rows(o²)``; the update is ``o``
  divided by ``√s_t`` column by column, rescaled to ``o``'s Frobenius norm,
  so only how the norm is shared between neurons changes::

      ô = o / (√s_t + ε),      u = ô · ‖o‖_F / (‖ô‖_F + ε)

  A common factor of ``s_t`` cancels in ``u``, so it needs no bias correction.

  Args:
    o: orthogonalised matrices (float32), batched on the axes not in ``axes``.
    second: ``s_{t−1}``, shaped as ``o`` with the row axes reduced to 1.
    axes: the matrix axes of ``o``.
    decay, complement: the EMA's decay and ``1 − decay``.

  Returns:
    ``(u, s_t)``, ``s_t`` in ``second``'s dtype.
  """
  rows = tuple(a % o.ndim for a in axes.row_axes)
  matrix = rows + tuple(a % o.ndim for a in axes.col_axes)
  stat = jnp.mean(o * o, axis=rows, keepdims=True)
  new = (complement * stat + decay * second.astype(jnp.float32)).astype(second.dtype)
  scaled = o / (jnp.sqrt(new.astype(jnp.float32)) + NEURON_EPS)
  norm = lambda x: jnp.sqrt(jnp.sum(x * x, axis=matrix, keepdims=True))  # noqa: E731
  return scaled * (norm(o) / (norm(scaled) + NEURON_EPS)), new
