"""Learning-rate schedules and sensitivity: validation perplexity against peak rate, per schedule.

    python -m experiments.schedules --lr-from experiments/results/compare.json \\
        --out experiments/results --runs runs/schedules --reuse-runs

For every optimizer (and SkewAdam configuration) and every schedule of
``--schedules`` (``cosine``, ``wsd``, ``cooldown``; see
:func:`experiments.training.optimizers.lr_schedule`), one run per peak rate of the grid
``lr × --lr-factors`` (``lr``: the rate the comparison ``--lr-from`` tuned for
that row, so the grid spans its optimum), with the comparison's model, data,
batch, horizon (``--steps``) and seed ``--seeds``'s first; then every other
seed of ``--seeds`` at each schedule's best rate. Runs whose loss stops being
finite count as diverged (perplexity ``inf``); loss spikes are counted per run
(:func:`loss_spikes`).

Outputs in ``--out``: ``schedules.json`` (one row per optimizer, schedule and
rate: ``optimizer, config, schedule, lr, lr_factor, seeds, val_ppl_by_seed,
val_ppl_mean, val_ppl_std, diverged, loss_spikes``; perplexities of diverged
runs are ``null``), ``schedules.md`` (the summary table) and
``schedule_<name>.png`` (perplexity against peak rate, one plot per schedule).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Sequence

import experiments
from experiments.studies import schedule_study
from experiments.studies.sweeps import base_config, parse_entries
from experiments.training import optimizers


def _write(rows: list[dict], out: pathlib.Path, write_json: bool = True) -> int:
  out.mkdir(parents=True, exist_ok=True)
  if write_json:
    (out / "schedules.json").write_text(json.dumps(rows, indent=2) + "\n")
  table = schedule_study.summary_table(rows)
  (out / "schedules.md").write_text(table + "\n")
  schedule_study.plot(rows, out)
  print(table)
  return 0


def build_parser() -> argparse.ArgumentParser:
  """The command's flags."""
  parser = argparse.ArgumentParser(prog="python -m experiments.schedules",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="small")
  parser.add_argument("--optimizers", default="adamw,skewadam,muon",
                      help="comma-separated (empty: only the --skewadam-configs rows)")
  parser.add_argument("--skewadam-configs", default="",
                      help="extra SkewAdam rows, ';'-separated, as in experiments.compare")
  parser.add_argument("--schedules", default=",".join(optimizers.SCHEDULES))
  parser.add_argument("--lr-from", required=True, metavar="COMPARE_JSON",
                      help="the comparison whose tuned rates centre the grids")
  parser.add_argument("--lr-factors", default=",".join(map(str, schedule_study.LR_FACTORS)))
  parser.add_argument("--steps", type=int, default=400)
  parser.add_argument("--seeds", default="0,1",
                      help="the first for the grid, the others at each best rate")
  parser.add_argument("--batch-size", type=int, default=16)
  parser.add_argument("--data", default=None)
  parser.add_argument("--out", default="runs/schedules", help="schedules.json, .md and plots")
  parser.add_argument("--runs", default=None, help="the runs' folders (default OUT/runs)")
  parser.add_argument("--reuse-runs", action="store_true",
                      help="read finished or diverged runs of the same configuration")
  parser.add_argument("--render", default=None, metavar="SCHEDULES_JSON",
                      help="run nothing: redraw the table and plots of a saved schedules.json")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  experiments.use_cpu_without_gpu()
  args = build_parser().parse_args(argv)
  out = pathlib.Path(args.out)
  if args.render:
    return _write(json.loads(pathlib.Path(args.render).read_text()), out, write_json=False)
  try:
    entries = parse_entries(args.optimizers, args.skewadam_configs)
    rows = schedule_study.sweep_schedules(
        entries, base=base_config(preset=args.preset, batch_size=args.batch_size,
                                  data=args.data),
        out_dir=pathlib.Path(args.runs) if args.runs else out / "runs",
        tuned=json.loads(pathlib.Path(args.lr_from).read_text()),
        schedules=[s for s in args.schedules.split(",") if s], steps=args.steps,
        seeds=[int(s) for s in args.seeds.split(",")],
        lr_factors=[float(f) for f in args.lr_factors.split(",")],
        reuse_runs=args.reuse_runs, log=lambda m: print(m, file=sys.stderr, flush=True))
  except ValueError as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  return _write(rows, out)


if __name__ == "__main__":
  sys.exit(main())
