"""SkewAdam: Adam's learning rule with per-tier storage of its moments.

Adam keeps, for every parameter, a momentum ``m`` and a second moment ``v``::

    m_t = b1·m_{t−1} + (1 − b1)·g_t          m̂_t = m_t / (1 − b1^t)
    v_t = b2·v_{t−1} + (1 − b2)·g_t²         v̂_t = v_t / (1 − b2^t)
    u_t = m̂_t / (√(v̂_t + eps_root) + eps)

SkewAdam computes the same ``u_t`` but lets each *tier* of a Mixture-of-Experts
model store ``m`` and ``v`` in its own form (see :class:`TierConfig`):

* ``backbone`` (embeddings, attention, norms, unembedding): bf16 momentum and
  a factored ``v`` for matrices (exact for vectors) by default; fp32 momentum
  and an exact ``v`` make it Adam's.
* ``expert`` (the stacked expert bank ``[..., E, d_in, d_out]``): a compact
  momentum encoding (:mod:`skewadam_jax.encodings`, default 1-bit sign with a
  factored magnitude) and a factored ``v`` per expert matrix: row and column
  EMAs of ``g² + factored_eps`` over the last two axes, reconstructed as
  ``v ≈ row·colᵀ / mean(row)`` (:mod:`skewadam_jax.factored`). Every leading
  axis (layer, expert) is a batch axis.
* ``router`` (gating weights): fp32 momentum and exact ``v``.

Tiers are assigned by labels on the parameter pytree (:mod:`skewadam_jax.labels`).
The state keeps each tier's moments in a dict keyed by the ``/``-joined
parameter path, so the state says which tier holds what and how many bytes
it takes (:mod:`skewadam_jax.accounting`).

A step's reductions (the factored statistics of ``g²`` and ``|m|`` and the
packed sign bits) are computed in the form each backend compiles best, chosen
with ``jax.lax.platform_dependent``: plain means on GPU and TPU, two grouped
passes on CPU (:func:`skewadam_jax.factored.row_col_means_grouped`). Both give
the same state up to the order of summation.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from skewadam_jax import encodings
from skewadam_jax import factored
from skewadam_jax import labels as labels_lib

SECOND_MOMENT_FORMS = ("exact", "factored")


@dataclasses.dataclass(frozen=True)
class TierConfig:
  """How one tier stores Adam's moments.

  All fields determine the shapes and dtypes of the state: under
  ``optax.inject_hyperparams`` they are static (a ``TierConfig`` is never
  injected as a hyperparameter).

  Attributes:
    momentum: the momentum encoding, one of ``"fp32"``, ``"bf16"``, ``"int8"``,
      ``"sign"``, ``"none"`` (see :mod:`skewadam_jax.encodings` for bytes per
      parameter and round-trip bounds).
    second_moment: ``"exact"`` (one value per parameter) or ``"factored"``
      (row and column statistics over the last two axes; leaves with fewer
      than two dimensions stay exact).
    nu_dtype: dtype of the stored second-moment statistics.
    int8_block_size: block length along the last axis for ``"int8"``.
  """
  momentum: str = "fp32"
  second_moment: str = "exact"
  nu_dtype: Any = jnp.float32
  int8_block_size: int = 256

  def __post_init__(self):
    # Checked for every encoding, so a bad value fails where it is written
    # rather than later, when someone switches the tier to "int8".
    if (isinstance(self.int8_block_size, bool)
        or not isinstance(self.int8_block_size, int) or self.int8_block_size <= 0):
      raise ValueError(f"int8_block_size must be a positive int, got "
                       f"{self.int8_block_size!r}.")
    encodings.get_encoding(self.momentum, block_size=self.int8_block_size)
    if self.second_moment not in SECOND_MOMENT_FORMS:
      raise ValueError(
          f"Unknown second_moment {self.second_moment!r}; expected one of "
          f"{SECOND_MOMENT_FORMS}.")
    if not jnp.issubdtype(jnp.dtype(self.nu_dtype), jnp.floating):
      raise ValueError(f"nu_dtype must be a floating dtype, got {self.nu_dtype!r}.")


# The defaults were chosen by experiments/compare.py's ablation (choose_default):
# the best validation perplexity among configurations whose moe-6.78b state is
# at most the published 1.29 GB, provided it matches AdamW's (README,
# "Optimizer comparison"). tests/test_compare.py holds them to that choice.
DEFAULT_BACKBONE = TierConfig(momentum="bf16", second_moment="factored")
DEFAULT_EXPERT = TierConfig(momentum="sign", second_moment="factored")
DEFAULT_ROUTER = TierConfig(momentum="fp32", second_moment="exact")

TierLike = Union[TierConfig, dict, None]


class TierState(NamedTuple):
  """One tier's moments, keyed by ``/``-joined parameter path.

  Attributes:
    mu: path → encoded momentum (absent for the ``"none"`` encoding).
    nu: path → exact second moment (array) or
      :class:`~skewadam_jax.factored.FactoredMoment`.
  """
  mu: dict
  nu: dict


class ScaleBySkewAdamState(NamedTuple):
  """State of :func:`scale_by_skewadam`."""
  count: jax.Array  # shape=(), dtype=jnp.int32.
  backbone: TierState
  expert: TierState
  router: TierState


class _LeafPlan(NamedTuple):
  """How one leaf is stored: resolved from its tier and its shape."""
  encoding: Optional[encodings.MomentumEncoding]
  factored: bool
  nu_dtype: Any


def _as_tier_config(name: str, value: TierLike, default: TierConfig) -> TierConfig:
  if value is None:
    return default
  if isinstance(value, TierConfig):
    return value
  if isinstance(value, dict):
    return dataclasses.replace(default, **value)
  raise ValueError(f"{name} must be a TierConfig or a dict of its fields, got {value!r}.")


def _check_unit_interval(name: str, value) -> None:
  if isinstance(value, numbers.Real) and not 0.0 <= value < 1.0:
    raise ValueError(f"{name} must be in [0, 1), got {value}.")


def _check_hyperparameters(b1, b2, eps, eps_root, factored_eps) -> None:
  """Checks the hyperparameters that are concrete numbers (not injected)."""
  _check_unit_interval("b1", b1)
  _check_unit_interval("b2", b2)
  if isinstance(eps, numbers.Real) and not eps > 0:
    raise ValueError(f"eps must be > 0, got {eps}.")
  if isinstance(eps_root, numbers.Real) and not eps_root >= 0:
    raise ValueError(f"eps_root must be >= 0, got {eps_root}.")
  if isinstance(factored_eps, numbers.Real) and not factored_eps >= 0:
    raise ValueError(f"factored_eps must be >= 0, got {factored_eps}.")


def _leaf_plan(tier: str, config: TierConfig, path: str, shape) -> _LeafPlan:
  ndim = len(shape)
  if tier == labels_lib.EXPERT and ndim < 3:
    raise ValueError(
        f"Expert parameter {path!r} has shape {tuple(shape)}; the expert tier "
        "needs a stacked bank of at least 3 dimensions [..., E, d_in, d_out]. "
        "Label it 'backbone' or fix its shape.")
  encoding = encodings.get_encoding(config.momentum, block_size=config.int8_block_size)
  if encoding is not None and ndim < encoding.min_ndim:
    encoding = encodings.DenseEncoding(jnp.float32)
  return _LeafPlan(encoding=encoding,
                   factored=config.second_moment == "factored" and ndim >= 2,
                   nu_dtype=config.nu_dtype)


def _init_leaf(plan: _LeafPlan, shape):
  mu = None if plan.encoding is None else plan.encoding.init(shape)
  if plan.factored:
    nu = factored.init_factored(shape, plan.nu_dtype)
  else:
    nu = jnp.zeros(shape, plan.nu_dtype)
  return mu, nu


def _expected_nu_shapes(plan: _LeafPlan, shape):
  if plan.factored:
    return factored.factored_shapes(tuple(shape))
  return (tuple(shape),)


def _reductions(g_sq, m, *, grouped: bool):
  """The reductions of one step, over the last two axes of a leaf.

  Returns the row and column means of each of ``g_sq`` (the factored ``v``'s
  input, or ``None``) and ``|m|`` (the sign encoding's magnitude, when ``m`` is
  not ``None``), and the packed sign bits of ``m`` (or ``None``).
  ``grouped=True`` computes them all in two passes
  (:func:`~skewadam_jax.factored.row_col_means_grouped`, for XLA:CPU);
  otherwise as plain means and ``jnp.packbits``, which XLA:GPU and XLA:TPU fuse
  with their producers.
  """
  xs = [x for x in (g_sq, None if m is None else jnp.abs(m)) if x is not None]
  if grouped:
    weights = [] if m is None else [encodings.SignEncoding.bit_weights(m)]
    means, group_sums = factored.row_col_means_grouped(xs, weights)
    bits = group_sums[0] if group_sums else None
  else:
    means = [factored.row_col_means(x) for x in xs]
    bits = None if m is None else jnp.packbits(m < 0, axis=-1)
  return means, bits


def _update_leaf(plan: _LeafPlan, g, mu, nu, *, b1, b2, eps, eps_root,
                 factored_eps, count):
  """One leaf's Adam step in float32; returns (update, new mu, new nu)."""
  g32 = g.astype(jnp.float32)
  encoding = plan.encoding
  sign = isinstance(encoding, encodings.SignEncoding)
  m = None if encoding is None else (1 - b1) * g32 + b1 * encoding.decode(mu)
  if plan.factored or sign:
    g_sq = g32 * g32 + factored_eps if plan.factored else None
    m_signed = m if sign else None
    means, bits = jax.lax.platform_dependent(
        cpu=lambda: _reductions(g_sq, m_signed, grouped=True),
        default=lambda: _reductions(g_sq, m_signed, grouped=False))
  if plan.factored:
    nu = factored.ema_factored(nu, means[0], b2)
    v = factored.rank_one(nu.row.astype(jnp.float32), nu.col.astype(jnp.float32))
  else:
    v = (1 - b2) * g32 * g32 + b2 * nu.astype(jnp.float32)
    nu = v.astype(plan.nu_dtype)
  v_hat = v / (1 - b2**count)
  if encoding is None:
    m_hat = g32
  else:
    mu = (encodings.SignMomentum(bits=bits, magnitude=means[-1]) if sign
          else encoding.encode(m))
    m_hat = m / (1 - b1**count)
  update = m_hat / (jnp.sqrt(v_hat + eps_root) + eps)
  return update.astype(g.dtype), mu, nu


def scale_by_skewadam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    *,
    param_labels: labels_lib.LabelSpec = None,
    backbone: TierLike = None,
    expert: TierLike = None,
    router: TierLike = None,
    factored_eps: float = 1e-30,
) -> optax.GradientTransformationExtraArgs:
  r"""Rescales updates with Adam's rule, storing moments per tier.

  For every leaf, with ``t`` the step count::

      m_t = b1·m_{t−1} + (1 − b1)·g_t,       m̂_t = m_t / (1 − b1^t)
      v_t = b2·v_{t−1} + (1 − b2)·g_t²,      v̂_t = v_t / (1 − b2^t)
      u_t = m̂_t / (√(v̂_t + eps_root) + eps)

  where ``m_{t−1}`` is the decoded stored momentum of the leaf's tier and,
  for a factored tier, ``v_t`` is the rank-one reconstruction
  ``row_t·col_tᵀ / mean(row_t)`` of the row and column EMAs of
  ``g_t² + factored_eps`` over the last two axes. With the ``"none"`` momentum
  encoding ``m̂_t = g_t``. With every tier at ``TierConfig("fp32", "exact")``
  this is ``optax.scale_by_adam`` exactly.

  Args:
    b1: EMA decay of the momentum, in [0, 1).
    b2: EMA decay of the second moment, in [0, 1).
    eps: added to √v̂ in the denominator, > 0.
    eps_root: added to v̂ inside the square root, >= 0.
    param_labels: tier of each leaf: ``None`` for
      :func:`~skewadam_jax.moe_param_labels` with its defaults, a pytree of
      ``"backbone" | "expert" | "router"`` with the structure of the params,
      or a callable returning one. A callable must depend only on the tree's
      structure: it is called on the params in ``init`` and on the updates in
      ``update``. Static under ``optax.inject_hyperparams`` (pass
      ``static_args=("param_labels",)`` when it is a callable).
    backbone: :class:`TierConfig` (or a dict of its fields) for the backbone;
      default bf16 momentum, factored ``v`` (exact for vectors).
    expert: the same for the expert bank; default ``"sign"`` momentum,
      factored ``v``.
    router: the same for the router; default fp32 momentum, exact ``v``.
    factored_eps: added to ``g²`` before factoring, so that all-zero rows keep
      a defined reconstruction (Adafactor's ``epsilon1``).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state is a
    :class:`ScaleBySkewAdamState`.

  Raises:
    ValueError: for hyperparameters out of range, an unknown encoding, labels
      that do not match the tree or are not tiers, an expert leaf with fewer
      than 3 dimensions, or an ``update`` whose tree differs from ``init``'s
      (each message names the parameter path).

  Example:
    >>> import jax, jax.numpy as jnp, optax
    >>> import skewadam_jax
    >>> params = {"embed": jnp.ones((8, 4)),
    ...           "moe": {"router": jnp.ones((4, 2)),
    ...                   "experts": jnp.ones((2, 4, 6))}}
    >>> tx = skewadam_jax.scale_by_skewadam()
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state)
    >>> sorted(state.expert.nu)
    ['moe/experts']
  """
  _check_hyperparameters(b1, b2, eps, eps_root, factored_eps)
  configs = {
      labels_lib.BACKBONE: _as_tier_config("backbone", backbone, DEFAULT_BACKBONE),
      labels_lib.EXPERT: _as_tier_config("expert", expert, DEFAULT_EXPERT),
      labels_lib.ROUTER: _as_tier_config("router", router, DEFAULT_ROUTER),
  }

  def plans_for(tree):
    paths, leaves, tiers, treedef = labels_lib.resolve_labels(param_labels, tree)
    plans = [_leaf_plan(tier, configs[tier], path, leaf.shape)
             for path, leaf, tier in zip(paths, leaves, tiers)]
    return paths, leaves, tiers, plans, treedef

  def init_fn(params):
    paths, leaves, tiers, plans, _ = plans_for(params)
    tier_states = {t: TierState(mu={}, nu={}) for t in labels_lib.TIERS}
    for path, leaf, tier, plan in zip(paths, leaves, tiers, plans):
      mu, nu = _init_leaf(plan, leaf.shape)
      if mu is not None:
        tier_states[tier].mu[path] = mu
      tier_states[tier].nu[path] = nu
    return ScaleBySkewAdamState(count=jnp.zeros([], jnp.int32), **tier_states)

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    # Injected hyperparameters may arrive in a low-precision dtype, where
    # b2**t rounds to 1 and the bias correction divides by zero.
    b1_, b2_ = jnp.asarray(b1, jnp.float32), jnp.asarray(b2, jnp.float32)
    paths, grads, tiers, plans, treedef = plans_for(updates)
    count = optax.safe_increment(state.count)
    new_states = {t: TierState(mu={}, nu={}) for t in labels_lib.TIERS}
    out = []
    for path, g, tier, plan in zip(paths, grads, tiers, plans):
      old = getattr(state, tier)
      if path not in old.nu:
        held_by = [t for t in labels_lib.TIERS if path in getattr(state, t).nu]
        where = f"the {held_by[0]!r} tier" if held_by else "no tier"
        raise ValueError(
            f"Update for {path!r} is labelled {tier!r}, but init put it in "
            f"{where}: labels and tree must not change between init and update.")
      got = tuple(tuple(x.shape) for x in jax.tree.leaves(old.nu[path]))
      if got != _expected_nu_shapes(plan, g.shape):
        raise ValueError(
            f"Update for {path!r} has shape {tuple(g.shape)}, which does not "
            f"match the state made at init (second-moment shapes {got}).")
      u, mu, nu = _update_leaf(
          plan, g, old.mu.get(path), old.nu[path], b1=b1_, b2=b2_, eps=eps,
          eps_root=eps_root, factored_eps=factored_eps, count=count)
      if mu is not None:
        new_states[tier].mu[path] = mu
      new_states[tier].nu[path] = nu
      out.append(u)
    for tier in labels_lib.TIERS:
      stale = set(getattr(state, tier).nu) - set(new_states[tier].nu)
      if stale:
        raise ValueError(
            f"Parameters {sorted(stale)[:3]} had {tier!r} state at init but "
            "are missing from the updates.")
    return jax.tree.unflatten(treedef, out), ScaleBySkewAdamState(
        count=count, **new_states)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def matrices_only(params):
  """Weight-decay mask: True for leaves with at least 2 dimensions.

  The default ``weight_decay_mask`` of :func:`skewadam`: no decay on biases,
  norm scales and other 1-D (or scalar) leaves.
  """
  return jax.tree.map(lambda p: len(p.shape) > 1, params)


def skewadam(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    weight_decay: float = 1e-4,
    *,
    weight_decay_mask: Any = matrices_only,
    param_labels: labels_lib.LabelSpec = None,
    backbone: TierLike = None,
    expert: TierLike = None,
    router: TierLike = None,
    factored_eps: float = 1e-30,
) -> optax.GradientTransformationExtraArgs:
  r"""SkewAdam with decoupled weight decay, composed as ``optax.adamw`` is.

  ``optax.chain(scale_by_skewadam(...), add_decayed_weights(weight_decay,
  weight_decay_mask), scale_by_learning_rate(learning_rate))``, so the
  parameter update is::

      Δθ_t = −lr_t · (u_t + λ·θ_{t−1})

  with ``u_t`` from :func:`scale_by_skewadam` and ``λ = weight_decay`` applied
  where the mask is True.

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, eps_root: as in :func:`scale_by_skewadam`.
    weight_decay: decoupled weight decay coefficient λ.
    weight_decay_mask: pytree of bools or callable returning one; default
      :func:`matrices_only` (no decay on 1-D leaves). ``None`` decays all
      leaves. Under ``optax.inject_hyperparams`` pass
      ``static_args=("weight_decay_mask", "param_labels")``.
    param_labels, backbone, expert, router, factored_eps: as in
      :func:`scale_by_skewadam`.

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

  Example:
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
  return optax.chain(
      scale_by_skewadam(
          b1=b1, b2=b2, eps=eps, eps_root=eps_root, param_labels=param_labels,
          backbone=backbone, expert=expert, router=router,
          factored_eps=factored_eps),
      optax.add_decayed_weights(weight_decay, weight_decay_mask),
      optax.scale_by_learning_rate(learning_rate),
  )
