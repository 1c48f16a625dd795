"""A leaf's moments in Adam's direction: the per-leaf step and its state leaves.

:func:`_adam_step` is one leaf's Adam step from its stored (encoded,
factored) moments; :func:`is_placeholder` tells a state leaf that stands for
a field the leaf's form does not use.

A step's reductions (the factored statistics of ``g²`` and ``|m|`` and the
packed sign bits) are computed in the form each backend compiles best, chosen
with ``jax.lax.platform_dependent``: plain means on GPU and TPU, two grouped
passes on CPU (:func:`skewadam_jax.factored.row_col_means_grouped`) for a
matrix over the last two axes of at least :data:`GROUPED_MIN_SIZE` entries
that is not explicitly sharded. Both give the same state up to the order of
summation.

Examples:
  >>> import jax.numpy as jnp
  >>> from skewadam_jax import moments
  >>> moments.is_placeholder(jnp.zeros((1,), jnp.bool_)), moments.is_placeholder(jnp.zeros(1))
  (True, False)
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import optax

from skewadam_jax import _explicit
from skewadam_jax import encodings
from skewadam_jax import factored
from skewadam_jax.safety import finite_entries
from skewadam_jax.tiers import LeafPlan


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
