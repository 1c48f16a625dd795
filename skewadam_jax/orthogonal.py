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

import functools
import math
import numbers

import jax
import jax.numpy as jnp

from skewadam_jax.axes import MatrixAxes

NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
# The update RMS an orthogonalised direction is scaled to: about Adam's.
ADAM_RMS = 0.2


# One float32 copy of a chunk of matrices is at most this many elements (64 MB) under the
# "auto" chunking: a few such copies are Newton–Schulz's whole working set, whatever the bank.
AUTO_CHUNK_ELEMENTS = 1 << 24
CHUNKINGS = ("auto", "all")
COMPUTE_DTYPES = ("float32", "bfloat16")


def check_chunk(chunk) -> None:
  """Raises ``ValueError`` unless ``chunk`` is ``"auto"``, ``"all"`` or a positive int."""
  if chunk in CHUNKINGS:
    return
  if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1:
    raise ValueError(f"orthogonal chunk must be 'auto', 'all' or a positive int (matrices at "
                     f"once), got {chunk!r}.")


def chunk_size(count: int, matrix_elements: int, chunk="auto") -> int:
  """How many of ``count`` stacked matrices are orthogonalised at once.

  ``chunk``: ``"all"`` (every one: the working set grows with the stack),
  an int (at most that many), or ``"auto"`` (at most
  ``AUTO_CHUNK_ELEMENTS // matrix_elements``, at least one). The size is the
  largest divisor of ``count`` within that bound, so every chunk is alike
  and the loop compiles one body.

  Examples:
    >>> chunk_size(64, 1024 * 1400), chunk_size(8, 4096 * 14336), chunk_size(64, 10, 12)
    (8, 1, 8)
  """
  check_chunk(chunk)
  if chunk == "all" or count == 0:  # an empty stack is one (empty) chunk
    return count
  bound = max(1, AUTO_CHUNK_ELEMENTS // max(1, matrix_elements)) if chunk == "auto" else chunk
  return max(d for d in range(1, min(bound, count) + 1) if count % d == 0)


def map_in_chunks(fn, tree, axis: int, size: int):
  """``fn`` over chunks of ``size`` entries of ``axis`` of every leaf of ``tree``, in a loop.

  The chunks are strided: entry ``j·(n/size) + i`` of the axis is member ``j``
  of chunk ``i``. A bank sharded over that axis in contiguous blocks then keeps
  its sharding on the members of every chunk (when ``size`` is a multiple of
  the number of shards), so the loop reads no other device's matrices; and
  splitting the axis so is a reshape, not a copy.
  ``fn`` maps a chunk (the leaves with ``size`` entries on ``axis``) to a
  tree of the same structure, shapes and dtypes; its results overwrite their
  inputs in the loop's carry, which XLA updates in place, so the loop makes
  no second stack of its own. One chunk (``size`` equal to the axis) calls
  ``fn`` once, with no loop.
  """
  n = jax.tree.leaves(tree)[0].shape[axis]
  if size == n:
    return fn(tree)
  if size <= 0 or n % size:
    raise ValueError(f"A chunk of {size} does not divide the axis of {n}.")
  loops = n // size
  split = lambda x: x.reshape(x.shape[:axis] + (size, loops) + x.shape[axis + 1:])  # noqa: E731
  take = lambda x, i: jax.lax.dynamic_index_in_dim(x, i, axis + 1, keepdims=False)  # noqa: E731

  def body(i, stacks):
    chunk = jax.tree.map(lambda x: take(x, i), stacks)
    result = fn(chunk)
    if jax.tree.structure(result) != jax.tree.structure(chunk) or any(
        (r.shape, r.dtype) != (c.shape, c.dtype)
        for r, c in zip(jax.tree.leaves(result), jax.tree.leaves(chunk))):
      raise ValueError("map_in_chunks: fn must return its input's structure, shapes and "
                       f"dtypes; got {jax.tree.map(jax.typeof, result)} for "
                       f"{jax.tree.map(jax.typeof, chunk)}.")
    return jax.tree.map(lambda x, r: jax.lax.dynamic_update_index_in_dim(x, r, i, axis + 1),
                        stacks, result)

  out = jax.lax.fori_loop(0, loops, body, jax.tree.map(split, tree))
  return jax.tree.map(lambda x: x.reshape(x.shape[:axis] + (n,) + x.shape[axis + 2:]), out)


def newton_schulz(x: jax.Array, axes: MatrixAxes = MatrixAxes(), *, steps: int = NS_STEPS,
                  coeffs: tuple[float, float, float] = NS_COEFFS,
                  eps: float = 1e-7, dtype="float32", chunk="all") -> jax.Array:
  """The approximate orthogonal factor ``U Vᵀ`` of each matrix of ``x``, in float32.

  Args:
    x: a real array with at least two dimensions.
    axes: the axes forming each matrix (a side may be several axes, which
      are flattened); the others are batch axes.
    steps: Newton–Schulz iterations.
    coeffs: the iteration's ``(a, b, c)``.
    eps: added to the Frobenius norm, so a zero matrix stays zero.
    dtype: the iterates' dtype: ``"float32"``, or ``"bfloat16"`` (each product
      accumulated in float32 and the polynomial formed in float32, the iterate
      stored in bfloat16: half the temporaries, Muon's usual precision).
    chunk: how many matrices are iterated at once (:func:`chunk_size`):
      ``"all"``, ``"auto"`` (a bounded working set) or a positive int. The
      batch axes are flattened and looped over in chunks (:func:`map_in_chunks`).

  Returns:
    An array of ``x``'s shape whose matrices have the singular vectors of
    ``x``'s and singular values near one.

  Examples:
    >>> import jax.numpy as jnp
    >>> q = newton_schulz(jnp.array([[3.0, 0.0], [0.0, 0.5]]))
    >>> bool(jnp.all(jnp.abs(jnp.diag(q) - 1) < 0.35))
    True
  """
  if dtype not in COMPUTE_DTYPES:
    raise ValueError(f"Unknown Newton–Schulz dtype {dtype!r}; expected one of {COMPUTE_DTYPES}.")
  check_chunk(chunk)
  axes = MatrixAxes(*axes)
  rows = tuple(r % x.ndim for r in axes.row_axes)
  cols = tuple(c % x.ndim for c in axes.col_axes)
  r, c = len(rows), len(cols)
  # Batch axes flattened to one leading axis and matrix sides to one axis each.
  moved = jnp.moveaxis(x, rows + cols, tuple(range(x.ndim - r - c, x.ndim)))
  batch = moved.shape[:x.ndim - r - c]
  flat = moved.reshape((math.prod(batch), math.prod(x.shape[i] for i in rows),
                        math.prod(x.shape[i] for i in cols)))
  size = chunk_size(flat.shape[0], flat.shape[1] * flat.shape[2], chunk)
  iterate = functools.partial(_newton_schulz_last_two, steps=steps, coeffs=coeffs, eps=eps,
                              dtype=jnp.dtype(dtype))
  out = map_in_chunks(iterate, flat.astype(jnp.float32), 0, size)
  return jnp.moveaxis(out.reshape(moved.shape), tuple(range(x.ndim - r - c, x.ndim)),
                      rows + cols)


def _newton_schulz_last_two(x, *, steps, coeffs, eps, dtype):
  """:func:`newton_schulz` over the last two axes of ``x``."""
  a, b, c = coeffs
  m = x.astype(jnp.float32)
  wide = m.shape[-2] <= m.shape[-1]
  if not wide:  # iterate on the side whose Gram matrix is smaller
    m = jnp.swapaxes(m, -1, -2)
  m = (m / (jnp.sqrt(jnp.sum(m * m, axis=(-2, -1), keepdims=True)) + eps)).astype(dtype)
  matmul = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)
  for _ in range(steps):
    gram = matmul(m, jnp.swapaxes(m, -1, -2))
    poly = (b * gram + c * matmul(gram.astype(dtype), gram.astype(dtype))).astype(dtype)
    m = (a * m.astype(jnp.float32) + matmul(poly, m)).astype(dtype)
  m = m.astype(jnp.float32)
  if not wide:
    m = jnp.swapaxes(m, -1, -2)
  return m


def newton_schulz_in_subspace(basis: jax.Array, x: jax.Array, **newton_schulz_kwargs
                              ) -> jax.Array:
  """The orthogonal factor of ``x`` projected on a rank-``r`` subspace, through its factors.

  With ``P`` (``R × r``, orthonormal columns) spanning the subspace, the
  projection ``P·Pᵀ·x`` has the singular values of the small ``Pᵀ·x``
  (``r × C``) and left singular vectors ``P·U``, so its orthogonal factor is::

      orth(P·Pᵀ·x) = P · orth(Pᵀ·x)

  and Newton–Schulz runs on the ``r × C`` matrix (its Gram matrix is
  ``r × r``). Each iteration's polynomial in ``X·Xᵀ`` commutes with ``P``
  (``Pᵀ·P = I``), so this equals :func:`newton_schulz` of ``P·Pᵀ·x`` iterate
  for iterate, at ``O((R + C)·r²)`` a step beside ``O(R·C·min(R, C))``, plus
  two ``R·C·r`` products. The result has rank at most ``r``: the directions of
  ``x`` outside the subspace are dropped (Dion's rank-``r`` orthonormal update,
  without its error feedback).

  Args:
    basis: ``P``, ``[..., R, r]`` with orthonormal columns (the matrices'
      batch axes first, as in ``x``).
    x: ``[..., R, C]``.
    **newton_schulz_kwargs: :func:`newton_schulz`'s ``steps``, ``coeffs``,
      ``eps``, ``dtype``, ``chunk``.

  Returns:
    ``[..., R, C]`` float32: ``P · newton_schulz(Pᵀ·x)``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> p = jnp.linalg.qr(jax.random.normal(jax.random.key(0), (6, 2)))[0]
    >>> x = jax.random.normal(jax.random.key(1), (6, 5))
    >>> fast = newton_schulz_in_subspace(p, x)
    >>> bool(jnp.allclose(fast, newton_schulz(p @ (p.T @ x)), atol=1e-5))
    True
  """
  basis = basis.astype(jnp.float32)
  small = jnp.swapaxes(basis, -1, -2) @ x.astype(jnp.float32)
  return basis @ newton_schulz(small, MatrixAxes(-2, -1), **newton_schulz_kwargs)


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
  rows, cols = matrix_sides(shape, axes)
  # A matrix with no rows has no entries to scale (an empty leaf of a model's tree).
  return math.sqrt(max(1.0, cols / rows)) if rows else 1.0


def adam_rms_scale(shape, axes: MatrixAxes, rms: float = ADAM_RMS) -> float:
  """The factor that gives an orthogonal matrix over ``axes`` of ``shape`` the RMS ``rms``."""
  return rms * math.sqrt(max(matrix_sides(shape, axes)))


def matrix_sides(shape, axes: MatrixAxes) -> tuple[int, int]:
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
