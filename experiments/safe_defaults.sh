#!/usr/bin/env bash
# #44's re-run of the training command's default row on 0.3.0's library defaults
# (stochastic rounding of the bf16 momentum, update clipping where a form has no
# bound of its own, non-finite containment), at the rate both comparisons gave the
# old default row (1.35e-2), set beside the default row of compare-400.json /
# compare-long.json. About 11 min a 400-step run and 45 min a 1600-step run on
# 2 CPU cores (one run at a time). Then the rank-16 expert momentum's 400-step row
# beside the default's (#42: the row the comparison's rule picks at 1600 steps),
# 3 seeds at the same rate, reusing the default's runs: lowrank-400.{json,md}.
# Last, which safe setting moves the 1600-step row: the default with one of them
# off at a time, seed 0 (ABLATION picks some of u_clip=off, contain=off,
# m_round=nearest; empty: none), beside the default's seed-0 run: safe-defaults-ablation.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
source experiments/runs_folder.sh
runs_folder experiments/results/safe-defaults-400-runs experiments/results/safe-defaults-1600-runs
ROW=(--optimizers skewadam --skewadam-configs "" --lr 0.0135 --reuse-runs --no-progress)
if [ -n "${SEEDS_400-0,1,2}" ]; then
  "$PYTHON" -m experiments.compare --steps 400 --seeds "${SEEDS_400-0,1,2}" "${ROW[@]}" \
      --runs experiments/results/safe-defaults-400-runs --out experiments/results \
      --name safe-defaults-400
fi
if [ -n "${SEEDS_1600-0,1,2}" ]; then
  "$PYTHON" -m experiments.compare --steps 1600 --seeds "${SEEDS_1600-0,1,2}" "${ROW[@]}" \
      --runs experiments/results/safe-defaults-1600-runs --out experiments/results \
      --name safe-defaults-1600
fi
if [ -n "${LOWRANK_SEEDS_400-0,1,2}" ]; then
  "$PYTHON" -m experiments.compare --steps 400 --seeds "${LOWRANK_SEEDS_400-0,1,2}" "${ROW[@]}" \
      --skewadam-configs "expert_m=lowrank" \
      --runs experiments/results/safe-defaults-400-runs --out experiments/results \
      --name lowrank-400
fi
if [ -n "${ABLATION-}" ]; then
  "$PYTHON" -m experiments.compare --steps 1600 --seeds 0 "${ROW[@]}" \
      --skewadam-configs "${ABLATION// /;}" \
      --runs experiments/results/safe-defaults-1600-runs --out experiments/results \
      --name safe-defaults-ablation
fi
