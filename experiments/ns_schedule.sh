#!/usr/bin/env bash
# The quality check of the bounded Newton–Schulz schedule (orthogonalising a chunk of
# matrices at a time): the training command's
# default row (the orthogonal tiers at its 1600-step rate, 1.35e-2) re-run with
# Newton–Schulz forced one matrix at a time (--orthogonal-chunk 1, the smallest working
# set; `small`'s banks are below the "auto" bound, so "auto" steps them whole), at both
# horizons, set beside the default row of compare-400.json / compare-long.json.
# About 7 min a 400-step run and 30 min a 1600-step run on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
source experiments/runs_folder.sh
runs_folder experiments/results/ns-schedule-400-runs experiments/results/ns-schedule-1600-runs
# The row as measured: packed-sign expert momentum (the default before rank 16), and
# the orthogonal tiers' settings of then (runs_folder.sh: RANK16_DEFAULT_KEYS).
ROW=(--optimizers "" --skewadam-configs "expert_m=sign,$RANK16_DEFAULT_KEYS,ns_chunk=1" --lr 0.0135
     --reuse-runs --no-progress)
"$PYTHON" -m experiments.compare --steps 400 --seeds "${SEEDS_400:-0,1,2}" "${ROW[@]}" \
    --runs experiments/results/ns-schedule-400-runs --out experiments/results --name ns-schedule-400
"$PYTHON" -m experiments.compare --steps 1600 --seeds "${SEEDS_1600:-0,1,2}" "${ROW[@]}" \
    --runs experiments/results/ns-schedule-1600-runs --out experiments/results --name ns-schedule-1600
