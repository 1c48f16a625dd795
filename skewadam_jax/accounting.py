"""Exact optimizer-state bytes, by tier, from live or abstract states.

Every function here reads only ``shape`` and ``dtype``, so it works the same on
a live state and on the ``jax.ShapeDtypeStruct`` tree that ``jax.eval_shape``
returns. That sizes a 100B-parameter model's state without allocating it::

    abstract = jax.eval_shape(tx.init, abstract_params)
    state_bytes_by_tier(abstract)

Tiers: a SkewAdam state's fields are shaped like the parameters, so each of
their leaves is attributed to the tier of its parameter: by ``param_labels``
when given (the labels the optimizer was built with; a tree or a callable of
the tree's paths), otherwise by matching the default tier patterns against the
parameter's path. Leaves of other optax states (or the parts of a chain around
SkewAdam) are attributed by matching the patterns against their path, which
ends with the parameter's path (for example ``0/mu/layers/moe/experts/w_up``).
Scalars (step counts, injected hyperparameters) and SkewAdam's one-byte
placeholders are counted as ``"other"``.
"""

from __future__ import annotations

import math

import jax
import optax

from skewadam_jax import labels as labels_lib
from skewadam_jax import transform

OTHER = "other"


def leaf_bytes(x) -> int:
  """Bytes of one array-like leaf (0 for leaves with no shape and dtype)."""
  shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
  if shape is None or dtype is None:
    return 0
  return math.prod(shape) * jax.numpy.dtype(dtype).itemsize


def tree_bytes(tree) -> int:
  """Total bytes of the arrays (or ``ShapeDtypeStruct``s) in ``tree``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> tree_bytes({"w": jax.ShapeDtypeStruct((1000, 1000), jnp.bfloat16)})
    2000000
  """
  return sum(leaf_bytes(x) for x in jax.tree.leaves(tree))


def state_bytes_by_tier(state, *, param_labels=None, params=None,
                        router=labels_lib.DEFAULT_ROUTER_PATTERNS,
                        expert=labels_lib.DEFAULT_EXPERT_PATTERNS) -> dict[str, int]:
  """Optimizer-state bytes split by tier, for any optax state.

  Args:
    state: a live or abstract (``jax.eval_shape``) optimizer state: SkewAdam's,
      any optax optimizer's, or a chain / wrapper containing them.
    param_labels: the ``param_labels`` SkewAdam was built with, if not the
      default (a tree or a callable; matched to each field by path). A
      SkewAdam state holds no record of its tiers: without ``param_labels``
      they are read from its paths with ``router`` and ``expert``, and a state
      in which those find neither tier is refused (its labels were custom). They
      also attribute the parameter-shaped parts of other optimizers' states
      (AdamW's ``mu`` and ``nu``): any subtree with the structure of
      ``params`` (or, without ``params``, of a full ``param_labels`` tree).
    params: the parameters (or ``ShapeDtypeStruct``s) the state was made for;
      needed with a callable ``param_labels`` when the state holds no
      SkewAdam state.
    router: patterns attributing other leaves to the router tier.
    expert: patterns attributing other leaves to the expert tier.

  Returns:
    ``{"backbone", "expert", "router", "other", "total"}`` in bytes; the first
    four sum to ``"total"``.

  Raises:
    ValueError: for a SkewAdam state without ``param_labels`` whose paths
      match neither the expert nor the router patterns.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> params = {"embed": jax.ShapeDtypeStruct((100, 8), jnp.float32),
    ...           "moe": {"experts": jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)}}
    >>> state = jax.eval_shape(optax.adam(1e-3).init, params)
    >>> state_bytes_by_tier(state)["expert"]  # fp32 m and v: 8 B/param
    4096
  """
  is_skew = lambda x: isinstance(x, transform.ScaleBySkewAdamState)
  totals = {t: 0 for t in labels_lib.TIERS + (OTHER,)}
  shaped = _params_structure(state, param_labels, params, is_skew)

  def is_params_shaped(x):
    return (shaped is not None and not is_skew(x) and not jax.tree_util.all_leaves([x])
            and jax.tree.structure(x) == shaped)

  skew_paths, skew_tiers = [], set()  # what the patterns make of SkewAdam's own leaves
  for path, leaf in jax.tree_util.tree_flatten_with_path(
      state, is_leaf=lambda x: is_skew(x) or is_params_shaped(x))[0]:
    if is_params_shaped(leaf):
      tiers = labels_lib.resolve_labels(param_labels, leaf if params is None else params)
      for tier, x in zip(tiers, jax.tree.leaves(leaf)):
        totals[tier] += leaf_bytes(x)
      continue
    if is_skew(leaf):
      totals[OTHER] += leaf_bytes(leaf.count)
      for name in transform.FIELDS:
        field = getattr(leaf, name)
        if param_labels is None:
          paths = labels_lib.flatten_with_paths(field)[0]
          tiers = [labels_lib.label_path(p, router=router, expert=expert) for p in paths]
          skew_paths += paths
          skew_tiers.update(tiers)
        else:
          tiers = labels_lib.resolve_labels(param_labels, field)
        for tier, x in zip(tiers, jax.tree.leaves(field)):
          totals[OTHER if transform.is_placeholder(x) else tier] += leaf_bytes(x)
      continue
    nbytes = leaf_bytes(leaf)
    if math.prod(getattr(leaf, "shape", ())) <= 1:
      totals[OTHER] += nbytes
    else:
      tier = labels_lib.label_path(labels_lib.path_to_str(path), router=router,
                                   expert=expert)
      totals[tier] += nbytes
  if skew_paths and not {labels_lib.EXPERT, labels_lib.ROUTER} & skew_tiers:
    # SkewAdam keeps no record of its tiers: with custom labels every leaf would be
    # counted as backbone in silence.
    raise ValueError(
        "state_bytes_by_tier: no path of this SkewAdam state matches the expert or "
        f"router patterns ({', '.join(skew_paths[:3])}{', ...' if len(skew_paths) > 3 else ''}), "
        "so it cannot tell which tier SkewAdam gave each leaf. Pass the "
        "param_labels the optimizer was built with (param_labels='backbone' for a "
        "model without experts).")
  totals["total"] = sum(totals.values())
  return totals


def _params_structure(state, param_labels, params, is_skew):
  """The tree structure of the parameters, to find their copies in other states (or None)."""
  if param_labels is None:
    return None
  if params is not None:
    return jax.tree.structure(params)
  if not labels_lib.is_function(param_labels) and not isinstance(param_labels, str):
    return jax.tree.structure(param_labels)
  if not any(is_skew(x) for x in jax.tree.leaves(state, is_leaf=is_skew)):
    raise ValueError("state_bytes_by_tier with callable param_labels needs params= to find "
                     "the parameter-shaped parts of a state that holds no SkewAdam state.")
  return None


def abstract_state_bytes_by_tier(tx, params, **patterns) -> dict[str, int]:
  """:func:`state_bytes_by_tier` of ``tx.init(params)`` without allocating.

  Args:
    tx: any optax ``GradientTransformation``.
    params: parameters or a matching tree of ``jax.ShapeDtypeStruct``.
    **patterns: ``param_labels``, ``router`` / ``expert`` patterns, as in
      :func:`state_bytes_by_tier`.
  """
  return state_bytes_by_tier(jax.eval_shape(tx.init, params), **patterns)


def state_bytes_per_param(tx, params) -> list[int]:
  """Optimizer-state bytes that belong to each parameter, in flattening order.

  Every state tree shaped like the parameters (found with
  ``optax.tree.map_params``: SkewAdam's fields, AdamW's ``mu``/``nu``,
  Adafactor's statistics, ``MultiSteps`` accumulators) adds each array's
  bytes to its parameter. SkewAdam's placeholders, step counts and other
  scalars belong to no parameter and are not counted. Nothing is allocated.
  A SkewAdam state in the stacked layout (``group_leaves="auto"`` or
  ``"stacked"``) holds each group's arrays at the group's first leaf, so its
  bytes are counted there; ``group_leaves=False`` gives each leaf its own.

  Args:
    tx: any optax ``GradientTransformation``.
    params: parameters or a matching tree of ``jax.ShapeDtypeStruct``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> params = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32),
    ...           "b": jax.ShapeDtypeStruct((8,), jnp.float32)}
    >>> state_bytes_per_param(optax.adam(1e-3), params)  # b, w: fp32 m and v
    [64, 256]
  """
  leaves, treedef = jax.tree.flatten(params)
  totals = [0] * len(leaves)
  abstract = jax.eval_shape(tx.init, params)

  def add(leaf, index):
    if not isinstance(leaf, optax.MaskedNode) and not transform.is_placeholder(leaf):
      totals[index] += leaf_bytes(leaf)
    return leaf

  optax.tree.map_params(tx, add, abstract, treedef.unflatten(range(len(leaves))),
                        is_leaf=lambda x: isinstance(x, optax.MaskedNode))
  return totals
