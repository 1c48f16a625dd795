"""Clipping and the containment of non-finite gradient entries.

:func:`finite_entries` and :func:`contained` zero the gradient entries that
are not finite (or whose square could overflow a sum over their leaf);
:func:`has_own_bound` says which leaves' updates need Adafactor's update
clipping (:func:`_clip_rms`) under ``clip_threshold="auto"``; and
``max_grad_norm``'s global-norm clip is :func:`_global_norm_clip`.

Examples:
  >>> import jax.numpy as jnp
  >>> from skewadam_jax import safety
  >>> safety.finite_entries(jnp.array([1.0, jnp.nan, -jnp.inf, 2.0])).tolist()
  [1.0, 0.0, 0.0, 2.0]
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from skewadam_jax import encodings
from skewadam_jax import orthogonal
from skewadam_jax.tiers import LeafPlan


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
