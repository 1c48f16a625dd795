"""Tier labels: which of SkewAdam's three tiers each parameter belongs to.

Every leaf of a parameter pytree is labelled ``"backbone"``, ``"expert"`` or
``"router"``. The default labeller, :func:`moe_param_labels`, reads the
``/``-joined path of each leaf and matches regular expressions against it, in
the style of big_vision's parameter routing: router patterns first, then expert
patterns; everything else is backbone.

Labels must depend on the *structure* of the tree only (paths, not values),
because optax calls label functions on the parameters in ``init`` and on the
updates in ``update``. Flax NNX states flatten to paths that may end in a
``value`` component in one call and not in the other; :func:`path_to_str`
drops that trailing component so both calls see the same path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Union

import jax

BACKBONE = "backbone"
EXPERT = "expert"
ROUTER = "router"
TIERS = (BACKBONE, EXPERT, ROUTER)

DEFAULT_ROUTER_PATTERNS = (r"(^|/)router(/|$)",)
DEFAULT_EXPERT_PATTERNS = (r"(^|/)experts(/|$)",)

Patterns = Union[str, Sequence[str]]
LabelSpec = Union[None, Any, Callable[[Any], Any]]


def _key_to_str(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_to_str(path) -> str:
  """Joins a ``jax.tree_util`` key path with ``/``, dropping a trailing ``value``.

  Args:
    path: a key path from ``jax.tree_util.tree_flatten_with_path``.

  Returns:
    The path as a string, e.g. ``"layers/moe/experts/w_up"``; ``""`` for a
    bare array.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> [(p, _)] = jax.tree_util.tree_flatten_with_path({"a": [jnp.ones(2)]})[0]
    >>> path_to_str(p)
    'a/0'
  """
  parts = [_key_to_str(k) for k in path]
  if parts and parts[-1] == "value":
    parts = parts[:-1]
  return "/".join(parts)


def flatten_with_paths(tree) -> tuple[list[str], list[Any], Any]:
  """Flattens ``tree`` into (paths, leaves, treedef), paths as strings.

  Raises:
    ValueError: if two leaves map to the same path string.
  """
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  paths = [path_to_str(p) for p, _ in path_leaves]
  leaves = [leaf for _, leaf in path_leaves]
  seen = set()
  for path in paths:
    if path in seen:
      raise ValueError(
          f"Two parameter leaves share the path {path!r}; SkewAdam keys its "
          "state by path, so paths must be unique.")
    seen.add(path)
  return paths, leaves, treedef


def _compile(patterns: Patterns) -> list[re.Pattern]:
  if isinstance(patterns, str):
    patterns = (patterns,)
  return [re.compile(p) for p in patterns]


def label_path(path: str, *, router: Patterns = DEFAULT_ROUTER_PATTERNS,
               expert: Patterns = DEFAULT_EXPERT_PATTERNS) -> str:
  """The tier of one ``/``-joined path (router patterns take precedence)."""
  if any(p.search(path) for p in _compile(router)):
    return ROUTER
  if any(p.search(path) for p in _compile(expert)):
    return EXPERT
  return BACKBONE


def moe_param_labels(tree, *, router: Patterns = DEFAULT_ROUTER_PATTERNS,
                     expert: Patterns = DEFAULT_EXPERT_PATTERNS):
  """Labels every leaf of ``tree`` with its tier, by regex on its path.

  A leaf whose path matches any ``router`` pattern (``re.search`` on the
  ``/``-joined path) is ``"router"``; otherwise one matching any ``expert``
  pattern is ``"expert"``; every other leaf, including a bare array, is
  ``"backbone"``. The defaults match a path component exactly named
  ``router`` or ``experts``, e.g. ``layers/moe/router/kernel`` and
  ``layers/moe/experts/w_up``.

  Args:
    tree: parameters or updates (arrays, ``jax.ShapeDtypeStruct`` or Flax NNX
      state); only paths are read.
    router: regex or sequence of regexes for router leaves.
    expert: regex or sequence of regexes for expert-bank leaves.

  Returns:
    A pytree of strings with the structure of ``tree``.

  Example:
    >>> import jax.numpy as jnp
    >>> params = {"embed": jnp.zeros((8, 4)),
    ...           "moe": {"router": jnp.zeros((4, 2)),
    ...                   "experts": jnp.zeros((2, 4, 6))}}
    >>> moe_param_labels(params)
    {'embed': 'backbone', 'moe': {'experts': 'expert', 'router': 'router'}}
  """
  return jax.tree_util.tree_map_with_path(
      lambda p, _: label_path(path_to_str(p), router=router, expert=expert),
      tree)


def resolve_labels(param_labels: LabelSpec, tree) -> tuple[list[str], list[Any], list[str], Any]:
  """Resolves ``param_labels`` against ``tree``.

  Args:
    param_labels: ``None`` (use :func:`moe_param_labels`), a pytree of tier
      names with the structure of ``tree``, or a callable mapping ``tree`` to
      such a pytree.
    tree: parameters or updates.

  Returns:
    ``(paths, leaves, labels, treedef)`` with one label per leaf, in flattening
    order.

  Raises:
    ValueError: if the labels do not match the tree leaf for leaf (naming the
      first differing path), or a label is not a tier name (naming its path).
  """
  paths, leaves, treedef = flatten_with_paths(tree)
  if param_labels is None:
    labels_tree = moe_param_labels(tree)
  elif callable(param_labels):
    labels_tree = param_labels(tree)
  else:
    labels_tree = param_labels
  label_paths, labels, _ = flatten_with_paths(labels_tree)
  if label_paths != paths:
    missing = sorted(set(paths) - set(label_paths))
    extra = sorted(set(label_paths) - set(paths))
    detail = []
    if missing:
      detail.append(f"no label for {missing[:3]}")
    if extra:
      detail.append(f"labels for paths not in the parameters {extra[:3]}")
    if not detail:
      detail.append("leaves are in a different order")
    raise ValueError(
        "param_labels does not match the parameter tree: " + "; ".join(detail)
        + f" ({len(labels)} labels for {len(leaves)} leaves).")
  for path, label in zip(paths, labels):
    if label not in TIERS:
      raise ValueError(
          f"Parameter {path!r} has label {label!r}, which is not a tier; "
          f"expected one of {TIERS}.")
  return paths, leaves, labels, treedef
