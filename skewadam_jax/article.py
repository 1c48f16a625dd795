"""The article's optimizer, as its public code computes it: a reference mode.

``skewadam_article`` reproduces the update of the SkewAdam article's PyTorch
code (github.com/nuemaan/skewadam: ``skewadam.py`` and the tier groups of
``train.py: build_optimizer``), for comparison with the library's own forms
(:func:`skewadam_jax.skewadam`, Adam's direction with the library's
encodings, ε and clipping; :func:`skewadam_jax.skewadam_orthogonal`, the
recommended default). Per leaf, with ``t`` the step (from 1), ``β1 = 0.9``,
``β2 = 0.999``, the floor ``φ = 1e-8`` and ``g`` the gradient in float32:

* second moment, an EMA of the raw ``g²`` (no bias correction on the state):

  - *factored* (backbone and expert matrices: leaves of rank ≥ 2 over their
    last two axes, or the axes ``matrix_axes`` declares; every other axis, a
    stacked bank's experts or layers, is a batch axis)::

        V_r ← β2 V_r + (1 − β2) mean_c g²,   V_c ← β2 V_c + (1 − β2) mean_r g²
        D   = sqrt(max(V_r / max(mean_r V_r, 1e-15), φ)) · sqrt(max(V_c, φ))

  - *exact* (the router, and vectors: leaves of rank < 2, or declared
    ``None`` by ``matrix_axes``, such as a stacked norm scale ``[L, D]``)::

        V ← β2 V + (1 − β2) g²,   D = sqrt(max(V, φ))

  The floor sits inside the root, on the EMA before bias correction: on the
  bias-corrected ``V̂`` it is ``φ / (1 − β2^t)``, 1e-5 at the first step.
* numerator: the backbone keeps momentum, ``m ← β1 m + (1 − β1) g`` and
  ``u = m · sqrt(1 − β2^t) / (1 − β1^t) / D``; the expert and router tiers
  keep none, ``u = g · sqrt(1 − β2^t) / D``;
* an RMS clip, ``u ← u / max(rms(u), 1)``, over each whole leaf (vectors
  too), or over each of its matrices and each vector along its last axis
  (``clip_scope="matrix"``: what the article's run did, with one 2-D tensor
  per expert and one module per layer; a stacked norm scale ``[L, D]`` is
  then clipped a layer at a time);
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

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from skewadam_jax import axes as axes_lib
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

  Every field but ``count`` is a tree shaped like the parameters, with
  ``optax.MaskedNode()`` where a leaf keeps no such array, so
  :func:`skewadam_jax.state_shardings` shards it as it shards the library's.

  Attributes:
    count: the step count ``t`` (int32; 0 before the first update).
    mu: the backbone's float32 momentum per leaf (none in the other tiers).
    nu: the exact second moment ``V`` (float32, the leaf's shape), where it
      is not factored.
    nu_row, nu_col: ``V_r`` and ``V_c`` (float32; the leaf's shape with its
      column, resp. row, axes reduced to 1), where it is factored.
  """
  count: jax.Array
  mu: Any
  nu: Any
  nu_row: Any
  nu_col: Any


def _matrix_axes(matrix_axes: axes_lib.AxesSpec, tree) -> list:
  """Per leaf, its ``(rows, cols)`` axis tuples, or ``None`` for a vector.

  Without a declaration, the reference's rule: a leaf of rank ≥ 2 is a
  matrix over its last two axes.
  """
  if matrix_axes is None:
    return [((n - 2,), (n - 1,)) if n >= 2 else None
            for n in map(jnp.ndim, jax.tree.leaves(tree))]
  return [None if a is None else (a.row_axes, a.col_axes)
          for a in axes_lib.resolve_matrix_axes(matrix_axes, tree)]


def _factored(tier: str, axes) -> bool:
  return ARTICLE_TIERS[tier]["factored"] and axes is not None


def _rms_clip(u: jax.Array, scope: str, axes) -> jax.Array:
  if scope == "tensor" or u.ndim == 0:
    over = None
  elif axes is None:
    over = (u.ndim - 1,)  # a vector, stacked or not: one clip per slice
  else:
    over = axes[0] + axes[1]
  rms = jnp.sqrt(jnp.mean(jnp.square(u), axis=over, keepdims=True))
  return u / jnp.maximum(rms, 1.0)


def _denominator(nu, g2, axes, b2: float, floor: float):
  """The new second-moment state and ``D`` (module docstring); ``axes`` are
  the matrix's ``(rows, cols)`` when the second moment is factored."""
  if axes is not None:
    rows, cols = axes
    v_row, v_col = nu
    v_row = b2 * v_row + (1 - b2) * jnp.mean(g2, axis=cols, keepdims=True)
    v_col = b2 * v_col + (1 - b2) * jnp.mean(g2, axis=rows, keepdims=True)
    v_mean = jnp.maximum(jnp.mean(v_row, axis=rows, keepdims=True), 1e-15)
    d = (jnp.sqrt(jnp.maximum(v_row / v_mean, floor))
         * jnp.sqrt(jnp.maximum(v_col, floor)))
    return (v_row, v_col), d
  (v,) = nu
  v = b2 * v + (1 - b2) * g2
  return (v,), jnp.sqrt(jnp.maximum(v, floor))


def _reduced(shape, axes) -> tuple[int, ...]:
  return tuple(1 if i in axes else n for i, n in enumerate(shape))


def scale_by_skewadam_article(
    b1: float = 0.9, b2: float = 0.999, floor: float = FLOOR, *,
    clip_threshold: float = 1.0, clip_scope: str = "tensor",
    param_labels: labels_lib.LabelSpec = None,
    matrix_axes: axes_lib.AxesSpec = None) -> optax.GradientTransformation:
  """The article's SkewAdam direction, as its code computes it (module docstring).

  Args:
    b1: the backbone momentum's decay.
    b2: the second moment's decay.
    floor: ``φ``, the floor on the second-moment EMA inside the square root.
    clip_threshold: the RMS clip's threshold (``u / max(rms(u) / c, 1)``).
    clip_scope: ``"tensor"``: each leaf's RMS, as the reference code; or
      ``"matrix"``: each matrix's, and each vector's along its last axis, as
      the article's run with one tensor per expert and per layer.
    param_labels: tier labels, as in :func:`skewadam_jax.scale_by_skewadam`.
    matrix_axes: the axes of each leaf's matrix, as in
      :func:`skewadam_jax.scale_by_skewadam` (:mod:`skewadam_jax.axes`);
      ``None``: the reference's rule, the last two axes of every leaf of
      rank ≥ 2. A scanned model declares its stacked vectors (``None``)
      so that they keep an exact second moment, as the reference's
      per-layer vectors do.

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
    fields = {name: [] for name in ("mu", "nu", "nu_row", "nu_col")}
    for leaf, tier, axes in zip(leaves, tiers, _matrix_axes(matrix_axes, params)):
      shape, factored = jnp.shape(leaf), _factored(tier, axes)
      masked = optax.MaskedNode()
      fields["mu"].append(jnp.zeros(shape, jnp.float32) if ARTICLE_TIERS[tier]["momentum"]
                          else masked)
      fields["nu"].append(masked if factored else jnp.zeros(shape, jnp.float32))
      fields["nu_row"].append(jnp.zeros(_reduced(shape, axes[1]), jnp.float32) if factored
                              else masked)
      fields["nu_col"].append(jnp.zeros(_reduced(shape, axes[0]), jnp.float32) if factored
                              else masked)
    return ScaleByArticleState(count=jnp.zeros((), jnp.int32),
                               **{k: treedef.unflatten(v) for k, v in fields.items()})

  def update_fn(updates, state, params=None):
    del params
    grads, treedef = jax.tree.flatten(updates)
    tiers = labels_lib.resolve_labels(param_labels, updates)
    fields = ("mu", "nu", "nu_row", "nu_col")
    old = [treedef.flatten_up_to(getattr(state, name)) for name in fields]
    count = optax.safe_increment(state.count)
    # 1 - b^t as -expm1(t log b): float32 keeps its relative precision where
    # 1 - b^t would lose it (1 - 0.999 is 1.3e-5 off in float32); log 0 = -inf
    # gives 1 - 0^t = 1.
    t = count.astype(jnp.float32)
    bc1, bc2 = (-jnp.expm1(t * jnp.log(jnp.asarray(b, jnp.float32))) for b in (b1, b2))
    out, new = [], {name: [] for name in fields}
    matrices = _matrix_axes(matrix_axes, updates)
    for g, tier, axes, mu, nu, nu_row, nu_col in zip(grads, tiers, matrices, *old):
      g32 = g.astype(jnp.float32)
      if _factored(tier, axes):
        (nu_row, nu_col), d = _denominator((nu_row, nu_col), jnp.square(g32), axes, b2, floor)
      else:
        (nu,), d = _denominator((nu,), jnp.square(g32), None, b2, floor)
      if ARTICLE_TIERS[tier]["momentum"]:
        mu = b1 * mu + (1 - b1) * g32
        u = mu * (jnp.sqrt(bc2) / bc1) / d
      else:
        u = g32 * jnp.sqrt(bc2) / d
      u = _rms_clip(u / clip_threshold, clip_scope, axes) * clip_threshold
      out.append(u.astype(g.dtype))
      for name, value in zip(fields, (mu, nu, nu_row, nu_col)):
        new[name].append(value)
    return treedef.unflatten(out), ScaleByArticleState(
        count=count, **{k: treedef.unflatten(v) for k, v in new.items()})

  return optax.GradientTransformation(init_fn, update_fn)


def article_decay_mask(params, param_labels: labels_lib.LabelSpec = None):
  """True for the leaves the reference decays: every backbone and expert leaf, no router leaf."""
  tiers = labels_lib.resolve_labels(param_labels, params)
  leaves, treedef = jax.tree.flatten(params)
  return treedef.unflatten([ARTICLE_TIERS[t]["decay"] for t in tiers])


def skewadam_article(
    learning_rate: optax.ScalarOrSchedule, *, weight_decay: float = 0.05, b1: float = 0.9,
    b2: float = 0.999, floor: float = FLOOR, clip_threshold: float = 1.0,
    clip_scope: str = "tensor", param_labels: labels_lib.LabelSpec = None,
    matrix_axes: axes_lib.AxesSpec = None) -> optax.GradientTransformation:
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
    b1, b2, floor, clip_threshold, clip_scope, param_labels, matrix_axes: as
      in :func:`scale_by_skewadam_article`.

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
                                clip_scope=clip_scope, param_labels=param_labels,
                                matrix_axes=matrix_axes),
      optax.add_decayed_weights(weight_decay,
                                mask=lambda p: article_decay_mask(p, param_labels)),
      optax.scale_by_learning_rate(learning_rate))


def article_states(opt_state) -> list[ScaleByArticleState]:
  """Every :class:`ScaleByArticleState` in ``opt_state`` (chains and wrappers included)."""
  is_state = lambda x: isinstance(x, ScaleByArticleState)  # noqa: E731
  return [s for s in jax.tree.leaves(opt_state, is_leaf=is_state) if is_state(s)]


def floor_share(opt_state, floor: float = FLOOR) -> jax.Array:
  """The share of parameter entries whose denominator the floor sets, in every
  :class:`ScaleByArticleState` found in ``opt_state`` (chains and wrappers
  included).

  An exact entry binds where ``V < φ``; a factored one where its row's
  normalised statistic or its column's is below ``φ`` (either floor changes
  ``D``), counted per matrix without forming it. 0 where the state holds none.

  Example:
    >>> import jax.numpy as jnp
    >>> tx = skewadam_article(1e-3)
    >>> params = {"router": jnp.ones((2, 2))}
    >>> grads = {"router": jnp.array([[1.0, 1.0], [1e-6, 1e-6]])}
    >>> _, state = tx.update(grads, tx.init(params), params)
    >>> float(floor_share(state))  # the second row's V = 1e-3 · 1e-12
    0.5
  """
  states = article_states(opt_state)
  bound, total = jnp.zeros((), jnp.float32), 0
  masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
  for state in states:
    for v in jax.tree.leaves(state.nu, is_leaf=masked):
      if not masked(v):
        bound, total = bound + jnp.sum(v < floor), total + v.size
    rows = jax.tree.leaves(state.nu_row, is_leaf=masked)
    cols = jax.tree.leaves(state.nu_col, is_leaf=masked)
    for v_row, v_col in zip(rows, cols):
      if masked(v_row):
        continue
      # The reduced axes: length 1 in one statistic and not in the other.
      row_axes = tuple(a for a in range(v_row.ndim) if v_col.shape[a] == 1 != v_row.shape[a])
      mean = jnp.maximum(jnp.mean(v_row, axis=row_axes, keepdims=True), 1e-15)
      row_bound = (v_row / mean < floor).astype(jnp.float32)
      col_bound = (v_col < floor).astype(jnp.float32)
      n_rows = math.prod(v_row.shape[a] for a in row_axes)
      n_cols = v_col.size * n_rows // v_row.size
      # Entries with a bound row or column, per matrix: |R_b|·C + R·|C_b| − |R_b|·|C_b|.
      col_axes = tuple(a for a in range(v_col.ndim) if v_row.shape[a] == 1 != v_col.shape[a])
      r_b = jnp.sum(row_bound, axis=row_axes, keepdims=True)
      c_b = jnp.sum(col_bound, axis=col_axes, keepdims=True)
      bound = bound + jnp.sum(r_b * n_cols + n_rows * c_b - r_b * c_b)
      total += (v_row.size // n_rows) * n_rows * n_cols
  return bound / max(total, 1)
