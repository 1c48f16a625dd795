#!/usr/bin/env bash
# The tuning against Muon's second hyperparameter, the same for every contender: the
# warmup at
# the long horizon. Each contender's 1600-step row (rate swept at 1600 steps,
# experiments/results/compare-long.json; the default SkewAdam row on 0.3.0's
# defaults, experiments/results/safe-defaults-1600.json; the rank-16 expert
# momentum's, experiments/expert_momentum.sh) re-run at seed 0 with
# only the warmup changed from the comparison's 10 % (160 steps), one coordinate
# of a coordinate descent (rate, then warmup). ROWS picks some ("muon-60"; empty: none);
# a row "CONTENDER-WARMUP-seedN" is that row at seed N (a tuned point's other seeds);
# each is about 30 min alone on 2 CPU cores, 45 min beside another. A finished
# row is not trained again; the table is rewritten from whatever has finished.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
RUNS=experiments/results/tune-warmup-runs
source experiments/runs_folder.sh
runs_folder "$RUNS"
BASE=("${LONG_RUN[@]}" --no-progress)
declare -A FLAGS=(  # each contender at its 1600-step rate
  [skewadam]="--optimizer skewadam --lr 0.0135 $RANK16_DEFAULT --expert-momentum sign"
  # the rank-16 expert momentum (experiments/expert_momentum.sh), its rate swept there
  [lowrank]="--optimizer skewadam --lr 0.0135 $RANK16_DEFAULT --expert-momentum lowrank"
  [muon]="--optimizer muon --lr 0.015"
  [adamw]="--optimizer adamw --lr 0.0045"
)
declare -A BASELINE=(  # each contender's seed-0 run with the 160-step warmup
  [skewadam]=experiments/results/safe-defaults-1600-runs/skewadam-bf16-factored-sign-exact-orthogonal-orthogonal-stochastic-auto-on-seed0
  [lowrank]=experiments/results/expert-momentum-runs/lowrank-16
  [muon]=experiments/results/compare-long-runs/muon-sweep-lr1.50e-02
  [adamw]=experiments/results/compare-long-runs/adamw-sweep-lr4.50e-03
)
for row in ${ROWS-skewadam-60 lowrank-60 muon-60 adamw-60 lowrank-320 muon-320 adamw-320 adamw-640 skewadam-320 adamw-640-seed1 adamw-640-seed2}; do
  seed=$(row_seed "$row") point=$(row_point "$row")
  contender=${point%-*} warmup=${point##*-}
  finished "$RUNS/$row" && continue
  # shellcheck disable=SC2086
  "$PYTHON" -m experiments.train "${BASE[@]}" ${FLAGS[$contender]} --warmup-steps "$warmup" --seed "$seed" \
      --out "$RUNS/$row"
done
# rewrites the committed experiments/results/tune-warmup.md: one table a contender, then
# each point that has other seeds: its mean and spread over them
{
  contender_tables "$RUNS" skewadam lowrank muon adamw
  seed_means "$RUNS"
} > experiments/results/tune-warmup.md
