"""The optimizers the experiments compare, built the same way for each.

Every optimizer gets the same learning-rate schedule shape (linear warmup, cosine
decay to 10 % of the peak) and the same global-norm clipping; each gets its own
peak learning rate. What each does with a parameter follows from the model's
declared logical axes (:mod:`models.axes`), read once and passed as ``axes``
(``{path: names}`` from :func:`models.logical_axes`):

* **weight decay** (decoupled) on matrices only, for every optimizer and every
  part of Muon: never on a norm scale or another vector, stacked or not
  (:func:`decay_mask`);
* **SkewAdam** gets the tier of each parameter and its matrix axes, so a
  stacked norm scale ``[L, D]`` keeps an exact second moment
  (:func:`skewadam_axes`);
* **Muon** orthogonalises the attention and expert matrices over their two
  matrix axes (the layer and expert axes are batch axes); embeddings, the
  unembedding (a ``vocab`` axis), the router and vectors go to AdamW
  (:func:`muon_dimension_numbers`).

Every baseline keeps its state in fp32 whatever the parameter dtype
(:func:`with_fp32_state`); SkewAdam's dtypes are set per tier.

| name | transform | weight decay |
|---|---|---|
| adamw | ``optax.adamw`` (fp32 moments) | ``weight_decay`` on matrices |
| skewadam | ``skewadam_jax.skewadam`` (tier configs from ``skewadam_tiers``) | same |
| muon | ``optax.contrib.muon`` on the orthogonalised matrices, ``optax.adamw`` (Nesterov, as Muon's own AdamW part) on the rest, through ``optax.partition`` | same on both parts |
| lion | ``optax.lion`` | same (Lion's usual lr is ~10× smaller) |
| adafactor | ``optax.adafactor`` without momentum, its relative step replaced by our schedule | same, as ``weight_decay_rate`` |
| skewadam_article | ``skewadam_jax.skewadam_article``: the article's code, with its own ``b2 = 0.999``, its clip a matrix (its run's tensors were one a layer and an expert) and our tiers and matrix axes | its own: 0.05 on every backbone and expert leaf (vectors too), none on the router |
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, muon

import skewadam_jax
from models import axes as model_axes

OPTIMIZERS = ("adamw", "skewadam", "muon", "lion", "adafactor", "skewadam_article")

# Starting learning rates: the centre of the comparison's sweep grid
# (experiments.compare sweeps around them); SkewAdam's by its expert tier's
# direction (default_lr).
DEFAULT_LR = {"adamw": 3e-3, "skewadam": 3e-3, "muon": 1e-2, "lion": 3e-4,
              "adafactor": 3e-3,
              # The article's own rate (its train.py), where its sweep starts.
              "skewadam_article": 3e-4}
# The library's update direction (skewadam_jax.skewadam) and the training
# command's default for both tiers' matrices: the orthogonal tiers
# (skewadam_jax.skewadam_orthogonal), which the comparison's rule chose
# (experiments.studies.comparison.choose_default on compare-long.json).
LIBRARY_DIRECTION = "adam"
DEFAULT_DIRECTION = "orthogonal"
# SkewAdam's rate by the expert tier's direction and, for an orthogonal one,
# its update scale. Adam's is the sweep centre (its 1600-step best, 4.5e-3, is
# in compare-long.json). Orthogonal with Adam's update RMS: the 1600-step
# sweep's best (compare-long.json); with Muon's width scaling: the tuning's
# (muon-gap.json, the default since the tuning against Muon). Normalized
# orthogonal with width
# scaling: the orthogonal rate, the best of its rate's neighbours at seed 0
# (muon-gap.md: 58.29 against 59.42 at half and 61.03 at twice; it keeps each
# matrix's Frobenius norm).
SKEWADAM_LR = {("adam", None): DEFAULT_LR["skewadam"],
               ("orthogonal", "adam_rms"): 1.35e-2, ("orthogonal", "width"): 1.5e-2,
               ("normalized_orthogonal", "adam_rms"): 2.7e-2,
               ("normalized_orthogonal", "width"): 1.5e-2}


# The article's optimizer without --lr: the best of its rate sweep on `small`
# (experiments/article_rows.sh; article-400.json: 114.0 at 8.1e-3, 139.5 at 2.7e-3,
# 188.2 at 2.4e-2 and 370.7 at the article's own 3e-4, which stays the sweep's centre).
ARTICLE_LR = 8.1e-3


# Decoupled weight decay on matrices without --weight-decay, every optimizer's;
# SkewAdam with an orthogonal expert tier takes skewadam_orthogonal's default
# (default_weight_decay), so the training command's default run is the alias.
DEFAULT_WEIGHT_DECAY = 0.1


def default_weight_decay(optimizer: str, skewadam_tiers: dict | None = None) -> float:
  """The weight decay a run of ``optimizer`` takes without ``--weight-decay``.

  Example:
    >>> default_weight_decay("adamw"), default_weight_decay("skewadam", {})
    (0.1, 0.1)
    >>> default_weight_decay("skewadam_article")  # the article's own
    0.05
  """
  if optimizer == "skewadam_article":
    return inspect.signature(skewadam_jax.skewadam_article).parameters["weight_decay"].default
  if (optimizer == "skewadam"
      and _direction((skewadam_tiers or {}).get("expert", {})) != LIBRARY_DIRECTION):
    # The alias's own default, so the two cannot drift apart.
    return inspect.signature(skewadam_jax.skewadam_orthogonal).parameters["weight_decay"].default
  return DEFAULT_WEIGHT_DECAY


def default_lr(optimizer: str, skewadam_tiers: dict | None = None) -> float:
  """The rate a run of ``optimizer`` takes without ``--lr``.

  SkewAdam's follows its expert tier's direction and update scale
  (:data:`SKEWADAM_LR`; a scale left out is the library's, ``adam_rms``).

  Example:
    >>> default_lr("skewadam", {"expert": {"direction": "orthogonal", "orthogonal_scale": "width"}})
    0.015
    >>> default_lr("skewadam", {"expert": {"direction": "orthogonal"}})  # Adam's update RMS
    0.0135
    >>> default_lr("skewadam", {})  # the library's direction
    0.003
    >>> default_lr("skewadam_article")  # its sweep's best, not the article's 3e-4
    0.0081
  """
  if optimizer == "skewadam_article":
    return ARTICLE_LR
  if optimizer != "skewadam":
    return DEFAULT_LR[optimizer]
  expert = (skewadam_tiers or {}).get("expert", {})
  direction = _direction(expert)
  if direction == LIBRARY_DIRECTION:
    return SKEWADAM_LR[(direction, None)]
  scale = (expert.get("orthogonal_scale") if isinstance(expert, dict)
           else getattr(expert, "orthogonal_scale", None))
  return SKEWADAM_LR[(direction, scale or skewadam_jax.DEFAULT_EXPERT.orthogonal_scale)]

Axes = Mapping[str, tuple]  # {path: logical axis names}, from models.logical_axes


def per_path(table: Mapping[str, Any]) -> Callable[[Any], Any]:
  """A function mapping any tree with these parameter paths to ``table``'s entries.

  optax calls masks and labellers on parameters, updates and partition-masked
  trees alike; matching by path fits them all.
  """
  def fn(tree):
    def one(path, _):
      name = model_axes.path_to_str(path)
      if name not in table:
        raise ValueError(f"no declared axes for parameter {name!r}; known: "
                         f"{sorted(table)[:4]}...")
      return table[name]
    return jax.tree_util.tree_map_with_path(one, tree)
  return fn


def decay_mask(axes: Axes) -> Callable[[Any], Any]:
  """Weight decay on matrices only (two unstacked axes), as a mask function.

  Example:
    >>> mask = decay_mask({"w": ("embed", "mlp"), "scale": ("layers", "embed")})
    >>> mask({"w": jnp.zeros((2, 3)), "scale": jnp.ones((4, 2))})
    {'scale': False, 'w': True}
  """
  return per_path({p: model_axes.matrix_dims(n) is not None for p, n in axes.items()})


# The key of ``skewadam_tiers`` that is not a tier: which tier holds the backbone
# leaves the orthogonal direction leaves out (TrainConfig.orthogonal_rest_tier).
REST_TIER = "orthogonal_rest_tier"
# Keys of ``skewadam_tiers`` that are the library's keyword arguments, not
# tiers: the update clip, the containment of non-finite gradient entries and
# Nesterov's momentum in Adam's direction
# (TrainConfig.update_clip, TrainConfig.contain_nonfinite, TrainConfig.nesterov).
# (group_leaves: the planning accounting's per-leaf bytes, which the stacked layout
# would put at each group's first leaf)
OPTION_KEYS = ("clip_threshold", "contain_nonfinite", "nesterov", "group_leaves")


def skewadam_options(skewadam_tiers: dict | None) -> dict:
  """The library keyword arguments :data:`OPTION_KEYS` carried in ``skewadam_tiers``."""
  return {k: v for k, v in (skewadam_tiers or {}).items() if k in OPTION_KEYS}


def tier_configs(skewadam_tiers: dict | None) -> dict:
  """``skewadam_tiers`` without :data:`REST_TIER` and :data:`OPTION_KEYS`: the
  library's ``backbone``, ``expert`` and ``router`` arguments."""
  return {k: v for k, v in (skewadam_tiers or {}).items()
          if k != REST_TIER and k not in OPTION_KEYS}


def skewadam_axes(axes: Axes, skewadam_tiers: dict | None = None) -> dict:
  """SkewAdam's ``param_labels``, ``matrix_axes`` and ``orthogonal_mask`` from the logical axes.

  All are functions of the tree they are given (matched by path), so the
  same optimizer serves the whole parameter tree or any part of it (one
  layer's slice, the parameters outside the layer stack). The
  ``orthogonal_mask`` only where ``skewadam_tiers`` has an orthogonal tier
  (the library refuses a mask it would ignore). With :data:`REST_TIER` set,
  the backbone leaves that are not orthogonalised (embeddings, unembedding,
  vectors) are labelled with that tier instead: ``"router"`` gives them
  AdamW's moments (fp32 ``m``, exact ``v``), as Muon's AdamW part has.

  Examples:
    >>> axes = {"embed": ("vocab", "embed"), "w": ("embed", "mlp"), "scale": ("embed",)}
    >>> labels = skewadam_axes(axes, {REST_TIER: "router"})["param_labels"]
    >>> labels({"embed": jnp.zeros((8, 2)), "w": jnp.zeros((2, 4)), "scale": jnp.ones(2)})
    {'embed': 'router', 'scale': 'router', 'w': 'backbone'}
  """
  rest = (skewadam_tiers or {}).get(REST_TIER)

  def label(names):
    tier = model_axes.tier(names)
    return rest if rest and tier == model_axes.BACKBONE and not orthogonalized(names) else tier

  out = {
      "param_labels": per_path({p: label(n) for p, n in axes.items()}),
      "matrix_axes": per_path({
          p: None if (d := model_axes.matrix_dims(n)) is None else skewadam_jax.MatrixAxes(*d)
          for p, n in axes.items()}),
  }
  if any(_direction(t) in skewadam_jax.transform.ORTHOGONAL_DIRECTIONS
         for t in tier_configs(skewadam_tiers).values()):
    # A tier with the orthogonal direction orthogonalises what Muon does.
    out["orthogonal_mask"] = per_path({p: orthogonalized(n) for p, n in axes.items()})
  return out


def _direction(tier) -> str:
  if isinstance(tier, dict):
    return tier.get("direction", "adam")
  return getattr(tier, "direction", "adam")


def orthogonalized(names) -> bool:
  """Whether Muon orthogonalises a parameter: a backbone or expert matrix
  without a ``vocab`` axis (embeddings and the unembedding go to AdamW)."""
  return (model_axes.matrix_dims(names) is not None
          and model_axes.tier(names) != model_axes.ROUTER
          and model_axes.VOCAB not in names)


def muon_dimension_numbers(axes: Axes) -> Callable[[Any], Any]:
  """Muon's dimension numbers per parameter (``None``: left to AdamW).

  Rows are the reduction axis and columns the output axis of the declared
  matrix; stacked layer and expert axes are batch axes, so each layer's (and
  each expert's) matrix is orthogonalised on its own.
  """
  return per_path({
      p: MuonDimensionNumbers(*model_axes.matrix_dims(n)) if orthogonalized(n) else None
      for p, n in axes.items()})


SCHEDULES = ("cosine", "wsd", "cooldown")


def lr_schedule(peak_lr: float, total_steps: int, warmup_steps: int, *,
                kind: str = "cosine", decay_fraction: float = 0.2):
  """Linear warmup to ``peak_lr``, then the schedule ``kind``.

  With ``T`` = ``total_steps``, ``W`` = warmup steps and, for the two
  schedules with a constant phase, ``D = round(decay_fraction * T)`` decay
  steps starting at ``S = T - D``:

  * ``cosine``: cosine decay from ``peak_lr`` at ``W`` to ``peak_lr / 10`` at ``T``;
  * ``wsd`` (warmup-stable-decay): ``peak_lr`` until ``S``, then
    ``peak_lr * (1 - sqrt((t - S) / D))``, 0 at ``T`` (the 1-sqrt cooldown of
    Hägele et al., 2024);
  * ``cooldown`` (constant with linear cooldown): ``peak_lr`` until ``S``,
    then ``peak_lr * (1 - (t - S) / D)``.

  Raises:
    ValueError: an unknown ``kind``, or a decay that would start inside the warmup.
  """
  warmup_steps = max(1, min(warmup_steps, total_steps - 1)) if total_steps > 1 else 0
  if kind == "cosine":
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=peak_lr, warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1), end_value=peak_lr / 10)
  if kind not in SCHEDULES:
    raise ValueError(f"unknown schedule {kind!r}; choose from {', '.join(SCHEDULES)}")
  decay_steps = max(1, round(decay_fraction * total_steps))
  decay_start = total_steps - decay_steps
  if decay_start < warmup_steps:
    raise ValueError(f"schedule {kind!r}: {decay_steps} decay steps "
                     f"(decay_fraction={decay_fraction} of {total_steps}) overlap the "
                     f"{warmup_steps} warmup steps")

  def schedule(step):
    step = jnp.asarray(step, jnp.float32)
    warm = peak_lr * step / max(warmup_steps, 1)
    done = jnp.clip((step - decay_start) / decay_steps, 0.0, 1.0)
    shape = 1.0 - (jnp.sqrt(done) if kind == "wsd" else done)
    return jnp.where(step < warmup_steps, warm, peak_lr * shape)

  return schedule


def with_fp32_state(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """Runs ``tx`` on float32 copies of the gradients and parameters.

  optax keeps Adam's ``nu`` (and, unless told, ``mu``) in the parameters'
  dtype, so bf16 parameters would give AdamW bf16 moments. Wrapped, every
  baseline keeps fp32 state, as SkewAdam's fp32 tiers do and as the published
  AdamW baseline (8 bytes of state per parameter) does. Updates come back in
  the gradients' dtype. A no-op for fp32 parameters.
  """
  to32 = lambda tree: jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)

  def init(params):
    return tx.init(jax.tree.map(
        lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32)
        if isinstance(p, jax.ShapeDtypeStruct) else jnp.asarray(p, jnp.float32), params))

  def update(updates, state, params=None, **extra_args):
    new, state = optax.with_extra_args_support(tx).update(
        to32(updates), state, None if params is None else to32(params), **extra_args)
    return jax.tree.map(lambda u, g: u.astype(g.dtype), new, updates), state

  return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(name: str, *, learning_rate: Any, axes: Axes,
                   weight_decay: float | None = None,
                   clip_norm: float = 1.0, skewadam_tiers: dict | None = None,
                   b1: float = 0.9, b2: float = 0.95,
                   muon_momentum: float = 0.95) -> optax.GradientTransformation:
  """Builds optimizer ``name`` with global-norm clipping in front.

  Args:
    name: one of :data:`OPTIMIZERS`.
    learning_rate: float or schedule.
    axes: the model's logical axes by path (:func:`models.logical_axes`).
    weight_decay: decoupled weight decay on matrices (``None``:
      :func:`default_weight_decay`'s).
    clip_norm: global gradient-norm clip (``0`` disables it).
    skewadam_tiers: ``{"backbone": ..., "expert": ..., "router": ...}``
      ``TierConfig``s (or dicts) for SkewAdam; defaults otherwise.
    b1, b2: Adam-family moment decays (AdamW, SkewAdam, Muon's AdamW part;
      the article's optimizer takes ``b1`` and keeps its own ``b2``, 0.999).
    muon_momentum: Muon's own momentum on the matrices it orthogonalises
      (``optax.contrib.muon``'s ``beta``, whose default it is).

  Raises:
    ValueError: for an unknown name.
  """
  mask = decay_mask(axes)
  if weight_decay is None:
    weight_decay = default_weight_decay(name, skewadam_tiers)
  if name == "adamw":
    tx = optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay,
                     mask=mask, mu_dtype=jnp.float32)
  elif name == "skewadam":
    # SkewAdam clips inside its own step (the same result as the chained clip
    # below): an orthogonalised bank's layer loop then reads the raw gradient,
    # and no clipped copy of it is live (4.4 GB a bank at moe-6.78b).
    tx = skewadam_jax.skewadam(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay,
                               mask=mask, max_grad_norm=clip_norm or None,
                               **skewadam_axes(axes, skewadam_tiers),
                               **tier_configs(skewadam_tiers),
                               **skewadam_options(skewadam_tiers))
  elif name == "muon":
    # optax's muon() decays every leaf of its AdamW part (norm scales
    # included) with adam_weight_decay; partitioning here gives both parts
    # the same mask.
    dims = muon_dimension_numbers(axes)
    label = per_path({p: "muon" if orthogonalized(n) else "adam" for p, n in axes.items()})
    tx = optax.partition({
        "muon": muon(learning_rate, beta=muon_momentum, weight_decay=weight_decay,
                     weight_decay_mask=mask, muon_weight_dimension_numbers=dims),
        "adam": optax.adamw(learning_rate, b1=b1, b2=b2, eps=1e-8,
                            weight_decay=weight_decay, mask=mask, nesterov=True),
    }, label)
  elif name == "skewadam_article":
    # The reference's decay mask (every backbone and expert leaf), not ours.
    routing = skewadam_axes(axes)
    tx = skewadam_jax.skewadam_article(learning_rate, weight_decay=weight_decay, b1=b1,
                                       clip_scope="matrix",
                                       param_labels=routing["param_labels"],
                                       matrix_axes=routing["matrix_axes"])
  elif name == "lion":
    tx = optax.lion(learning_rate, weight_decay=weight_decay, mask=mask)
  elif name == "adafactor":
    tx = optax.adafactor(learning_rate, multiply_by_parameter_scale=False,
                         weight_decay_rate=weight_decay, weight_decay_mask=mask)
  else:
    raise ValueError(f"Unknown optimizer {name!r}; expected one of {OPTIMIZERS}.")
  if name != "skewadam":
    tx = with_fp32_state(tx)
  if clip_norm and name != "skewadam":
    tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
  return tx
