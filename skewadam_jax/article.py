"""The article's optimizer, as its public code computes it: a reference mode.

``skewadam_article`` reproduces the update of the SkewAdam article's PyTorch
code (github.com/nuemaan/skewadam: ``skewadam.py`` and the tier groups of
``train.py: build_optimizer``), for comparison with the library's own forms
(:func:`skewadam_jax.skewadam`, Adam's direction with the library's
encodings, ε and clipping; :func:`skewadam_jax.skewadam_orthogonal`, the
recommended default). Per leaf, with ``t`` the step (from 1), ``β1 = 0.9``,
``β2 = 0.999``, the floor ``φ = 1e-8`` and ``g`` the gradient in float32:

* second moment, an EMA of the raw ``g²`` (no bias correction on the state):

  - *factored* (backbone and expert leaves of rank ≥ 2, over the last two
    axes; leading axes, a stacked bank's experts or layers, are batch axes)::

        V_r ← β2 V_r + (1 − β2) mean_c g²,   V_c ← β2 V_c + (1 − β2) mean_r g²
        D   = sqrt(max(V_r / max(mean_r V_r, 1e-15), φ)) · sqrt(max(V_c, φ))

  - *exact* (the router, and vectors)::

        V ← β2 V + (1 − β2) g²,   D = sqrt(max(V, φ))

  The floor sits inside the root, on the EMA before bias correction: on the
  bias-corrected ``V̂`` it is ``φ / (1 − β2^t)``, 1e-5 at the first step.
* numerator: the backbone keeps momentum, ``m ← β1 m + (1 − β1) g`` and
  ``u = m · sqrt(1 − β2^t) / (1 − β1^t) / D``; the expert and router tiers
  keep none, ``u = g · sqrt(1 − β2^t) / D``;
* an RMS clip, ``u ← u / max(rms(u), 1)``, over each whole leaf (vectors
  too), or over each of its matrices (``clip_scope="matrix"``: what the
  article's run did, with one 2-D tensor per expert);
* decoupled weight decay ``λ = 0.05`` on the backbone and expert leaves,
  none on the router: ``p ← p − lr · (u + λ p)``, which is the reference's
  ``p ← p (1 − lr λ) − lr u``.

Leaves are routed to tiers as the library routes them (``experts`` and
``router`` in the path, or ``param_labels``); the reference's own rule is the
same substring test. The reference skips a parameter with no gradient (its
step count then lags); here every leaf steps every step, as in any optax
transformation. Its dithered bf16 rounding of parameters is not reproduced:
apply the updates with :func:`optax.apply_updates` (float32 parameters, as
the tests compare) or :func:`skewadam_jax.apply_updates_stochastic`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from skewadam_jax import labels as labels_lib

FLOOR = 1e-8
CLIP_SCOPES = ("tensor", "matrix")
# The reference's groups: momentum and a factored second moment per tier.
ARTICLE_TIERS = {
    labels_lib.BACKBONE: {"momentum": True, "factored": True, "decay": True},
    labels_lib.EXPERT: {"momentum": False, "factored": True, "decay": True},
    labels_lib.ROUTER: {"momentum": False, "factored": False, "decay": False},
}


class ScaleByArticleState(NamedTuple):
  """State of :func:`scale_by_skewadam_article`.

  Attributes:
    count: the step count ``t`` (int32; 0 before the first update).
    mu: the backbone's float32 momentum per leaf; ``optax.MaskedNode()``
      for the leaves of tiers without momentum.
    nu: per leaf, ``(V_r, V_c)`` (shapes ``[..., R, 1]`` and ``[..., 1, C]``)
      where the second moment is factored, else ``(V,)``, all float32.
  """
  count: jax.Array
  mu: Any
  nu: Any


def _factored(tier: str, leaf) -> bool:
  return ARTICLE_TIERS[tier]["factored"] and jnp.ndim(leaf) >= 2


def _rms_clip(u: jax.Array, scope: str) -> jax.Array:
  axes = (tuple(range(u.ndim)) if scope == "tensor" or u.ndim < 2
          else (u.ndim - 2, u.ndim - 1))
  rms = jnp.sqrt(jnp.mean(jnp.square(u), axis=axes, keepdims=True))
  return u / jnp.maximum(rms, 1.0)


def _denominator(nu, g2, factored: bool, b2: float, floor: float):
  """The new second-moment state and ``D`` (module docstring)."""
  if factored:
    v_row, v_col = nu
    v_row = b2 * v_row + (1 - b2) * jnp.mean(g2, axis=-1, keepdims=True)
    v_col = b2 * v_col + (1 - b2) * jnp.mean(g2, axis=-2, keepdims=True)
    v_mean = jnp.maximum(jnp.mean(v_row, axis=-2, keepdims=True), 1e-15)
    d = (jnp.sqrt(jnp.maximum(v_row / v_mean, floor))
         * jnp.sqrt(jnp.maximum(v_col, floor)))
    return (v_row, v_col), d
  (v,) = nu
  v = b2 * v + (1 - b2) * g2
  return (v,), jnp.sqrt(jnp.maximum(v, floor))


def scale_by_skewadam_article(
    b1: float = 0.9, b2: float = 0.999, floor: float = FLOOR, *,
    clip_threshold: float = 1.0, clip_scope: str = "tensor",
    param_labels: labels_lib.LabelSpec = None) -> optax.GradientTransformation:
  """The article's SkewAdam direction, as its code computes it (module docstring).

  Args:
    b1: the backbone momentum's decay.
    b2: the second moment's decay.
    floor: ``φ``, the floor on the second-moment EMA inside the square root.
    clip_threshold: the RMS clip's threshold (``u / max(rms(u) / c, 1)``).
    clip_scope: ``"tensor"``: each leaf's RMS, as the reference code; or
      ``"matrix"``: each trailing 2-D matrix's (vectors whole), as the
      article's run with one tensor per expert.
    param_labels: tier labels, as in :func:`skewadam_jax.scale_by_skewadam`.

  Returns:
    An ``optax.GradientTransformation`` whose updates are ``u`` (descent
    direction; scale by ``-lr``).

  Raises:
    ValueError: for a decay outside ``[0, 1)``, a floor or threshold that is
      not positive, or an unknown ``clip_scope``.
  """
  # Under optax.inject_hyperparams the numbers arrive traced: checked when concrete.
  concrete = lambda x: not isinstance(x, jax.core.Tracer)  # noqa: E731
  for name, value in (("b1", b1), ("b2", b2)):
    if concrete(value) and not 0.0 <= value < 1.0:
      raise ValueError(f"{name} must be in [0, 1), got {value}")
  if concrete(floor) and not floor > 0:
    raise ValueError(f"floor must be > 0, got {floor}")
  if concrete(clip_threshold) and not clip_threshold > 0:
    raise ValueError(f"clip_threshold must be > 0, got {clip_threshold}")
  if clip_scope not in CLIP_SCOPES:
    raise ValueError(f"clip_scope must be one of {', '.join(CLIP_SCOPES)}, got {clip_scope!r}")

  def init_fn(params):
    leaves, treedef = jax.tree.flatten(params)
    tiers = labels_lib.resolve_labels(param_labels, params, warn=True)
    mu, nu = [], []
    for leaf, tier in zip(leaves, tiers):
      shape = jnp.shape(leaf)
      mu.append(jnp.zeros(shape, jnp.float32) if ARTICLE_TIERS[tier]["momentum"]
                else optax.MaskedNode())
      if _factored(tier, leaf):
        nu.append((jnp.zeros(shape[:-1] + (1,), jnp.float32),
                   jnp.zeros(shape[:-2] + (1,) + shape[-1:], jnp.float32)))
      else:
        nu.append((jnp.zeros(shape, jnp.float32),))
    return ScaleByArticleState(count=jnp.zeros((), jnp.int32),
                               mu=treedef.unflatten(mu), nu=treedef.unflatten(nu))

  def update_fn(updates, state, params=None):
    del params
    grads, treedef = jax.tree.flatten(updates)
    tiers = labels_lib.resolve_labels(param_labels, updates)
    mus = treedef.flatten_up_to(state.mu)
    nus = treedef.flatten_up_to(state.nu)
    count = optax.safe_increment(state.count)
    # 1 - b^t as -expm1(t log b): float32 keeps its relative precision where
    # 1 - b^t would lose it (1 - 0.999 is 1.3e-5 off in float32); log 0 = -inf
    # gives 1 - 0^t = 1.
    t = count.astype(jnp.float32)
    bc1, bc2 = (-jnp.expm1(t * jnp.log(jnp.asarray(b, jnp.float32))) for b in (b1, b2))
    out, new_mu, new_nu = [], [], []
    for g, tier, mu, nu in zip(grads, tiers, mus, nus):
      g32 = g.astype(jnp.float32)
      nu, d = _denominator(nu, jnp.square(g32), _factored(tier, g), b2, floor)
      if ARTICLE_TIERS[tier]["momentum"]:
        mu = b1 * mu + (1 - b1) * g32
        u = mu * (jnp.sqrt(bc2) / bc1) / d
      else:
        u = g32 * jnp.sqrt(bc2) / d
      u = _rms_clip(u / clip_threshold, clip_scope) * clip_threshold
      out.append(u.astype(g.dtype))
      new_mu.append(mu)
      new_nu.append(nu)
    return treedef.unflatten(out), ScaleByArticleState(
        count=count, mu=treedef.unflatten(new_mu), nu=treedef.unflatten(new_nu))

  return optax.GradientTransformation(init_fn, update_fn)


def article_decay_mask(params, param_labels: labels_lib.LabelSpec = None):
  """True for the leaves the reference decays: every backbone and expert leaf, no router leaf."""
  tiers = labels_lib.resolve_labels(param_labels, params)
  leaves, treedef = jax.tree.flatten(params)
  return treedef.unflatten([ARTICLE_TIERS[t]["decay"] for t in tiers])


def skewadam_article(
    learning_rate: optax.ScalarOrSchedule, *, weight_decay: float = 0.05, b1: float = 0.9,
    b2: float = 0.999, floor: float = FLOOR, clip_threshold: float = 1.0,
    clip_scope: str = "tensor",
    param_labels: labels_lib.LabelSpec = None) -> optax.GradientTransformation:
  """The SkewAdam article's optimizer, as its public code computes it.

  ``scale_by_skewadam_article``, then decoupled weight decay on the backbone
  and expert leaves (:func:`article_decay_mask`), then ``-learning_rate``:

    p ← p − lr · (u + λ p)

  The reference's own settings are the defaults (its ``train.py`` trains at
  ``lr = 3e-4`` with 300 warmup steps and cosine decay). The library's forms
  differ: :func:`skewadam_jax.skewadam` keeps momentum in every tier, adds
  ``eps`` outside the root of the bias-corrected second moment and clips only
  matrices; :func:`skewadam_jax.skewadam_orthogonal` orthogonalises.

  Args:
    learning_rate: a float or an optax schedule.
    weight_decay: ``λ``, on the backbone and expert tiers.
    b1, b2, floor, clip_threshold, clip_scope, param_labels: as in
      :func:`scale_by_skewadam_article`.

  Example:
    >>> import jax.numpy as jnp, optax
    >>> params = {"w": jnp.ones((4, 3)), "experts": jnp.ones((2, 4, 3)),
    ...           "router": jnp.ones((3, 2))}
    >>> tx = skewadam_article(3e-4)
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(lambda p: 1e-5 * jnp.ones_like(p), params)
    >>> updates, state = tx.update(grads, state, params)
    >>> # The floor binds: |u| = 1e-5 · sqrt(1e-3) / 1e-4, not Adam's 1.
    >>> router_step = -updates["router"] / 3e-4
    >>> round(float(jnp.max(router_step)), 4)
    0.0032
  """
  return optax.chain(
      scale_by_skewadam_article(b1, b2, floor, clip_threshold=clip_threshold,
                                clip_scope=clip_scope, param_labels=param_labels),
      optax.add_decayed_weights(weight_decay,
                                mask=lambda p: article_decay_mask(p, param_labels)),
      optax.scale_by_learning_rate(learning_rate))
