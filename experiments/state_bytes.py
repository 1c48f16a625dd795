"""Optimizer-state bytes by tier for a model preset, without allocating anything.

    python -m experiments.state_bytes --preset moe-6.78b

Parameters come from ``nnx.eval_shape`` of the real model, the optimizer state
from ``jax.eval_shape(tx.init, params)``; the byte counts are exact.
"""

from __future__ import annotations

import argparse
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


def state_bytes(preset: str, optimizer: str, *, skewadam_tiers: dict | None = None,
                param_dtype=jnp.float32) -> dict[str, int]:
  """Exact optimizer-state bytes by tier of ``optimizer`` on ``preset``."""
  tx = optimizers.make_optimizer(optimizer, learning_rate=1e-3,
                                 skewadam_tiers=skewadam_tiers)
  return skewadam_jax.abstract_state_bytes_by_tier(tx, abstract_params(preset, param_dtype))


def main(argv: Sequence[str] | None = None) -> int:
  experiments.use_cpu_without_gpu()
  parser = argparse.ArgumentParser(prog="python -m experiments.state_bytes",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="moe-6.78b")
  parser.add_argument("--optimizers", default=",".join(optimizers.OPTIMIZERS))
  args = parser.parse_args(argv)
  print(f"| optimizer ({args.preset}, fp32 params) | backbone | expert | router | total |")
  print("|---|---|---|---|---|")
  for name in args.optimizers.split(","):
    b = state_bytes(args.preset, name)
    gb = lambda k: f"{b[k] / 1e9:.3f} GB"
    print(f"| {name} | {gb('backbone')} | {gb('expert')} | {gb('router')} | **{gb('total')}** |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
