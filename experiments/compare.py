"""The optimizer comparison: same model, data, token budget and seeds; each optimizer at its own tuned learning rate.

    python -m experiments.compare --quick            # a few minutes on 2 CPU cores
    python -m experiments.compare                    # the full protocol

Protocol, for every optimizer (and every SkewAdam configuration given with
``--skewadam-configs``):

1. learning-rate sweep: ``--sweep-steps`` steps at each rate of a log grid
   (by default the optimizer's default rate × {1/3, 1, 3}), seed 0; while the
   best rate is at an edge of the grid, the grid grows by one point in that
   direction (at most twice);
2. the best rate by validation perplexity, trained for ``--steps`` steps with
   every seed of ``--seeds``.

Everything else is shared: the preset, the corpus and its split, batch and
sequence length, the warmup + cosine schedule shape, clipping at 1.0 and
decoupled weight decay 0.1 on matrices (see ``experiments/optimizers.py``).

Outputs in ``--out``: ``compare.json`` (one row per optimizer/configuration:
``optimizer, config, lr, seeds, val_ppl_mean, val_ppl_std, val_ppl_by_seed,
opt_state_bytes_small, opt_state_bytes_6p78b, step_time_ratio_to_adamw,
sweep``), ``compare.md`` (the table), ``val_ppl.png`` (validation perplexity
against tokens, seed 0) and ``state_bytes.png`` (optimizer state at
``moe-6.78b``), and every run's folder under ``runs/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import pathlib
import shutil
import statistics
import sys
from typing import Sequence

import jax.numpy as jnp

from experiments import optimizers
from experiments import state_bytes
from experiments import train as train_lib

QUICK = dict(steps=150, sweep_steps=60, seeds=(0, 1), eval_every=50, eval_batches=8)
FULL = dict(steps=600, sweep_steps=200, seeds=(0, 1), eval_every=100, eval_batches=16)


def parse_skewadam_config(text: str) -> dict:
  """``expert=int8,backbone_v=factored,router_v=exact`` → TrainConfig overrides."""
  keys = {"expert": "expert_momentum", "backbone_v": "backbone_second_moment",
          "router_v": "router_second_moment"}
  out = {}
  for part in filter(None, text.split(",")):
    key, _, value = part.partition("=")
    if key not in keys or not value:
      raise ValueError(f"bad SkewAdam configuration {text!r}: use "
                       f"{', '.join(k + '=...' for k in keys)}")
    out[keys[key]] = value
  return out


def lr_grid(optimizer: str, factors: Sequence[float]) -> list[float]:
  base = optimizers.DEFAULT_LR[optimizer]
  return [base * f for f in factors]


def _run(base: train_lib.TrainConfig, out: pathlib.Path, cache_dir, **overrides) -> dict:
  config = dataclasses.replace(base, **overrides)
  shutil.rmtree(out, ignore_errors=True)  # a rerun replaces its own earlier run
  summary = train_lib.train(config, out, cache_dir=cache_dir, progress=False)
  curve = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  return {"val_ppl": summary["val_ppl"], "tokens_per_s": summary["tokens_per_s"],
          "opt_state_bytes": summary["opt_state_bytes_by_tier"]["total"],
          "curve": [(r["tokens"], r["val_ppl"]) for r in curve if "val_ppl" in r]}


def compare(entries: Sequence[tuple[str, dict]], *, base: train_lib.TrainConfig,
            out_dir: str | pathlib.Path, steps: int, sweep_steps: int,
            seeds: Sequence[int], lr_factors: Sequence[float] = (1 / 3, 1, 3),
            max_extensions: int = 2, cache_dir=None, log=print) -> list[dict]:
  """Runs the protocol for ``entries`` = [(optimizer, TrainConfig overrides)]."""
  out_dir = pathlib.Path(out_dir)
  rows = []
  for optimizer, overrides in entries:
    label = optimizer + "".join(f"-{v}" for v in overrides.values())
    sweep = []

    def try_lr(lr):
      result = _run(base, out_dir / "runs" / f"{label}-sweep-lr{lr:.2e}", cache_dir,
                    optimizer=optimizer, lr=lr, steps=sweep_steps, seed=seeds[0],
                    warmup_steps=max(1, sweep_steps // 10), **overrides)
      sweep.append({"lr": lr, "val_ppl": result["val_ppl"]})
      sweep.sort(key=lambda r: r["lr"])
      log(f"{label}: sweep lr {lr:.2e} -> val ppl {result['val_ppl']:.2f}")

    score = lambda r: r["val_ppl"] if math.isfinite(r["val_ppl"]) else math.inf
    for lr in lr_grid(optimizer, lr_factors):
      try_lr(lr)
    # A best rate at the edge of the grid is not a tuned rate: extend the grid
    # (by the grid's own step) in that direction, a bounded number of times.
    step = (max(lr_factors) / min(lr_factors)) ** (1 / max(1, len(lr_factors) - 1))
    for _ in range(max_extensions if len(lr_factors) > 1 else 0):
      best = min(sweep, key=score)
      if best is sweep[-1]:
        try_lr(best["lr"] * step)
      elif best is sweep[0]:
        try_lr(best["lr"] / step)
      else:
        break
    best = min(sweep, key=score)
    finals = [_run(base, out_dir / "runs" / f"{label}-seed{seed}", cache_dir,
                   optimizer=optimizer, lr=best["lr"], steps=steps, seed=seed,
                   warmup_steps=max(1, steps // 10), **overrides) for seed in seeds]
    ppls = [f["val_ppl"] for f in finals]
    tiers = dataclasses.replace(base, **overrides).skewadam_tiers()
    rows.append({
        "optimizer": optimizer, "config": overrides or "default", "lr": best["lr"],
        "seeds": list(seeds), "val_ppl_by_seed": ppls,
        "val_ppl_mean": statistics.mean(ppls),
        "val_ppl_std": statistics.stdev(ppls) if len(ppls) > 1 else 0.0,
        "opt_state_bytes_small": finals[0]["opt_state_bytes"],
        "opt_state_bytes_6p78b": state_bytes.state_bytes(
            "moe-6.78b", optimizer, skewadam_tiers=tiers, param_dtype=jnp.bfloat16)["total"],
        "tokens_per_s": statistics.median(f["tokens_per_s"] or 0.0 for f in finals),
        "curve_seed0": finals[0]["curve"], "sweep": sweep,
    })
    log(f"{label}: lr {best['lr']:.2e}, val ppl {rows[-1]['val_ppl_mean']:.2f} "
        f"± {rows[-1]['val_ppl_std']:.2f}")
  adamw = next((r for r in rows if r["optimizer"] == "adamw" and r["config"] == "default"), None)
  for r in rows:
    r["step_time_ratio_to_adamw"] = (
        adamw["tokens_per_s"] / r["tokens_per_s"] if adamw and r["tokens_per_s"] else None)
  return rows


def markdown_table(rows: Sequence[dict]) -> str:
  lines = ["| optimizer | config | lr | val ppl (mean ± std) | state, this preset | state, moe-6.78b "
           "| step time ÷ AdamW |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    config = r["config"] if isinstance(r["config"], str) else ", ".join(
        f"{k}={v}" for k, v in r["config"].items())
    ratio = f"{r['step_time_ratio_to_adamw']:.2f}" if r["step_time_ratio_to_adamw"] else "–"
    lines.append(f"| {r['optimizer']} | {config} | {r['lr']:.2e} | {r['val_ppl_mean']:.2f} ± "
                 f"{r['val_ppl_std']:.2f} | {r['opt_state_bytes_small'] / 1e6:.2f} MB "
                 f"| {r['opt_state_bytes_6p78b'] / 1e9:.2f} GB | {ratio} |")
  return "\n".join(lines)


def plot(rows: Sequence[dict], out_dir: pathlib.Path) -> list[pathlib.Path]:
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  names = [r["optimizer"] + ("" if r["config"] == "default" else " " + ",".join(
      f"{v}" for v in r["config"].values())) for r in rows]
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for name, r in zip(names, rows):
    tokens, ppl = zip(*r["curve_seed0"]) if r["curve_seed0"] else ((), ())
    ax.plot(tokens, ppl, marker="o", label=name)
  ax.set(xlabel="training tokens", ylabel="validation perplexity", yscale="log",
         title="Validation perplexity (seed 0)")
  ax.legend()
  fig.tight_layout()
  curves = out_dir / "val_ppl.png"
  fig.savefig(curves, dpi=120)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  ax.barh(names, [r["opt_state_bytes_6p78b"] / 1e9 for r in rows])
  ax.set(xlabel="optimizer state at moe-6.78b (GB)", xscale="log",
         title="Optimizer state for the 6.78B MoE")
  fig.tight_layout()
  bars = out_dir / "state_bytes.png"
  fig.savefig(bars, dpi=120)
  plt.close("all")
  return [curves, bars]


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m experiments.compare",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="small")
  parser.add_argument("--optimizers", default=",".join(optimizers.OPTIMIZERS))
  parser.add_argument("--skewadam-configs", default="",
                      help="extra SkewAdam rows, ';'-separated, e.g. 'expert=int8;backbone_v=factored'")
  parser.add_argument("--quick", action="store_true", help=f"budgets {QUICK}")
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--sweep-steps", type=int, default=None)
  parser.add_argument("--seeds", default=None, help="comma-separated, e.g. 0,1")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--data", default=None)
  parser.add_argument("--out", default="runs/compare")
  args = parser.parse_args(argv)
  budget = dict(QUICK if args.quick else FULL)
  if args.steps:
    budget["steps"] = args.steps
  if args.sweep_steps:
    budget["sweep_steps"] = args.sweep_steps
  if args.seeds:
    budget["seeds"] = tuple(int(s) for s in args.seeds.split(","))
  try:
    entries = [(name, {}) for name in args.optimizers.split(",")]
    for name, _ in entries:
      if name not in optimizers.OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose from "
                         f"{', '.join(optimizers.OPTIMIZERS)}")
    entries += [("skewadam", parse_skewadam_config(c))
                for c in args.skewadam_configs.split(";") if c]
    base = train_lib.TrainConfig(preset=args.preset, batch_size=args.batch_size, data=args.data,
                                 eval_every=budget["eval_every"],
                                 eval_batches=budget["eval_batches"], ckpt_every=10**9,
                                 log_every=1)  # every step timed, for the step-time ratio
    out = pathlib.Path(args.out)
    rows = compare(entries, base=base, out_dir=out, steps=budget["steps"],
                   sweep_steps=budget["sweep_steps"], seeds=budget["seeds"],
                   log=lambda m: print(m, file=sys.stderr, flush=True))
  except ValueError as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  out.mkdir(parents=True, exist_ok=True)
  (out / "compare.json").write_text(json.dumps(rows, indent=2) + "\n")
  table = markdown_table(rows)
  (out / "compare.md").write_text(table + "\n")
  plot(rows, out)
  print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
