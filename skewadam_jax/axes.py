"""Declared matrix axes: which two axes of a leaf form its matrix.

SkewAdam treats a leaf as a matrix (factored second moment, ``sign`` and
``int8`` momentum, weight decay by default) only along two declared axes;
every other axis (layer, expert, ...) is a batch axis, each matrix on it
handled on its own. A leaf declared ``None`` is a vector everywhere, whatever
its rank: a stacked norm scale ``[L, D]`` keeps an exact second moment, fp32
momentum under a matrix-only encoding, and no weight decay.

The declaration is a pytree (or a callable returning one) with one entry per
parameter, matched by path like the tier labels
(:func:`skewadam_jax.labels.spec_per_leaf`): a :class:`MatrixAxes`, a pair of
ints ``(rows, cols)``, an ``optax.contrib.MuonDimensionNumbers`` with one
reduction and one output axis, or ``None``. Without a declaration, a leaf
with at least two dimensions is a matrix over its last two axes and anything
smaller is a vector (:func:`default_matrix_axes`).

A scanned model (``nnx.scan``, MaxText's scanned layers) declares its stacked
axes, e.g. for ``{"layers": {"norm": {"scale": [L, D]}, "attn": {"wq": [L, D, H]}}}``::

    matrix_axes = {"layers": {"norm": {"scale": None},
                              "attn": {"wq": MatrixAxes(rows=1, cols=2)}}}

and a layer axis in the middle (MaxText's ``param_scan_axis=1``:
``wi_0`` as ``[E, L, d, f]``) needs nothing special: ``MatrixAxes(2, 3)``.

Either side may be several axes, as ``optax.contrib.MuonDimensionNumbers``
allows: an attention kernel ``[D, H, K]`` (KerasHub, MaxText's
``[D, L, H, Dh]`` query) is the ``D × (H·K)`` matrix ``MatrixAxes(0, (1, 2))``
(``MatrixAxes(0, (2, 3))`` with the layer axis 1 a batch axis). Its
statistics keep every axis (reduced ones as 1), so they are shaped and
sharded like the parameter; ``sign`` bits and ``int8`` blocks run along the
last column axis, and the orthogonal direction orthogonalises the flattened
matrix.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Union

import jax

from skewadam_jax import labels as labels_lib


class MatrixAxes(NamedTuple):
  """The axes of a leaf that form its matrix (negative values count from the end).

  Attributes:
    rows: the axis of the rows (Muon's reduction axis, ``d_in`` of ``x @ W``),
      or a tuple of axes flattened into the rows.
    cols: the axis of the columns (``d_out``), or a tuple of axes; ``sign``
      bits are packed and ``int8`` blocks run along the (last) column axis.
    layer: optionally, the batch axis a scanned model stacks its layers on.
      The orthogonal direction steps a leaf with two or more batch axes one
      slice of this axis at a time (``None``: its first batch axis), so a
      MaxText bank ``[E, L, d, f]`` declared ``MatrixAxes(2, 3, layer=1)``
      is stepped a layer at a time, not an expert at a time. It changes no
      other tier's arithmetic.

  Examples:
    >>> from skewadam_jax import MatrixAxes
    >>> query = MatrixAxes(0, (1, 2))      # [D, H, K] as the D x (H*K) matrix
    >>> query.row_axes, query.col_axes, query.pack_axis
    ((0,), (1, 2), 2)
  """
  rows: Union[int, tuple[int, ...]] = -2
  cols: Union[int, tuple[int, ...]] = -1
  layer: Optional[int] = None

  @property
  def row_axes(self) -> tuple[int, ...]:
    """The row axes as a tuple."""
    return _as_axes(self.rows)

  @property
  def col_axes(self) -> tuple[int, ...]:
    """The column axes as a tuple."""
    return _as_axes(self.cols)

  @property
  def pack_axis(self) -> int:
    """The axis along which ``sign`` packs bits and ``int8`` forms blocks: the last column axis."""
    return self.col_axes[-1]


def _as_axes(a) -> tuple[int, ...]:
  return (a,) if isinstance(a, int) else tuple(a)


AxesSpec = Union[None, Any, Callable[[Any], Any]]


def _is_axis_or_axes(a) -> bool:
  if isinstance(a, int) and not isinstance(a, bool):
    return True
  return (isinstance(a, tuple) and len(a) > 0
          and all(isinstance(b, int) and not isinstance(b, bool) for b in a))


def _is_entry(x) -> bool:
  if x is None or isinstance(x, MatrixAxes):
    return True
  if type(x).__name__ == "MuonDimensionNumbers":
    return True
  return isinstance(x, tuple) and len(x) == 2 and all(_is_axis_or_axes(a) for a in x)


def normalize(entry, shape, path: str) -> Optional[MatrixAxes]:
  """``entry`` as non-negative :class:`MatrixAxes` for a leaf of ``shape``.

  Raises:
    ValueError: naming ``path``, for an entry that is not a pair of distinct
      axes of ``shape``.
  """
  if entry is None:
    return None
  layer = None
  if isinstance(entry, MatrixAxes):
    rows, cols, layer = entry
  elif type(entry).__name__ == "MuonDimensionNumbers":
    rows, cols = entry.reduction_axis, entry.output_axis
  elif isinstance(entry, tuple) and len(entry) == 2:
    rows, cols = entry
  else:
    raise ValueError(f"Matrix axes for {path!r} must be a MatrixAxes, a pair of "
                     f"ints (or of tuples of ints) or None, got {entry!r}.")
  ndim = len(shape)
  sides = []
  for side in (rows, cols):
    side = tuple(side) if isinstance(side, (tuple, list)) else side
    axes = _as_axes(side) if _is_axis_or_axes(side) else None
    if axes is None or not all(-ndim <= a < ndim for a in axes):
      raise ValueError(f"Matrix axes {(rows, cols)} for {path!r} are not "
                       f"axes of its shape {tuple(shape)}.")
    sides.append(tuple(sorted(a % ndim for a in axes)))
  rows, cols = sides
  named = rows + cols
  if len(set(named)) != len(named):
    twice = sorted({a for a in named if named.count(a) > 1})
    raise ValueError(f"Matrix axes for {path!r} name axis {twice[0]} twice; a "
                     "matrix needs distinct row and column axes.")
  if layer is not None:
    if not _is_axis_or_axes(layer) or not isinstance(layer, int) or not -ndim <= layer < ndim:
      raise ValueError(f"The layer axis {layer!r} for {path!r} is not an axis of its "
                       f"shape {tuple(shape)}.")
    layer %= ndim
    if layer in named:
      raise ValueError(f"The layer axis {layer} for {path!r} is one of its matrix axes "
                       f"{(rows, cols)}; it must be a batch axis.")
  # One axis a side stays an int: the form every single-axis declaration had.
  return MatrixAxes(rows[0] if len(rows) == 1 else rows, cols[0] if len(cols) == 1 else cols,
                    layer)


def default_matrix_axes(tree):
  """The default declaration: the last two axes of every leaf with ``ndim >= 2``."""
  return jax.tree.map(lambda x: MatrixAxes() if len(x.shape) >= 2 else None, tree)


def resolve_matrix_axes(matrix_axes: AxesSpec, tree) -> list[Optional[MatrixAxes]]:
  """Non-negative :class:`MatrixAxes` (or ``None``) for every leaf of ``tree``.

  Args:
    matrix_axes: ``None`` for :func:`default_matrix_axes`, a declaration tree,
      or a callable mapping ``tree`` to one.
    tree: parameters or updates.

  Raises:
    ValueError: naming the path, for a declaration that does not match the
      tree or names axes the leaf does not have.
  """
  paths, leaves, _ = labels_lib.flatten_with_paths(tree)
  if matrix_axes is None:
    entries = [MatrixAxes() if len(x.shape) >= 2 else None for x in leaves]
  else:
    spec = matrix_axes(tree) if labels_lib.is_function(matrix_axes) else matrix_axes
    entries = labels_lib.spec_per_leaf(spec, tree, what="matrix_axes",
                                       is_spec_leaf=_is_entry)
  return [normalize(e, x.shape, p) for e, x, p in zip(entries, leaves, paths)]
