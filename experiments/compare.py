"""The optimizer comparison: same model, data, token budget and seeds; each optimizer at its own tuned learning rate.

    python -m experiments.compare --quick            # AdamW, SkewAdam, Muon: about 12 min on 2 CPU cores
    python -m experiments.compare                    # the full protocol

    python -m experiments.compare --ablation --out experiments/results
                                                     # + SkewAdam's tier ablation

Protocol, for every optimizer (and every SkewAdam configuration given with
``--skewadam-configs`` or ``--ablation``):

1. learning-rate sweep: ``--sweep-steps`` steps at each rate of a log grid
   (by default the optimizer's default rate × {1/3, 1, 3}; ``--lr-factors``
   with ``--lr-from``: those multiples of each row's rate in a saved
   comparison), seed 0; while the best rate is at an edge of the grid, the
   grid grows by one point in that direction (at most twice);
2. the best rate by validation perplexity, trained for ``--steps`` steps with
   every seed of ``--seeds`` (when the sweep is as long, its run at the best
   rate is the first seed's).

The long-horizon protocol (``experiments/results/compare-long.json``) is
``--steps 1600 --sweep-steps 1600 --lr-factors 0.5,1 --lr-from
experiments/results/compare-long.json,...``: a sweep at the final budget,
centred on the rates the shorter sweep tuned, with its runs' folders kept in
``experiments/results/compare-long-runs`` so that ``--reuse-runs`` continues
it across sessions (``experiments/long_protocol.sh``).

``--equal-time`` gives every contender AdamW's wall-clock for ``--steps`` steps
instead of the same steps: each contender's train step is timed first, side by
side in this process (:mod:`experiments.studies.equal_time`), its final runs
train for the budget over its step time with their schedule ending there
(folders ``NAME-stepsN-seedS``), and each row records its ``steps`` and
``budget`` (the seconds a step measured, its own and AdamW's).

Everything else is shared: the preset, the corpus and its split, batch and
sequence length, the warmup + cosine schedule shape, clipping at 1.0 and
decoupled weight decay 0.1 on matrices (see ``experiments/training/optimizers.py``).

Outputs in ``--out``: ``compare.json`` (one row per optimizer/configuration:
``optimizer, config, lr, seeds, val_ppl_mean, val_ppl_std, val_ppl_by_seed,
opt_state_bytes_small, opt_state_bytes_6p78b, step_time_ratio_to_adamw,
sweep``), ``compare.md`` (the table), ``val_ppl.png`` (validation perplexity
against tokens, seed 0), ``state_bytes.png`` (optimizer state at
``moe-6.78b``) and, with more than one SkewAdam configuration,
``frontier.png`` (validation perplexity against state at ``moe-6.78b``); every
run's folder goes under ``--runs``. ``--name STEM`` writes ``STEM.json`` and
``STEM.md`` instead, and prefixes the plots with ``STEM-``; ``--shorter
COMPARE_JSON`` sets the comparison beside one at a shorter horizon (say the
same rows at a quarter of the tokens): a table of both perplexities and ranks
(:func:`horizon_table`) and ``horizons.png``, both horizons' curves on one
token axis.

A SkewAdam row's ``config`` is its full tier configuration
(``backbone_m, backbone_v, expert_m, router_v``), resolved against the
library's defaults; so the rows, and their folder names, do not change when
the defaults do (tables mark the row that is the library's default now, and
``--render`` redraws them from a saved ``compare.json``). ``--keep-rows-from``
re-runs only some rows of a saved comparison, say SkewAdam's after a change to
the library, and keeps the rest (:func:`merge_rows`).
:func:`choose_default` is the rule that picked the defaults.
"""


from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
from typing import Sequence

import jax

import experiments
from experiments.studies import comparison
from experiments.studies import equal_time
from experiments.studies import sweeps
from experiments.studies.sweeps import base_config, entry_key, parse_entries, resolve_entry
from experiments.studies.sweeps import row_key
from experiments.training import config as config_lib
from experiments.training import optimizers

# JAX's persistent compilation cache for the comparison's runs (beside the tokenizers').
COMPILATION_CACHE = pathlib.Path(__file__).resolve().parents[1] / ".cache" / "jax"




def build_parser() -> argparse.ArgumentParser:
  """The command's flags."""
  parser = argparse.ArgumentParser(prog="python -m experiments.compare",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="small")
  parser.add_argument("--config", default=None, metavar="FILE",
                      help="a TOML configuration file whose [model] table sets the model (its "
                      "preset and dimensions); the protocol sets everything else")
  parser.add_argument("--optimizers", default=None,
                      help="comma-separated, from " + ", ".join(optimizers.OPTIMIZERS)
                      + f" (default: all; with --quick {comparison.QUICK_OPTIMIZERS}; empty: only the "
                      "--skewadam-configs rows)")
  parser.add_argument("--skewadam-configs", default="",
                      help="extra SkewAdam rows, ';'-separated, e.g. "
                      "'expert_m=int8;backbone_m=bf16,backbone_v=factored'")
  parser.add_argument("--ablation", action="store_true",
                      help="add SkewAdam's tier ablation (comparison.ABLATION)")
  parser.add_argument("--quick", action="store_true",
                      help=f"budgets {comparison.QUICK}, {comparison.QUICK_OPTIMIZERS} at the rates of "
                      "experiments/results/compare.json (no sweep unless --sweep-steps)")
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--sweep-steps", type=int, default=None)
  parser.add_argument("--seeds", default=None, help="comma-separated, e.g. 0,1")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--data", default=None)
  parser.add_argument("--out", default="runs/compare", help="compare.json, compare.md, plots")
  parser.add_argument("--name", default="compare", metavar="STEM",
                      help="write OUT/STEM.json and OUT/STEM.md, and prefix the plots with STEM- "
                      "(default: compare.json, compare.md, unprefixed plots)")
  parser.add_argument("--shorter", default=None, metavar="COMPARE_JSON",
                      help="a saved comparison at a shorter horizon: add both horizons' "
                      "perplexities and ranks to the table, and draw (STEM-)horizons.png")
  parser.add_argument("--runs", default=None, help="the runs' folders (default OUT/runs)")
  parser.add_argument("--render", default=None, metavar="COMPARE_JSON",
                      help="run nothing: redraw the table and plots of a saved compare.json into OUT")
  parser.add_argument("--plans", default=None, metavar="DIR",
                      help="planner reports (python -m experiments.memory --json) for the default "
                           "rule: only a configuration whose standard moe-6.78b step fits the "
                           "A100-40GB target is chosen (e.g. experiments/results/memory)")
  parser.add_argument("--runs-table", default=None, metavar="RUN_DIR[,RUN_DIR...]",
                      help="only print finished runs against --baseline: what each changes, its "
                           "validation perplexity and state at moe-6.78b (nothing is trained)")
  parser.add_argument("--baseline", default=None, metavar="RUN_DIR",
                      help="the run --runs-table sets the others against")
  parser.add_argument("--keep-checkpoints", action="store_true",
                      help="keep each run's checkpoints (default: only its metrics and summary)")
  parser.add_argument("--lr-from", default=None, metavar="COMPARE_JSON[,COMPARE_JSON...]",
                      help="each row's rate is the rate its row has in these saved comparisons "
                      "(the first file that has the row wins): alone, no sweep (say, a longer "
                      "horizon at the rates tuned at the shorter one); with --lr-factors, the "
                      "centre of each row's sweep")
  parser.add_argument("--lr", type=float, default=None, metavar="RATE",
                      help="every row at this learning rate, no sweep (say, a variant of a row "
                      "at that row's tuned rate)")
  parser.add_argument("--lr-factors", default=None, metavar="F,F,...",
                      help="the sweep's grid as multiples of the centre rate (default "
                      "0.333,1,3 around the optimizer's default rate)")
  parser.add_argument("--equal-time", action="store_true",
                      help="every contender trains for the wall-clock AdamW takes for --steps "
                      "steps: each one's train step is timed first, side by side in this "
                      "process, and its final runs take the budget over its step time "
                      "(experiments/studies/equal_time.py)")
  parser.add_argument("--no-progress", action="store_true", help="no overall progress bar")
  parser.add_argument("--reuse-runs", action="store_true",
                      help="read runs already finished with the same configuration instead of "
                      "training them again (continues an interrupted comparison)")
  parser.add_argument("--keep-rows-from", default=None, metavar="COMPARE_JSON",
                      help="add this saved comparison's rows that were not (re)run "
                      "(with --render: merge the two into OUT/compare.json)")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  experiments.use_cpu_without_gpu()
  # The seeds of one configuration run one program: compiled once, read back for
  # the others (and by the next comparison on this machine).
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    jax.config.update("jax_compilation_cache_dir", str(COMPILATION_CACHE))
  args = build_parser().parse_args(argv)
  write = functools.partial(
      _write, name=args.name,
      reports=comparison.load_reports(args.plans) if args.plans else None,
      shorter=json.loads(pathlib.Path(args.shorter).read_text()) if args.shorter else None)
  kept = (json.loads(pathlib.Path(args.keep_rows_from).read_text())
          if args.keep_rows_from else None)
  if args.runs_table:
    if not args.baseline:
      print("error: --runs-table needs --baseline RUN_DIR", file=sys.stderr)
      return 2
    try:
      print(comparison.runs_table(args.runs_table.split(","), args.baseline))
    except (OSError, ValueError) as err:
      print(f"error: {err}", file=sys.stderr)
      return 2
    return 0
  if args.render:
    rows = json.loads(pathlib.Path(args.render).read_text())
    if kept is not None:
      rows = comparison.merge_rows(kept, rows)
    return write(rows, pathlib.Path(args.out), write_json=kept is not None,
                 step_time=not args.quick)
  budget = dict(comparison.QUICK if args.quick else comparison.FULL)
  if args.steps:
    budget["steps"] = args.steps
  if args.sweep_steps:
    budget["sweep_steps"] = args.sweep_steps
  if args.seeds:
    budget["seeds"] = tuple(int(s) for s in args.seeds.split(","))
  names = args.optimizers
  if names is None:
    names = comparison.QUICK_OPTIMIZERS if args.quick else ",".join(optimizers.OPTIMIZERS)
  factors = (tuple(float(f) for f in args.lr_factors.split(",")) if args.lr_factors
             else (1 / 3, 1, 3))
  try:
    entries = parse_entries(names, args.skewadam_configs)
    if args.ablation:
      entries += [("skewadam", c) for c in comparison.ABLATION]
    saved_rates = _saved_rates(args, entries)
    around = saved_rates is not None and args.lr_factors is not None
    model = {}
    if args.config:
      model = {k: v for k, v in config_lib.load_config_file(args.config).items()
               if k in config_lib.SECTIONS["model"]}
    base = base_config(preset=model.pop("preset", args.preset), batch_size=args.batch_size,
                       data=args.data, eval_every=budget["eval_every"],
                       eval_batches=budget["eval_batches"], model=model)
    out = pathlib.Path(args.out)
    runs = pathlib.Path(args.runs) if args.runs else out / "runs"
    steps_by_entry, step_seconds = (
        _equal_time_steps(entries, base, budget["steps"]) if args.equal_time else (None, None))
    rows = comparison.compare(entries, base=base, out_dir=runs,
                   steps=budget["steps"], sweep_steps=budget["sweep_steps"], seeds=budget["seeds"],
                   lr_factors=factors, max_extensions=budget["max_extensions"],
                   log=lambda m: print(m, file=sys.stderr, flush=True),
                   keep_checkpoints=args.keep_checkpoints, progress=not args.no_progress,
                   reuse_runs=args.reuse_runs,
                   fixed_lrs=saved_rates if saved_rates is not None and not around else None,
                   sweep_around=saved_rates if around else None,
                   steps_by_entry=steps_by_entry)
  except ValueError as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  _annotate(rows, budget["steps"], step_seconds)
  rows = rows if kept is None else comparison.merge_rows(kept, rows)
  return write(rows, out, step_time=not args.quick)


def _annotate(rows: list[dict], steps: int, step_seconds: dict | None) -> None:
  """Each row's machine and, at an equal-time budget, the budget it trained to."""
  machine = comparison.machine_text()
  for row in rows:
    row["machine"] = machine
    if step_seconds is not None:
      row["budget"] = {"kind": "equal time", "reference": equal_time.REFERENCE,
                       "reference_steps": steps, "step_seconds": step_seconds[row_key(row)],
                       "reference_step_seconds": step_seconds[entry_key(equal_time.REFERENCE,
                                                                        None)]}


def _equal_time_steps(entries, base, steps: int) -> tuple[dict, dict]:
  """Each entry's steps at AdamW's wall-clock for ``steps`` steps, and the seconds
  a step each measured (by :func:`~experiments.studies.sweeps.entry_key`; AdamW's
  timed too when it is not an entry)."""
  configs = {}
  for optimizer, config in list(entries) + [(equal_time.REFERENCE, None)]:
    resolved = resolve_entry(optimizer, config)
    overrides = sweeps.train_overrides(resolved) if resolved else {}
    configs.setdefault(entry_key(optimizer, resolved), dataclasses.replace(
        base, optimizer=optimizer, steps=steps, **overrides))
  print(f"compare: timing {len(configs)} train steps side by side for the equal-time budget",
        file=sys.stderr, flush=True)
  seconds = equal_time.measure_step_seconds(configs)
  return (equal_time.equal_time_steps(seconds, steps,
                                      reference=entry_key(equal_time.REFERENCE, None)),
          seconds)


def _saved_rates(args, entries) -> list[dict] | None:
  """The rows whose rates the entries train at (or sweep around), or ``None`` to sweep.

  ``--lr``: one rate for every entry, as if a saved comparison had it;
  ``--lr-from``: the first file that has a row wins; ``--quick`` trains at the
  tuned rates unless a sweep is asked for (``--sweep-steps``).
  """
  if args.lr is not None:
    if args.lr_from or args.lr_factors:
      raise ValueError("--lr fixes every row's rate: give it without --lr-from and --lr-factors")
    if not args.lr > 0:
      raise ValueError(f"--lr must be > 0, got {args.lr}")
    return [{"optimizer": o, "config": resolve_entry(o, c) or "default", "lr": args.lr}
            for o, c in entries]
  lr_from = args.lr_from or (
      comparison.TUNED_RATES if args.quick and not args.sweep_steps else None)
  if not lr_from:
    return None
  return [row for path in reversed(str(lr_from).split(","))
          for row in json.loads(pathlib.Path(path).read_text())]


def _write(rows: list[dict], out: pathlib.Path, write_json: bool = True, *,
           name: str = "compare", shorter: Sequence[dict] | None = None,
           step_time: bool = True, reports: Sequence[dict] | None = None) -> int:
  out.mkdir(parents=True, exist_ok=True)
  prefix = "" if name == "compare" else f"{name}-"
  if write_json:
    (out / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
  machines = sorted({r["machine"] for r in rows if r.get("machine")})
  table = ((f"Machine: {'; '.join(machines)}\n\n" if machines else "")
           + comparison.markdown_table(rows, step_time=step_time) + "\n\n" + comparison.verdict_text(rows)
           + "\n\n" + comparison.choice_text(rows, reports))
  if shorter is not None:
    table += "\n\nAgainst the shorter horizon:\n\n" + comparison.horizon_table(shorter, rows)
    comparison.plot_horizons(shorter, rows, out / f"{prefix}horizons.png")
  (out / f"{name}.md").write_text(table + "\n")
  comparison.plot(rows, out, prefix)
  print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
