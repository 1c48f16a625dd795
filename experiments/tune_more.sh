#!/usr/bin/env bash
# The tuning against Muon's third and fourth coordinates, after the rate (swept at
# 1600 steps) and the
# warmup (experiments/tune_warmup.sh), each contender at its tuned point, seed 0,
# against its own seed-0 run there: the momentum (b1 0.95 and 0.85 for the rank-16
# momentum and AdamW; Muon's own momentum 0.9 and 0.98) and the weight decay (0.05
# and 0.2 against 0.1, one step further where the edge improved). A row is
# "CONTENDER-FLAG-VALUE" (e.g. "lowrank-b1-0.95", "muon-muon-momentum-0.9",
# "muon-weight-decay-0.2": the training command's --FLAG VALUE), or "...-seedN"
# for that row at seed N (a new tuned point's other seeds). Any flag of the training
# command serves: "lowrank-update-clip-off" is the default without its update clip
# (Adafactor's, on the leaves in Adam's direction with a factored v), a row of the
# search for what separates the default from Muon (experiments/muon_gap.sh).
# ROWS picks them (empty: none, only the table). A finished row is not trained
# again; the table is rewritten from whatever has finished. About 17 min a row
# alone on this 2-core CPU (AdamW about 10).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
RUNS=experiments/results/tune-more-runs
source experiments/runs_folder.sh
runs_folder "$RUNS"
BASE=("${LONG_RUN[@]}" --no-progress)
declare -A FLAGS=(  # each contender at its tuned point: rate, then warmup (tune-warmup.md)
  [lowrank]="--optimizer skewadam --lr 0.0135 $RANK16_DEFAULT --expert-momentum lowrank --warmup-steps 160"
  [muon]="--optimizer muon --lr 0.015 --warmup-steps 160"
  [adamw]="--optimizer adamw --lr 0.0045 --warmup-steps 640"
)
declare -A BASELINE=(  # each contender's seed-0 run at its tuned point
  [lowrank]=experiments/results/expert-momentum-runs/lowrank-16
  [muon]=experiments/results/compare-long-runs/muon-sweep-lr1.50e-02
  [adamw]=experiments/results/tune-warmup-runs/adamw-640
)
for row in ${ROWS-}; do
  seed=$(row_seed "$row") point=$(row_point "$row")
  contender=${point%%-*} value=${point##*-}
  flag=${point#"$contender"-}; flag=${flag%-"$value"}
  finished "$RUNS/$row" && continue
  # shellcheck disable=SC2086
  "$PYTHON" -m experiments.train "${BASE[@]}" ${FLAGS[$contender]} "--$flag" "$value" \
      --seed "$seed" --out "$RUNS/$row"
done
# rewrites the committed experiments/results/tune-more.md: one table a contender, then
# each point that has other seeds: its mean and spread over them
{
  contender_tables "$RUNS" lowrank muon adamw
  seed_means "$RUNS"
} > experiments/results/tune-more.md
