"""Momentum encodings: how a tier stores Adam's first moment between steps.

Each step SkewAdam decodes the stored momentum to float32, forms the new
momentum ``m_t = b1·m_{t−1} + (1 − b1)·g_t`` exactly, uses it for this step's
update, and encodes it for the next step. Only the carried momentum is lossy.

An encoding stores a leaf's momentum in up to four arrays, each kept in the
field of that name of :class:`~skewadam_jax.ScaleBySkewAdamState` (every field
is a tree shaped like the parameters):

| name   | ``mu``                                     | other fields                                   | bytes / param          |
|--------|--------------------------------------------|------------------------------------------------|------------------------|
| fp32   | float32 values                             |                                                | 4                      |
| bf16   | bfloat16 values                            |                                                | 2                      |
| int8   | int8 codes                                 | ``mu_scale``: float32 absmax per block of      | 1 + 4 / block_size     |
|        |                                            | ``block_size`` along the matrix's columns      | (1.016 at 256)         |
| sign   | sign bits, packed 8 to a uint8 along the   | ``mu_row``, ``mu_col``: float32 row and column | 1/8 + 4·(R + C)/(R·C)  |
|        | columns (1 = negative)                     | means of ``m²`` of each matrix                 | (≈ 0.128 for 1024²)    |
| lowrank| ``mu_row``: ``P``, float32, the matrix's   | ``mu_col``: ``Qᵀ``, float32, the rows side     | 4·r·(R + C)/(R·C)      |
|        | columns side replaced by the rank ``r``    | replaced by ``r``; ``m ≈ P·Qᵀ``                | (0.11 at 1024×1400, 16)|
|        | (or bfloat16: ``lowrank_dtype``)           | (bfloat16 likewise)                            | 2·r·(R + C)/(R·C)      |
|        | (or int8 codes)                            | (int8 likewise; ``mu_scale``: a float32 step   | (r·(R + C) + 4·r)/(R·C)|
|        |                                            | per row of ``Qᵀ``, ``P``'s steps moved there)  |                        |
| none   | nothing: no momentum (``m_t = g_t``)       |                                                | 0                      |

Round-trip guarantees (``x̃ = decode(encode(x))``), checked by the tests:

* fp32: exact.
* bf16: ``|x̃ − x| ≤ 2⁻⁸·|x|`` (round to nearest, 8 significant bits);
  ``bf16`` with ``rounding="stochastic"`` (the tiers' default): ``x̃`` is one
  of ``x``'s two bf16 neighbours, the upper with probability ``(x − lo)/(hi −
  lo)``, so ``|x̃ − x| < 2⁻⁷·|x|`` and ``E[x̃] = x``. Rounding to nearest drops
  every EMA increment below half a bf16 step, so a bf16 momentum stalls short
  of a constant gradient (0.83x of it at b1 = 0.99); stochastic rounding keeps
  it unbiased (``tests/skewadam_jax/test_encodings.py``).
* int8: ``|x̃ − x| ≤ absmax(block)/254`` (half a step of ``absmax/127``);
  with ``int8_code="mulaw"``: ``|x̃ − x| ≤ 2.2 %·(|x| + absmax/255)`` (see
  :class:`Int8BlockEncoding`).
* sign: ``sign(x̃) = sign(x)`` wherever ``x ≠ 0``; each row and column of
  ``x̃`` has the same RMS as in ``x`` (the momentum keeps its size); exact
  when ``|x|`` is rank one (see :mod:`skewadam_jax.factored`). What it
  costs: one bit an entry, so the per-entry spread of ``|m|`` is lost. On a
  stationary noisy gradient the expert tier's update RMS is 0.90x Adam's
  (0.86x that of fp32 momentum with the same factored ``v``) and the decoded
  mean ``|m|`` 1.07x fp32's (``tests/skewadam_jax/test_transform_numerics.py``, ``pytest -s``);
  on heavy-tailed (log-normal) magnitudes the update RMS is lower (0.77x
  Adam's, the same test) and the decoded mean ``|m|`` higher, since a rank-one size
  cannot follow single large entries. There is no code for zero: in Adam's
  direction an entry whose gradient is exactly 0 is not moved that step
  (LazyAdam's rule), so an entry whose gradient is always 0 stays where it
  is; its momentum is still carried. (The first releases kept each row's
  mean ``|m|`` instead: the carried momentum shrank, to update RMS 0.60x
  Adam's, and always-zero entries drifted.)

``sign`` and ``int8`` are *matrix* encodings: they run along the declared
matrix axes (:mod:`skewadam_jax.axes`), and a leaf declared a vector stores
fp32 instead. Neither pads: a last block shorter than ``block_size`` gets its
own scale, so no padded copy of the momentum is made.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

from skewadam_jax import _explicit
from skewadam_jax import factored
from skewadam_jax import orthogonal
from skewadam_jax import rounding
from skewadam_jax.axes import MatrixAxes

ENCODINGS = ("fp32", "bf16", "int8", "sign", "lowrank", "none")
ROUNDINGS = ("stochastic", "nearest")
MOMENTUM_FIELDS = ("mu", "mu_scale", "mu_row", "mu_col")

Parts = dict  # field name -> array, for the fields an encoding uses


@dataclasses.dataclass(frozen=True)
class MomentumEncoding:
  """Base class: ``encode`` and ``decode`` one leaf's momentum.

  ``encode(m, axes)`` returns a dict from field names
  (:data:`MOMENTUM_FIELDS`) to arrays; ``decode(parts, axes)`` inverts it to
  float32. ``axes`` is the leaf's :class:`~skewadam_jax.axes.MatrixAxes`
  (non-negative), ``None`` for a vector.
  """

  name = "base"
  matrix_only = False  # leaves declared vectors use fp32 instead

  def encode(self, m: jax.Array, axes: Optional[MatrixAxes], salt=None,
             previous: Optional[Parts] = None) -> Parts:
    """``salt``: the step count, for an encoding that rounds at random;
    ``previous``: the parts it replaces, for one that refines them (else unused)."""
    raise NotImplementedError

  def decode(self, parts: Parts, axes: Optional[MatrixAxes]) -> jax.Array:
    raise NotImplementedError

  def bytes_per_param(self, shape: tuple[int, ...],
                      axes: Optional[MatrixAxes] = None) -> float:
    """Bytes of state per parameter for a leaf of ``shape``."""
    if axes is None and len(shape) >= 2:  # the default declaration
      axes = MatrixAxes(len(shape) - 2, len(shape) - 1)
    parts = jax.eval_shape(lambda: self.encode(jnp.zeros(shape, jnp.float32), axes))
    nbytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(parts))
    return nbytes / max(1, math.prod(shape))


@dataclasses.dataclass(frozen=True)
class DenseEncoding(MomentumEncoding):
  """The momentum as a plain array of ``dtype`` (fp32, bf16, or complex64).

  ``stochastic=True`` rounds to bf16 stochastically
  (:func:`~skewadam_jax.rounding.stochastic_round_to_bf16_hashed`, salted by
  the step count) instead of to nearest; other dtypes ignore it.
  """
  dtype: Any = jnp.float32
  stochastic: bool = False

  @property
  def name(self):
    return {jnp.dtype(jnp.bfloat16): "bf16",
            jnp.dtype(jnp.complex64): "complex64"}.get(jnp.dtype(self.dtype), "fp32")

  def encode(self, m, axes=None, salt=None, previous=None):
    if self.stochastic and salt is not None and jnp.dtype(self.dtype) == jnp.bfloat16:
      return {"mu": rounding.stochastic_round_to_bf16_hashed(m, salt)}
    return {"mu": m.astype(self.dtype)}

  def decode(self, parts, axes=None):
    mu = parts["mu"]
    return mu.astype(jnp.complex64 if jnp.iscomplexobj(mu) else jnp.float32)


# The low-rank factors' storage dtypes (a factor is a float32 product each step).
LOWRANK_DTYPES = ("float32", "bfloat16", "int8")

# μ of the μ-law int8 code: entries down to ~absmax/μ keep ~2 % relative error.
MULAW_MU = 255.0
INT8_CODES = ("linear", "mulaw")


@dataclasses.dataclass(frozen=True)
class Int8BlockEncoding(MomentumEncoding):
  """int8 codes with one float32 absmax scale per block along the columns.

  ``code="linear"``: ``codes = round(127·m / absmax(block))``, so an entry
  below ``absmax/254`` of its block decodes as 0 (beside one 1000x outlier,
  ordinary entries lose their momentum). ``code="mulaw"``: the μ-law
  companding of telephony (μ = 255), ``codes = round(127·sign(m)·ln(1 +
  μ|m|/absmax) / ln(1 + μ))``: half a code step is a factor
  ``(1 + μ)^(1/254) ≈ 1.022`` on ``1 + μ|m|/absmax``, so
  ``|m̃ − m| ≤ 2.2 %·(|m| + absmax/μ)`` (about 2 % relative down to
  ``absmax/μ``, against linear codes' ``absmax/254`` absolute), for one
  ``log1p`` and one ``expm1`` an entry. Blocks never straddle rows, so a leaf's blocks stay with their
  expert and layer when the leaf is sharded.
  """
  block_size: int = 256
  code: str = "linear"
  matrix_only = True

  @property
  def name(self):
    return "int8" if self.code == "linear" else f"int8-{self.code}"

  def _num_blocks(self, cols: int) -> int:
    return -(-cols // self.block_size)

  def _per_element(self, scale, axis: int, cols: int):
    """Each block's scale repeated over its elements (fused by XLA, not stored)."""
    blocks = scale.shape[axis]
    spread = jnp.broadcast_to(
        jnp.expand_dims(scale, axis + 1),
        scale.shape[:axis + 1] + (self.block_size,) + scale.shape[axis + 1:])
    merged = spread.reshape(scale.shape[:axis] + (blocks * self.block_size,)
                            + scale.shape[axis + 1:])
    return _explicit.take(merged, axis, 0, cols)

  def _block_absmax(self, m, axis: int, cols: int):
    """Each block's absmax along ``axis``, shape ``[..., ceil(cols / block), ...]``."""
    spec = _explicit.explicit_spec(m)
    if spec is None or spec[axis] is None:
      # One windowed max per block; the window pads the last block itself, so
      # no padded copy of the momentum is made.
      window = [1] * m.ndim
      window[axis] = self.block_size
      padding = [(0, 0)] * m.ndim
      padding[axis] = (0, self._num_blocks(cols) * self.block_size - cols)
      return jax.lax.reduce_window(jnp.abs(m), 0.0, jax.lax.max, tuple(window),
                                   tuple(window), tuple(padding))
    # Explicitly sharded columns: reduce_window cannot say how its output is
    # sharded, a split of the axis can (_explicit.split_axis).
    full = cols // self.block_size
    pieces = []
    if full:
      body = _explicit.split_axis(_explicit.take(m, axis, 0, full * self.block_size),
                                  axis, full, self.block_size)
      pieces.append(jnp.max(jnp.abs(body), axis=axis + 1))
    if cols % self.block_size:
      tail = _explicit.take(m, axis, full * self.block_size, cols)
      pieces.append(jnp.max(jnp.abs(tail), axis=axis, keepdims=True))
    if len(pieces) == 1:
      return pieces[0]
    return jnp.concatenate([_explicit.gather_axis(p, axis) for p in pieces], axis=axis)

  def encode(self, m, axes, salt=None, previous=None):
    axis, cols = axes.pack_axis, m.shape[axes.pack_axis]
    m = m.astype(jnp.float32)
    scale = self._block_absmax(m, axis, cols)
    safe = jnp.where(scale > 0, scale, 1.0)
    if self.code == "mulaw":
      inverse = _explicit.like(self._per_element(MULAW_MU / safe, axis, cols), m)
      level = 127.0 / math.log1p(MULAW_MU) * jnp.log1p(jnp.abs(m) * inverse)
      return {"mu": (jnp.sign(m) * jnp.round(level)).astype(jnp.int8), "mu_scale": scale}
    step = _explicit.like(self._per_element(127.0 / safe, axis, cols), m)
    return {"mu": jnp.round(m * step).astype(jnp.int8), "mu_scale": scale}

  def decode(self, parts, axes):
    codes = parts["mu"]
    axis, cols = axes.pack_axis, codes.shape[axes.pack_axis]
    if self.code == "mulaw":
      scale = _explicit.like(self._per_element(parts["mu_scale"] / MULAW_MU, axis, cols), codes)
      level = codes.astype(jnp.float32)
      return jnp.sign(level) * jnp.expm1(jnp.abs(level) * (math.log1p(MULAW_MU) / 127.0)) * scale
    step = _explicit.like(self._per_element(parts["mu_scale"] / 127.0, axis, cols), codes)
    return codes.astype(jnp.float32) * step


@dataclasses.dataclass(frozen=True)
class SignEncoding(MomentumEncoding):
  """Packed sign bits times a rank-one estimate of ``|m|`` per matrix.

  The estimate is ``√(rank_one(mean_j m², mean_i m²))``: each row and column
  keeps the RMS of ``m`` it had. (Keeping the mean ``|m|`` instead, as the
  first releases did, let the carried momentum shrink: its update RMS was
  0.58× fp32 momentum's on a stationary noisy gradient.)
  """
  name = "sign"
  matrix_only = True

  @staticmethod
  def bit_weights(m: jax.Array) -> jax.Array:
    """uint8 weights whose sums over groups of 8 along the last axis are the bits.

    Element ``j`` of a row weighs ``2^(7 − j mod 8)`` where ``m < 0`` and 0
    elsewhere, so the sum of each group of 8 is ``packbits(m < 0)``'s byte
    (big-endian, as :func:`jax.numpy.packbits`). With
    :func:`~skewadam_jax.factored.row_col_means_grouped` the bits are packed in
    the same pass as the row statistics.
    """
    position = jnp.arange(m.shape[-1]) % factored.GROUP
    weight = jnp.left_shift(jnp.uint8(1), (7 - position).astype(jnp.uint8))
    return jnp.where(m < 0, weight, jnp.uint8(0))

  @staticmethod
  def pack(negative: jax.Array, axis: int) -> jax.Array:
    """Packs booleans 8 to a byte along ``axis`` (big-endian, as ``jnp.packbits``).

    ``jnp.packbits`` splits the axis with a reshape that explicit sharding
    refuses when the axis is sharded; the written-out form below says what
    the result's sharding is (:mod:`skewadam_jax._explicit`).
    """
    if _explicit.explicit_spec(negative) is None and negative.size:
      return jnp.packbits(negative, axis=axis)
    size = negative.shape[axis]
    groups = -(-size // factored.GROUP)
    if groups * factored.GROUP != size:
      pad = [(0, 0)] * negative.ndim
      pad[axis] = (0, groups * factored.GROUP - size)
      negative = jnp.pad(negative, pad)
    grouped = _explicit.split_axis(negative.astype(jnp.uint8), axis, groups, factored.GROUP)
    shift = (7 - jnp.arange(factored.GROUP)).astype(jnp.uint8)
    shift = shift.reshape((factored.GROUP,) + (1,) * (negative.ndim - axis - 1))
    return jnp.sum(jnp.left_shift(grouped, shift), axis=axis + 1, dtype=jnp.uint8)

  @staticmethod
  def unpack(bits: jax.Array, axis: int, size: int) -> jax.Array:
    """The first ``size`` booleans along ``axis`` of :meth:`pack`'s bytes."""
    if _explicit.explicit_spec(bits) is None and bits.size:
      return jnp.unpackbits(bits, axis=axis, count=size).astype(bool)
    shift = (7 - jnp.arange(factored.GROUP)).astype(jnp.uint8)
    shift = shift.reshape((factored.GROUP,) + (1,) * (bits.ndim - axis - 1))
    expanded = jnp.right_shift(jnp.expand_dims(bits, axis + 1), shift) & 1
    merged = expanded.reshape(bits.shape[:axis] + (bits.shape[axis] * factored.GROUP,)
                              + bits.shape[axis + 1:])
    return _explicit.take(merged, axis, 0, size).astype(bool)

  @staticmethod
  def size_statistic(m: jax.Array) -> jax.Array:
    """What the row and column statistics average: ``m²``, so that the decoded
    momentum keeps each row's and column's RMS (its size), not its mean ``|m|``."""
    return m * m

  def encode(self, m, axes, salt=None, previous=None):
    row, col = factored.row_col_means(self.size_statistic(m), axes)
    return {"mu": self.pack(m < 0, axes.pack_axis), "mu_row": row, "mu_col": col}

  def decode(self, parts, axes):
    negative = self.unpack(parts["mu"], axes.pack_axis, parts["mu_col"].shape[axes.pack_axis])
    magnitude = factored.rank_one(parts["mu_row"], parts["mu_col"], axes, root=True)
    return jnp.where(_explicit.like(negative, magnitude), -magnitude, magnitude)


class _MatrixView(NamedTuple):
  """A leaf seen as a stack of ``R × C`` matrices: its batch axes first, then its
  row axes flattened into ``R`` and its column axes into ``C``."""
  order: tuple[int, ...]  # the leaf's axes: batch, then rows, then columns
  batch: tuple[int, ...]  # the batch axes' sizes
  rows: tuple[int, ...]   # the row axes' sizes
  cols: tuple[int, ...]   # the column axes' sizes

  @classmethod
  def of(cls, shape: tuple[int, ...], axes: MatrixAxes) -> "_MatrixView":
    ndim = len(shape)
    rows = tuple(a % ndim for a in axes.row_axes)
    cols = tuple(a % ndim for a in axes.col_axes)
    batch = tuple(a for a in range(ndim) if a not in rows + cols)
    return cls(batch + rows + cols, tuple(shape[a] for a in batch),
               tuple(shape[a] for a in rows), tuple(shape[a] for a in cols))

  def to_matrix(self, x: jax.Array) -> jax.Array:
    """A leaf-shaped array (or a factor in its stored layout) as ``[..., R', C']``.

    Under explicit sharding the row and column axes are gathered first (the
    flattening and the QR need them whole); the batch axes keep their shards.
    """
    split = len(self.batch) + len(self.rows)
    for axis in self.order[len(self.batch):]:
      x = _explicit.gather_axis(x, axis)
    x = jnp.transpose(x, self.order)
    return x.reshape(x.shape[:len(self.batch)] + (math.prod(x.shape[len(self.batch):split]),
                                                   math.prod(x.shape[split:])))

  def from_matrix(self, x: jax.Array, rows: tuple[int, ...], cols: tuple[int, ...]) -> jax.Array:
    """``[..., R', C']`` back in the leaf's axis order, its two sides split into
    ``rows`` and ``cols`` (sizes of the row and column axes, in order)."""
    x = x.reshape(self.batch + rows + cols)
    return jnp.transpose(x, tuple(sorted(range(len(self.order)), key=self.order.__getitem__)))


@dataclasses.dataclass(frozen=True)
class LowRankEncoding(MomentumEncoding):
  """A rank-``r`` factorisation ``m ≈ P·Qᵀ`` of each matrix, refined once a step.

  PowerSGD's warm-started subspace iteration, one step per update: with the
  previous step's ``Q`` (``C × r``), ``P = orth(m·Q)`` and ``Q = mᵀ·P``, so the
  stored ``P·Qᵀ = P·Pᵀ·m`` is ``m`` projected on a subspace that follows its
  leading left singular vectors over the steps (exact when ``m`` has rank at
  most ``r``). What it costs: ``4·r·(R + C)`` bytes a ``R × C`` matrix, and
  the directions of ``m`` outside the subspace are dropped each step (no
  error feedback: it would store a full-size residual). Before the first
  step ``Q`` is zero and a fixed pseudo-random ``Q`` starts the iteration.

  A matrix of several row or column axes (``MatrixAxes(0, (1, 2))``) is the
  ``R × C`` matrix of its flattened sides. ``P`` is stored in the leaf's axis
  order with its column axes shortened (the last to ``r``, the others to 1),
  ``Qᵀ`` with its row axes shortened the same way, so each factor shards as
  its parameter does along every axis it keeps
  (:func:`~skewadam_jax.state_shardings`). Under explicit sharding (sharding
  in types) each matrix's row and column axes are gathered for the QR, and the
  factors keep only the batch axes' (layer, expert) shards. The factors are
  unique only up to a rotation: compare two states by their product.

  ``stacked``: how many leading axes stack separate leaves (leaves of one
  plan stepped as a group, ``scale_by_skewadam(group_leaves=True)``): the
  starting ``Q`` is drawn once for the rest of the shape and shared along
  them, so each leaf of a group starts as it does stepped alone.

  ``dtype``: the factors' storage dtype, ``float32``, ``bfloat16`` (half the
  bytes, so twice the rank at the same state) or ``int8`` (a quarter, plus
  ``4·r`` bytes of scales a matrix). Every step still computes in float32 and
  rounds only what it stores; ``stochastic=True`` rounds stochastically
  (salted by the step count) so the carried ``Qᵀ`` stays unbiased, as a bf16
  dense momentum does. In int8, ``P``'s columns are coded against their
  absmax ``a_j`` and those steps are moved into ``Qᵀ``
  (``P·Qᵀ = P̂·(diag(a/127)·Qᵀ)``), whose rows are coded against their own
  absmax, kept as float32 in ``mu_scale`` (``Qᵀ``'s shape with its column
  axes 1). ``P̂`` then no longer has orthonormal columns; :meth:`project`
  orthonormalises it.
  """
  rank: int = 16
  stacked: int = 0
  dtype: Any = jnp.float32
  stochastic: bool = False
  name = "lowrank"
  matrix_only = True

  def _store(self, x, salt):
    if jnp.dtype(self.dtype) != jnp.bfloat16:
      return x.astype(self.dtype)
    if self.stochastic and salt is not None:
      return rounding.stochastic_round_to_bf16_hashed(x, salt)
    return x.astype(jnp.bfloat16)

  def _int8(self, x, axis: int, salt, stream: int):
    """``x`` in int8 codes against the absmax along ``axis``, and the code step.

    ``codes = round(127·x / absmax)``, rounded stochastically (unbiased) when
    ``stochastic`` and ``salt`` are given, else to nearest; ``x ≈ codes·step``.
    ``stream`` keeps the two factors' random draws apart.
    """
    if x.shape[axis] == 0:  # an empty leaf's factors have no absmax: any step codes them
      shape = list(x.shape)
      shape[axis] = 1
      step = jnp.ones(shape, jnp.float32)
    else:
      step = jnp.max(jnp.abs(x), axis=axis, keepdims=True) / 127.0
      step = jnp.where(step > 0, step, 1.0)
    scaled = x / step
    if self.stochastic and salt is not None:
      codes = jnp.floor(scaled + rounding.uniform_hashed(scaled, salt, stream))
    else:
      codes = jnp.round(scaled)
    return jnp.clip(codes, -127, 127).astype(jnp.int8), step

  def encode(self, m, axes, salt=None, previous=None):
    view = _MatrixView.of(m.shape, axes)
    m = view.to_matrix(m.astype(jnp.float32))  # [..., R, C]
    r = min(self.rank, m.shape[-2], m.shape[-1])
    shape = m.shape[:-2] + (m.shape[-1], r)
    start = _explicit.like(jnp.broadcast_to(  # sharded as m's batch axes
        jax.random.normal(jax.random.key(0), shape[self.stacked:], jnp.float32), shape), m)
    if previous is None:
      q = start
    else:
      # The stored Qᵀ (times its row scales, for int8: a scale per column of Q
      # would leave the subspace m·Q spans as it is anyway).
      q = _explicit.like(jnp.swapaxes(self._matrix_q_t(previous, axes), -1, -2), m)
      started = _explicit.like(jnp.any(q != 0, axis=(-2, -1), keepdims=True), q)
      q = jnp.where(started, q, start)
    # XLA's batched QR has no sharding rule for explicit mesh axes: it runs on the
    # gathered R × r products (r columns a matrix, small beside the momentum).
    mq = m @ q
    p = _explicit.like(orthonormal_columns(_explicit.replicated(mq)), mq)
    q_t = jnp.swapaxes(p, -1, -2) @ m  # Qᵀ = Pᵀ·m, [..., r, C]
    shortened = lambda sizes: (1,) * (len(sizes) - 1) + (r,)  # noqa: E731
    as_p = lambda x: view.from_matrix(x, view.rows, shortened(view.cols))  # noqa: E731
    as_q_t = lambda x, cols=view.cols: view.from_matrix(x, shortened(view.rows), cols)  # noqa: E731
    if jnp.dtype(self.dtype) != jnp.int8:
      return {"mu_row": self._store(as_p(p), salt), "mu_col": self._store(as_q_t(q_t), salt)}
    # P·Qᵀ = P̂·(diag(a)·Qᵀ) with a P's column code steps: P's scales move into
    # Qᵀ, whose rows keep one float32 step each.
    p_codes, p_step = self._int8(p, -2, salt, 0)
    q_codes, q_step = self._int8(q_t * jnp.swapaxes(p_step, -1, -2), -1, salt, 1)
    return {"mu_row": as_p(p_codes), "mu_col": as_q_t(q_codes),
            "mu_scale": as_q_t(q_step, (1,) * len(view.cols))}

  def _matrix_q_t(self, parts, axes):
    """The stored ``Qᵀ`` as float32 ``[..., r, C]`` (int8 codes times their row steps)."""
    q_t = _MatrixView.of(parts["mu_col"].shape, axes).to_matrix(parts["mu_col"].astype(jnp.float32))
    if jnp.dtype(self.dtype) == jnp.int8:
      q_t = q_t * _MatrixView.of(parts["mu_scale"].shape, axes).to_matrix(parts["mu_scale"])
    return q_t

  def decode(self, parts, axes):
    p_view = _MatrixView.of(parts["mu_row"].shape, axes)
    q_view = _MatrixView.of(parts["mu_col"].shape, axes)
    product = p_view.to_matrix(parts["mu_row"].astype(jnp.float32)) @ self._matrix_q_t(parts, axes)
    return p_view.from_matrix(product, p_view.rows, q_view.cols)

  def _basis(self, parts, axes):
    """``P`` as float32 ``[..., R, r]`` with orthonormal columns."""
    p = _MatrixView.of(parts["mu_row"].shape, axes).to_matrix(
        parts["mu_row"].astype(jnp.float32))
    if jnp.dtype(self.dtype) == jnp.int8:  # codes: the columns' scales moved into Qᵀ
      p = _explicit.like(orthonormal_columns(_explicit.replicated(p)), p)
    return p

  def project(self, parts, x, axes):
    """``P·Pᵀ·x``: ``x`` (leaf-shaped) projected on the stored momentum's subspace.

    ``P`` has orthonormal columns, so this is the orthogonal projection on the
    left subspace the stored ``m ≈ P·Qᵀ`` lives in; ``x − P·Pᵀ·x`` is the part
    the encoding drops.
    """
    p = self._basis(parts, axes)
    view = _MatrixView.of(x.shape, axes)
    x_matrix = view.to_matrix(x.astype(jnp.float32))
    projected = p @ (jnp.swapaxes(p, -1, -2) @ x_matrix)
    return view.from_matrix(projected, view.rows, view.cols)

  def orthogonalise(self, parts, x, axes, **newton_schulz_kwargs):
    """The orthogonal factor of ``P·Pᵀ·x`` (leaf-shaped), through the factors.

    :func:`~skewadam_jax.orthogonal.newton_schulz_in_subspace` with the stored
    ``P``: Newton–Schulz on the ``r × C`` matrix ``Pᵀ·x``, lifted back by
    ``P``. A rank-``r`` result, at ``O((R + C)·r²)`` an iteration.
    """
    p = self._basis(parts, axes)
    view = _MatrixView.of(x.shape, axes)
    out = orthogonal.newton_schulz_in_subspace(p, view.to_matrix(x.astype(jnp.float32)),
                                               **newton_schulz_kwargs)
    return view.from_matrix(out, view.rows, view.cols)


def orthonormal_columns(x: jax.Array) -> jax.Array:
  """``Q`` of the reduced QR factorisation of each matrix ``x[..., :, :]``.

  On GPU and TPU this is ``jnp.linalg.qr(x)[0]``. On XLA:CPU the matrices are
  factored one at a time (``lax.map`` over the batch axes): the same LAPACK
  calls, bit for bit the same ``Q``, but no batched QR. jaxlib 0.10.2's batched
  LAPACK QR spreads its batch over XLA:CPU's intra-op thread pool and waits
  for it; when several such QRs run at once (a jitted update of several
  expert banks stepped leaf by leaf does that) every worker of the pool can
  end up waiting on work queued behind itself, and the program never returns
  (``docs/development.md``, "The batched-QR deadlock on XLA:CPU").

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> x = jax.random.normal(jax.random.key(0), (3, 6, 2))
    >>> q = orthonormal_columns(x)
    >>> q.shape
    (3, 6, 2)
    >>> bool(jnp.allclose(jnp.swapaxes(q, -1, -2) @ q, jnp.eye(2), atol=1e-5))
    True
  """
  batch = x.shape[:-2]
  if not batch or x.size == 0:  # one matrix, or nothing to factor
    return jnp.linalg.qr(x)[0]

  def one_at_a_time():
    flat = x.reshape((math.prod(batch),) + x.shape[-2:])
    q = jax.lax.map(lambda matrix: jnp.linalg.qr(matrix)[0], flat)
    return q.reshape(batch + q.shape[-2:])

  return jax.lax.platform_dependent(cpu=one_at_a_time, default=lambda: jnp.linalg.qr(x)[0])


def get_encoding(name: str, *, block_size: int = 256, int8_code: str = "linear",
                 rounding: str = "nearest", rank: int = 16,
                 lowrank_dtype: str = "float32") -> MomentumEncoding | None:
  """The encoding called ``name`` (``None`` for ``"none"``).

  ``rounding``: how ``"bf16"`` (and ``"lowrank"`` factors stored in bfloat16
  or int8) round, ``"nearest"`` or ``"stochastic"``. ``lowrank_dtype``: the
  ``"lowrank"`` factors' storage dtype, one of :data:`LOWRANK_DTYPES`.

  Raises:
    ValueError: for an unknown name, a non-positive block size or an unknown
      int8 code.

  Examples:
    >>> import jax.numpy as jnp
    >>> from skewadam_jax import MatrixAxes
    >>> int8, axes = get_encoding("int8", block_size=4), MatrixAxes(0, 1)  # axes >= 0
    >>> m = jnp.array([[0.5, -1.0, 0.25, 0.0]])
    >>> parts = int8.encode(m, axes)
    >>> {name: (str(x.dtype), x.shape) for name, x in parts.items()}
    {'mu': ('int8', (1, 4)), 'mu_scale': ('float32', (1, 1))}
    >>> float(jnp.max(jnp.abs(int8.decode(parts, axes) - m))) <= 1.0 / 254
    True
  """
  if int8_code not in INT8_CODES:
    raise ValueError(f"Unknown int8_code {int8_code!r}; expected one of {INT8_CODES}.")
  if rounding not in ROUNDINGS:
    raise ValueError(f"Unknown rounding {rounding!r}; expected one of {ROUNDINGS}.")
  if name == "fp32":
    return DenseEncoding(jnp.float32)
  if name == "bf16":
    return DenseEncoding(jnp.bfloat16, stochastic=rounding == "stochastic")
  if name == "int8":
    if not isinstance(block_size, int) or block_size <= 0:
      raise ValueError(f"int8 block_size must be a positive int, got {block_size!r}.")
    return Int8BlockEncoding(block_size, int8_code)
  if name == "sign":
    return SignEncoding()
  if name == "lowrank":
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
      raise ValueError(f"lowrank rank must be a positive int, got {rank!r}.")
    try:
      dtype_name = jnp.dtype(lowrank_dtype).name
    except TypeError:
      dtype_name = None
    if dtype_name not in LOWRANK_DTYPES:
      raise ValueError(f"lowrank_dtype must be one of {LOWRANK_DTYPES}, got {lowrank_dtype!r}.")
    return LowRankEncoding(rank, dtype=jnp.dtype(dtype_name),
                           stochastic=dtype_name != "float32" and rounding == "stochastic")
  if name == "none":
    return None
  raise ValueError(f"Unknown momentum encoding {name!r}; expected one of {ENCODINGS}.")
