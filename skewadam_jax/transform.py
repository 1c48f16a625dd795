"""SkewAdam: Adam's learning rule with per-tier storage of its moments.

Adam keeps, for every parameter, a momentum ``m`` and a second moment ``v``::

    m_t = b1·m_{t−1} + (1 − b1)·g_t          m̂_t = m_t / (1 − b1^t)
    v_t = b2·v_{t−1} + (1 − b2)·|g_t|²       v̂_t = v_t / (1 − b2^t)
    u_t = m̂_t / (√(v̂_t + eps_root) + eps)

SkewAdam computes the same ``u_t`` but lets each *tier* of a Mixture-of-Experts
model store ``m`` and ``v`` in its own form (see :class:`TierConfig`):

* ``backbone`` (embeddings, attention, norms, unembedding): bf16 momentum and
  a factored ``v`` for matrices (exact for vectors) by default; fp32 momentum
  and an exact ``v`` make it Adam's.
* ``expert`` (the expert bank): a compact momentum encoding
  (:mod:`skewadam_jax.encodings`, default 1-bit sign with a factored
  magnitude) and a factored ``v`` per matrix: row and column EMAs of
  ``g² + factored_eps``, reconstructed as ``v ≈ row·colᵀ / mean(row)``
  (:mod:`skewadam_jax.factored`).
* ``router`` (gating weights): fp32 momentum and exact ``v``.

Tiers are assigned by labels on the parameter pytree (:mod:`skewadam_jax.labels`);
which two axes of a leaf form its matrix is declared separately
(:mod:`skewadam_jax.axes`; default: the last two of a leaf with ``ndim >= 2``).
Every other axis (layer, expert) is a batch axis. A leaf declared a vector has
an exact ``v`` and dense momentum in every tier.

Each field of :class:`ScaleBySkewAdamState` is a tree with the parameters'
structure. Stepped leaf by leaf (``group_leaves=False``) it holds for every
leaf the array that field stores for it, or a one-byte placeholder
(``bool[1]``) where the leaf's form has no such array (as
``optax.scale_by_factored_rms`` keeps ``(1,)`` placeholders; orbax cannot
save zero-size arrays), shaped like the parameters as optax's own states
are. The default on every backend (``group_leaves="auto"``, stacked) trades
that for compile time: leaves of one plan, shape and dtype are a group, whose
arrays are stacked at its first leaf, with ``optax.MaskedNode`` at the others
(as ``optax.masked`` leaves them). Orbax, ``state_shardings`` and
``state_bytes_per_param`` read either layout.

Complex parameters follow ``optax.scale_by_adam``: ``v`` is an EMA of
``|g|²`` (real, factored or exact as configured) and the momentum is complex,
stored as complex64 whatever the tier's encoding (the compact encodings are
for real matrices).

A step's reductions (the factored statistics of ``g²`` and ``|m|`` and the
packed sign bits) are computed in the form each backend compiles best, chosen
with ``jax.lax.platform_dependent``: plain means on GPU and TPU, two grouped
passes on CPU (:func:`skewadam_jax.factored.row_col_means_grouped`) for a
matrix over the last two axes of at least :data:`GROUPED_MIN_SIZE` entries
that is not explicitly sharded. Both give the same state up to the order of
summation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import warnings
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skewadam_jax import _explicit
from skewadam_jax import axes as axes_lib
from skewadam_jax import encodings
from skewadam_jax import factored
from skewadam_jax import labels as labels_lib
from skewadam_jax import orthogonal

SECOND_MOMENT_FORMS = ("exact", "factored")
DIRECTIONS = ("adam", "orthogonal", "normalized_orthogonal")
# What an orthogonal direction with low-rank momentum runs Newton–Schulz on
# (TierConfig.lowrank_orthogonalise).
LOWRANK_ORTHOGONALISE = ("full", "factors")
ORTHOGONAL_DIRECTIONS = ("orthogonal", "normalized_orthogonal")
NU_FIELDS = ("nu", "nu_row", "nu_col")
FIELDS = ("mu",) + NU_FIELDS + encodings.MOMENTUM_FIELDS[1:]
# The default weight-decay mask: decay exactly the leaves declared matrices.
MATRICES = "matrices"


@dataclasses.dataclass(frozen=True)
class TierConfig:
  """How one tier stores Adam's moments.

  All fields determine the shapes and dtypes of the state: under
  ``optax.inject_hyperparams`` they are static (a ``TierConfig`` is never
  injected as a hyperparameter).

  Attributes:
    momentum: the momentum encoding, one of ``"fp32"``, ``"bf16"``, ``"int8"``,
      ``"sign"``, ``"lowrank"``, ``"none"`` (see :mod:`skewadam_jax.encodings`
      for bytes per parameter and round-trip bounds). ``"int8"``, ``"sign"``
      and ``"lowrank"`` apply to declared matrices; vectors store fp32.
    second_moment: ``"exact"`` (one value per parameter) or ``"factored"``
      (row and column statistics over the declared matrix axes; vectors stay
      exact).
    nu_dtype: dtype of the stored second-moment statistics: ``float32`` (or
      ``float64``); ``bfloat16`` only where ``1 − b2 >= 10·eps(bfloat16)``
      (``b2 <= 0.92``), since below that rounding to nearest stalls the EMA
      (checked by :func:`scale_by_skewadam`). ``float16`` is refused: its
      range underflows ``(1 − b2)·g²``.
    int8_block_size: block length along the columns for ``"int8"``.
    int8_code: ``"linear"`` (absmax/127 steps; what every measured int8 run
      used) or ``"mulaw"`` (μ-law companding: small entries beside an outlier
      keep their momentum; :class:`~skewadam_jax.encodings.Int8BlockEncoding`).
    direction: the update direction for the tier's declared matrices:
      ``"adam"`` (``m̂ / √v̂``) or ``"orthogonal"``: the Newton–Schulz
      orthogonal factor of the Nesterov momentum ``b1·m_t + (1 − b1)·g_t``
      over the matrix axes, scaled to Adam's update RMS
      (:mod:`skewadam_jax.orthogonal`; Muon's direction). An orthogonalised
      matrix stores no second moment; vectors, complex leaves and matrices
      left out by ``orthogonal_mask`` keep Adam's direction.
      ``"normalized_orthogonal"``: the same, then NorMuon's per-neuron
      normalisation (:func:`~skewadam_jax.orthogonal.normalize_per_neuron`),
      which stores one float32 value per output column of each matrix (in
      the state's ``nu_col`` field).
    neuron_b2: the decay of that per-neuron second moment (NorMuon's 0.95);
      read only by ``"normalized_orthogonal"``.
    orthogonal_scale: how an orthogonalised matrix's update is scaled:
      ``"adam_rms"`` (``0.2·√max(r, c)``: Adam's update RMS whatever the shape,
      so Adam's learning rate and weight decay carry over) or ``"width"``
      (Muon's ``√max(1, cols/rows)``, ``optax.contrib.muon``'s default:
      :func:`~skewadam_jax.orthogonal.width_scale`; a learning rate tuned for
      Muon carries over). Read only by the orthogonal directions.
    orthogonal_chunk: how many stacked matrices (experts, layers) are
      orthogonalised at once: ``"auto"`` (as many as keep one float32 copy of
      the chunk within 64 MB; :func:`~skewadam_jax.orthogonal.chunk_size`),
      a positive int (at most that many; on a bank sharded over its expert
      axis, a multiple of the number of shards keeps the loop local), or
      ``"all"`` (the whole slice at once: the iteration's float32 temporaries
      are then several copies of a layer's bank). The chunks run in a loop, so
      the direction is the same to float32 round-off whatever the chunking.
    orthogonal_owner_axes: mesh axis names (a name or a tuple) over which the
      matrices of a chunk are spread whole, one set a device, before they are
      orthogonalised: a stacked leaf whose matrices a data-parallel layout
      (FSDP) splits is then iterated where each matrix lives whole, and the
      iteration's products are not all-reduced across the split (each
      matrix's Nesterov mix is resharded to its owner device and its update
      back: about a copy of the matrices, against five iterations of
      all-reduced Gram matrices). Read under a context mesh
      (``jax.set_mesh`` or ``jax.sharding.use_abstract_mesh``) that has those
      axes; without a context mesh (one device) it changes nothing. A chunk
      then holds a multiple of the owners' count (a slice whose stack does
      not divide over them keeps the usual chunks). ``()`` (the default):
      no resharding. Changes no state and, to float32 round-off, no update.
    orthogonal_dtype: the Newton–Schulz iterates' dtype, ``"float32"`` or
      ``"bfloat16"`` (products accumulated in float32; Muon's usual precision,
      half the temporaries).
    lowrank_rank: the rank ``r`` of the ``"lowrank"`` momentum
      (:class:`~skewadam_jax.encodings.LowRankEncoding`: ``4·r·(R + C)`` bytes
      a ``R × C`` matrix; 16 keeps ``moe-6.78b``'s whole state within 1.29 GB).
    lowrank_dtype: the ``"lowrank"`` factors' storage dtype: ``"float32"``,
      ``"bfloat16"`` (``2·r·(R + C)`` bytes, so rank ``2r`` at rank ``r``'s
      float32 bytes) or ``"int8"`` (``r·(R + C) + 4·r`` bytes: codes, and a
      float32 step per row of ``Qᵀ``); rounded as ``momentum_rounding`` says;
      the step computes in float32 either way.
    lowrank_complement: with ``"lowrank"`` momentum and an orthogonal
      direction, the weight ``λ`` of the update's part outside the stored
      momentum's subspace: ``u ← P·Pᵀ·u + λ·(u − P·Pᵀ·u)``, with ``P`` the
      new momentum's left factor
      (:meth:`~skewadam_jax.encodings.LowRankEncoding.project`). There the
      momentum keeps no history, so that part of the orthogonalised update is
      the current gradient's alone, at the same singular values as the averaged
      part. 1 (the default) leaves the update as it is; 0 keeps only the
      subspace (a rank-``r`` update). Changes no state.
    lowrank_orthogonalise: with ``"lowrank"`` momentum and an orthogonal
      direction, what Newton–Schulz runs on: ``"full"`` (the default: the
      whole ``R × C`` Nesterov mix) or ``"factors"`` (its projection on the
      stored momentum's subspace, through the factors:
      ``P · orth(Pᵀ·(b1·m_t + (1 − b1)·g_t))``,
      :func:`~skewadam_jax.orthogonal.newton_schulz_in_subspace`; a rank-``r``
      update whose singular values are the full one's, at ``O((R + C)·r²)``
      an iteration instead of ``O(R·C·min(R, C))``: 68x fewer FLOPs for a
      ``1400 × 1024`` expert matrix at rank 84). With ``"factors"`` there is
      no complement to weigh, so ``lowrank_complement`` must stay 1. Changes
      no state.
    momentum_rounding: how a ``"bf16"`` momentum is rounded when stored:
      ``"stochastic"`` (the default; unbiased, so the stored EMA follows the
      fp32 one at any ``b1``: within 0.1 % on average after 1000 steps of a
      constant gradient at b1 = 0.99, each entry within about
      ``2⁻⁸/√(1 − b1²)``) or ``"nearest"`` (every increment below half a
      bf16 step is dropped: the momentum stalls short of its EMA, at 0.83x of
      a constant gradient at b1 = 0.99; the default before 0.3.0, and what every run before it measured).

  The update's bound, by form (Adam's direction): dense momentum (fp32, bf16)
  with an exact ``v`` keeps Adam's, ``|m̂/√v̂| ≤ (1 − b1)/√((1 − b2)(1 − b1²/b2))``
  times the bias corrections' ratio (7.3 at the defaults); ``sign`` with an
  exact ``v`` has none and is refused; every factored or compact form (a
  reconstruction can underestimate an entry's ``v`` or overstate its ``|m|``)
  is bounded by update clipping, ``scale_by_skewadam(clip_threshold=d)``:
  ``RMS(u) ≤ d`` per matrix (Adafactor's).
  """
  momentum: str = "fp32"
  second_moment: str = "exact"
  nu_dtype: Any = jnp.float32
  int8_block_size: int = 256
  direction: str = "adam"
  int8_code: str = "linear"
  neuron_b2: float = 0.95
  orthogonal_scale: str = "adam_rms"
  orthogonal_chunk: Union[int, str] = "auto"
  orthogonal_dtype: str = "float32"
  orthogonal_owner_axes: Union[str, tuple[str, ...]] = ()
  momentum_rounding: str = "stochastic"
  lowrank_rank: int = 16
  lowrank_complement: float = 1.0
  lowrank_dtype: str = "float32"
  lowrank_orthogonalise: str = "full"

  def __post_init__(self):
    # Checked for every encoding, so a bad value fails where it is written
    # rather than later, when someone switches the tier to "int8".
    if (isinstance(self.int8_block_size, bool)
        or not isinstance(self.int8_block_size, numbers.Integral)
        or self.int8_block_size <= 0):
      raise ValueError(f"int8_block_size must be a positive int, got "
                       f"{self.int8_block_size!r}.")
    # A NumPy integer (np.int64 from a config file) is stored as a Python int,
    # so equal configs compare and hash equal.
    object.__setattr__(self, "int8_block_size", int(self.int8_block_size))
    self.momentum_encoding()
    object.__setattr__(self, "lowrank_dtype", jnp.dtype(self.lowrank_dtype).name)
    if self.momentum == "sign" and self.second_moment == "exact" and self.direction == "adam":
      raise ValueError(
          "momentum='sign' with second_moment='exact' has no bound on the update: the "
          "sign encoding decodes |m| from row and column means while an exact v is "
          "per entry, so m̂/√v̂ does not cancel (max |u| reached 2.4e4 on log-normal "
          "gradients; Adam's stays below ~1). Use second_moment='factored' (whose "
          "rank-one v matches the rank-one |m|), or a dense momentum ('fp32', 'bf16').")
    if self.direction not in DIRECTIONS:
      raise ValueError(f"Unknown direction {self.direction!r}; expected one of {DIRECTIONS}.")
    if self.orthogonal_scale not in orthogonal.SCALES:
      raise ValueError(f"Unknown orthogonal_scale {self.orthogonal_scale!r}; expected one of "
                       f"{orthogonal.SCALES}.")
    owners = self.orthogonal_owner_axes
    owners = ((owners,) if isinstance(owners, str)
              else tuple(owners) if isinstance(owners, (tuple, list)) else (owners,))
    if not all(isinstance(a, str) and a for a in owners):
      raise ValueError(f"orthogonal_owner_axes must be mesh axis names (a str or a tuple of "
                       f"str), got {self.orthogonal_owner_axes!r}.")
    object.__setattr__(self, "orthogonal_owner_axes", owners)
    orthogonal.check_chunk(self.orthogonal_chunk)
    if not isinstance(self.orthogonal_chunk, str):
      object.__setattr__(self, "orthogonal_chunk", int(self.orthogonal_chunk))
    try:
      dtype_name = jnp.dtype(self.orthogonal_dtype).name
    except TypeError:
      dtype_name = None
    if dtype_name not in orthogonal.COMPUTE_DTYPES:
      raise ValueError(f"orthogonal_dtype must be one of {orthogonal.COMPUTE_DTYPES}, got "
                       f"{self.orthogonal_dtype!r}.")
    object.__setattr__(self, "orthogonal_dtype", dtype_name)
    if (isinstance(self.neuron_b2, bool) or not isinstance(self.neuron_b2, numbers.Real)
        or not 0.0 <= self.neuron_b2 < 1.0):
      raise ValueError(f"neuron_b2 must be in [0, 1), got {self.neuron_b2!r}.")
    object.__setattr__(self, "neuron_b2", float(self.neuron_b2))
    if (isinstance(self.lowrank_complement, bool)
        or not isinstance(self.lowrank_complement, numbers.Real)
        or not 0.0 <= self.lowrank_complement <= 1.0):
      raise ValueError(f"lowrank_complement must be in [0, 1], got "
                       f"{self.lowrank_complement!r}.")
    object.__setattr__(self, "lowrank_complement", float(self.lowrank_complement))
    if self.lowrank_orthogonalise not in LOWRANK_ORTHOGONALISE:
      raise ValueError(f"Unknown lowrank_orthogonalise {self.lowrank_orthogonalise!r}; "
                       f"expected one of {LOWRANK_ORTHOGONALISE}.")
    if self.lowrank_orthogonalise == "factors" and self.momentum != "lowrank":
      raise ValueError(f"lowrank_orthogonalise='factors' orthogonalises through the low-rank "
                       f"momentum's factors; momentum={self.momentum!r} has none (use "
                       "momentum='lowrank').")
    if self.lowrank_orthogonalise == "factors" and self.lowrank_complement != 1.0:
      raise ValueError(
          f"lowrank_complement={self.lowrank_complement} weighs the part of a full "
          "orthogonalised update outside the momentum's subspace; "
          "lowrank_orthogonalise='factors' orthogonalises inside the subspace only, so "
          "there is no such part: leave lowrank_complement at 1.")
    if self.second_moment not in SECOND_MOMENT_FORMS:
      raise ValueError(
          f"Unknown second_moment {self.second_moment!r}; expected one of "
          f"{SECOND_MOMENT_FORMS}.")
    try:
      dtype = jnp.dtype(self.nu_dtype)
    except TypeError as e:
      raise ValueError(f"nu_dtype must be a floating dtype, got {self.nu_dtype!r}.") from e
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"nu_dtype must be a floating dtype, got {self.nu_dtype!r}.")
    if dtype == jnp.float16:
      raise ValueError(
          "nu_dtype float16 is not supported: (1 - b2)·g² underflows its range "
          "(smallest normal 6e-5) for ordinary gradients, and the factored "
          "updates become orders of magnitude too large. Use float32, or a "
          "factored second moment to save memory.")
    if dtype.itemsize > 4 and not jax.config.jax_enable_x64:
      raise ValueError(
          f"nu_dtype {dtype.name} needs 64-bit JAX (jax.config.update("
          "'jax_enable_x64', True)); without it JAX stores and computes float32.")

  def momentum_encoding(self) -> Optional[encodings.MomentumEncoding]:
    """The tier's momentum encoding (``None`` for ``"none"``), before a leaf's
    shape chooses between it and float32 (vectors, complex leaves)."""
    return encodings.get_encoding(self.momentum, block_size=self.int8_block_size,
                                  int8_code=self.int8_code, rounding=self.momentum_rounding,
                                  rank=self.lowrank_rank, lowrank_dtype=self.lowrank_dtype)


# The defaults were chosen by experiments/compare.py's ablation (choose_default):
# the best validation perplexity among configurations whose moe-6.78b state is
# at most the published 1.29 GB, provided it matches AdamW's
# (docs/results/comparison.md). tests/experiments/test_compare.py holds them to that choice.
DEFAULT_BACKBONE = TierConfig(momentum="bf16", second_moment="factored")
DEFAULT_EXPERT = TierConfig(momentum="sign", second_moment="factored")
DEFAULT_ROUTER = TierConfig(momentum="fp32", second_moment="exact")

TierLike = Union[TierConfig, dict, None]


class ScaleBySkewAdamState(NamedTuple):
  """State of :func:`scale_by_skewadam`: every field but ``count`` is shaped like the params.

  Each leaf of a field is the array that field stores for that parameter, or
  a ``bool[1]`` placeholder (:func:`is_placeholder`) where the parameter's
  form has none. With ``group_leaves="stacked"`` a group's first leaf holds
  the group's arrays stacked on a new leading axis and its later leaves
  ``optax.MaskedNode()``.

  Attributes:
    count: the step count, ``int32[]``.
    mu: the momentum: fp32/bf16 values, int8 codes or packed sign bits.
    nu: the exact second moment.
    nu_row: the factored second moment's row statistic (columns reduced to 1).
    nu_col: its column statistic (rows reduced to 1).
    mu_scale: int8 block scales.
    mu_row: the sign encoding's row means of ``m²``.
    mu_col: its column means of ``m²``.
  """
  count: jax.Array  # shape=(), dtype=jnp.int32.
  mu: optax.Updates
  nu: optax.Updates
  nu_row: optax.Updates
  nu_col: optax.Updates
  mu_scale: optax.Updates
  mu_row: optax.Updates
  mu_col: optax.Updates


class LeafPlan(NamedTuple):
  """How one leaf is stored, resolved from its tier, declared axes, shape and dtype.

  Attributes:
    tier: the leaf's tier.
    encoding: its momentum encoding (``None``: no momentum).
    axes: its declared matrix axes (non-negative), ``None`` for a vector.
    factored: whether its second moment is factored.
    nu_dtype: dtype of the stored second moment.
    orthogonal: whether its direction is orthogonalised (no second moment).
    neuron_b2: for the normalised orthogonal direction, the decay of its
      per-neuron second moment; ``None`` otherwise.
    orthogonal_scale: for an orthogonalised leaf, how its update is scaled
      (``TierConfig.orthogonal_scale``); ``None`` otherwise.
    orthogonal_chunk, orthogonal_dtype, orthogonal_owner_axes: for an
      orthogonalised leaf, its Newton–Schulz schedule (``TierConfig``'s);
      ``None`` otherwise.
    lowrank_complement: for an orthogonalised leaf with low-rank momentum,
      the weight of its update outside the momentum's subspace
      (``TierConfig.lowrank_complement``); ``None`` otherwise.
    lowrank_orthogonalise: for an orthogonalised leaf with low-rank
      momentum, ``TierConfig.lowrank_orthogonalise``; ``None`` otherwise.
  """
  tier: str
  encoding: Optional[encodings.MomentumEncoding]
  axes: Optional[axes_lib.MatrixAxes]
  factored: bool
  nu_dtype: Any
  orthogonal: bool = False
  neuron_b2: Optional[float] = None
  orthogonal_scale: Optional[str] = None
  orthogonal_chunk: Union[int, str, None] = None
  orthogonal_dtype: Optional[str] = None
  orthogonal_owner_axes: Optional[tuple[str, ...]] = None
  lowrank_complement: Optional[float] = None
  lowrank_orthogonalise: Optional[str] = None


def _as_tier_config(name: str, value: TierLike, default: TierConfig) -> TierConfig:
  if value is None:
    return default
  if isinstance(value, TierConfig):
    return value
  if isinstance(value, dict):
    known = {f.name for f in dataclasses.fields(TierConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
      raise ValueError(f"{name} has unknown TierConfig fields {unknown}; expected some of "
                       f"{sorted(known)}.")
    return dataclasses.replace(default, **value)
  raise ValueError(f"{name} must be a TierConfig or a dict of its fields, got {value!r}.")


def _check_unit_interval(name: str, value) -> None:
  if isinstance(value, numbers.Real) and not 0.0 <= value < 1.0:
    raise ValueError(f"{name} must be in [0, 1), got {value}.")


def _check_hyperparameters(b1, b2, eps, eps_root, factored_eps) -> None:
  """Checks the hyperparameters that are concrete numbers (not injected)."""
  _check_unit_interval("b1", b1)
  _check_unit_interval("b2", b2)
  if isinstance(eps, numbers.Real) and not eps >= 0:
    raise ValueError(f"eps must be >= 0, got {eps}.")
  if isinstance(eps_root, numbers.Real) and not eps_root >= 0:
    raise ValueError(f"eps_root must be >= 0, got {eps_root}.")
  if isinstance(factored_eps, numbers.Real) and not factored_eps >= 0:
    raise ValueError(f"factored_eps must be >= 0, got {factored_eps}.")


def _check_nu_dtype(name: str, config: TierConfig, b2) -> None:
  """Refuses a second-moment dtype too coarse for the EMA's increments.

  Rounding to nearest leaves ``v`` unchanged while ``(1 − b2)·|g² − v|`` is
  below half its spacing, i.e. while ``|g² − v| / v < eps / (2·(1 − b2))``;
  within 5 % needs ``1 − b2 >= 10·eps``.
  """
  dtype = jnp.dtype(config.nu_dtype)
  eps = float(jnp.finfo(dtype).eps)
  if eps <= float(jnp.finfo(jnp.float32).eps):
    return
  try:
    b2 = float(b2)
  except (TypeError, jax.errors.ConcretizationTypeError) as e:
    raise ValueError(
        f"{name}.nu_dtype={dtype.name} needs a concrete b2 to check that the "
        "EMA can move; pass b2 as a number (static under inject_hyperparams) "
        "or use float32.") from e
  if 1.0 - b2 < 10 * eps:
    raise ValueError(
        f"{name}.nu_dtype={dtype.name} cannot hold the second moment's EMA at "
        f"b2={b2}: rounding stalls v while |g² − v|/v < {eps / (2 * (1 - b2)):.2f} "
        f"(needs 1 − b2 >= {10 * eps:.3f}, b2 <= {1 - 10 * eps:.3f}). Use "
        "nu_dtype=float32; a factored second moment already stores only row "
        "and column statistics.")


def _warn_bf16_momentum(name: str, config: TierConfig, b1) -> None:
  """Warns where bf16 momentum cannot follow its EMA (the rule ``_check_nu_dtype`` applies to v).

  Rounding to nearest leaves ``m`` unchanged while ``(1 − b1)·|g − m|`` is below
  half its spacing: ``m`` may stall up to ``eps / (2·(1 − b1))`` relative from
  the fp32 EMA (3.9 % at b1 = 0.9, 7.8 % at 0.95, 39 % at 0.99). Within 5 %
  needs ``1 − b1 >= 10·eps(bf16)``, ``b1 <= 0.922``. A warning, not an error:
  runs with b1 0.95 and bf16 momentum were measured and stay reproducible.
  """
  if config.momentum != "bf16" or config.momentum_rounding == "stochastic":
    return
  try:
    b1 = float(b1)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return  # injected: not known here
  eps = float(jnp.finfo(jnp.bfloat16).eps)
  if 1.0 - b1 < 10 * eps:
    warnings.warn(
        f"{name} tier: bf16 momentum at b1={b1} can stall up to "
        f"{eps / (2 * (1 - b1)):.0%} away from the EMA it stores (rounding to nearest "
        f"drops increments below half a bf16 step; needs b1 <= {1 - 10 * eps:.3f} for 5 %). "
        "Use momentum_rounding='stochastic' (the default) or momentum='fp32' for this tier.",
        stacklevel=4)


def _is_complex(leaf) -> bool:
  return jnp.issubdtype(jnp.dtype(leaf.dtype), jnp.complexfloating)


def leaf_plans(tree, *, param_labels=None, matrix_axes=None, backbone: TierLike = None,
               expert: TierLike = None, router: TierLike = None, orthogonal_mask=None,
               warn: bool = False) -> list[LeafPlan]:
  """How SkewAdam stores each leaf of ``tree``, in flattening order.

  The same resolution :func:`scale_by_skewadam` makes in ``init`` and
  ``update``: a user can print it before a long run.

  Args:
    tree: parameters (arrays or ``jax.ShapeDtypeStruct``).
    param_labels, matrix_axes, backbone, expert, router, orthogonal_mask: as
      in :func:`scale_by_skewadam`.
    warn: warn when the default labeller finds no expert or router leaf.

  Returns:
    A :class:`LeafPlan` per leaf.
  """
  configs = {
      labels_lib.BACKBONE: _as_tier_config("backbone", backbone, DEFAULT_BACKBONE),
      labels_lib.EXPERT: _as_tier_config("expert", expert, DEFAULT_EXPERT),
      labels_lib.ROUTER: _as_tier_config("router", router, DEFAULT_ROUTER),
  }
  leaves = jax.tree.leaves(tree)
  tiers = labels_lib.resolve_labels(param_labels, tree, warn=warn)
  matrix_axes = axes_lib.for_labels(matrix_axes, param_labels)
  declared = axes_lib.resolve_matrix_axes(matrix_axes, tree)
  if warn and matrix_axes is None and labels_lib.EXPERT in tiers:
    # (a tree without experts has had the labels' warning, which comes first)
    _warn_guessed_axes(tree, tiers)
  if orthogonal_mask is None:
    allowed = [True] * len(leaves)
  else:
    spec = (orthogonal_mask(tree) if labels_lib.is_function(orthogonal_mask)
            else orthogonal_mask)
    allowed = labels_lib.spec_per_leaf(spec, tree, what="orthogonal_mask")
  plans = []
  for leaf, tier, axes, allow in zip(leaves, tiers, declared, allowed):
    config = configs[tier]
    encoding = config.momentum_encoding()
    if encoding is not None and (_is_complex(leaf) or (encoding.matrix_only and axes is None)):
      encoding = encodings.DenseEncoding(
          jnp.complex64 if _is_complex(leaf) else jnp.float32)
    ortho = (config.direction in ORTHOGONAL_DIRECTIONS and axes is not None
             and not _is_complex(leaf) and bool(allow))
    normalized = ortho and config.direction == "normalized_orthogonal"
    lowrank_ortho = ortho and isinstance(encoding, encodings.LowRankEncoding)
    plans.append(LeafPlan(
        tier=tier, encoding=encoding, axes=axes,
        factored=config.second_moment == "factored" and axes is not None and not ortho,
        nu_dtype=jnp.dtype(config.nu_dtype), orthogonal=ortho,
        neuron_b2=config.neuron_b2 if normalized else None,
        orthogonal_scale=config.orthogonal_scale if ortho else None,
        orthogonal_chunk=config.orthogonal_chunk if ortho else None,
        orthogonal_dtype=config.orthogonal_dtype if ortho else None,
        orthogonal_owner_axes=config.orthogonal_owner_axes if ortho else None,
        lowrank_complement=(config.lowrank_complement if lowrank_ortho else None),
        lowrank_orthogonalise=(config.lowrank_orthogonalise if lowrank_ortho else None)))
  return plans


def _check_inexact(params) -> None:
  """Refuses integer and boolean leaves by path: an Adam step has no integer form (its
  update would be cast to the leaf's dtype, moving nothing), so a counter or a mask in
  the tree is to be kept out of it rather than stepped silently."""
  paths, leaves, _ = labels_lib.flatten_with_paths(params)
  exact = [f"{path or '<root>'} ({jnp.dtype(leaf.dtype).name})" for path, leaf in zip(paths, leaves)
           if not jnp.issubdtype(leaf.dtype, jnp.inexact)]
  if exact:
    raise ValueError(
        f"SkewAdam steps floating-point (and complex) leaves; {len(exact)} "
        f"{'is' if len(exact) == 1 else 'are'} not: {', '.join(exact[:5])}"
        f"{', ...' if len(exact) > 5 else ''}. Keep them out of the optimised tree "
        "(optax.partition with optax.set_to_zero() for them, or a filtered tree).")


def _warn_guessed_axes(tree, tiers: list[str]) -> None:
  stacked = axes_lib.guessed_stacked_paths(tree, tiers)
  if stacked:
    warnings.warn(
        f"SkewAdam guessed the matrix axes of {len(stacked)} stacked leaves as their last "
        f"two, e.g. {stacked[:3]}: a layer or head axis among them would be factored, "
        "decayed and orthogonalised across. Declare matrix_axes (MatrixAxes(rows, cols, "
        "layer=...), scanned_matrix_axes(...)) or label with a label_fn set that declares "
        f"its axes ({', '.join(axes_lib.NAMED_SETS)}); skewadam_jax.plan_table(params) "
        "shows every leaf's axes.", stacklevel=5)


def _is_masked(x) -> bool:
  return isinstance(x, optax.MaskedNode)


def _placeholder() -> jax.Array:
  return jnp.zeros((1,), jnp.bool_)


def is_placeholder(x) -> bool:
  """Whether a state leaf is the placeholder of a field the parameter does not use."""
  return tuple(x.shape) == (1,) and jnp.dtype(x.dtype) == jnp.bool_


def _square(g32):
  return (g32 * jnp.conj(g32)).real if jnp.iscomplexobj(g32) else g32 * g32


def _reductions(plan: LeafPlan, g_sq, m, *, grouped: bool):
  """The step's reductions over the leaf's matrix axes.

  Returns ``(nu_means, sign_parts)``: the row and column means of ``g_sq``
  in squeezed form (or ``None``), and the sign encoding's fields for ``m`` (or
  ``None``).
  ``grouped=True`` computes them in two passes
  (:func:`~skewadam_jax.factored.row_col_means_grouped`, for XLA:CPU, matrices
  over the last two axes only); otherwise as plain means and packing, which
  XLA:GPU and XLA:TPU fuse with their producers.
  """
  sign = m is not None
  if not grouped:
    nu_means = None if g_sq is None else factored.squeezed_means(g_sq, plan.axes)
    return nu_means, plan.encoding.encode(m, plan.axes) if sign else None
  xs = [x for x in (g_sq, encodings.SignEncoding.size_statistic(m) if sign else None)
        if x is not None]
  weights = [encodings.SignEncoding.bit_weights(m)] if sign else []
  means, group_sums = factored.row_col_means_grouped(xs, weights)
  nu_means = factored.squeeze(*means[0], plan.axes) if g_sq is not None else None
  sign_parts = None
  if sign:
    sign_parts = {"mu": group_sums[0], "mu_row": means[-1][0], "mu_col": means[-1][1]}
  return nu_means, sign_parts


# XLA:CPU's two-pass reductions pay for themselves on large matrices; on a
# small leaf they only add kernels to compile (a tree of hundreds of small
# per-expert leaves compiled 27 % slower and traced 1.8x slower with them).
GROUPED_MIN_SIZE = 2**14


def _groupable(plan: LeafPlan, leaf) -> bool:
  ndim = leaf.ndim
  return ((plan.axes.rows, plan.axes.cols) == (ndim - 2, ndim - 1)
          and math.prod(leaf.shape) >= GROUPED_MIN_SIZE
          and _explicit.explicit_spec(leaf) is None)


def finite_entries(g32):
  """``g32`` with each entry that is not finite, or whose square could overflow a sum
  over the leaf, replaced by 0: one bad entry must not poison a whole matrix's
  factored statistics (or its momentum) for good. Finite, ordinary entries are
  passed through bit for bit."""
  limit = math.sqrt(float(jnp.finfo(jnp.float32).max) / max(1, math.prod(g32.shape)))
  return jnp.where(jnp.abs(g32) <= limit, g32, jnp.zeros((), g32.dtype))


def contained(grads):
  """Every leaf of ``grads`` in (at least) float32 through :func:`finite_entries`:
  the gradients a global norm that one bad entry must not poison is taken of."""
  return jax.tree.map(
      lambda g: finite_entries(g.astype(jnp.promote_types(g.dtype, jnp.float32))), grads)


# A leaf (or group) at least this large is stepped after the previous large one has
# finished (an optimisation barrier between them): a bound on the update's working
# set. A clipped leaf this large computes its update twice rather than store it.
LARGE_LEAF_ELEMENTS = orthogonal.AUTO_CHUNK_ELEMENTS


# Adafactor's d: what clip_threshold="auto" applies where a leaf's form has no
# bound of its own. Adam's first step has RMS(u) = 1 exactly (u = sign(g)).
AUTO_CLIP_THRESHOLD = 1.0


def has_own_bound(plan: LeafPlan) -> bool:
  """Whether a leaf's update is bounded without clipping.

  Bounded: an orthogonalised matrix (its singular values are at most about
  1.2 before the scale), a vector, and a dense momentum (fp32, bf16) over an
  exact ``v`` (Adam's bound, :class:`TierConfig`). Unbounded: a factored
  ``v`` (its rank-one reconstruction can underestimate an entry's ``v``:
  step-1 RMS 7.55 on heavy-tailed gradients) and a compact momentum (int8,
  sign) in Adam's direction (its decode can overstate an entry's ``|m|``).
  """
  if plan.orthogonal or plan.axes is None:
    return True
  dense = plan.encoding is None or isinstance(plan.encoding, encodings.DenseEncoding)
  return dense and not plan.factored


def _leaf_clip_threshold(plan: LeafPlan, clip_threshold):
  if isinstance(clip_threshold, str):  # "auto"
    return None if has_own_bound(plan) else AUTO_CLIP_THRESHOLD
  return clip_threshold


def _clip_rms(update, plan: LeafPlan, threshold, rms_of=None):
  """Adafactor's update clipping over the matrix axes: ``u / max(1, RMS(u)/d)``.

  ``rms_of``: the same update computed again, to take the RMS of (``update``
  when ``None``)."""
  if threshold is None or plan.axes is None:
    return update
  matrix = plan.axes.row_axes + plan.axes.col_axes
  rms_of = update if rms_of is None else rms_of
  rms = jnp.sqrt(jnp.mean(jnp.square(jnp.abs(rms_of)), axis=matrix, keepdims=True))
  return update / jnp.maximum(1.0, rms / threshold)


def _decay(rate) -> tuple[Any, Any]:
  """``(rate, 1 − rate)`` as the step uses them.

  A concrete rate stays a Python float, as in optax's moments and bias
  corrections: ``1 − rate`` is then taken before any rounding (``fp32(1 −
  0.999)`` is not ``1 − fp32(0.999)``, 1.3e-5 apart relative) and ``rate^t``
  is computed as optax computes it, so fp32 tiers repeat ``optax.adamw`` bit
  for bit. An injected (traced) rate may arrive in the params' dtype, so it
  is cast to float32 first. (A b2 that already rounded to 1, as 0.999 does
  in bf16, cannot be recovered: inject with ``hyperparam_dtype=float32``.)
  """
  if isinstance(rate, numbers.Real):
    return float(rate), 1.0 - float(rate)
  rate = jnp.asarray(rate, jnp.float32)
  return rate, 1 - rate


@functools.partial(jax.jit, inline=True)
def _bias_correction(rate, count):
  """``1 − rate^t``, traced as optax traces it (a jitted power of a weak float:
  XLA:CPU's eager power rounds differently, about 2e-5 relative at t = 3)."""
  return 1 - rate**count


def _global_norm_clip(updates, max_norm, contain_nonfinite=False):
  """``optax.clip_by_global_norm(max_norm)``'s per-leaf function, to apply later.

  The same norm and the same expression as optax's, so a leaf clipped here
  equals the chained transform's leaf bit for bit; it is returned instead of
  applied so that a layer loop can clip one slice at a time. With
  ``contain_nonfinite`` the norm is that of the contained gradients
  (:func:`finite_entries`): one NaN must not turn every leaf's clip factor
  into NaN, nor one 1e19 scale every other leaf to nothing.
  """
  if contain_nonfinite:
    updates = contained(updates)
  norm = optax.tree.norm(updates)
  trigger = jnp.squeeze(norm < max_norm)
  return lambda t: jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm)


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


def _adam_step(plan: LeafPlan, g, parts: dict, *, b1, b2, eps, eps_root,
               factored_eps, count, nesterov=False, contain_nonfinite=False, clip=None):
  """One leaf's Adam step in float32 (complex64); returns (update, new parts).

  ``b1`` and ``b2`` are :func:`_decay` pairs. A float64 ``nu_dtype`` (under
  ``jax_enable_x64``) computes the second moment and the division in float64.
  ``clip`` (from :func:`_global_norm_clip`, or ``None``) is applied to the
  gradient first. The update is not clipped nor cast (:func:`_step_leaf`).
  """
  if clip is not None:
    g = clip(g)
  (b1, c1), (b2, c2) = b1, b2
  g32 = g.astype(jnp.complex64 if jnp.iscomplexobj(g) else jnp.float32)
  if contain_nonfinite:
    g32 = finite_entries(g32)
  encoding = plan.encoding
  sign = isinstance(encoding, encodings.SignEncoding)
  m = None if encoding is None else c1 * g32 + b1 * encoding.decode(parts, plan.axes)
  g_sq = _square(g32)
  new = {}
  nu_means = sign_parts = None
  if plan.factored or sign:
    fac_sq = g_sq + factored_eps if plan.factored else None
    m_sign = m if sign else None
    if _groupable(plan, g):
      nu_means, sign_parts = jax.lax.platform_dependent(
          cpu=lambda: _reductions(plan, fac_sq, m_sign, grouped=True),
          default=lambda: _reductions(plan, fac_sq, m_sign, grouped=False))
    else:
      nu_means, sign_parts = _reductions(plan, fac_sq, m_sign, grouped=False)
  wide = jnp.promote_types(jnp.float32, plan.nu_dtype)  # float64 stays float64
  if plan.factored:
    old_row, old_col = factored.squeeze(parts["nu_row"], parts["nu_col"], plan.axes)
    row = factored.ema(old_row, nu_means[0], b2, c2)
    col = factored.ema(old_col, nu_means[1], b2, c2)
    new["nu_row"] = jnp.expand_dims(row, plan.axes.cols)
    new["nu_col"] = jnp.expand_dims(col, plan.axes.rows)
    v = factored.rank_one_squeezed(row.astype(wide), col.astype(wide), plan.axes)
  else:
    g_wide = g32.astype(jnp.promote_types(g32.dtype, wide))
    v = c2 * _square(g_wide) + b2 * parts["nu"].astype(wide)  # optax's order
    new["nu"] = v.astype(plan.nu_dtype)
  v_hat = v / _bias_correction(b2, count).astype(v.dtype)
  if encoding is None:
    m_hat = g32
  else:
    new.update(sign_parts if sign else encoding.encode(m, plan.axes, salt=count, previous=parts))
    if nesterov:
      # optax.scale_by_adam(nesterov=True): each term with its own bias correction.
      m_hat = (b1 * m / _bias_correction(b1, optax.safe_increment(count))
               + c1 * g32 / _bias_correction(b1, count))
    else:
      m_hat = m / _bias_correction(b1, count)
  update = m_hat / (jnp.sqrt(v_hat + eps_root) + eps)
  if sign:
    # The sign code has no zero: an entry whose gradient is exactly 0 would
    # decode a momentum it never had and drift. Such an entry is not moved
    # this step (LazyAdam's rule, for this encoding only); its momentum is
    # still carried, so a sporadic zero pauses an entry rather than resets it.
    update = jnp.where(g32 == 0, jnp.zeros((), update.dtype), update)
  return update, new


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
    if plan.lowrank_orthogonalise == "factors":
      update = plan.encoding.orthogonalise(new, nesterov, axes, dtype=plan.orthogonal_dtype)
    else:
      update = orthogonal.newton_schulz(nesterov, axes, dtype=plan.orthogonal_dtype)
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
    count = g_s.shape[inner_batch[0]]
    owners = _owner_devices(plan.orthogonal_owner_axes)
    spread = None
    if owners > 1 and count % owners == 0:
      # Each owner device a whole matrix of every chunk (strided, so the chunk's
      # members are any of the stack's).
      size = owners * orthogonal.chunk_size(count // owners, rows * cols, plan.orthogonal_chunk)
      spread = functools.partial(_spread_over, axis=inner_batch[0],
                                 mesh_axes=plan.orthogonal_owner_axes)
    else:
      size = orthogonal.chunk_size(count, rows * cols, plan.orthogonal_chunk)
    return orthogonal.map_in_chunks(lambda t: step(*t, axes, spread), (g_s, momentum),
                                    inner_batch[0], size)

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


# Leaves of one plan, shape and dtype are stepped together, stacked on a new
# leading axis, in groups of at most this many entries (64 MB of float32, the
# Newton–Schulz chunk's bound): the compiled program then grows with the
# number of distinct plans, not of leaves (a Hugging Face tree holds one leaf
# per expert matrix), while the stacked copy a group costs stays bounded.
GROUP_MAX_ELEMENTS = orthogonal.AUTO_CHUNK_ELEMENTS

# ``scale_by_skewadam(group_leaves=STACKED)``: groups stepped stacked, their state kept so.
STACKED = "stacked"


def _init_stacks_state(group_leaves) -> bool:
  """Whether ``init`` keeps each group's state stacked: ``"stacked"`` or ``"auto"``, on every backend."""
  return group_leaves in (STACKED, "auto")


def _holds_stacked_groups(groups: list[list[int]], parts: list[dict]) -> bool:
  """Whether a state was laid out with each group stacked at its first leaf.

  Such a state holds ``optax.MaskedNode`` in a group's later leaves, which a
  per-leaf state never does (a field a leaf does not use is a ``bool[1]``
  placeholder there); whether the rest agrees is checked leaf by leaf after.
  """
  return any(_is_masked(parts[indices[1]][name])
             for indices in groups if len(indices) > 1 for name in FIELDS)


def leaf_groups(plans, leaves, max_elements: Optional[int] = GROUP_MAX_ELEMENTS
                ) -> list[list[int]]:
  """Indices of the leaves :func:`scale_by_skewadam` steps together, in order of first leaf.

  A group's leaves share their :class:`LeafPlan`, shape and dtype and hold at
  most ``max_elements`` entries together; a leaf larger than half of it, or
  explicitly sharded (its stack could not keep its sharding), is a group of
  its own. ``max_elements=None``: every leaf alone.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import skewadam_jax
    >>> tree = {"a": jnp.zeros((4, 4)), "b": jnp.zeros((4, 4)), "c": jnp.zeros((4, 8))}
    >>> plans = skewadam_jax.leaf_plans(tree, param_labels="expert")
    >>> skewadam_jax.transform.leaf_groups(plans, jax.tree.leaves(tree))
    [[0, 1], [2]]
  """
  groups: dict[Any, list[list[int]]] = {}
  order: list[list[int]] = []
  for i, (plan, leaf) in enumerate(zip(plans, leaves)):
    size = math.prod(leaf.shape)
    if (max_elements is None or 2 * size > max_elements
        or _explicit.explicit_spec(leaf) is not None):
      order.append([i])
      continue
    runs = groups.setdefault((plan, tuple(leaf.shape), jnp.dtype(leaf.dtype)), [])
    if not runs or (len(runs[-1]) + 1) * size > max_elements:
      runs.append([])
      order.append(runs[-1])
    runs[-1].append(i)
  return order


def _stacked_plan(plan: LeafPlan) -> LeafPlan:
  """``plan`` for its leaves stacked on a new leading (batch) axis."""
  if plan.axes is None:
    return plan
  shift = lambda side: side + 1 if isinstance(side, int) else tuple(a + 1 for a in side)  # noqa: E731
  axes = plan.axes
  encoding = plan.encoding
  if isinstance(encoding, encodings.LowRankEncoding):  # each leaf's own starting subspace
    encoding = dataclasses.replace(encoding, stacked=encoding.stacked + 1)
  return plan._replace(encoding=encoding, axes=axes_lib.MatrixAxes(
      shift(axes.rows), shift(axes.cols), None if axes.layer is None else axes.layer + 1))


def _unstack(stacked, n: int, anchor: jax.Array) -> list:
  """``[tree_map(lambda x: x[j], stacked) for j in range(n)]``, sliced as each compiler prefers.

  XLA:CPU compiles a slice at a constant offset as a kernel of its own (2.1 s
  for the 96 slices of one ``[96, 64, 128]`` array), but slices at offsets it
  only knows at run time as one kernel, compiled once and reused (0.3 s). So
  on the CPU the offsets come out of a sort whose keys depend on ``anchor``
  (any traced integer scalar) but are ascending whatever its value: exact,
  and opaque to constant folding. XLA:GPU compiles the sort slowly (2.8 s
  for 96 offsets) and constant slices well, so it gets those.
  """
  def at_runtime_offsets():
    keys = jnp.minimum(anchor.astype(jnp.int32), 0) + jnp.arange(2, dtype=jnp.int32)
    offsets = []
    for start in range(0, n, 32):  # sorts of 32 offsets: one kernel, however many groups
      payloads = tuple(np.full((2,), j, np.int32) for j in range(start, min(n, start + 32)))
      offsets += [p[0] for p in jax.lax.sort((keys, *payloads), num_keys=1)[1:]]
    take = lambda x, o: jax.lax.dynamic_index_in_dim(  # noqa: E731
        x, o, keepdims=False, allow_negative_indices=False)  # the offsets are in range
    return [jax.tree.map(lambda x, o=o: take(x, o), stacked) for o in offsets]
  return jax.lax.platform_dependent(
      cpu=at_runtime_offsets,
      default=lambda: [jax.tree.map(lambda x, j=j: x[j], stacked) for j in range(n)])


def _step_group(indices: list[int], grads, plans, parts, step, anchor,
                state_stacked: bool = False) -> dict:
  """``{i: step(plans[i], grads[i], parts[i])}`` for a group, in one stacked step.

  ``anchor``: a traced integer scalar (the step count), for :func:`_unstack`.
  ``state_stacked``: the group's state is already stacked, in its first
  leaf's parts (``group_leaves="stacked"``), and its new state stays so: only
  the gradients are stacked and only the updates sliced.
  """
  if len(indices) == 1:
    i = indices[0]
    return {i: step(plans[i], grads[i], parts[i])}
  first = parts[indices[0]]
  stacked = first if state_stacked else {
      name: first[name] if is_placeholder(first[name])
      else jnp.stack([parts[i][name] for i in indices]) for name in FIELDS}
  # Barriers on both sides keep XLA from fusing the stacking into, and the
  # step into, each of the group's slices (XLA:GPU, 126-leaf tree: 32.4 s to
  # trace and compile without them, 16.0 s with them, 28.8 s ungrouped).
  g, stacked = jax.lax.optimization_barrier(
      (jnp.stack([grads[i] for i in indices]), stacked))
  update, new = jax.lax.optimization_barrier(
      step(_stacked_plan(plans[indices[0]]), g, stacked))
  if state_stacked:
    updates = _unstack(update, len(indices), anchor)
    return {i: (u, new if i == indices[0] else {}) for i, u in zip(indices, updates)}
  return dict(zip(indices, _unstack((update, new), len(indices), anchor)))


def _stacked_leaf(indices: list[int], leaves) -> jax.ShapeDtypeStruct:
  """The shape and dtype of a group's leaves stacked on a new leading axis."""
  first = leaves[indices[0]]
  return jax.ShapeDtypeStruct((len(indices),) + tuple(first.shape), first.dtype)


def _init_parts(plans, leaves, state_stacked: bool) -> list[dict]:
  """Each leaf's state at step 0; with ``state_stacked`` each group's in its first leaf's place."""
  if not state_stacked:
    return [_init_leaf(plan, leaf) for plan, leaf in zip(plans, leaves)]
  # The group's other leaves hold nothing: optax.MaskedNode, as under optax.masked.
  # A bool[1] placeholder in each of their fields would be a program input and an
  # output (a copy) each, seven a leaf: on the bench's 501-leaf tree they cost XLA
  # about as much compile time again as the whole of AdamW's update.
  per_leaf = [dict.fromkeys(FIELDS, optax.MaskedNode()) for _ in leaves]
  for indices in leaf_groups(plans, leaves):
    i = indices[0]
    per_leaf[i] = (_init_leaf(plans[i], leaves[i]) if len(indices) == 1 else
                   _init_leaf(_stacked_plan(plans[i]), _stacked_leaf(indices, leaves)))
  return per_leaf


def _check_group_parts(paths, indices, plans, grads, parts) -> None:
  """:func:`_check_parts` for a group whose state is stacked in its first leaf's place."""
  first = indices[0]
  _check_parts(f"{paths[first]} (stacked with the {len(indices) - 1} leaves after it)",
               _stacked_plan(plans[first]), _stacked_leaf(indices, grads), parts[first])
  for i in indices[1:]:
    held = [name for name in FIELDS if not _is_masked(parts[i][name])]
    if held:
      raise ValueError(
          f"SkewAdam state for {paths[i]!r} holds {held}, but with "
          f"group_leaves='stacked' its group's state is stacked at {paths[first]!r} "
          "and it holds optax.MaskedNode: the state was made with another "
          "group_leaves, or the tree changed between init and update.")


def _fresh_parts(plan: LeafPlan, leaf) -> dict:
  """The leaf's state at step 0, computed by the step's own operations.

  Used under ``jax.eval_shape`` only: the result's shapes, dtypes and (under
  explicit sharding) shardings are exactly those ``update`` produces.
  """
  zeros = jnp.zeros_like(leaf, jnp.complex64 if _is_complex(leaf) else jnp.float32)
  parts = {}
  if plan.encoding is not None:
    parts.update(plan.encoding.encode(zeros, plan.axes))
  if plan.factored:
    row, col = factored.row_col_means(_square(zeros), plan.axes)
    parts.update(nu_row=row.astype(plan.nu_dtype), nu_col=col.astype(plan.nu_dtype))
  elif plan.neuron_b2 is not None:  # one value per output column of each matrix
    parts["nu_col"] = factored.row_col_means(_square(zeros), plan.axes)[1].astype(jnp.float32)
  elif not plan.orthogonal:
    parts["nu"] = _square(zeros).astype(plan.nu_dtype)
  return parts


def _zeros_like_abstract(x: jax.ShapeDtypeStruct) -> jax.Array:
  sharding = getattr(x, "sharding", None)
  if sharding is not None and _explicit.explicit_spec(x) is not None:
    return jnp.zeros(x.shape, x.dtype, out_sharding=sharding)
  return jnp.zeros(x.shape, x.dtype)


def _abstract_leaf(leaf):
  """A ``ShapeDtypeStruct`` of ``leaf`` with its sharding type (for eval_shape)."""
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return leaf
  return jax.typeof(leaf) if isinstance(leaf, jax.Array) else jax.ShapeDtypeStruct(
      leaf.shape, leaf.dtype)


def _init_leaf(plan: LeafPlan, leaf) -> dict:
  abstract = jax.eval_shape(lambda p: _fresh_parts(plan, p), _abstract_leaf(leaf))
  return {name: _zeros_like_abstract(x) for name, x in abstract.items()}


@functools.lru_cache(maxsize=4096)
def _expected_parts(plan: LeafPlan, shape: tuple, dtype) -> dict:
  return jax.eval_shape(lambda p: _fresh_parts(plan, p), jax.ShapeDtypeStruct(shape, dtype))


def _check_parts(path: str, plan: LeafPlan, leaf, parts: dict) -> None:
  """Raises if a leaf's state is not what ``plan`` makes for it (naming the path)."""
  if _explicit.explicit_spec(leaf) is None:  # one eval_shape per plan, shape and dtype
    expected = _expected_parts(plan, tuple(leaf.shape), jnp.dtype(leaf.dtype))
  else:
    expected = jax.eval_shape(lambda p: _fresh_parts(plan, p), _abstract_leaf(leaf))
  for name in FIELDS:
    got = parts[name]
    want = expected.get(name)
    if _is_masked(got):
      raise ValueError(
          f"SkewAdam state for {path!r} holds optax.MaskedNode in field {name!r}, as a "
          "state made with group_leaves='stacked' does for a group's later leaves, but "
          "this update steps the leaf with its own state: group_leaves and the tree must "
          "not change between init and update.")
    want_shape, want_dtype = ((1,), jnp.dtype(jnp.bool_)) if want is None else (
        tuple(want.shape), jnp.dtype(want.dtype))
    if want is None and tuple(got.shape) == (1,):
      continue  # a placeholder, passed through whatever its dtype
    if tuple(got.shape) != want_shape or jnp.dtype(got.dtype) != want_dtype:
      second = ("per-neuron (normalized orthogonal)" if plan.neuron_b2 is not None else
                "none (orthogonal direction)" if plan.orthogonal else
                f"{'factored' if plan.factored else 'exact'} ({plan.nu_dtype.name})")
      what = (f"momentum {plan.encoding.name if plan.encoding else 'none'}, "
              f"second moment {second}, matrix axes {plan.axes}")
      raise ValueError(
          f"SkewAdam state for {path!r} does not match its configuration "
          f"({what}) and the update's shape {tuple(leaf.shape)}: field {name!r} "
          f"is {jnp.dtype(got.dtype).name}{list(got.shape)}, expected "
          f"{want_dtype.name}{list(want_shape)}. Labels, matrix axes, tier "
          "configs, group_leaves='stacked' (or not) and the tree must not change "
          "between init and update.")


def _refuse_scheduled_structure(**arguments) -> None:
  """Refuses a structural argument that arrives as an array: a schedule's value.

  ``optax.inject_hyperparams`` calls each callable argument with the step
  count and passes on what it returns; a labeller, axes or mask function
  returns an array there only when it was taken for a schedule.
  """
  for name, value in arguments.items():
    if isinstance(value, (jax.Array, np.ndarray)):
      raise labels_lib.static_args_error(name)


def scale_by_skewadam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    param_labels: labels_lib.LabelSpec = None,
    matrix_axes: axes_lib.AxesSpec = None,
    backbone: TierLike = None,
    expert: TierLike = None,
    router: TierLike = None,
    factored_eps: float = 1e-30,
    orthogonal_mask: Any = None,
    nesterov: bool = False,
    clip_threshold: Union[float, str, None] = "auto",
    contain_nonfinite: bool = True,
    max_grad_norm: Optional[float] = None,
    group_leaves: Union[bool, str] = "auto",
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales updates with Adam's rule, storing moments per tier.

  For every leaf, with ``t`` the step count::

      m_t = b1·m_{t−1} + (1 − b1)·g_t,       m̂_t = m_t / (1 − b1^t)
      v_t = b2·v_{t−1} + (1 − b2)·|g_t|²,    v̂_t = v_t / (1 − b2^t)
      u_t = m̂_t / (√(v̂_t + eps_root) + eps)

  where ``m_{t−1}`` is the decoded stored momentum of the leaf's tier and,
  for a factored tier and a declared matrix, ``v_t`` is the rank-one
  reconstruction ``row_t·col_tᵀ / mean(row_t)`` of the row and column EMAs of
  ``|g_t|² + factored_eps`` over the matrix axes. With the ``"none"`` momentum
  encoding ``m̂_t = g_t``. With every tier at ``TierConfig("fp32", "exact")``
  this is ``optax.scale_by_adam`` exactly.

  A tier with ``direction="orthogonal"`` replaces ``u_t`` for its declared
  real matrices (those ``orthogonal_mask`` allows) by Muon's direction::

      u_t = 0.2·√max(r, c) · NS5(b1·m_t + (1 − b1)·g_t)

  (:mod:`skewadam_jax.orthogonal`), with ``m_t`` stored in the tier's encoding
  and no second moment.

  Args:
    b1: EMA decay of the momentum, in [0, 1).
    b2: EMA decay of the second moment, in [0, 1).
    eps: added to √v̂ in the denominator, >= 0 (0 as in ``optax.adam``: an
      entry whose gradients are all zero then gets 0/0 = NaN, unless
      ``eps_root > 0``).
    eps_root: added to v̂ inside the square root, >= 0.
    param_labels: tier of each leaf: ``None`` for
      :func:`~skewadam_jax.moe_param_labels` with its defaults (warning at
      ``init`` if they find no expert or no router leaf), a tier name for
      every leaf, a pytree of ``"backbone" | "expert" | "router"`` matched to
      the params by path (the params' structure or a prefix of it), or a
      callable returning one. A callable must depend only on the tree's
      structure: it is called on the params in ``init`` and on the updates in
      ``update``. Under ``optax.inject_hyperparams`` a callable must be named
      in ``static_args``.
    matrix_axes: which two axes of each leaf form its matrix
      (:mod:`skewadam_jax.axes`): ``None`` for the last two axes of every
      leaf with ``ndim >= 2``, a pytree of
      :class:`~skewadam_jax.MatrixAxes` / ``(rows, cols)`` / ``None``
      (a vector, e.g. a stacked norm scale ``[L, D]``) matched by path, or a
      callable returning one (static, like ``param_labels``).
    backbone: :class:`TierConfig` (or a dict of its fields) for the backbone;
      default bf16 momentum, factored ``v`` (exact for vectors).
    expert: the same for the expert bank; default ``"sign"`` momentum,
      factored ``v``.
    router: the same for the router; default fp32 momentum, exact ``v``.
    factored_eps: added to ``g²`` before factoring, so that all-zero rows keep
      a defined reconstruction (Adafactor's ``epsilon1``).
    orthogonal_mask: which declared matrices of a tier with
      ``direction="orthogonal"`` take that direction: ``None`` for all, or a
      pytree of bools matched by path like ``param_labels`` (or a callable
      returning one; static under ``inject_hyperparams``). Muon leaves
      embeddings and the unembedding to Adam; so can this. Refused when no
      tier is orthogonal (it would be ignored).
    nesterov: Nesterov's momentum in Adam's direction, as
      ``optax.scale_by_adam(nesterov=True)``:
      ``m̂_t = b1·m_t / (1 − b1^(t+1)) + (1 − b1)·g_t / (1 − b1^t)``. (The
      orthogonal direction always uses its Nesterov mix.)
    clip_threshold: ``d`` of Adafactor's update clipping, ``u ← u / max(1,
      RMS(u)/d)`` over a declared matrix's axes, so ``RMS(u) ≤ d``.
      ``"auto"`` (default): ``d = 1`` (:data:`AUTO_CLIP_THRESHOLD`,
      Adafactor's, and Adam's own first-step RMS) on exactly the leaves
      whose form has no bound of its own (:func:`has_own_bound`: a factored
      ``v`` or a compact momentum in Adam's direction, whose
      reconstructions can make single entries far larger than Adam's, 6–23x
      at step 1); a number: that ``d`` on every declared matrix in Adam's
      direction; ``None``: no clipping (the default before 0.3.0, and what every run before it measured).
    contain_nonfinite: ``True`` (default): gradient entries that are not
      finite, or whose square could overflow a sum over their leaf
      (``|g| > √(max_float32 / size)``, which ``optax.apply_if_finite`` lets
      through), count as zero for that step, in the global norm of
      ``max_grad_norm`` too: their moments decay, every other entry and leaf
      is unaffected, and a factored matrix is never poisoned (without it,
      one NaN or one 3e19 entry spreads over its whole matrix and stays).
      Ordinary entries pass unchanged, but the extra select lets XLA order
      some products differently (last-bit differences). ``False``: off
      (the default before 0.3.0, and what every run before it measured).
    max_grad_norm: clip the incoming updates to this global norm first, as
      ``optax.clip_by_global_norm(max_grad_norm)`` chained in front does,
      with the same result bit for bit; ``None`` (default): no clipping. The
      difference is where: each leaf is clipped inside its own step, so an
      orthogonalised stacked bank reads its raw gradient in the layer loop.
      Chained in front, the clipped gradients are a new array that XLA:GPU
      copies into the loop: one more bank-sized buffer at the peak (4.4 GB at
      ``moe-6.78b``). The norm is over the leaves this transform sees (under
      ``optax.partition``, its own partition's).
    group_leaves: ``True``: leaves of one plan, shape and dtype are stepped
      together, stacked, in groups of at most :data:`GROUP_MAX_ELEMENTS`
      entries (:func:`leaf_groups`), so the step's kernels are compiled once
      a group, not once a leaf; the result is the same to float32 round-off
      (batched products and reductions may sum in another order). What it
      costs is the stacking: a copy of each grouped leaf's gradient and state
      in, and one out, per step. ``"stacked"``: as ``True``, and each group's
      state is kept stacked too, in the place of the group's first leaf (its
      later leaves hold ``optax.MaskedNode()`` in every field, as under
      ``optax.masked``), so a step stacks only the gradients and slices only
      the updates. ``False``: each leaf alone. ``"auto"`` (default): a new
      state is ``"stacked"`` on every backend (before 0.3.0 the CPU stepped
      each leaf alone, and every CPU-trained figure up to then was measured so;
      grouping moves an update by round-off only, and the default's 1600-step
      row moved by 0.05 perplexity, ``experiments/stacked_layout.sh``); its
      update continues a state of either layout, on either backend (a
      leaf-by-leaf state on the CPU leaf by leaf, as it was made). On the 501-leaf Hugging Face
      Mixtral-shaped tree of ``python -m experiments.bench --compile-time``
      (8192-entry leaves; the README's compile rows), trace + compile took
      1.8x ``optax.adamw``'s with XLA:GPU stacked, 3.3x grouped and 7.9x each
      leaf alone (XLA:CPU: 1.1x, 3.5x and 8.5x), and on the CPU the stacked
      update ran in 0.4-1.1 of the time of each leaf alone (``python -m
      experiments.bench --grouping-cost``). What ``"stacked"`` changes is the
      state's layout: a group's arrays have one more leading axis (the group's
      leaves in flattening order), ``state_shardings`` replicates that axis,
      and a state made with ``True``, ``False`` or ``"stacked"`` must be
      continued with the same setting (``"auto"`` reads it from the state; a
      checkpoint restored into a target made on another backend must name the
      layout, e.g. ``group_leaves="stacked"`` on a CPU for a GPU's state).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`ScaleBySkewAdamState`.

  Raises:
    ValueError: for hyperparameters out of range, an unknown encoding, a
      ``nu_dtype`` too coarse for ``b2``, labels or matrix axes that do not
      match the tree or are invalid, or an ``update`` whose tree or state
      differs from what ``init`` made (each message names the parameter path).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import skewadam_jax
    >>> params = {"embed": jnp.ones((8, 4)),
    ...           "moe": {"router": jnp.ones((4, 2)),
    ...                   "experts": jnp.ones((2, 4, 6))}}
    >>> tx = skewadam_jax.scale_by_skewadam()
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state)
    >>> state.nu_row["moe"]["experts"].shape   # factored v: [E, d_in, 1]
    (2, 4, 1)
  """
  _check_hyperparameters(b1, b2, eps, eps_root, factored_eps)
  _refuse_scheduled_structure(param_labels=param_labels, matrix_axes=matrix_axes,
                              orthogonal_mask=orthogonal_mask)
  tiers = {"backbone": backbone, "expert": expert, "router": router}
  for name, default in (("backbone", DEFAULT_BACKBONE), ("expert", DEFAULT_EXPERT),
                        ("router", DEFAULT_ROUTER)):
    tiers[name] = _as_tier_config(name, tiers[name], default)
    _check_nu_dtype(name, tiers[name], b2)
  for name, tier in tiers.items():
    _warn_bf16_momentum(name, tier, b1)
  if group_leaves not in ("auto", True, False, STACKED):
    raise ValueError(f"group_leaves must be 'auto', True, False or 'stacked', got "
                     f"{group_leaves!r}.")
  if isinstance(clip_threshold, str) and clip_threshold != "auto":
    raise ValueError(f"clip_threshold must be 'auto', a number > 0 or None, got "
                     f"{clip_threshold!r}.")
  if isinstance(clip_threshold, numbers.Real) and not clip_threshold > 0:
    raise ValueError(f"clip_threshold must be > 0 or None, got {clip_threshold}.")
  if isinstance(max_grad_norm, numbers.Real) and not max_grad_norm > 0:
    raise ValueError(f"max_grad_norm must be > 0 or None, got {max_grad_norm}.")
  if orthogonal_mask is not None and not any(
      t.direction in ORTHOGONAL_DIRECTIONS for t in tiers.values()):
    raise ValueError("orthogonal_mask is given but no tier has direction='orthogonal', so "
                     "it would be ignored; set a tier's direction or drop the mask.")

  def plans_for(tree, warn=False):
    return leaf_plans(tree, param_labels=param_labels, matrix_axes=matrix_axes,
                      orthogonal_mask=orthogonal_mask, warn=warn, **tiers)

  def init_fn(params):
    # A Python number is a leaf optax accepts; its state is that of a 0-d array.
    params = jax.tree.map(lambda x: x if hasattr(x, "shape") else jnp.asarray(x), params)
    _check_inexact(params)
    leaves, treedef = jax.tree.flatten(params)
    plans = plans_for(params, warn=True)
    per_leaf = _init_parts(plans, leaves, _init_stacks_state(group_leaves))
    fields = {name: treedef.unflatten([parts.get(name, _placeholder()) for parts in per_leaf])
              for name in FIELDS}
    return ScaleBySkewAdamState(count=jnp.zeros([], jnp.int32), **fields)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    if isinstance(state, (dict, list)) or (type(state) is tuple):  # pylint: disable=unidiomatic-typecheck
      raise ValueError(
          f"SkewAdam's update got a plain {type(state).__name__} where its "
          "ScaleBySkewAdamState belongs: a checkpoint restored without a target (orbax "
          "with no abstract state) comes back as plain containers. Restore it into the "
          "optimizer's own state, e.g. with orbax "
          "ocp.args.StandardRestore(jax.eval_shape(tx.init, params)) or a target of "
          "tx.init(params); its arrays then continue where they stopped.")
    if not isinstance(state, ScaleBySkewAdamState):
      raise ValueError(
          f"SkewAdam's update got a {type(state).__name__} state, not the "
          "ScaleBySkewAdamState its init makes: a state from another optimizer "
          "(e.g. optax.adamw) cannot be continued by SkewAdam; init a new one.")
    b1_, b2_ = _decay(b1), _decay(b2)
    paths, grads, treedef = labels_lib.flatten_with_paths(updates)
    masked_treedef = jax.tree.structure(updates, is_leaf=_is_masked)
    field_leaves = {}
    for name in FIELDS:
      field = getattr(state, name)
      # MaskedNode as a leaf on both sides: optax.masked's (in the updates and the
      # state alike) and a stacked group's later leaves (in the state only).
      if jax.tree.structure(field, is_leaf=_is_masked) != masked_treedef:
        raise ValueError(
            f"The updates' tree ({masked_treedef.num_leaves} leaves) differs from the "
            f"one SkewAdam's state was made for "
            f"({jax.tree.structure(field, is_leaf=_is_masked).num_leaves} "
            f"leaves in its {name!r} field): {_tree_difference(updates, field)}. "
            "The tree must not change between init and update.")
      field_leaves[name] = treedef.flatten_up_to(field)
    plans = plans_for(updates)
    count = optax.safe_increment(state.count)
    parts = [{name: field_leaves[name][i] for name in FIELDS} for i in range(len(grads))]
    stack_groups = leaf_groups(plans, grads)  # the groups, when leaves are grouped
    if group_leaves == "auto":  # the layout the state was made with, on whichever backend
      state_stacked = _holds_stacked_groups(stack_groups, parts)
      grouped = state_stacked or jax.default_backend() != "cpu"
    else:
      state_stacked = group_leaves == STACKED
      grouped = bool(group_leaves)
    groups = stack_groups if grouped else leaf_groups(plans, grads, None)
    for indices in groups:
      if state_stacked and len(indices) > 1:
        _check_group_parts(paths, indices, plans, grads, parts)
      else:
        for i in indices:
          _check_parts(paths[i], plans[i], grads[i], parts[i])
    clip = None if max_grad_norm is None else _global_norm_clip(updates, max_grad_norm,
                                                                 contain_nonfinite)
    step = functools.partial(
        _step_leaf, b1=b1_, b2=b2_, eps=eps, eps_root=eps_root, factored_eps=factored_eps,
        count=count, nesterov=nesterov, clip_threshold=clip_threshold,
        contain_nonfinite=contain_nonfinite, clip=clip)
    stepped = {}
    previous = None  # the outputs of the last large step
    for indices in groups:
      large = sum(math.prod(grads[i].shape) for i in indices) >= LARGE_LEAF_ELEMENTS
      if large and previous is not None:
        # One large step at a time: its inputs wait for the previous one's
        # outputs, so the program's temporaries are one bank's, not several
        # banks' at once (XLA:GPU otherwise overlaps them as its scheduler
        # sees fit: 17.9 GB against 4.4 GB for moe-6.78b's update).
        (inputs, _) = jax.lax.optimization_barrier(
            ([(grads[i], parts[i]) for i in indices], previous))
        for i, (g_i, parts_i) in zip(indices, inputs):
          grads[i], parts[i] = g_i, parts_i
      result = _step_group(indices, grads, plans, parts, step, count, state_stacked)
      if large:
        previous = [result[i] for i in indices]
      stepped.update(result)
    out = [stepped[i][0] for i in range(len(grads))]
    new_parts = [{name: stepped[i][1].get(name, parts[i][name]) for name in FIELDS}
                 for i in range(len(grads))]
    return treedef.unflatten(out), ScaleBySkewAdamState(
        count=count, **{name: treedef.unflatten([p[name] for p in new_parts])
                        for name in FIELDS})

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _tree_difference(updates, field) -> str:
  """Which paths are only in the updates and which only in the state, for errors.

  ``optax.MaskedNode`` counts as a leaf on both sides: a stacked group's later
  leaves (in the state) and ``optax.masked``'s holes (in both) are paths too.
  """
  paths, _, _ = labels_lib.flatten_with_paths(updates, is_leaf=_is_masked)
  state_paths, _, _ = labels_lib.flatten_with_paths(field, is_leaf=_is_masked)
  only_updates = [p for p in paths if p not in set(state_paths)]
  only_state = [p for p in state_paths if p not in set(paths)]
  if not only_updates and not only_state:
    return "the same paths in containers of other types or order"
  return (f"paths only in the updates {only_updates[:3]}, only in the state "
          f"{only_state[:3]}")


def decayed_leaves(mask, tree, matrix_axes: axes_lib.AxesSpec = None) -> list[bool]:
  """Whether each leaf of ``tree`` is decayed, in flattening order.

  ``mask``: ``"matrices"`` (the leaves ``matrix_axes`` declares matrices),
  ``None`` (every leaf), or a pytree of bools matched by path (or a function
  returning one).
  """
  if isinstance(mask, str) and mask == MATRICES:
    return jax.tree.leaves(matrices_only(tree, matrix_axes))
  if mask is None:
    return [True] * len(jax.tree.leaves(tree))
  spec = mask(tree) if labels_lib.is_function(mask) else mask
  return [bool(m) for m in labels_lib.spec_per_leaf(spec, tree, what="mask")]


def matrices_only(params, matrix_axes: axes_lib.AxesSpec = None):
  """Weight-decay mask: True for the leaves declared matrices.

  With ``matrix_axes=None``, the leaves with at least 2 dimensions; otherwise
  the leaves whose declared axes (:mod:`skewadam_jax.axes`) are not ``None``:
  no decay on biases, norm scales (also stacked ``[L, D]`` ones, when
  declared) and other vectors.
  """
  _, treedef = jax.tree.flatten(params)
  declared = axes_lib.resolve_matrix_axes(matrix_axes, params)
  return treedef.unflatten([axes is not None for axes in declared])


class _DecayState(NamedTuple):
  """State of the declared-matrix weight decay with a constant rate (none)."""


class DecayScheduleState(NamedTuple):
  """State of the declared-matrix weight decay with a scheduled rate.

  Attributes:
    count: the number of updates so far, the schedule's argument.
  """
  count: jax.Array  # shape=(), dtype=jnp.int32.


def add_decayed_weights_to_matrices(
    weight_decay: optax.ScalarOrSchedule = 0.0,
    matrix_axes: axes_lib.AxesSpec = None,
    *,
    mask: Any = MATRICES,
) -> optax.GradientTransformation:
  """``u + λ_t·p`` on the leaves declared matrices, ``u`` elsewhere.

  ``optax.add_decayed_weights(weight_decay, mask)`` with the mask
  :func:`matrices_only` computed from the tree at each update. Unlike a
  callable mask it holds no callable argument, so
  ``optax.inject_hyperparams`` does not mistake it for a schedule.

  Args:
    weight_decay: ``λ``, a number or a schedule of the update count (as
      ``optax.add_decayed_weights``; then the state counts updates).
    matrix_axes: the declared matrix axes (:mod:`skewadam_jax.axes`).
    mask: ``"matrices"`` (the leaves ``matrix_axes`` declares matrices),
      ``None`` (every leaf), or a pytree of bools matched by path (or a
      function returning one).

  Raises:
    ValueError: if ``update`` is called without ``params``.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> decay = add_decayed_weights_to_matrices(optax.linear_schedule(0.1, 0.0, 10))
    >>> params = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    >>> updates, state = decay.update(params, decay.init(params), params)
    >>> updates["w"][0, 0].item(), updates["b"][0].item()  # 1 + 0.1·1, no decay
    (1.100000023841858, 1.0)
  """
  scheduled = callable(weight_decay)

  def init_fn(params):
    del params
    return DecayScheduleState(jnp.zeros([], jnp.int32)) if scheduled else _DecayState()

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("Weight decay needs the params: call update(updates, state, params).")
    if scheduled:
      rate = weight_decay(state.count)
      state = DecayScheduleState(optax.safe_increment(state.count))
    else:
      rate = weight_decay
    where = jax.tree.structure(updates).unflatten(decayed_leaves(mask, updates, matrix_axes))
    decayed = jax.tree.map(
        lambda u, p, m: (u + rate * p).astype(u.dtype) if m else u,
        updates, params, where)
    return decayed, state

  return optax.GradientTransformation(init_fn, update_fn)


_UNSET = object()
_MU_DTYPE_ENCODINGS = {jnp.dtype(jnp.float32): "fp32", jnp.dtype(jnp.bfloat16): "bf16"}


def _with_mu_dtype(name: str, tier: TierLike, mu_dtype) -> TierLike:
  """``tier`` with its momentum stored densely in ``mu_dtype`` (``optax.adamw``'s argument)."""
  if mu_dtype is None:
    return tier
  encoding = _MU_DTYPE_ENCODINGS.get(jnp.dtype(mu_dtype))
  if encoding is None:
    raise ValueError(f"mu_dtype must be None, float32 or bfloat16, got {mu_dtype!r}.")
  if isinstance(tier, TierConfig) or (isinstance(tier, dict) and "momentum" in tier):
    raise ValueError(f"mu_dtype and an explicit {name} tier both set its momentum; "
                     f"set momentum={encoding!r} in the {name} config instead.")
  return {**(tier or {}), "momentum": encoding}


def skewadam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    weight_decay: optax.ScalarOrSchedule = 1e-4,
    mask: Any = MATRICES,
    *,
    nesterov: bool = False,
    weight_decay_mask: Any = _UNSET,
    param_labels: labels_lib.LabelSpec = None,
    matrix_axes: axes_lib.AxesSpec = None,
    backbone: TierLike = None,
    expert: TierLike = None,
    router: TierLike = None,
    factored_eps: float = 1e-30,
    orthogonal_mask: Any = None,
    clip_threshold: Union[float, str, None] = "auto",
    contain_nonfinite: bool = True,
    max_grad_norm: Optional[float] = None,
    group_leaves: Union[bool, str] = "auto",
) -> optax.GradientTransformationExtraArgs:
  r"""SkewAdam with decoupled weight decay, composed as ``optax.adamw`` is.

  ``optax.chain(scale_by_skewadam(...), <weight decay>,
  scale_by_learning_rate(learning_rate))``, so the parameter update is::

      Δθ_t = −lr_t · (u_t + λ_t·θ_{t−1})

  with ``u_t`` from :func:`scale_by_skewadam` and ``λ_t = weight_decay`` applied
  where the mask is True. The positional arguments are ``optax.adamw``'s, in
  its order, so a call written for ``optax.adamw`` runs unchanged.

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, eps_root: as in :func:`scale_by_skewadam`.
    mu_dtype: ``None`` (default): each tier stores its momentum in its own
      encoding. ``float32`` or ``bfloat16``: every tier not given explicitly
      stores it densely in that dtype (``optax.adamw``'s meaning); set a
      given tier's ``momentum`` in its config instead.
    weight_decay: decoupled weight decay ``λ``, a number or a schedule of the
      update count (as ``optax.adamw``).
    mask: which leaves are decayed. ``"matrices"`` (default): exactly the
      leaves ``matrix_axes`` declares matrices
      (:func:`add_decayed_weights_to_matrices`; no decay on vectors, stacked
      norm scales included when declared). Otherwise as ``optax.adamw``'s
      ``mask``: a pytree of bools or a callable returning one, passed to
      ``optax.add_decayed_weights``; ``None`` decays all leaves. A callable
      must be named in ``static_args`` under ``optax.inject_hyperparams``;
      the default needs nothing.
    nesterov: Nesterov's momentum, as ``optax.adamw(nesterov=True)``.
    weight_decay_mask: the former name of ``mask`` (either, not both).
    param_labels: as in :func:`scale_by_skewadam`, and so are
      ``matrix_axes``, ``backbone``, ``expert``, ``router``,
      ``factored_eps``, ``orthogonal_mask``, ``clip_threshold``,
      ``contain_nonfinite``, ``group_leaves`` and ``max_grad_norm`` (``max_grad_norm=1.0`` is
      ``optax.chain(optax.clip_by_global_norm(1.0), skewadam(...))`` with no
      clipped copy of the gradients).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Raises:
    ValueError: for ``learning_rate < 0`` or ``weight_decay < 0`` (or NaN),
      and everything :func:`scale_by_skewadam` rejects.

  Non-finite gradients: wrap the whole chain in
  ``optax.apply_if_finite(tx, max_consecutive_errors=K)``. A step whose
  gradients hold a NaN or Inf then returns zero updates and leaves the inner
  state (moments, step count, schedule) untouched, exactly as if the batch
  had been skipped. Note that after ``K`` consecutive bad steps optax applies
  the next one anyway: stop the loop yourself when ``state.notfinite_count``
  reaches ``K``, before that happens (``state.total_notfinite`` counts all
  skips).

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import skewadam_jax
    >>> params = {"embed": jnp.ones((8, 4)),
    ...           "moe": {"router": jnp.ones((4, 2)),
    ...                   "experts": jnp.ones((2, 4, 6))}}
    >>> tx = optax.chain(optax.clip_by_global_norm(1.0),
    ...                  skewadam_jax.skewadam(learning_rate=1e-3))
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
  """
  # `not x >= 0` also rejects NaN. Schedules and injected arrays are not checked.
  if isinstance(weight_decay, numbers.Real) and not weight_decay >= 0:
    raise ValueError(f"weight_decay must be >= 0, got {weight_decay}.")
  if isinstance(learning_rate, numbers.Real) and not learning_rate >= 0:
    raise ValueError(f"learning_rate must be >= 0, got {learning_rate}.")
  if weight_decay_mask is not _UNSET:
    if not (isinstance(mask, str) and mask == MATRICES):
      raise ValueError("Give the weight-decay mask as mask= or as weight_decay_mask=, not both.")
    mask = weight_decay_mask
  matrix_axes = axes_lib.for_labels(matrix_axes, param_labels)
  if (isinstance(mask, str) and mask == MATRICES) or callable(weight_decay):
    # A scheduled rate with any mask counts its own steps here: optax 0.2.6's
    # add_decayed_weights never advances its schedule.
    decay = add_decayed_weights_to_matrices(weight_decay, matrix_axes, mask=mask)
  elif isinstance(mask, str):
    raise ValueError(f"mask must be {MATRICES!r}, a pytree of bools, "
                     f"a callable or None, got {mask!r}.")
  else:
    if mask is not None and not labels_lib.is_function(mask) and callable(mask):
      # optax calls any callable mask: a callable pytree (an Equinox module of
      # bools) is the mask itself.
      mask = (lambda tree, _mask=mask: _mask)
    decay = optax.add_decayed_weights(weight_decay, mask)
  backbone, expert, router = (
      _with_mu_dtype(name, tier, mu_dtype)
      for name, tier in (("backbone", backbone), ("expert", expert), ("router", router)))
  return optax.chain(
      scale_by_skewadam(
          b1=b1, b2=b2, eps=eps, eps_root=eps_root, param_labels=param_labels,
          matrix_axes=matrix_axes, backbone=backbone, expert=expert, router=router,
          factored_eps=factored_eps, orthogonal_mask=orthogonal_mask, nesterov=nesterov,
          clip_threshold=clip_threshold, contain_nonfinite=contain_nonfinite,
          max_grad_norm=max_grad_norm, group_leaves=group_leaves),
      decay,
      optax.scale_by_learning_rate(learning_rate),
  )
