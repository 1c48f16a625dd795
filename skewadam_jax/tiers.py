"""The tier plan: how each leaf's moments are stored.

:class:`TierConfig` says how one tier (backbone, expert, router) stores Adam's
moments; :func:`leaf_plans` resolves it, with the leaf's declared matrix axes,
shape and dtype, into a :class:`LeafPlan` per leaf, the plan
:func:`~skewadam_jax.scale_by_skewadam` steps by. Also here: the default
tiers and the checks of the hyperparameters and the tree that the
transformation runs before it builds anything.

Examples:
  >>> import jax.numpy as jnp
  >>> from skewadam_jax import tiers
  >>> plan, = tiers.leaf_plans({"w": jnp.zeros((4, 8))}, param_labels="expert")
  >>> plan.encoding.name, plan.factored, (plan.axes.rows, plan.axes.cols)
  ('sign', True, (0, 1))
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp

from skewadam_jax import _warn
from skewadam_jax import axes as axes_lib
from skewadam_jax import encodings
from skewadam_jax import labels as labels_lib
from skewadam_jax import orthogonal


SECOND_MOMENT_FORMS = ("exact", "factored")
DIRECTIONS = ("adam", "orthogonal", "normalized_orthogonal")
# What an orthogonal direction with low-rank momentum runs Newton–Schulz on
# (TierConfig.lowrank_orthogonalise).
LOWRANK_ORTHOGONALISE = ("full", "factors", "factors_rms")
# The forms that orthogonalise through the stored factors.
THROUGH_FACTORS = ("factors", "factors_rms")
ORTHOGONAL_DIRECTIONS = ("orthogonal", "normalized_orthogonal")
NU_FIELDS = ("nu", "nu_row", "nu_col")
FIELDS = ("mu",) + NU_FIELDS + encodings.MOMENTUM_FIELDS[1:]


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
      axes; without a context mesh (one device) it changes nothing. The
      owners split the first batch axis whose length divides by their count
      (a group of same-shaped banks stepped together, ``[2, E, R, C]``, along
      its experts), and a chunk holds a multiple of that count (a stack with
      no such axis keeps the usual chunks). ``()`` (the default):
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
      ``1400 × 1024`` expert matrix at rank 84), or ``"factors_rms"``: the
      same, times ``√(min(R, C)/r)``, so that the rank-``r`` update has the
      Frobenius norm (and RMS) of the whole matrix's, whose ``min(R, C)``
      singular values are all about 1; a rank-``r`` update is otherwise
      ``√(r/min(R, C))`` of it, a smaller step at the same rate. Through the
      factors there is no complement to weigh, so ``lowrank_complement``
      must stay 1. Changes no state.
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
    if self.lowrank_orthogonalise in THROUGH_FACTORS and self.momentum != "lowrank":
      raise ValueError(f"lowrank_orthogonalise={self.lowrank_orthogonalise!r} "
                       f"orthogonalises through the low-rank "
                       f"momentum's factors; momentum={self.momentum!r} has none (use "
                       "momentum='lowrank').")
    if self.lowrank_orthogonalise in THROUGH_FACTORS and self.lowrank_complement != 1.0:
      raise ValueError(
          f"lowrank_complement={self.lowrank_complement} weighs the part of a full "
          "orthogonalised update outside the momentum's subspace; "
          f"lowrank_orthogonalise={self.lowrank_orthogonalise!r} orthogonalises inside the "
          "subspace only, so "
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
    _warn.warn(
        f"{name} tier: bf16 momentum at b1={b1} can stall up to "
        f"{eps / (2 * (1 - b1)):.0%} away from the EMA it stores (rounding to nearest "
        f"drops increments below half a bf16 step; needs b1 <= {1 - 10 * eps:.3f} for 5 %). "
        "Use momentum_rounding='stochastic' (the default) or momentum='fp32' for this tier.",
        )


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
    _warn.warn(
        f"SkewAdam guessed the matrix axes of {len(stacked)} stacked leaves as their last "
        f"two, e.g. {stacked[:3]}: a layer or head axis among them would be factored, "
        "decayed and orthogonalised across. Declare matrix_axes (MatrixAxes(rows, cols, "
        "layer=...), scanned_matrix_axes(...)) or label with a label_fn set that declares "
        f"its axes ({', '.join(axes_lib.NAMED_SETS)}); skewadam_jax.plan_table(params) "
        "shows every leaf's axes.")
