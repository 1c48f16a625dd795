"""Decoupled weight decay on the leaves declared matrices.

:func:`add_decayed_weights_to_matrices` is ``optax.add_decayed_weights``
with the mask :func:`matrices_only` computed from the tree at each update
(:func:`decayed_leaves` for any mask), as :func:`~skewadam_jax.skewadam`
chains it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from skewadam_jax import axes as axes_lib
from skewadam_jax import labels as labels_lib


# The default weight-decay mask: decay exactly the leaves declared matrices.
MATRICES = "matrices"


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
