#!/usr/bin/env bash
# The contenders on `small` at equal wall-clock: each at its tuned 1600-step point (rate,
# warmup, weight decay; muon-gap.md, tune-more.md), trained for the time AdamW takes for
# 1600 steps on this machine. The budget comes from one measurement: every contender's
# train step timed side by side in one process (python -m experiments.bench
# --train-step-only; saved once in experiments/results/equal-time/step-times.json, delete
# it to time again), so each contender's steps are 1600 / its step time x AdamW's, and
# its warmup keeps its share of the schedule. AdamW's own row is its 1600-step tuned run
# (tune-more-runs/adamw-weight-decay-0.4, seeds 0 to 2). ROWS: rows to train, as
# muon_gap.sh's (CONTENDER or CONTENDER-seedN; contenders: muon, default, factors).
# About 12 min a run on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=experiments/results/equal-time
RUNS=$OUT/runs
source experiments/runs_folder.sh
runs_folder "$RUNS"
TIMES=$OUT/step-times.json
[ -s "$TIMES" ] || "$PYTHON" -m experiments.bench --train-step-only --json > "$TIMES"
# bench's row names for the contenders' steps
declare -A TIMED=([muon]="muon" [default]="skewadam orthogonal"
                  [factors]="skewadam orthogonal, expert factors")
# Each contender's tuned 1600-step point, and its warmup at 1600 steps
MUON_SCALE="--backbone-orthogonal-scale width --expert-orthogonal-scale width --lr 0.015 --weight-decay 0.2"
DEFAULT="--optimizer skewadam $MUON_SCALE --expert-momentum lowrank --expert-lowrank-rank 84 --expert-lowrank-dtype int8"
declare -A FLAGS=([muon]="--optimizer muon --lr 0.015 --weight-decay 0.2"
                  [default]="$DEFAULT"
                  [factors]="$DEFAULT --expert-lowrank-orthogonalise factors")
declare -A WARMUP=([muon]=160 [default]=320 [factors]=320)
# steps_for CONTENDER: AdamW's 1600-step time over the contender's step time
steps_for() {
  "$PYTHON" - "$TIMES" "${TIMED[$1]}" <<'PY'
import json, sys
from experiments.studies.equal_time import equal_time_steps
ratios = json.load(open(sys.argv[1]))["step_time_ratio_to_adamw"]
print(equal_time_steps(ratios, 1600)[sys.argv[2]])
PY
}
for row in ${ROWS-}; do
  contender=$(row_point "$row")
  finished "$RUNS/$row" && continue
  steps=$(steps_for "$contender")
  warmup=$(( (WARMUP[$contender] * steps + 800) / 1600 ))
  # shellcheck disable=SC2086
  "$PYTHON" -m experiments.train "${LONG_RUN[@]}" --no-progress ${FLAGS[$contender]} \
      --steps "$steps" --warmup-steps "$warmup" --seed "$(row_seed "$row")" --out "$RUNS/$row"
done
# rewrites the committed experiments/results/equal-time/equal-time.md: equal steps (the
# tuned 1600-step runs) beside equal time, by seed
"$PYTHON" - <<'PY' > "$OUT/equal-time.md"
import json, pathlib, statistics
from experiments.studies.equal_time import equal_time_steps
out = pathlib.Path("experiments/results/equal-time")
times = json.loads((out / "step-times.json").read_text())
ratios = times["step_time_ratio_to_adamw"]
steps_at_equal_time = equal_time_steps(ratios, 1600)
load = ", ".join(f"{x:.2f}" for x in times["load_average"])
print(f"Step times: {times['machine']}, load average {load}, {times['date']} "
      f"(python -m experiments.bench --train-step-only).\n")
steps_runs = {  # the tuned 1600-step runs: seed -> folder
    "adamw": ("adamw", "experiments/results/tune-more-runs/adamw-weight-decay-0.4"),
    "muon": ("muon", "experiments/results/tune-more-runs/muon-weight-decay-0.2"),
    "default": ("skewadam orthogonal",
                "experiments/results/muon-gap-runs/muon-scale-rank-84-int8-warmup-320"),
    "factors": ("skewadam orthogonal, expert factors",
                "experiments/results/muon-gap-runs/muon-scale-rank-84-int8-warmup-320-factors"),
}


def ppl(folder):
  summary = pathlib.Path(folder) / "summary.json"
  if not summary.exists():
    return None
  data = json.loads(summary.read_text())
  return data["val_ppl"] if data.get("completed") else None


def cell(values):
  values = [v for v in values if v is not None]
  if not values:
    return "–"
  if len(values) == 1:
    return f"{values[0]:.2f} (seed 0)"
  return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f} ({len(values)} seeds)"


print("| contender | step time ÷ AdamW | steps at equal time | val ppl, 1600 steps "
      "| the same, seed 0 | val ppl, AdamW's 1600-step time, seed 0 | the same, seeds |")
print("|---|---|---|---|---|---|---|")
for name, (timed, folder) in steps_runs.items():
  seeds = [folder] + [f"{folder}-seed{s}" for s in (1, 2)]
  steps = steps_at_equal_time[timed]
  equal = ([ppl(f) for f in seeds] if name == "adamw" else
           [ppl(out / "runs" / (name if s == 0 else f"{name}-seed{s}")) for s in range(3)])
  first = lambda values: "–" if values[0] is None else f"{values[0]:.2f}"  # noqa: E731
  print(f"| {name} | {ratios[timed]:.2f} | {steps} | {cell(ppl(f) for f in seeds)} "
        f"| {first([ppl(f) for f in seeds])} | {first(equal)} | {cell(equal)} |")
PY
cat "$OUT/equal-time.md"
