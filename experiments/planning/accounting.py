"""Optimizer-state bytes and per-parameter plans for a model preset, without allocating.

Parameters come from ``nnx.eval_shape`` of the real model
(:func:`experiments.training.steps.abstract_model`), the optimizer state from
``jax.eval_shape(tx.init, params)``; the byte counts are exact. The
per-parameter plan (:func:`per_leaf`) is read from the objects the training
step is built from. ``python -m experiments.state_bytes`` prints both.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp

import skewadam_jax
from experiments.training import optimizers
from experiments.training.steps import abstract_axes, abstract_params

# per_leaf observes weight decay with a real update on presets up to this size.
OBSERVE_MAX_PARAMS = 50_000_000


def state_bytes(preset: str, optimizer: str, *, skewadam_tiers: dict | None = None,
                param_dtype=jnp.float32) -> dict[str, int]:
  """Exact optimizer-state bytes by tier of ``optimizer`` on ``preset``."""
  tx = optimizers.make_optimizer(optimizer, learning_rate=1e-3, axes=abstract_axes(preset),
                                 skewadam_tiers=skewadam_tiers)
  return skewadam_jax.abstract_state_bytes_by_tier(tx, abstract_params(preset, param_dtype))


@functools.cache
def _decayed_by_path(preset: str, optimizer: str, tiers_json: str) -> dict[str, bool]:
  params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), abstract_params(preset))
  tx = optimizers.make_optimizer(optimizer, learning_rate=1.0, weight_decay=0.1,
                                 axes=abstract_axes(preset),
                                 skewadam_tiers=json.loads(tiers_json) or None)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  paths, moved, _ = skewadam_jax.labels.flatten_with_paths(updates)
  return {path: bool(jnp.any(u != 0)) for path, u in zip(paths, moved)}


def decayed_by_path(optimizer: str, *, preset: str = "tiny",
                    skewadam_tiers: dict | None = None) -> dict[str, bool]:
  """Which parameters ``optimizer`` decays, by path, observed rather than assumed.

  One update of the training command's own optimizer with zero gradients on
  ``preset`` (allocated: use it on small presets; all presets share the
  model's parameter paths and axes): a parameter that moves was decayed. This catches what a mask alone would not
  say, e.g. ``optax.contrib.muon`` alone decays every leaf of its AdamW part
  (norm scales included) with ``adam_weight_decay``, whatever
  ``weight_decay_mask`` says; :func:`optimizers.make_optimizer` partitions
  Muon so that it does not.
  """
  return _decayed_by_path(preset, optimizer, json.dumps(skewadam_tiers or {}, sort_keys=True))


def per_leaf(preset: str, optimizer: str, *, skewadam_tiers: dict | None = None,
             param_dtype=jnp.float32) -> list[dict]:
  """What ``optimizer`` does with each parameter of ``preset``, one dict per leaf.

  Read from the objects the training step is built from: the model's
  declared logical axes (``axes``), the optimizer's observed weight decay
  (:func:`decayed_by_path`), Muon's dimension numbers that
  :func:`optimizers.make_optimizer` passes on, SkewAdam's
  :func:`skewadam_jax.leaf_plans` with the labels, matrix axes and tiers it
  is given, and the state's bytes per parameter
  (:func:`skewadam_jax.state_bytes_per_param` of the optimizer itself, each
  leaf's state laid out alone for SkewAdam). Keys
  that do not apply to ``optimizer`` are ``None``.
  """
  params = abstract_params(preset, param_dtype)
  axes = abstract_axes(preset)
  tx = optimizers.make_optimizer(optimizer, learning_rate=1e-3, axes=axes,
                                 skewadam_tiers=skewadam_tiers)
  paths, leaves, _ = skewadam_jax.labels.flatten_with_paths(params)
  # Observed on the preset itself where it is small enough to allocate; the
  # presets share every path and declared axis, so tiny stands in otherwise.
  observe_on = preset if sum(x.size for x in leaves) <= OBSERVE_MAX_PARAMS else "tiny"
  decayed_paths = decayed_by_path(optimizer, preset=observe_on, skewadam_tiers=skewadam_tiers)
  decayed = [decayed_paths.get(path) for path in paths]
  if optimizer == "skewadam":  # each leaf's own bytes: stacked, a group's first leaf holds all
    tx = optimizers.make_optimizer(optimizer, learning_rate=1e-3, axes=axes, skewadam_tiers={
        **(skewadam_tiers or {}), "group_leaves": False})
  nbytes = skewadam_jax.state_bytes_per_param(tx, params)
  plans = (skewadam_jax.leaf_plans(params, **optimizers.skewadam_axes(axes, skewadam_tiers),
                                    **optimizers.tier_configs(skewadam_tiers))
           if optimizer == "skewadam" else [None] * len(leaves))
  orthogonal = None
  if optimizer == "muon":
    dims = optimizers.muon_dimension_numbers(axes)(params)
    orthogonal = [d is not None for d in jax.tree.leaves(
        dims, is_leaf=lambda x: x is None or isinstance(x, optimizers.MuonDimensionNumbers))]
  elif optimizer == "skewadam":
    orthogonal = [plan.orthogonal for plan in plans]
  rows = []
  for i, (path, leaf, plan) in enumerate(zip(paths, leaves, plans)):
    rows.append({
        "path": path, "shape": list(leaf.shape), "axes": list(axes[path]),
        "tier": plan.tier if plan else None,
        "momentum": (plan.encoding.name if plan.encoding else "none") if plan else None,
        "second_moment": (("none" if plan.orthogonal else "factored" if plan.factored
                           else "exact") if plan else None),
        "decayed": decayed[i],
        "orthogonalized": orthogonal[i] if orthogonal is not None else None,
        "state_bytes": nbytes[i]})
  return rows


def params_by_tier(preset: str, *, skewadam_tiers: dict | None = None) -> dict[str, int]:
  """Parameter counts of ``preset`` by SkewAdam tier, and their ``"total"``.

  The tiers are the ones the training command's SkewAdam gives each leaf
  (:func:`skewadam_jax.leaf_plans` with the model's declared axes), so a
  tier's state bytes from :func:`state_bytes` divided by its count here is
  what that tier's state costs a parameter, for SkewAdam and for the other
  optimizers alike (their states are split by the same labels).
  """
  params = abstract_params(preset)
  plans = skewadam_jax.leaf_plans(
      params, **optimizers.skewadam_axes(abstract_axes(preset), skewadam_tiers),
      **optimizers.tier_configs(skewadam_tiers))
  counts = {tier: 0 for tier in skewadam_jax.labels.TIERS}
  for leaf, plan in zip(jax.tree.leaves(params), plans):
    counts[plan.tier] += leaf.size
  counts["total"] = sum(counts.values())
  return counts


def bits_per_param(nbytes: dict[str, int], counts: dict[str, int]) -> dict[str, float | None]:
  """State bits a parameter by tier: ``nbytes`` (:func:`state_bytes`) over ``counts``
  (:func:`params_by_tier`), for each tier and the ``"total"``; ``None`` for a tier
  without parameters."""
  return {k: 8 * nbytes[k] / counts[k] if counts[k] else None for k in counts}


def per_leaf_markdown(rows: list[dict]) -> str:
  """The per-leaf plan as a Markdown table."""
  keys = ("path", "shape", "axes", "tier", "momentum", "second_moment", "decayed",
          "orthogonalized", "state_bytes")
  lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
  for row in rows:
    cells = ["—" if row[k] is None else str(row[k]) for k in keys]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
