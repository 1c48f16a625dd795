"""Tier labels: which of SkewAdam's three tiers each parameter belongs to.

Every leaf of a parameter pytree is labelled ``"backbone"``, ``"expert"`` or
``"router"``. The default labeller, :func:`moe_param_labels`, reads the
``/``-joined path of each leaf and matches regular expressions against it, in
the style of big_vision's parameter routing: router patterns first, then expert
patterns; everything else is backbone.

Pattern sets for common parameter trees (pass them as
``functools.partial(moe_param_labels, **PATTERNS[name])`` or through
:func:`label_fn`):

| name | expert leaves | router leaves |
|---|---|---|
| ``"default"`` (this project's model) | a path component ``experts`` | a path component ``router`` |
| ``"hf"`` (Hugging Face checkpoints: Mixtral ``model.layers.0.block_sparse_moe.experts.3.w1.weight``, one 2-D leaf per expert; Qwen2/3-MoE, DeepSeek-V2/V3 ``mlp.experts.K.gate_proj``; GPT-OSS ``mlp.experts.gate_up_proj``); ``"hf_mixtral"`` is the same set | ``block_sparse_moe/experts``, ``mlp/experts`` | ``block_sparse_moe/gate``, ``mlp/gate``, ``mlp/router`` |
| ``"easydel"`` (EasyDeL's Mixtral ``model/layers/0/block_sparse_moe/experts/w1/weight`` ``[E, D, F]``, Qwen3-MoE and DeepSeek-V3 ``mlp/experts/gate_proj/weight``: Hugging Face's names) | as ``"hf"`` | as ``"hf"`` |
| ``"levanter"`` (Levanter's Equinox Mixtral / Qwen3-MoE, scanned: ``transformer/layers/stacked/block_sparse_moe/experts/w1/weight/0`` ``[L, E, D, F]``) | as ``"hf"`` | as ``"hf"`` (``gate/weight/0`` ``[L, E, D]``) |
| ``"maxtext"`` (MaxText Mixtral ``MoeBlock_0``, Qwen3-MoE ``moe_block``, DeepSeek ``DeepSeekMoeBlock_0/MoeBlock_0``, GPT-OSS ``GptOssMlp``, Qwen3-Next ``routed_experts``) | ``wi_0``, ``wi_1``, fused ``wi``, ``wo``, their ``_bias``, ``per_expert_scale`` | ``<block>/gate`` (kernel and bias) |
| ``"keras_hub"`` (KerasHub Mixtral ``transformer_layer_0/mixtral_sparse_moe_block/experts/expert_feedforward_gate_dense``, Qwen-MoE, Qwen3-MoE, GPT-OSS; list-shaped parameters: label their ``.path`` names with :func:`label_names`) | ``*sparse_moe_block*/experts`` | ``sparse_feedforward_gate_dense``, ``router``, ``router_gate`` |

Shared experts are dense layers every token uses, so every set leaves them in
the backbone. A :func:`label_fn` labeller also declares its trees' matrix
axes (:func:`skewadam_jax.named_matrix_axes`: a 2-D expert bias ``[E, F]`` is
a vector, MaxText's layer axis at position 1 a batch axis); a user's own
patterns declare none, and a guess on a stacked leaf warns at ``init``. Check
the result with :func:`skewadam_jax.plan_table` before a long run.

Labels must depend on the *structure* of the tree only (paths, not values),
because optax calls label functions on the parameters in ``init`` and on the
updates in ``update``. Flax NNX states flatten to paths that may end in a
``value`` component in one call and not in the other; :func:`path_to_str`
drops that trailing component so both calls see the same path.

Per-leaf specifications (labels here, matrix axes in :mod:`skewadam_jax.axes`)
are matched to leaves by path (:func:`spec_per_leaf`): a specification tree
may be the parameter tree itself, any prefix of it (a single ``"expert"``
labels every leaf), or a tree whose containers differ in type (a plain dict
for an ``nnx.State``), as long as its paths name the parameters.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, Union

import jax
import numpy as np
import optax

from skewadam_jax import _warn

BACKBONE = "backbone"
EXPERT = "expert"
ROUTER = "router"
TIERS = (BACKBONE, EXPERT, ROUTER)

DEFAULT_ROUTER_PATTERNS = (r"(^|/)router(/|$)",)
DEFAULT_EXPERT_PATTERNS = (r"(^|/)experts(/|$)",)

# Hugging Face checkpoints (Mixtral's block_sparse_moe, Qwen-MoE / DeepSeek /
# GPT-OSS's mlp) and Levanter, whose Equinox fields copy Hugging Face's names.
# Shared experts (shared_expert, shared_experts, shared_mlp) and Qwen's
# shared_expert_gate are dense: backbone.
_HF = {"router": (r"(^|/)(block_sparse_moe|mlp)/(gate|router)(/|$)",),
       "expert": (r"(^|/)(block_sparse_moe|mlp)/experts(/|$)",)}
# MaxText's routed MoE module inside Mixtral's MoeBlock_N, Qwen3's moe_block,
# DeepSeek's and Llama4's .../MoeBlock_0, GPT-OSS's GptOssMlp, Qwen3-Next's
# routed_experts; a fused wi, expert biases and per-expert scales included.
_MAXTEXT_BLOCK = r"(^|/)(MoeBlock_\d+|moe_block|GptOssMlp|routed_experts)/"
# KerasHub's Mixtral, Qwen-MoE, Qwen3-MoE, Qwen3.5-MoE and GPT-OSS blocks
# (mixtral_sparse_moe_block_3, qwen_sparse_moe_block, sparse_moe_block, ...).
_KERAS_BLOCK = r"(^|/)[a-z0-9_]*sparse_moe_block(_\d+)?/"

PATTERNS = {
    "default": {"router": DEFAULT_ROUTER_PATTERNS, "expert": DEFAULT_EXPERT_PATTERNS},
    "hf": _HF,
    "hf_mixtral": _HF,
    "levanter": _HF,
    "easydel": _HF,
    "maxtext": {"router": (_MAXTEXT_BLOCK + r"gate(/|$)",),
                "expert": (_MAXTEXT_BLOCK + r"(wi_0|wi_1|wi|wo)(_bias)?(/|$)",
                           _MAXTEXT_BLOCK + r"per_expert_scale(/|$)")},
    "keras_hub": {"router": (_KERAS_BLOCK + r"(sparse_feedforward_gate_dense|router|router_gate)"
                             r"(/|$)",),
                  "expert": (_KERAS_BLOCK + r"experts(/|$)",)},
}

Patterns = Union[str, Sequence[str]]
LabelSpec = Union[None, str, Any, Callable[[Any], Any]]


def _key_to_str(key) -> str:
  for attr in ("key", "name", "idx"):
    if hasattr(key, attr):
      return str(getattr(key, attr))
  return str(key)


def path_parts(path) -> tuple[str, ...]:
  """The components of a key path as strings, without a trailing ``value``."""
  parts = [_key_to_str(k) for k in path]
  if parts and parts[-1] == "value":
    parts = parts[:-1]
  return tuple(parts)


def path_to_str(path) -> str:
  """Joins a ``jax.tree_util`` key path with ``/``, dropping a trailing ``value``.

  Args:
    path: a key path from ``jax.tree_util.tree_flatten_with_path``.

  Returns:
    The path as a string, e.g. ``"layers/moe/experts/w_up"``; ``""`` for a
    bare array.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> [(p, _)] = jax.tree_util.tree_flatten_with_path({"a": [jnp.ones(2)]})[0]
    >>> path_to_str(p)
    'a/0'
  """
  return "/".join(path_parts(path))


def flatten_with_paths(tree, is_leaf=None) -> tuple[list[str], list[Any], Any]:
  """Flattens ``tree`` into (paths, leaves, treedef), paths as strings."""
  path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)
  return ([path_to_str(p) for p, _ in path_leaves],
          [leaf for _, leaf in path_leaves], treedef)


def is_function(x) -> bool:
  """Whether ``x`` is a function to call, not a pytree container that happens to be callable.

  An Equinox module (or any registered pytree class with ``__call__``) is a
  tree of declarations built with ``jax.tree.map``: it is walked, never called.
  """
  if not callable(x):
    return False
  return isinstance(x, jax.tree_util.Partial) or jax.tree_util.all_leaves([x])


def _masked_paths(tree) -> list[tuple[str, ...]]:
  """Paths of the leaves ``optax.masked`` / ``optax.partition`` left out (``MaskedNode``)."""
  flat = jax.tree_util.tree_flatten_with_path(
      tree, is_leaf=lambda x: isinstance(x, optax.MaskedNode))[0]
  return [path_parts(p) for p, x in flat if isinstance(x, optax.MaskedNode)]


def spec_per_leaf(spec, tree, *, what: str, is_spec_leaf=None) -> list[Any]:
  """One entry of ``spec`` per leaf of ``tree``, matched by path.

  Each leaf takes the entry of ``spec`` whose path is the longest prefix
  (component-wise) of the leaf's path; a single non-container ``spec`` applies
  to every leaf. Inside ``optax.masked`` or ``optax.partition`` the tree holds
  ``optax.MaskedNode`` where a leaf is left to another transformation: a
  spec written for the whole parameter tree may name those paths. A ``None``
  entry (with ``is_spec_leaf`` keeping it) where the tree has no leaf is an
  absent field, as in an Equinox module filtered to its arrays.

  Args:
    spec: a tree of entries whose paths name leaves (or subtrees) of ``tree``.
    tree: parameters or updates.
    what: what the entries are, for error messages (``"param_labels"``).
    is_spec_leaf: marks entries that are themselves pytrees (``None``,
      NamedTuples) as leaves of ``spec``.

  Returns:
    The entries in ``tree``'s flattening order.

  Raises:
    ValueError: if a leaf has no entry (naming its path) or an entry names no
      leaf of ``tree`` (naming the entry's path).
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(spec, is_leaf=is_spec_leaf)
  entries = {path_parts(p): value for p, value in flat}
  paths = [path_parts(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  out, used = [], set()
  for parts in paths:
    for end in range(len(parts), -1, -1):
      if parts[:end] in entries:
        out.append(entries[parts[:end]])
        used.add(parts[:end])
        break
    else:
      missing = ["/".join(p) for p in paths
                 if not any(p[:e] in entries for e in range(len(p) + 1))]
      raise ValueError(
          f"{what} does not match the parameter tree: no entry for "
          f"{missing[:3]} ({len(entries)} entries for {len(paths)} leaves).")
  masked = _masked_paths(tree)
  # A None entry where the tree has nothing is an absent field (an Equinox
  # module filtered with eqx.filter keeps None there), not a misspelt path.
  unused = sorted("/".join(e) for e in set(entries) - used
                  if entries[e] is not None
                  and not any(m[:len(e)] == e or e[:len(m)] == m for m in masked))
  if unused and paths:
    raise ValueError(
        f"{what} does not match the parameter tree: entries for paths not in "
        f"the parameters {unused[:3]}.")
  return out


def _as_tuple(patterns: Patterns) -> tuple[str, ...]:
  return (patterns,) if isinstance(patterns, str) else tuple(patterns)


def _compile(patterns: Patterns) -> list[re.Pattern]:
  if isinstance(patterns, str):
    patterns = (patterns,)
  return [re.compile(p) for p in patterns]


def label_path(path: str, *, router: Patterns = DEFAULT_ROUTER_PATTERNS,
               expert: Patterns = DEFAULT_EXPERT_PATTERNS) -> str:
  """The tier of one ``/``-joined path (router patterns take precedence).

  ``.`` separates components too, so the flat names of a Hugging Face state
  dict (``model.layers.0.block_sparse_moe.gate.weight``) match the same
  patterns as nested paths.
  """
  path = path.replace(".", "/")
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
  ``layers/moe/experts/w_up``; :data:`PATTERNS` holds sets for other trees.

  Args:
    tree: parameters or updates (arrays, ``jax.ShapeDtypeStruct`` or Flax NNX
      state); only paths are read.
    router: regex or sequence of regexes for router leaves.
    expert: regex or sequence of regexes for expert-bank leaves.

  Returns:
    A pytree of strings with the structure of ``tree``.

  Examples:
    >>> import jax.numpy as jnp
    >>> params = {"embed": jnp.zeros((8, 4)),
    ...           "moe": {"router": jnp.zeros((4, 2)),
    ...                   "experts": jnp.zeros((2, 4, 6))}}
    >>> moe_param_labels(params)
    {'embed': 'backbone', 'moe': {'experts': 'expert', 'router': 'router'}}
  """
  refuse_step_count(tree, "param_labels")
  return jax.tree_util.tree_map_with_path(
      lambda p, _: label_path(path_to_str(p), router=router, expert=expert),
      tree)


def is_step_count(x) -> bool:
  """Whether ``x`` looks like the step count a schedule is called with: a 0-d integer array."""
  return (hasattr(x, "shape") and hasattr(x, "dtype") and tuple(x.shape) == ()
          and np.issubdtype(np.dtype(x.dtype), np.integer))


def static_args_error(argument: str) -> ValueError:
  """The error for a structural argument that ``optax.inject_hyperparams`` made a schedule."""
  return ValueError(
      f"SkewAdam's {argument} was called with a step count, not a tree: "
      "optax.inject_hyperparams takes every callable argument for a schedule; name it "
      f"static: optax.inject_hyperparams(..., static_args=({argument!r},)).")


def refuse_step_count(tree, argument: str) -> None:
  """Raises :func:`static_args_error` when a structural function gets a step count.

  ``optax.inject_hyperparams`` calls every callable argument with the step count
  unless it is named in ``static_args``; a labeller called so would label a
  scalar, and every leaf would land in one tier in silence. A parameter tree
  is never a lone integer scalar (SkewAdam refuses integer leaves).
  """
  if is_step_count(tree):
    raise static_args_error(argument)


def label_names(names: Sequence[str], *, router: Patterns = DEFAULT_ROUTER_PATTERNS,
                expert: Patterns = DEFAULT_EXPERT_PATTERNS) -> list[str]:
  """The tiers of parameters given as a list, from their names.

  Keras's stateless API (``model.stateless_call``, KerasHub on the JAX
  backend) passes the trainable variables as a list, whose tree paths are
  only ``0, 1, ...``; their names are the variables' ``.path``. The result is
  a list of tiers in the same order: pass it as ``param_labels``.

  Args:
    names: one name per parameter (``/``- or ``.``-separated).
    router, expert: patterns, as in :func:`moe_param_labels` (or
      ``**PATTERNS[name]``).

  Examples:
    >>> label_names(["block_0/attention/query/kernel",
    ...              "block_0/sparse_moe/router/kernel",
    ...              "block_0/sparse_moe/experts/gate_kernel"])
    ['backbone', 'router', 'expert']
  """
  return [label_path(str(name), router=router, expert=expert) for name in names]


class PatternLabeller:
  """A labeller for one named pattern set: called on a tree, returns its labels.

  Attributes:
    name: the pattern set's name in :data:`PATTERNS` (or ``"custom"``).
    router, expert: its patterns.
  """

  def __init__(self, name: str, router: Patterns, expert: Patterns):
    self.name, self.router, self.expert = name, router, expert

  def __call__(self, tree):
    return moe_param_labels(tree, router=self.router, expert=self.expert)

  def __repr__(self):
    return f"label_fn({self.name!r})"


def label_fn(name: str) -> PatternLabeller:
  """The labeller for one of the :data:`PATTERNS` sets, e.g. ``"maxtext"``.

  Pass it as ``param_labels`` (and, under ``optax.inject_hyperparams``, name
  ``param_labels`` in ``static_args``). ``init`` warns when it labels no leaf
  ``"expert"`` or none ``"router"``, naming the set and a few paths.

  Raises:
    ValueError: for a name not in :data:`PATTERNS`.
  """
  if name not in PATTERNS:
    raise ValueError(f"Unknown pattern set {name!r}; expected one of {sorted(PATTERNS)}.")
  return PatternLabeller(name, **PATTERNS[name])


# A path component that names a router (MaxText's MoeBlock_0/gate, Mixtral's
# block_sparse_moe/gate, router, routing): never offered as an expert.
_ROUTER_LIKE = re.compile(r"(^|[/.])(gate|[a-z_]*rout[a-z_]*)([/.]|$)", re.I)


def _example_paths(paths: list[str], leaves: list[Any], tier: str) -> list[str]:
  """A few paths that may be what the patterns missed, for the warning (none: none looks so)."""
  if tier == EXPERT:
    hits = [p for p, x in zip(paths, leaves)
            if ("expert" in p.lower() or len(x.shape) >= 3) and not _ROUTER_LIKE.search(p)]
  else:
    hits = [p for p in paths if re.search(r"gate|gating|rout", p, re.I) and "proj" not in p]
  return hits[:3]


def _warn_unmatched(name: str, patterns: dict, labels: list[str], tree) -> None:
  unmatched = [t for t in (EXPERT, ROUTER) if t not in labels]
  if not unmatched:
    return
  paths, leaves, _ = flatten_with_paths(tree)
  examples = {t: _example_paths(paths, leaves, t) for t in unmatched}
  who = ("default labeller" if name == "default" else "own param_labels function"
         if patterns is None else f"labeller {name!r}")
  shown = ("" if patterns is None else
           f" (patterns {_as_tuple(patterns['expert']) + _as_tuple(patterns['router'])})")
  _warn.warn(
      f"SkewAdam's {who} found no {' and no '.join(unmatched)} leaf among "
      f"{len(labels)} parameters{shown}; "
      f"every such leaf is in the backbone tier. Paths that may be meant: "
      + "; ".join(f"{t}: {examples[t]}" if examples[t] else f"{t}: none of the paths looks "
                  "like one" for t in unmatched) + ". "
      + _better_sets(paths, name)
      + f"Pass param_labels (a label_fn of {sorted(PATTERNS)}, a tree, or your own "
      "patterns) if the tree names its experts or router differently; "
      "skewadam_jax.plan_table(params) shows every leaf's tier.")


def _better_sets(paths: list[str], tried: str) -> str:
  """The named pattern sets that find both experts and a router in ``paths``, for the warning."""
  found, seen = [], [PATTERNS.get(tried)]
  for other, patterns in PATTERNS.items():
    if patterns in seen:  # a set under another name (hf_mixtral, levanter, easydel)
      continue
    seen.append(patterns)
    tiers = [label_path(p, **patterns) for p in paths]
    if EXPERT in tiers and ROUTER in tiers:
      found.append(f"label_fn({other!r}) finds {tiers.count(EXPERT)} expert and "
                   f"{tiers.count(ROUTER)} router leaves")
  return ("; ".join(found) + ". ") if found else ""


def resolve_labels(param_labels: LabelSpec, tree, *, warn: bool = False) -> list[str]:
  """The tier of every leaf of ``tree``, in flattening order.

  Args:
    param_labels: ``None`` (use :func:`moe_param_labels`), a tier name for
      every leaf, a pytree of tier names whose paths name the leaves (the
      parameter tree or a prefix of it; a callable pytree such as an Equinox
      module is a tree, see :func:`is_function`), or a function mapping
      ``tree`` to such a pytree.
    tree: parameters or updates.
    warn: with ``param_labels=None``, a :func:`label_fn` labeller or any
      other function (a user's :func:`moe_param_labels` patterns), warn when
      it labels no leaf ``"expert"`` or none ``"router"`` (the tree probably
      names them differently, or a pattern has a typo, and they would be
      backbone). Labels given as a tree or a tier name are taken as meant.

  Returns:
    One tier name per leaf.

  Raises:
    ValueError: if the labels do not match the tree (naming the first
      unmatched path), or a label is not a tier (naming its path).
  """
  if param_labels is None:
    labels_tree = moe_param_labels(tree)
  elif is_function(param_labels):
    labels_tree = param_labels(tree)
  else:
    labels_tree = param_labels
  labels = spec_per_leaf(labels_tree, tree, what="param_labels")
  paths, _, _ = flatten_with_paths(tree)
  for path, label in zip(paths, labels):
    if not isinstance(label, str) or label not in TIERS:
      raise ValueError(
          f"Parameter {path!r} has label {label!r}, which is not a tier; "
          f"expected one of {TIERS}.")
  # A tree with MaskedNode holes is one part of a partition (optax.partition,
  # the layerwise step's outer parameters): the experts may be in another part.
  warn = warn and not _masked_paths(tree)
  if warn and labels and param_labels is None:
    _warn_unmatched("default", PATTERNS["default"], labels, tree)
  elif warn and labels and isinstance(param_labels, PatternLabeller):
    _warn_unmatched(param_labels.name, {"router": param_labels.router,
                                        "expert": param_labels.expert}, labels, tree)
  elif warn and labels and is_function(param_labels):
    # A user's own labeller (moe_param_labels with their patterns, a lambda):
    # a typo in a pattern must not send every bank to the backbone silently.
    _warn_unmatched(getattr(param_labels, "__name__", "custom"), None, labels, tree)
  return labels
