"""Optimizer-state bytes by tier for a model preset, without allocating anything.

    python -m experiments.state_bytes --preset moe-6.78b

Parameters come from ``nnx.eval_shape`` of the real model, the optimizer state
from ``jax.eval_shape(tx.init, params)``; the byte counts are exact.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import models
import experiments
import skewadam_jax
from experiments import optimizers


def abstract_model(preset: str, param_dtype=None, **overrides):
  """(model config, graphdef, abstract params, abstract rest), nothing allocated.

  ``param_dtype=None`` keeps the preset's; params and rest are pure
  ``ShapeDtypeStruct`` trees (no Variables).
  """
  if param_dtype is not None:
    overrides["param_dtype"] = param_dtype
  config = models.get_preset(preset, **overrides)
  model = nnx.eval_shape(lambda: models.Transformer(config, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return config, graphdef, nnx.as_pure(params), nnx.as_pure(rest)


def abstract_params(preset: str, dtype=None):
  """The preset's parameters as ``ShapeDtypeStruct``s (pure arrays, no Variables)."""
  return abstract_model(preset, dtype)[2]


@functools.cache
def abstract_axes(preset: str) -> dict[str, tuple]:
  """The preset's declared logical axes by path (:func:`models.logical_axes`)."""
  return models.logical_axes(models.abstract_params(models.get_preset(preset)))


def state_bytes(preset: str, optimizer: str, *, skewadam_tiers: dict | None = None,
                param_dtype=jnp.float32) -> dict[str, int]:
  """Exact optimizer-state bytes by tier of ``optimizer`` on ``preset``."""
  tx = optimizers.make_optimizer(optimizer, learning_rate=1e-3, axes=abstract_axes(preset),
                                 skewadam_tiers=skewadam_tiers)
  return skewadam_jax.abstract_state_bytes_by_tier(tx, abstract_params(preset, param_dtype))


@functools.cache
def _decayed_by_path(optimizer: str, tiers_json: str) -> dict[str, bool]:
  params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), abstract_params("tiny"))
  tx = optimizers.make_optimizer(optimizer, learning_rate=1.0, weight_decay=0.1,
                                 axes=abstract_axes("tiny"),
                                 skewadam_tiers=json.loads(tiers_json) or None)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
  paths, moved, _ = skewadam_jax.labels.flatten_with_paths(updates)
  return {path: bool(jnp.any(u != 0)) for path, u in zip(paths, moved)}


def decayed_by_path(optimizer: str, *, skewadam_tiers: dict | None = None) -> dict[str, bool]:
  """Which parameters ``optimizer`` decays, by path, observed rather than assumed.

  One update of the training command's own optimizer with zero gradients on
  the ``tiny`` preset (all presets share the model's parameter paths): a
  parameter that moves was decayed. This catches what a mask alone would not
  say, e.g. ``optax.contrib.muon`` alone decays every leaf of its AdamW part
  (norm scales included) with ``adam_weight_decay``, whatever
  ``weight_decay_mask`` says; :func:`optimizers.make_optimizer` partitions
  Muon so that it does not.
  """
  return _decayed_by_path(optimizer, json.dumps(skewadam_tiers or {}, sort_keys=True))


def per_leaf(preset: str, optimizer: str, *, skewadam_tiers: dict | None = None,
             param_dtype=jnp.float32) -> list[dict]:
  """What ``optimizer`` does with each parameter of ``preset``, one dict per leaf.

  Read from the objects the training step is built from: the model's
  declared logical axes (``axes``), the optimizer's observed weight decay
  (:func:`decayed_by_path`), Muon's dimension numbers that
  :func:`optimizers.make_optimizer` passes on, SkewAdam's
  :func:`skewadam_jax.leaf_plans` with the labels, matrix axes and tiers it
  is given, and the state's bytes per parameter
  (:func:`skewadam_jax.state_bytes_per_param` of the optimizer itself). Keys
  that do not apply to ``optimizer`` are ``None``.
  """
  params = abstract_params(preset, param_dtype)
  axes = abstract_axes(preset)
  tx = optimizers.make_optimizer(optimizer, learning_rate=1e-3, axes=axes,
                                 skewadam_tiers=skewadam_tiers)
  paths, leaves, _ = skewadam_jax.labels.flatten_with_paths(params)
  decayed_paths = decayed_by_path(optimizer, skewadam_tiers=skewadam_tiers)
  decayed = [decayed_paths.get(path) for path in paths]
  nbytes = skewadam_jax.state_bytes_per_param(tx, params)
  plans = (skewadam_jax.leaf_plans(params, **optimizers.skewadam_axes(axes),
                                    **(skewadam_tiers or {}))
           if optimizer == "skewadam" else [None] * len(leaves))
  orthogonal = None
  if optimizer == "muon":
    dims = optimizers.muon_dimension_numbers(axes)(params)
    orthogonal = [d is not None for d in jax.tree.leaves(
        dims, is_leaf=lambda x: x is None or isinstance(x, optimizers.MuonDimensionNumbers))]
  rows = []
  for i, (path, leaf, plan) in enumerate(zip(paths, leaves, plans)):
    rows.append({
        "path": path, "shape": list(leaf.shape), "axes": list(axes[path]),
        "tier": plan.tier if plan else None,
        "momentum": (plan.encoding.name if plan.encoding else "none") if plan else None,
        "second_moment": ("factored" if plan.factored else "exact") if plan else None,
        "decayed": decayed[i],
        "orthogonalized": orthogonal[i] if orthogonal is not None else None,
        "state_bytes": nbytes[i]})
  return rows


def per_leaf_markdown(rows: list[dict]) -> str:
  """The per-leaf plan as a Markdown table."""
  keys = ("path", "shape", "axes", "tier", "momentum", "second_moment", "decayed",
          "orthogonalized", "state_bytes")
  lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
  for row in rows:
    cells = ["—" if row[k] is None else str(row[k]) for k in keys]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  experiments.use_cpu_without_gpu()
  parser = argparse.ArgumentParser(prog="python -m experiments.state_bytes",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="moe-6.78b")
  parser.add_argument("--optimizers", default=",".join(optimizers.OPTIMIZERS),
                      help="comma-separated, from " + ", ".join(optimizers.OPTIMIZERS))
  parser.add_argument("--per-leaf", action="store_true",
                      help="list every parameter and what --optimizer does with it")
  parser.add_argument("--optimizer", default="skewadam",
                      help="with --per-leaf: one of " + ", ".join(optimizers.OPTIMIZERS))
  parser.add_argument("--json", action="store_true", help="with --per-leaf: JSON")
  args = parser.parse_args(argv)
  if args.per_leaf:
    if args.optimizer not in optimizers.OPTIMIZERS:
      print(f"error: unknown optimizer {args.optimizer!r}", file=sys.stderr)
      return 2
    rows = per_leaf(args.preset, args.optimizer)
    print(json.dumps({"preset": args.preset, "optimizer": args.optimizer, "leaves": rows},
                     indent=1) if args.json else per_leaf_markdown(rows))
    return 0
  print(f"| optimizer ({args.preset}, fp32 params) | backbone | expert | router | total |")
  print("|---|---|---|---|---|")
  for name in args.optimizers.split(","):
    b = state_bytes(args.preset, name)
    gb = lambda k: f"{b[k] / 1e9:.3f} GB"
    print(f"| {name} | {gb('backbone')} | {gb('expert')} | {gb('router')} | **{gb('total')}** |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
