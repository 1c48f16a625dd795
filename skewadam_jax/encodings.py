"""Momentum encodings: how a tier stores Adam's first moment between steps.

Each step SkewAdam decodes the stored momentum to float32, forms the new
momentum ``m_t = b1·m_{t−1} + (1 − b1)·g_t`` exactly, uses it for this step's
update, and encodes it for the next step. Only the carried momentum is lossy.

| name   | stored as                                              | bytes / param                |
|--------|--------------------------------------------------------|------------------------------|
| fp32   | float32 array                                          | 4                            |
| bf16   | bfloat16 array                                         | 2                            |
| int8   | int8 codes + one float32 absmax scale per block of the | 1 + 4 / block_size           |
|        | last axis (default block 256)                          | (1.016 at 256)               |
| sign   | 1 sign bit (packed uint8 along the last axis) + float32| 1/8 + 4·(R + C)/(R·C)        |
|        | row and column means of ``|m|`` of each ``[R, C]``     | (≈ 0.128 for 1024 × 1400)    |
| none   | nothing: no momentum (``m_t = g_t``, Adafactor-style)  | 0                            |

Round-trip guarantees (``x̃ = decode(encode(x))``), checked by the tests:

* fp32: exact.
* bf16: ``|x̃ − x| ≤ 2⁻⁸·|x|`` (round to nearest, 8 significant bits).
* int8: ``|x̃ − x| ≤ absmax(block)/254`` (half a step of ``absmax/127``).
* sign: ``sign(x̃) = sign(x)`` wherever ``x ≠ 0``; each row and column of
  ``|x̃|`` has the same mean as in ``|x|``; exact when ``|x|`` is rank one
  (see :mod:`skewadam_jax.factored`).

``sign`` needs a matrix and ``int8`` a vector: smaller leaves configured for
them are stored as fp32 instead (they are tiny: biases, norms, scalars).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from skewadam_jax import factored

ENCODINGS = ("fp32", "bf16", "int8", "sign", "none")


class Int8Momentum(NamedTuple):
  """Block-quantised momentum.

  Attributes:
    codes: int8, the shape of the parameter.
    scale: float32 ``[..., ceil(C / block_size)]``: each block's absmax.
  """
  codes: jax.Array
  scale: jax.Array


class SignMomentum(NamedTuple):
  """1-bit sign with a factored magnitude.

  Attributes:
    bits: uint8 ``[..., R, ceil(C / 8)]``: sign bits packed along the last axis
      (1 = negative).
    magnitude: :class:`~skewadam_jax.factored.FactoredMoment` of ``|m|``.
  """
  bits: jax.Array
  magnitude: factored.FactoredMoment


@dataclasses.dataclass(frozen=True)
class MomentumEncoding:
  """Base class: ``init``, ``encode`` and ``decode`` one leaf's momentum."""

  name = "base"
  min_ndim = 0  # leaves with fewer dimensions are stored as fp32 instead

  def init(self, shape: tuple[int, ...]) -> Any:
    """The encoding of an all-zero momentum of ``shape``."""
    return self.encode(jnp.zeros(shape, jnp.float32))

  def encode(self, m: jax.Array) -> Any:
    raise NotImplementedError

  def decode(self, state: Any) -> jax.Array:
    raise NotImplementedError

  def bytes_per_param(self, shape: tuple[int, ...]) -> float:
    """Bytes of state per parameter for a leaf of ``shape``."""
    state = jax.eval_shape(lambda: self.init(tuple(shape)))
    nbytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state))
    return nbytes / max(1, math.prod(shape))


@dataclasses.dataclass(frozen=True)
class DenseEncoding(MomentumEncoding):
  """The momentum as a plain array of ``dtype`` (fp32 or bf16)."""
  dtype: Any = jnp.float32

  @property
  def name(self):
    return "bf16" if jnp.dtype(self.dtype) == jnp.bfloat16 else "fp32"

  def init(self, shape):
    return jnp.zeros(shape, self.dtype)

  def encode(self, m):
    return m.astype(self.dtype)

  def decode(self, state):
    return state.astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class Int8BlockEncoding(MomentumEncoding):
  """int8 codes with one float32 absmax scale per block of the last axis.

  ``codes = round(127·m / absmax(block))``; blocks never straddle rows, so a
  leaf's blocks stay with their expert and layer when the leaf is sharded.
  """
  block_size: int = 256
  name = "int8"
  min_ndim = 1

  def _blocks(self, x):
    cols = x.shape[-1]
    num_blocks = -(-cols // self.block_size)
    pad = num_blocks * self.block_size - cols
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
    return x.reshape(x.shape[:-1] + (num_blocks, self.block_size))

  def encode(self, m):
    blocks = self._blocks(m.astype(jnp.float32))
    scale = jnp.max(jnp.abs(blocks), axis=-1)
    safe = jnp.where(scale > 0, scale, 1.0)
    codes = jnp.round(blocks * (127.0 / safe[..., None])).astype(jnp.int8)
    codes = codes.reshape(codes.shape[:-2] + (-1,))[..., :m.shape[-1]]
    return Int8Momentum(codes=codes, scale=scale)

  def decode(self, state):
    codes = state.codes
    blocks = self._blocks(codes.astype(jnp.float32))
    values = blocks * (state.scale / 127.0)[..., None]
    return values.reshape(values.shape[:-2] + (-1,))[..., :codes.shape[-1]]


@dataclasses.dataclass(frozen=True)
class SignEncoding(MomentumEncoding):
  """Packed sign bits times a rank-one estimate of ``|m|`` per matrix."""
  name = "sign"
  min_ndim = 2

  def encode(self, m):
    bits = jnp.packbits(m < 0, axis=-1)
    return SignMomentum(bits=bits, magnitude=factored.row_col_means(jnp.abs(m)))

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

  def decode(self, state):
    cols = state.magnitude.col.shape[-1]
    negative = jnp.unpackbits(state.bits, axis=-1, count=cols).astype(bool)
    magnitude = factored.rank_one(state.magnitude.row, state.magnitude.col)
    return jnp.where(negative, -magnitude, magnitude)


def get_encoding(name: str, *, block_size: int = 256) -> MomentumEncoding | None:
  """The encoding called ``name`` (``None`` for ``"none"``).

  Raises:
    ValueError: for an unknown name or a non-positive block size.
  """
  if name == "fp32":
    return DenseEncoding(jnp.float32)
  if name == "bf16":
    return DenseEncoding(jnp.bfloat16)
  if name == "int8":
    if not isinstance(block_size, int) or block_size <= 0:
      raise ValueError(f"int8 block_size must be a positive int, got {block_size!r}.")
    return Int8BlockEncoding(block_size)
  if name == "sign":
    return SignEncoding()
  if name == "none":
    return None
  raise ValueError(f"Unknown momentum encoding {name!r}; expected one of {ENCODINGS}.")
