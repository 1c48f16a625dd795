"""The optimizers the experiments compare, built the same way for each.

Every optimizer gets the same learning-rate schedule shape (linear warmup, cosine
decay to 10 % of the peak) and the same global-norm clipping; each gets its own
peak learning rate. Weight decay is decoupled and applied to matrices only
(leaves with 2 or more dimensions) for every optimizer:

Every baseline keeps its state in fp32 whatever the parameter dtype
(:func:`with_fp32_state`); SkewAdam's dtypes are set per tier.

| name | transform | weight decay |
|---|---|---|
| adamw | ``optax.adamw`` (fp32 moments) | ``weight_decay`` on matrices |
| skewadam | ``skewadam_jax.skewadam`` (tier configs from ``skewadam_tiers``) | same |
| muon | ``optax.contrib.muon``: Newton–Schulz on the last two axes of attention and expert matrices (layer and expert axes are batch axes); AdamW for embeddings, unembedding, router and vectors | same on both parts |
| lion | ``optax.lion`` | same (Lion's usual lr is ~10× smaller) |
| adafactor | ``optax.adafactor`` without momentum, its relative step replaced by our schedule | same, as ``weight_decay_rate`` |
"""

from __future__ import annotations

import re
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax.contrib import MuonDimensionNumbers, muon

import skewadam_jax

OPTIMIZERS = ("adamw", "skewadam", "muon", "lion", "adafactor")

# Starting learning rates: the centre of the comparison's sweep grid (not yet
# tuned; experiments.compare sweeps around them).
DEFAULT_LR = {"adamw": 3e-3, "skewadam": 3e-3, "muon": 1e-2, "lion": 3e-4,
              "adafactor": 3e-3}

# Parameters Muon leaves to AdamW: embeddings, unembedding, the router.
_MUON_EXCLUDE = re.compile(r"(^|/)(embed|unembed|router)(/|$)")


# The weight-decay mask every optimizer is given (Muon applies it only to its
# orthogonalised part; state_bytes.decayed_by_path observes what is decayed).
WEIGHT_DECAY_MASK = skewadam_jax.matrices_only


def lr_schedule(peak_lr: float, total_steps: int, warmup_steps: int):
  """Linear warmup to ``peak_lr``, then cosine decay to ``peak_lr / 10``."""
  warmup_steps = max(1, min(warmup_steps, total_steps - 1)) if total_steps > 1 else 0
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=peak_lr, warmup_steps=warmup_steps,
      decay_steps=max(total_steps, warmup_steps + 1), end_value=peak_lr / 10)


def muon_dimension_numbers(params):
  """Muon's dimension numbers: the last two axes of every matrix it handles.

  Stacked leaves (``[L, d_in, d_out]`` attention, ``[L, E, d_in, d_out]``
  experts) are orthogonalised per layer and per expert; embeddings, the
  unembedding, the router and vectors return ``None`` and go to AdamW.
  """
  def spec(path, x):
    name = skewadam_jax.labels.path_to_str(path)
    if len(x.shape) < 2 or _MUON_EXCLUDE.search(name):
      return None
    return MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)
  return jax.tree_util.tree_map_with_path(spec, params)


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


def make_optimizer(name: str, *, learning_rate: Any, weight_decay: float = 0.1,
                   clip_norm: float = 1.0, skewadam_tiers: dict | None = None,
                   b1: float = 0.9, b2: float = 0.95) -> optax.GradientTransformation:
  """Builds optimizer ``name`` with global-norm clipping in front.

  Args:
    name: one of :data:`OPTIMIZERS`.
    learning_rate: float or schedule.
    weight_decay: decoupled weight decay on matrices.
    clip_norm: global gradient-norm clip (``0`` disables it).
    skewadam_tiers: ``{"backbone": ..., "expert": ..., "router": ...}``
      ``TierConfig``s (or dicts) for SkewAdam; defaults otherwise.
    b1, b2: Adam-family moment decays (AdamW, SkewAdam, Muon's AdamW part).

  Raises:
    ValueError: for an unknown name.
  """
  mask = WEIGHT_DECAY_MASK
  if name == "adamw":
    tx = optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay,
                     mask=mask, mu_dtype=jnp.float32)
  elif name == "skewadam":
    tx = skewadam_jax.skewadam(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay,
                               weight_decay_mask=mask, **(skewadam_tiers or {}))
  elif name == "muon":
    tx = muon(learning_rate, weight_decay=weight_decay, weight_decay_mask=mask,
              adam_b1=b1, adam_b2=b2, adam_weight_decay=weight_decay,
              muon_weight_dimension_numbers=muon_dimension_numbers)
  elif name == "lion":
    tx = optax.lion(learning_rate, weight_decay=weight_decay, mask=mask)
  elif name == "adafactor":
    tx = optax.adafactor(learning_rate, multiply_by_parameter_scale=False,
                         weight_decay_rate=weight_decay, weight_decay_mask=mask)
  else:
    raise ValueError(f"Unknown optimizer {name!r}; expected one of {OPTIMIZERS}.")
  if name != "skewadam":
    tx = with_fp32_state(tx)
  if clip_norm:
    tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
  return tx
