"""SkewAdam with Muon's direction, as the training command measured it.

:func:`skewadam` keeps the article's rule: Adam's direction ``m̂ / √v̂`` in
every tier. :func:`skewadam_orthogonal` is the configuration that measured
best at SkewAdam's memory in this project's long comparison
(``experiments/results/compare-long.json``), and the training command's
default: the backbone and expert
matrices step along the Newton–Schulz orthogonal factor of their momentum (Muon's
direction), stored in the tiers' compact encodings, while embeddings, the
unembedding, vectors and the router keep Adam's direction, as Muon's AdamW part
does. Its defaults are the training command's (``python -m experiments.train``).
"""

from __future__ import annotations

import types
import warnings
from typing import Any, Optional, Sequence, Union

import jax
import optax

from skewadam_jax import labels as labels_lib
from skewadam_jax import transform

# Embedding and unembedding names in this project's model (embed/embedding,
# unembed/kernel), Hugging Face (embed_tokens, lm_head, wte/wpe), MaxText
# (token_embedder, logits_dense), KerasHub (token_embedding, reversible
# embeddings), Levanter (token_embeddings) and Llama's tok_embeddings.
EMBEDDING_PATTERNS = (
    r"(^|/)(embed|embedding|embeddings|embed_tokens|token_embedder|token_embedding|"
    r"token_embeddings|tok_embeddings|wte|wpe|position_embedding|unembed|unembedding|"
    r"lm_head|logits_dense|output_embedding)(/|$)",
)

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


def _orthogonal_unless_embedding(patterns: Patterns):
  """An ``orthogonal_mask`` function: False on paths matching ``patterns``."""
  compiled = labels_lib._compile(patterns)  # pylint: disable=protected-access

  def mask(tree):
    paths, leaves, treedef = labels_lib.flatten_with_paths(tree)
    embedding = [any(p.search(path.replace(".", "/")) for p in compiled) for path in paths]
    if leaves and not any(embedding):
      warnings.warn(
          "skewadam_orthogonal: no parameter path matched the embedding patterns "
          f"({', '.join(paths[:3])}{', ...' if len(paths) > 3 else ''}): every declared matrix, "
          "an embedding or unembedding included, gets Muon's direction. If the model has "
          "them, pass embeddings=<your patterns> or orthogonal_mask.", stacklevel=2)
    return jax.tree.unflatten(treedef, [not e for e in embedding])

  return mask


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
    orthogonal_mask = _orthogonal_unless_embedding(
        EMBEDDING_PATTERNS if embeddings is _DEFAULT else embeddings)
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
    **kwargs: Any,
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
    **kwargs: the rest of :func:`skewadam`'s keyword arguments
      (``param_labels``, ``matrix_axes``, ``nesterov``, ...).

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
      router=router, max_grad_norm=max_grad_norm, **settings, **kwargs)
