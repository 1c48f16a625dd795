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

import re
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import numpy as np

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
  """The default declaration: the last two axes of every leaf with ``ndim >= 2``.

  Except biases and scales (a last path component ``bias``, ``scale`` or
  ending in ``_bias`` / ``_scale``): vectors per output however many axes they
  have (an attention bias ``[H, Dh]``, an expert bias ``[E, F]``), as the
  named sets declare them; not factored, orthogonalised or decayed.
  """
  paths, leaves, treedef = labels_lib.flatten_with_paths(tree)
  return treedef.unflatten([_guess(path, leaf.shape) for path, leaf in zip(paths, leaves)])


def _guess(path: str, shape) -> Optional[MatrixAxes]:
  if len(shape) < 2 or _VECTOR_NAME.search(_names(path.replace(".", "/"))[0]):
    return None
  return MatrixAxes()


# Where a named pattern set's trees stack their layers (a regex and the axis)
# and whether a projection stores its input axes first: MaxText's scanned
# decoder puts the layer axis at ``param_scan_axis`` (1 by default), Levanter's
# Haliax ``Stacked`` at 0 with a Linear's output axes first. Hugging Face,
# EasyDeL and KerasHub trees are not stacked; Flax and Keras kernels (and
# EasyDeL's, transposed from Hugging Face's) are input-first.
_NAMED = {
    "maxtext": (re.compile(r"(^|/)decoder/(layers|dense_layers|moe_layers)/"), 1, True),
    "levanter": (re.compile(r"(^|/)stacked/"), 0, False),
    "hf": (None, None, True), "hf_mixtral": (None, None, True),
    "easydel": (None, None, True), "keras_hub": (None, None, True),
}
NAMED_SETS = tuple(_NAMED)
# Biases and scales are vectors per output however many axes they have: an
# expert bias [E, F], an attention bias [H, Dh], a per-expert scale [E].
_VECTOR_NAME = re.compile(r"(^|_)(bias|scale)$")
# An attention output projection: its head axes are its input.
_OUTPUT_PROJECTION = re.compile(r"^(o|out|o_proj|out_proj|wo|output|attention_output)$")


def _names(path: str) -> tuple[str, str]:
  """The leaf's name and its module's, skipping indices (Haliax adds ``/0``)."""
  parts = [p for p in path.split("/") if p and not p.isdigit()] or [""]
  module = parts[-2] if len(parts) > 1 and parts[-1] in ("kernel", "weight", "w") else parts[-1]
  return parts[-1], module


def _named_entry(path: str, shape, tier: str, named) -> Optional[MatrixAxes]:
  stacked, layer_axis, input_first = named
  path = path.replace(".", "/")
  ndim = len(shape)
  layer = layer_axis if stacked is not None and stacked.search(path) and ndim > layer_axis else None
  kept = [a for a in range(ndim) if a != layer]
  if tier == labels_lib.EXPERT and len(kept) >= 3:
    kept = kept[1:]  # the expert axis: each expert's matrix on its own
  name, module = _names(path)
  if _VECTOR_NAME.search(name) or len(kept) < 2:
    return None
  if len(kept) == 2:
    return MatrixAxes(kept[0], kept[1], layer)
  # A projection with head axes is the D x (H·Dh) matrix: the heads are the
  # output of a query/key/value and the input of the output projection.
  heads_first = bool(_OUTPUT_PROJECTION.match(module)) == input_first
  if heads_first:
    return MatrixAxes(tuple(kept[:-1]), kept[-1], layer)
  return MatrixAxes(kept[0], tuple(kept[1:]), layer)


def named_matrix_axes(name: str) -> Callable[[Any], Any]:
  """The matrix axes of the trees one named pattern set (:data:`skewadam_jax.PATTERNS`) labels.

  :func:`skewadam_jax.label_fn` passes them to SkewAdam with its labels,
  so a tree labelled by a named set has its axes declared, not guessed. Per
  leaf of the whole (stacked) tree:

  * the layer axis of a scanned stack is a batch axis, declared as
    ``MatrixAxes.layer``: axis 1 under MaxText's ``decoder/layers``,
    ``decoder/dense_layers`` and ``decoder/moe_layers`` (its default
    ``param_scan_axis``), axis 0 under Levanter's ``stacked``;
  * an expert leaf's first other axis is the expert axis, a batch axis;
  * a leaf named ``bias``, ``*_bias``, ``scale`` or ``*_scale``, and one left
    with fewer than two axes, is a vector (no factoring, no weight decay);
  * a projection with head axes (MaxText's ``[D, H, Dh]`` query and
    ``[H, Dh, D]`` ``out``, Levanter's output-first ``[H, Dh, D]``
    ``q_proj``) is the ``D x (H·Dh)`` matrix: the heads are one side (the
    output of a projection, the input of one named ``out``, ``o_proj``,
    ``wo``, ``output`` or ``attention_output``), the model width the other.

  Args:
    name: one of :data:`NAMED_SETS`.

  Returns:
    A callable for ``skewadam(..., matrix_axes=...)``.

  Raises:
    ValueError: for a name that declares no axes (``"default"``, whose
      model's own training declares them from logical axes).

  Examples:
    >>> import jax.numpy as jnp
    >>> from skewadam_jax import named_matrix_axes
    >>> scanned = {"params": {"decoder": {"layers": {
    ...     "pre_self_attention_layer_norm": {"scale": jnp.ones((8, 2))},
    ...     "self_attention": {"query": {"kernel": jnp.ones((8, 2, 4, 16))},
    ...                        "out": {"kernel": jnp.ones((4, 2, 16, 8))}},
    ...     "MoeBlock_0": {"wi_0": jnp.ones((4, 2, 8, 32))}}}}}
    >>> axes = named_matrix_axes("maxtext")(scanned)["params"]["decoder"]["layers"]
    >>> axes["pre_self_attention_layer_norm"]["scale"] is None
    True
    >>> axes["self_attention"]["query"]["kernel"], axes["self_attention"]["out"]["kernel"]
    (MatrixAxes(rows=0, cols=(2, 3), layer=1), MatrixAxes(rows=(0, 2), cols=3, layer=1))
    >>> axes["MoeBlock_0"]["wi_0"]
    MatrixAxes(rows=2, cols=3, layer=1)
  """
  if name not in _NAMED:
    raise ValueError(f"The pattern set {name!r} declares no matrix axes; the sets that "
                     f"do are {sorted(_NAMED)}.")
  patterns = labels_lib.PATTERNS[name]

  def spec(tree):
    labels_lib.refuse_step_count(tree, "matrix_axes")
    paths, leaves, treedef = labels_lib.flatten_with_paths(tree)
    return treedef.unflatten([
        _named_entry(p, np.shape(x), labels_lib.label_path(p, **patterns), _NAMED[name])
        for p, x in zip(paths, leaves)])
  spec.__name__ = f"named_matrix_axes({name!r})"
  return spec


def for_labels(matrix_axes: AxesSpec, param_labels) -> AxesSpec:
  """``matrix_axes``, or the named set's (:func:`named_matrix_axes`) when none is given.

  A :func:`skewadam_jax.label_fn` labeller of a set in :data:`NAMED_SETS`
  declares its trees' axes too; an explicit ``matrix_axes`` always wins.
  """
  if (matrix_axes is None and isinstance(param_labels, labels_lib.PatternLabeller)
      and param_labels.name in _NAMED):
    return named_matrix_axes(param_labels.name)
  return matrix_axes


def guessed_stacked_paths(tree, tiers: list[str]) -> list[str]:
  """The leaves whose guessed axes (the last two) are likely wrong: stacked ones.

  A backbone or router leaf with three or more axes, or an expert leaf with
  four or more, stacks matrices (layers, heads) on axes the guess cannot
  tell apart from the matrix's own.
  """
  paths, leaves, _ = labels_lib.flatten_with_paths(tree)
  return [f"{p} {list(np.shape(x))}" for p, x, t in zip(paths, leaves, tiers)
          if len(np.shape(x)) >= (4 if t == labels_lib.EXPERT else 3)]


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
    entries = [_guess(p, x.shape) for p, x in zip(paths, leaves)]
  else:
    spec = matrix_axes(tree) if labels_lib.is_function(matrix_axes) else matrix_axes
    entries = labels_lib.spec_per_leaf(spec, tree, what="matrix_axes",
                                       is_spec_leaf=_is_entry)
  return [normalize(e, x.shape, p) for e, x, p in zip(entries, leaves, paths)]
