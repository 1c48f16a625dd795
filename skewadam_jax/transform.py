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

This module holds the transformation, :func:`scale_by_skewadam`, its state
and :func:`skewadam` (the transformation chained with weight decay and the
learning rate, as ``optax.adamw``). The parts it is built from live by
concern, and every name is also importable from here:
:mod:`skewadam_jax.tiers` (:class:`TierConfig`, :class:`LeafPlan`,
:func:`leaf_plans`), :mod:`skewadam_jax.moments` (a leaf's Adam step),
:mod:`skewadam_jax.directions` (the orthogonal direction's step),
:mod:`skewadam_jax.safety` (clipping, non-finite containment),
:mod:`skewadam_jax.grouping` (stacked groups, the state's layout and checks)
and :mod:`skewadam_jax.decay` (weight decay on declared matrices).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skewadam_jax import axes as axes_lib
from skewadam_jax import labels as labels_lib

# Every name this module defined before it was split by concern, so that
# ``transform.NAME`` (private names included) keeps resolving. The bare names
# are also what the code below calls: patching ``transform._step_leaf`` or
# ``transform.LARGE_LEAF_ELEMENTS`` still changes what ``update`` uses.
# pylint: disable=unused-import
from skewadam_jax.decay import (
    DecayScheduleState, MATRICES, _DecayState, add_decayed_weights_to_matrices, decayed_leaves,
    matrices_only)
from skewadam_jax.directions import (
    _orthogonal_step, _owner_devices, _spread_over, _step_leaf)
from skewadam_jax.grouping import (
    GROUP_MAX_ELEMENTS, STACKED, _abstract_leaf, _check_group_parts, _check_parts,
    _expected_parts, _fresh_parts, _holds_stacked_groups, _init_leaf, _init_parts,
    _init_stacks_state, _stacked_leaf, _stacked_plan, _step_group, _unstack,
    _zeros_like_abstract, leaf_groups)
from skewadam_jax.moments import (
    GROUPED_MIN_SIZE, _adam_step, _bias_correction, _decay, _groupable, _is_masked,
    _placeholder, _reductions, _square, is_placeholder)
from skewadam_jax.safety import (
    AUTO_CLIP_THRESHOLD, LARGE_LEAF_ELEMENTS, _clip_rms, _global_norm_clip,
    _leaf_clip_threshold, contained, finite_entries, has_own_bound)
from skewadam_jax.tiers import (
    DEFAULT_BACKBONE, DEFAULT_EXPERT, DEFAULT_ROUTER, DIRECTIONS, FIELDS, LOWRANK_ORTHOGONALISE,
    NU_FIELDS, ORTHOGONAL_DIRECTIONS, SECOND_MOMENT_FORMS, LeafPlan, TierConfig, TierLike,
    _as_tier_config, _check_hyperparameters, _check_inexact, _check_nu_dtype,
    _check_unit_interval, _is_complex, _warn_bf16_momentum, _warn_guessed_axes, leaf_plans)
# pylint: enable=unused-import


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
