#!/usr/bin/env bash
# The re-run of the training command's default row on 0.3.0's safe library defaults
# (stochastic rounding of the bf16 momentum, update clipping where a form has no
# bound of its own, non-finite containment), at the rate both comparisons gave the
# old default row (1.35e-2), set beside the default row of compare-400.json /
# compare-long.json. About 11 min a 400-step run and 45 min a 1600-step run on
# 2 CPU cores (one run at a time). Then the rank-16 expert momentum's 400-step row
# beside the default's (for the tuning against Muon: the row the comparison's rule
# picks at 1600 steps),
# 3 seeds at the same rate, reusing the default's runs: lowrank-400.{json,md}.
# Last, which safe setting moves the 1600-step row: the default with one of them
# off at a time, seed 0 (ABLATION picks some of u_clip=off, contain=off,
# m_round=nearest; empty: none), beside the default's seed-0 run: safe-defaults-ablation.
# Then the second scale, small-x5 at 400 steps (X5 below): x5-safe-defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
source experiments/runs_folder.sh
runs_folder experiments/results/safe-defaults-400-runs experiments/results/safe-defaults-1600-runs
# compare ROW_STEPS SEEDS CONFIGS RUNS NAME [FLAG...]: one comparison at the old
# default row's rate; CONFIGS are ';'-separated SkewAdam rows.
compare() {
  "$PYTHON" -m experiments.compare --steps "$1" --seeds "$2" --skewadam-configs "$3" \
      --lr 0.0135 --reuse-runs --no-progress --runs "$4" --out experiments/results \
      --name "$5" "${@:6}"
}
# The default row as these runs measured it: packed-sign expert momentum (the
# training command's default before rank 16, which is the lowrank rows), and the
# orthogonal tiers' settings of then (runs_folder.sh: RANK16_DEFAULT_KEYS), which the
# lowrank rows (rank 16, the default until the tuning against Muon moved it to rank 42)
# share.
SIGN="expert_m=sign,$RANK16_DEFAULT_KEYS"
LOWRANK="expert_m=lowrank,$RANK16_DEFAULT_KEYS"
ONLY=(--optimizers "")
R400=experiments/results/safe-defaults-400-runs
R1600=experiments/results/safe-defaults-1600-runs
if [ -n "${SEEDS_400-0,1,2}" ]; then
  compare 400 "${SEEDS_400-0,1,2}" "$SIGN" "$R400" safe-defaults-400 "${ONLY[@]}"
fi
if [ -n "${SEEDS_1600-0,1,2}" ]; then
  compare 1600 "${SEEDS_1600-0,1,2}" "$SIGN" "$R1600" safe-defaults-1600 "${ONLY[@]}"
fi
if [ -n "${LOWRANK_SEEDS_400-0,1,2}" ]; then
  compare 400 "${LOWRANK_SEEDS_400-0,1,2}" "$SIGN;$LOWRANK" "$R400" lowrank-400 \
      "${ONLY[@]}"
fi
if [ -n "${ABLATION-}" ]; then
  ROWS="$SIGN"
  for row in $ABLATION; do ROWS+=";$SIGN,$row"; done
  compare 1600 0 "$ROWS" "$R1600" safe-defaults-ablation "${ONLY[@]}"
fi
# The same question at 400 steps on the rank-16 default,
# seed 0, beside its lowrank-400 run (reused): ABLATION_400 picks some of
# u_clip=off, contain=off, m_round=nearest (about 11 min a run):
# safe-defaults-ablation-400.
if [ -n "${ABLATION_400-}" ]; then
  ROWS="$LOWRANK"
  for row in $ABLATION_400; do ROWS+=";$LOWRANK,$row"; done
  compare 400 0 "$ROWS" "$R400" safe-defaults-ablation-400 "${ONLY[@]}"
fi
# The second scale (small-x5, 400 steps, seed 0, about 1 h a run): rank 16 first,
# then the sign-momentum row on the same defaults beside it (X5=lowrank trains
# only the first; empty: neither).
if [ -n "${X5-lowrank,default}" ]; then
  X5_ROWS="$LOWRANK"
  case ",${X5-lowrank,default}," in *,default,*) X5_ROWS+=";$SIGN" ;; esac
  compare 400 0 "$X5_ROWS" experiments/results/compare-x5-runs x5-safe-defaults \
      --config experiments/configs/small-x5.toml "${ONLY[@]}"
fi
