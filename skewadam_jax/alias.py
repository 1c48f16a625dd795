"""SkewAdam with Muon's direction, as the training command measured it.

:func:`skewadam` keeps the article's tiering with Adam's direction ``m̂ / √v̂``
in every tier (the article's own update, its code's ε floor, momentum-free
expert and router tiers and whole-tensor clip, is :func:`skewadam_article`). :func:`skewadam_orthogonal` is the configuration that measured
best at SkewAdam's memory in this project's long comparison
(``experiments/results/compare-long.json``), and the training command's
default: the backbone and expert
matrices step along the Newton–Schulz orthogonal factor of their momentum (Muon's
direction), stored in the tiers' compact encodings, while embeddings, the
unembedding, vectors and the router keep Adam's direction, as Muon's AdamW part
does. Its defaults are the training command's (``python -m experiments.train``).
"""

from __future__ import annotations

import re
import types
from typing import Any, Optional, Sequence, Union

import jax
import optax

from skewadam_jax import _warn
from skewadam_jax import labels as labels_lib
from skewadam_jax import transform

# Embedding and unembedding names in this project's model (embed/embedding,
# unembed/kernel), Hugging Face (embed_tokens, lm_head, wte/wpe), MaxText
# (token_embedder, logits_dense), KerasHub (token_embedding, reversible
# embeddings), Levanter (token_embeddings), Llama's tok_embeddings, and the
# position tables of hand-written models (pos, pos_embedding, ...).
EMBEDDING_PATTERNS = (
    r"(^|/)(embed|embedding|embeddings|embed_tokens|token_embedder|token_embedding|"
    r"token_embeddings|tok_embeddings|wte|wpe|position_embedding|position_embeddings|"
    r"pos|pos_emb|pos_embed|pos_embedding|positional_embedding|unembed|unembedding|"
    r"lm_head|logits_dense|output_embedding)(/|$)",
)

# Which of those names an output side (an unembedding) or a position table: the
# rest are input embeddings, whose rows give the vocabulary size.
_OUTPUT_NAMES = re.compile(r"(^|/)(unembed|unembedding|lm_head|logits_dense|output_embedding)(/|$)")
_POSITION_NAMES = re.compile(r"(^|/)(wpe|position_embedding|position_embeddings|pos|pos_emb|"
                             r"pos_embed|pos_embedding|positional_embedding)(/|$)")

# What skewadam_orthogonal gives the backbone and expert tiers beyond their
# direction, where a tier is None or a dict that does not set the key: the
# settings the comparison's rule chose at 1600 steps within the 1.29 GB budget
# (docs/results/quality.md). skewadam() keeps DEFAULT_BACKBONE's and
# DEFAULT_EXPERT's; the training command's orthogonal tiers follow this table
# (experiments.training.config.direction_default), so a default moves here only.
ORTHOGONAL_TIER_SETTINGS = types.MappingProxyType({
    # Muon's width scaling (orthogonal.width_scale), so Muon's rates carry over
    "backbone": types.MappingProxyType({"orthogonal_scale": "width"}),
    # a rank-84 factorisation of each expert matrix's momentum in int8 codes
    # (encodings.LowRankEncoding: a float32 step per row of Qᵀ, stochastically rounded)
    # in place of DEFAULT_EXPERT's packed signs: the most rank moe-6.78b's 1.29 GB
    # holds, twice bfloat16's at the same bytes, and the better of the two at 1600 steps
    "expert": types.MappingProxyType({"momentum": "lowrank", "lowrank_rank": 84,
                                      "lowrank_dtype": "int8",
                                      "orthogonal_scale": "width"}),
})
"""The settings :func:`skewadam_orthogonal` gives each tier beyond its direction.

``{"backbone": {...}, "expert": {...}}``, read-only: a tier passed as ``None``
or as a dict gets them where it does not set the key itself (a
:class:`~skewadam_jax.TierConfig` is used as given). The training command's
defaults for an orthogonal tier are these too
(``experiments.training.config.direction_default``).
"""

# The expert tier's momentum in skewadam_orthogonal (ORTHOGONAL_TIER_SETTINGS's).
ORTHOGONAL_EXPERT_MOMENTUM = ORTHOGONAL_TIER_SETTINGS["expert"]["momentum"]

Patterns = Union[str, Sequence[str]]
_DEFAULT = object()  # embeddings=: EMBEDDING_PATTERNS unless orthogonal_mask is given


class EmbeddingMask:
  """``skewadam_orthogonal``'s ``orthogonal_mask``: False on embeddings and unembeddings.

  A leaf keeps Adam's direction when its path matches ``patterns``
  (``re.search`` on the ``/``-joined path, ``.`` read as ``/``), or when it is
  the output side of a matched input embedding: a 2-D matrix with the
  vocabulary size (the rows of a matched token embedding ``[V, D]``, when
  ``V ≠ D``) as one of its two sides, a readout or logits kernel of any
  name. :meth:`roles` says which rule took each leaf; ``plan_table`` shows it
  ("adam (unembedding)"). It warns at ``init`` when nothing matched and, with
  ``expect_output`` (the default patterns), when an input embedding matched but
  no output side did (a model with a tied embedding has none: pass
  ``embeddings=`` to say so).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> tree = {"tok": {"embedding": jax.ShapeDtypeStruct((100, 8), jnp.float32)},
    ...         "mlp": jax.ShapeDtypeStruct((8, 32), jnp.float32),
    ...         "readout": jax.ShapeDtypeStruct((8, 100), jnp.float32)}
    >>> EmbeddingMask(EMBEDDING_PATTERNS).roles(tree)
    [None, 'unembedding, vocabulary 100', 'embedding']
  """

  def __init__(self, patterns: Patterns, *, expect_output: bool = True):
    self.patterns = labels_lib._as_tuple(patterns)  # pylint: disable=protected-access
    self.expect_output = expect_output
    self._compiled = labels_lib._compile(self.patterns)  # pylint: disable=protected-access

  def __repr__(self):
    return f"EmbeddingMask({self.patterns!r})"

  def __eq__(self, other):
    return (isinstance(other, EmbeddingMask) and self.patterns == other.patterns
            and self.expect_output == other.expect_output)

  def __hash__(self):
    return hash((self.patterns, self.expect_output))

  def roles(self, tree) -> list[Optional[str]]:
    """Per leaf, in flattening order: why it keeps Adam's direction, or ``None``."""
    labels_lib.refuse_step_count(tree, "orthogonal_mask")
    paths, leaves, _ = labels_lib.flatten_with_paths(tree)
    return self._roles(paths, leaves)

  def _roles(self, paths: list[str], leaves: list[Any]) -> list[Optional[str]]:
    paths = [path.replace(".", "/") for path in paths]
    roles: list[Optional[str]] = []
    vocabularies = set()
    for path, leaf in zip(paths, leaves):
      if not any(p.search(path) for p in self._compiled):
        roles.append(None)
      elif _OUTPUT_NAMES.search(path):
        roles.append("unembedding")
      elif _POSITION_NAMES.search(path):
        roles.append("position embedding")
      else:
        roles.append("embedding")
        shape = getattr(leaf, "shape", ())
        if len(shape) == 2 and shape[0] != shape[1]:  # [V, D]: V rows, one per token
          vocabularies.add(shape[0])
    for i, leaf in enumerate(leaves):
      shape = tuple(getattr(leaf, "shape", ()))
      if roles[i] is None and len(shape) == 2 and shape[0] != shape[1]:
        vocabulary = vocabularies.intersection(shape)
        if vocabulary:
          roles[i] = f"unembedding, vocabulary {min(vocabulary)}"
    return roles

  def __call__(self, tree):
    labels_lib.refuse_step_count(tree, "orthogonal_mask")
    paths, leaves, treedef = labels_lib.flatten_with_paths(tree)
    roles = self._roles(paths, leaves)
    if leaves:
      if not any(roles):
        _warn.warn(
            "skewadam_orthogonal: no parameter path matched the embedding patterns "
            f"({', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''}): every declared "
            "matrix, an embedding or unembedding included, gets Muon's direction. If the "
            "model has them, pass embeddings=<your patterns> or orthogonal_mask.")
      elif self.expect_output and not any(role and role.startswith("unembedding")
                                          for role in roles):
        inputs = [p for p, role in zip(paths, roles) if role == "embedding"]
        if inputs:
          _warn.warn(
              f"skewadam_orthogonal: found the embedding {inputs[0]!r} but no unembedding "
              "(no path named like one, no other 2-D matrix with the vocabulary size as a "
              "side): the output layer, if the model has its own, gets Muon's direction. "
              "Name it in embeddings=<your patterns>, or pass embeddings= to say that the "
              "output is tied to the embedding.")
    return jax.tree.unflatten(treedef, [role is None for role in roles])


def _with_defaults(tier: transform.TierLike, **defaults: Any) -> transform.TierLike:
  if tier is None:
    return defaults
  if isinstance(tier, dict):
    return {**defaults, **tier}
  return tier  # a TierConfig says its own settings; skewadam checks anything else


def orthogonal_settings(*, direction: str = "orthogonal", embeddings: Any = _DEFAULT,
                        orthogonal_mask: Any = None, backbone: transform.TierLike = None,
                        expert: transform.TierLike = None) -> dict:
  """The ``backbone``, ``expert`` and ``orthogonal_mask`` arguments
  :func:`skewadam_orthogonal` passes to :func:`skewadam`, with the same
  arguments and checks: what to give :func:`~skewadam_jax.plan_table` to see
  its per-leaf plan before a run.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> import skewadam_jax
    >>> params = {"embed_tokens": jax.ShapeDtypeStruct((64, 8), jnp.float32),
    ...           "q_proj": jax.ShapeDtypeStruct((8, 8), jnp.float32)}
    >>> plans = skewadam_jax.leaf_plans(params, **skewadam_jax.orthogonal_settings())
    >>> [plan.orthogonal for plan in plans]   # the embedding keeps Adam's direction
    [False, True]
  """
  if direction not in transform.ORTHOGONAL_DIRECTIONS:
    raise ValueError(f"direction must be one of {transform.ORTHOGONAL_DIRECTIONS}, "
                     f"got {direction!r}.")
  if orthogonal_mask is not None:
    if embeddings is not _DEFAULT and embeddings is not None:
      raise ValueError("Give embeddings= or orthogonal_mask=, not both.")
  elif embeddings is not None:
    orthogonal_mask = (EmbeddingMask(EMBEDDING_PATTERNS) if embeddings is _DEFAULT
                       else EmbeddingMask(embeddings, expect_output=False))
  return {"backbone": _with_defaults(backbone, direction=direction,
                                     **ORTHOGONAL_TIER_SETTINGS["backbone"]),
          "expert": _with_defaults(expert, direction=direction,
                                   **ORTHOGONAL_TIER_SETTINGS["expert"]),
          "orthogonal_mask": orthogonal_mask}


def skewadam_orthogonal(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.95,
    eps: float = 1e-8,
    eps_root: float = 0.0,
    mu_dtype: Any = None,
    weight_decay: optax.ScalarOrSchedule = 0.2,
    mask: Any = transform.MATRICES,
    *,
    direction: str = "orthogonal",
    embeddings: Any = _DEFAULT,
    orthogonal_mask: Any = None,
    backbone: transform.TierLike = None,
    expert: transform.TierLike = None,
    router: transform.TierLike = None,
    max_grad_norm: Optional[float] = 1.0,
    param_labels: labels_lib.LabelSpec = None,
    matrix_axes: Any = None,
    nesterov: bool = False,
    factored_eps: float = 1e-30,
    clip_threshold: Union[float, str, None] = "auto",
    contain_nonfinite: bool = True,
    group_leaves: Union[bool, str] = "auto",
) -> optax.GradientTransformationExtraArgs:
  r"""SkewAdam with Muon's direction in the backbone and expert tiers.

  Each declared matrix of the backbone and expert tiers (embeddings and the
  unembedding excepted) stores its momentum in its tier's encoding (bf16 in
  the backbone; in the expert bank rank-84 int8 factors ``P·Qᵀ`` of each
  expert matrix, :data:`ORTHOGONAL_TIER_SETTINGS`) and steps along the
  orthogonal factor of its Nesterov momentum with Muon's width scaling::

      m_t = b1·m̃_{t−1} + (1 − b1)·g_t
      u_t = √max(1, c / r) · NS₅(b1·m_t + (1 − b1)·g_t)
      m̃_t = P_t·Q_tᵀ = P_t·P_tᵀ·m_t,   P_t = orth(m_t·Q_{t−1})   (expert matrices)

  where ``NS₅`` is five Newton–Schulz iterations over the ``r × c`` matrix
  (:func:`~skewadam_jax.newton_schulz`, :func:`~skewadam_jax.orthogonal.width_scale`).
  Such a matrix stores no second moment. Everything else (embeddings, vectors,
  the router) keeps :func:`skewadam`'s Adam step in its tier. The result is
  ``skewadam(..., backbone={"direction": direction, "orthogonal_scale":
  "width"}, expert={"direction": direction, "momentum": "lowrank",
  "lowrank_rank": 84, "lowrank_dtype": "int8", "orthogonal_scale":
  "width"}, orthogonal_mask=<not an embedding>)``.
  The expert momentum's ``P_t`` follows the momentum's leading left singular
  vectors over the steps (one warm-started subspace iteration a step,
  :class:`~skewadam_jax.encodings.LowRankEncoding`), stored in int8 codes
  (a float32 step per column of ``P``, moved into ``Qᵀ``'s rows),
  stochastically rounded: ``84·(R + C) + 4·84`` bytes an ``R × C`` expert
  matrix, the most rank the 1.29 GB budget holds at ``moe-6.78b`` (1.289 GB
  of state). The comparison's rule chose it over rank-42 bfloat16 factors at
  the same bytes and rank-16 float32 factors with Adam's update RMS (the
  default before 0.3.0): validation perplexity 56.37 ± 0.16 against
  57.66 ± 0.28 and 58.59 ± 0.59 (``small``, 1600 steps, 3 seeds, each tuned
  by the same procedure; Muon 57.45 ± 0.26), docs/results/quality.md. At 5×
  the parameters (``small-x5``) it is level with Muon over three seeds
  (54.94 ± 1.40 against Muon's 54.97 ± 0.69): its lead is measured on
  ``small`` only.
  ``expert={"momentum": "sign"}`` keeps packed signs;
  ``{"orthogonal_scale": "adam_rms"}`` in a tier scales the update to Adam's
  RMS (``0.2·√max(r, c)``), so Adam's rates carry over.

  The defaults are the settings the comparison tuned this configuration at:
  ``b2=0.95``, ``weight_decay=0.2`` on declared matrices, a global-norm clip
  of 1.0 inside the step (``max_grad_norm``). The learning rate has no
  default, as in optax; the tuning (the 4.46M-parameter ``small`` preset,
  1600 steps, warmup then cosine decay) chose ``1.5e-2``, the training
  command's default.

  Args:
    learning_rate: a float or an optax schedule.
    b1, b2, eps, eps_root, mu_dtype, weight_decay, mask: as in
      :func:`skewadam` (``b2`` and ``eps`` reach the leaves that keep Adam's
      direction).
    direction: ``"orthogonal"`` (Muon's) or ``"normalized_orthogonal"``
      (NorMuon's per-neuron normalisation after it).
    embeddings: regexes (``re.search`` on each leaf's ``/``-joined path, ``.``
      read as ``/``) naming the embedding and unembedding matrices, which
      keep Adam's direction; :data:`EMBEDDING_PATTERNS` covers this
      project's, Hugging Face's, MaxText's, KerasHub's and Levanter's names
      (the default), and a warning says when no path matched. ``None``:
      orthogonalise every declared matrix.
    orthogonal_mask: instead of ``embeddings``, which declared matrices are
      orthogonalised (as in :func:`scale_by_skewadam`).
    backbone, expert, router: tier configs as in :func:`skewadam`. A dict
      gets ``direction`` and the tier's :data:`ORTHOGONAL_TIER_SETTINGS`
      where it does not set them; a :class:`TierConfig` is used as given.
    max_grad_norm: the global-norm clip inside the step (``None``: none).
    param_labels, matrix_axes, nesterov, factored_eps: as in :func:`skewadam`.
    clip_threshold, contain_nonfinite, group_leaves: as in :func:`skewadam`
      (every argument is named here, none passed through ``**kwargs``, so
      ``optax.inject_hyperparams`` binds them as it binds ``optax.adamw``'s).

  Its per-leaf plan: ``plan_table(params, param_labels=...,
  **orthogonal_settings(...))`` with the same arguments
  (:func:`orthogonal_settings`).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.

  Raises:
    ValueError: for an unknown ``direction``, ``embeddings`` together with
      ``orthogonal_mask``, and everything :func:`skewadam` rejects.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import skewadam_jax
    >>> params = {"embed": jnp.ones((8, 4)), "w": jnp.ones((4, 4)),
    ...           "moe": {"router": jnp.ones((4, 2)),
    ...                   "experts": jnp.ones((2, 4, 6))}}
    >>> tx = skewadam_jax.skewadam_orthogonal(1e-2)
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = optax.apply_updates(params, updates)
  """
  settings = orthogonal_settings(direction=direction, embeddings=embeddings,
                                 orthogonal_mask=orthogonal_mask, backbone=backbone, expert=expert)
  return transform.skewadam(
      learning_rate, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask,
      router=router, max_grad_norm=max_grad_norm, param_labels=param_labels,
      matrix_axes=matrix_axes, nesterov=nesterov, factored_eps=factored_eps,
      clip_threshold=clip_threshold, contain_nonfinite=contain_nonfinite,
      group_leaves=group_leaves, **settings)
