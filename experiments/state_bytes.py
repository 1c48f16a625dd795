"""Optimizer-state bytes by tier for a model preset, or what an optimizer does with each parameter.

The byte table is followed by the same state in bits a parameter of each tier.

    python -m experiments.state_bytes --preset moe-6.78b
    python -m experiments.state_bytes --optimizers skewadam --param-dtype bfloat16 \\
        --expert-direction orthogonal --backbone-direction orthogonal
    python -m experiments.state_bytes --preset tiny --optimizer muon --per-leaf --json

Nothing is allocated; the figures come from :mod:`experiments.planning.accounting`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import jax.numpy as jnp

import experiments
from experiments.training import config as config_lib
from experiments.training import optimizers
from experiments.planning.accounting import (bits_per_param, params_by_tier, per_leaf,
                                             per_leaf_markdown, state_bytes)
from skewadam_jax.labels import TIERS


def build_parser() -> argparse.ArgumentParser:
  """The command's flags."""
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
  parser.add_argument("--param-dtype", default="float32", choices=config_lib.PARAM_DTYPES,
                      help="the parameters' dtype (the comparison's moe-6.78b figures: "
                      "bfloat16)")
  config_lib.add_flags(parser, config_lib.TIER_FIELDS)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  experiments.use_cpu_without_gpu()
  args = build_parser().parse_args(argv)
  tiers = config_lib.tiers_from_args(args)
  param_dtype = jnp.dtype(args.param_dtype)
  if args.per_leaf:
    if args.optimizer not in optimizers.OPTIMIZERS:
      print(f"error: unknown optimizer {args.optimizer!r}", file=sys.stderr)
      return 2
    rows = per_leaf(args.preset, args.optimizer, skewadam_tiers=tiers, param_dtype=param_dtype)
    print(json.dumps({"preset": args.preset, "optimizer": args.optimizer, "leaves": rows},
                     indent=1) if args.json else per_leaf_markdown(rows))
    return 0
  names = args.optimizers.split(",")
  by_name = {name: state_bytes(args.preset, name, param_dtype=param_dtype,
                               skewadam_tiers=tiers if name == "skewadam" else None)
             for name in names}
  print(f"| optimizer ({args.preset}, {args.param_dtype} params) | backbone | expert | router "
        "| total |")
  print("|---|---|---|---|---|")
  for name, b in by_name.items():
    gb = lambda k: f"{b[k] / 1e9:.3f} GB"  # noqa: E731
    print(f"| {name} | {gb('backbone')} | {gb('expert')} | {gb('router')} | **{gb('total')}** |")
  # Bits a parameter make a preset's state comparable with another's: a low-rank
  # momentum's share of fp32's bytes shrinks as the matrices grow.
  counts = params_by_tier(args.preset, skewadam_tiers=tiers)
  print()
  print("State bits a parameter (the tier's state bits over its parameters: "
        + ", ".join(f"{t} {counts[t]:,}" for t in TIERS) + "):")
  print()
  print("| optimizer | " + " | ".join(TIERS) + " | total |")
  print("|---|---|---|---|---|")
  for name, b in by_name.items():
    bits = bits_per_param(b, counts)
    cells = ["–" if bits[t] is None else f"{bits[t]:.2f}" for t in TIERS + ("total",)]
    print(f"| {name} | " + " | ".join(cells) + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
