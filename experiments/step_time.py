"""Step-time estimates from compiled programs, and their check against real GPU steps.

    python -m experiments.step_time --calibrate          # the H200 steps of 2026-12-04
    python -m experiments.step_time --hlo STEP.hlo[.gz] --target h100-80gb --layers 24

``--calibrate`` reads the programs of the steps measured on an H200 on
2026-12-04 (``experiments/results/step-time/programs/``: the training
command's step compiled for the ``h200`` target without a GPU, from the code
of commit 7d6fae6, the last before this estimate existed, by
``experiments/step_time_programs.sh``) and the measured median step times
(``experiments/results/gpu-check/h200-2026-12-04.jsonl``), prints each
program's roofline time (:mod:`experiments.planning.roofline`, no per-kernel
cost), its kernel count, the per-kernel cost that fits the measurements
best (least squares through zero), and each step's estimate with the
library's constant beside the measurement (``--json`` writes
``experiments/results/step-time/calibration.json``).

``--hlo`` estimates one saved program (``compiled.as_text()``) for a target.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import sys
from typing import Sequence

import models
from experiments.planning import roofline

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
PROGRAMS = RESULTS / "step-time" / "programs"
MEASURED = RESULTS / "gpu-check" / "h200-2026-12-04.jsonl"
# Each saved program: the gpu-check record it was measured as
# (preset, optimizer, batch, update in backward).
CALIBRATION = {
    "moe-6.78b-adamw-batch1-h200": ("moe-6.78b", "adamw", 1, False),
    "moe-6.78b-skewadam-update-in-backward-batch1-h200": ("moe-6.78b", "skewadam", 1, True),
    "moe-47b-skewadam-update-in-backward-batch1-h200": ("moe-47b", "skewadam", 1, True),
}


def read_program(path: str | pathlib.Path) -> str:
  """A saved program's HLO text (``.gz`` or plain)."""
  path = pathlib.Path(path)
  if path.suffix == ".gz":
    return gzip.decompress(path.read_bytes()).decode()
  return path.read_text()


def measured_steps(path: pathlib.Path = MEASURED) -> dict[tuple, float]:
  """``{(preset, optimizer, batch, update_in_backward): median step s}`` of the runs that ran."""
  out = {}
  for line in path.read_text().splitlines():
    record = json.loads(line)
    if record.get("status") == "ok":
      key = (record["preset"], record["optimizer"], record["batch"],
             bool(record.get("update_in_backward")))
      out[key] = record["median_step_seconds"]
  return out


def calibrate(programs: pathlib.Path = PROGRAMS, measured: pathlib.Path = MEASURED) -> dict:
  """The per-kernel cost fitted to the measured steps, and each step's estimate."""
  times = measured_steps(measured)
  rows = []
  for name, key in CALIBRATION.items():
    step = roofline.estimate(read_program(programs / f"{name}.hlo.gz"), "h200",
                             default_trip_count=models.get_preset(key[0]).num_layers,
                             kernel_overhead_s=0.0)
    rows.append({"program": name, "measured_seconds": times[key],
                 "roofline_seconds": step.seconds, "kernels": step.kernels})
  # m = r + c * k, least squares in c.
  fitted = (sum((r["measured_seconds"] - r["roofline_seconds"]) * r["kernels"] for r in rows)
            / sum(r["kernels"] ** 2 for r in rows))
  for r in rows:
    r["estimate_seconds"] = r["roofline_seconds"] + roofline.KERNEL_OVERHEAD_S * r["kernels"]
    r["measured_over_estimate"] = r["measured_seconds"] / r["estimate_seconds"]
  return {"fitted_kernel_overhead_s": fitted,
          "kernel_overhead_s": roofline.KERNEL_OVERHEAD_S, "steps": rows}


def calibration_table(result: dict) -> str:
  """Markdown: each measured step beside its estimate."""
  lines = ["| program (H200, batch 1 x 2048) | measured s | roofline s | kernels "
           "| estimate s | measured / estimate |", "|---|---|---|---|---|---|"]
  for r in result["steps"]:
    lines.append(f"| {r['program']} | {r['measured_seconds']:.3f} | {r['roofline_seconds']:.3f} "
                 f"| {r['kernels']:,} | {r['estimate_seconds']:.3f} "
                 f"| {r['measured_over_estimate']:.2f} |")
  lines.append(f"\nPer-kernel cost: fitted {result['fitted_kernel_overhead_s'] * 1e6:.2f} µs, "
               f"used {result['kernel_overhead_s'] * 1e6:.2f} µs "
               "(experiments.planning.roofline.KERNEL_OVERHEAD_S).")
  return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
  """The command's flags."""
  parser = argparse.ArgumentParser(prog="python -m experiments.step_time",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--calibrate", action="store_true",
                      help="the estimate against the H200 steps of 2026-12-04")
  parser.add_argument("--programs", default=str(PROGRAMS),
                      help="with --calibrate: the folder of saved programs "
                      "(experiments/step_time_programs.sh writes them)")
  parser.add_argument("--hlo", default=None, help="a saved program (compiled.as_text())")
  parser.add_argument("--target", default="h200", help=f"one of {', '.join(roofline.TARGETS)}")
  parser.add_argument("--layers", type=int, default=None,
                      help="trip count of a loop XLA does not know (the layer count)")
  parser.add_argument("--json", action="store_true")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  parser = build_parser()
  args = parser.parse_args(argv)
  if args.target not in roofline.TARGETS:
    print(f"error: --target must be one of {', '.join(roofline.TARGETS)}, got {args.target!r}",
          file=sys.stderr)
    return 2
  if args.calibrate:
    result = calibrate(pathlib.Path(args.programs))
    print(json.dumps(result, indent=2) if args.json else calibration_table(result))
    return 0
  if not args.hlo:
    parser.print_usage(sys.stderr)
    print("error: give --calibrate or --hlo FILE", file=sys.stderr)
    return 2
  step = roofline.estimate(read_program(args.hlo), args.target,
                           default_trip_count=args.layers)
  print(json.dumps(step.to_json(), indent=2))
  return 0


if __name__ == "__main__":
  sys.exit(main())
