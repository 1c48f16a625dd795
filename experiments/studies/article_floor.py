"""What the article's floor does over a run: the share of entries it sets, and the step's size.

The article's optimizer (:func:`skewadam_jax.skewadam_article`) floors the
second-moment EMA at ``φ = 1e-8`` inside the root: where ``g²`` stays below it
the step is ``g·√(1 − β2^t)/1e-4``, proportional to the gradient, not Adam's
sign-like ``±1``. Every train step of ``--optimizer skewadam_article`` logs
``floor_share`` (:func:`skewadam_jax.article.floor_share`: the share of
parameter entries whose denominator the floor sets) and, as every run does,
``update_rms`` (the RMS of the parameter change). This reads them back from
runs' ``metrics.jsonl`` at chosen steps, the change per unit of learning rate
(``update_rms / lr``, which is the RMS of ``u + λ·p``) beside the share:

    python -m experiments.studies.article_floor RUN_DIR [RUN_DIR ...] [--steps 10,100,...]
"""

from __future__ import annotations

import argparse
import pathlib
from typing import Sequence

from experiments.training.metrics_log import read_metrics

STEPS = (10, 100, 400, 800, 1600)


def at_steps(run: pathlib.Path, steps: Sequence[int]) -> list[dict]:
  """``{"step", "floor_share", "step_per_lr"}`` of ``run``'s logged steps among ``steps``.

  Example:
    >>> import json, tempfile
    >>> run = pathlib.Path(tempfile.mkdtemp())
    >>> lines = [{"step": 1, "lr": 0.0, "update_rms": 0.0, "floor_share": 1.0},
    ...          {"step": 10, "lr": 2e-3, "update_rms": 1e-4, "floor_share": 0.5}]
    >>> _ = (run / "metrics.jsonl").write_text("\\n".join(map(json.dumps, lines)))
    >>> at_steps(run, [1, 10])
    [{'step': 1, 'floor_share': 1.0, 'step_per_lr': None}, {'step': 10, 'floor_share': 0.5, 'step_per_lr': 0.05}]
  """
  wanted = set(steps)
  rows = []
  for record in read_metrics(run / "metrics.jsonl", max(steps)):
    if record.get("step") in wanted and "update_rms" in record:
      lr = record.get("lr") or 0.0
      rows.append({"step": record["step"], "floor_share": record.get("floor_share"),
                   "step_per_lr": round(record["update_rms"] / lr, 12) if lr > 0 else None})
  return rows


def table(runs: Sequence[pathlib.Path], steps: Sequence[int] = STEPS) -> str:
  """A markdown table: a row per run and step."""
  lines = ["| run | step | share of entries the floor sets | RMS of the change ÷ lr |",
           "|---|---|---|---|"]
  for run in runs:
    for row in at_steps(run, steps):
      share = "–" if row["floor_share"] is None else f"{row['floor_share']:.1%}"
      size = "–" if row["step_per_lr"] is None else f"{row['step_per_lr']:.3g}"
      lines.append(f"| `{run.name}` | {row['step']} | {share} | {size} |")
  return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("runs", nargs="+", type=pathlib.Path)
  parser.add_argument("--steps", default=",".join(map(str, STEPS)),
                      help="comma-separated steps to read (default: %(default)s)")
  args = parser.parse_args(argv)
  print(table(args.runs, [int(s) for s in args.steps.split(",")]))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
