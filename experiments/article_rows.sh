#!/usr/bin/env bash
# The article's optimizer (skewadam_jax.skewadam_article, `--optimizer skewadam_article`:
# the reference code's tiers, floor, clip and decay) in the comparison, tuned by the
# protocol every contender had: at 400 steps its rate swept around the article's own
# 3e-4 (x1/3, x1, x3, one more point past an edge), 3 seeds at the best; at 1600 steps
# swept again around that rate (x0.5, x1, one more past an edge), 3 seeds at the best.
# About 4 min a 400-step run and 15-30 min a 1600-step run on 2 CPU cores; finished
# runs are read back, not trained again. STAGES picks "400", "1600" or both.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
source experiments/runs_folder.sh
RUNS400=experiments/results/article-400-runs
RUNS1600=experiments/results/article-1600-runs
runs_folder "$RUNS400" "$RUNS1600"
ROW=(--optimizers skewadam_article --reuse-runs --no-progress --out experiments/results)
for stage in ${STAGES:-400 1600}; do
  if [ "$stage" = 400 ]; then
    "$PYTHON" -m experiments.compare "${ROW[@]}" --steps 400 --sweep-steps 400 \
        --seeds "${SEEDS_400:-0,1,2}" --lr-factors "${FACTORS_400:-0.333,1,3}" --runs "$RUNS400" --name article-400
  else
    "$PYTHON" -m experiments.compare "${ROW[@]}" --steps 1600 --sweep-steps 1600 \
        --seeds "${SEEDS_1600:-0,1,2}" --lr-factors 0.5,1 \
        --lr-from experiments/results/article-400.json --runs "$RUNS1600" --name article-1600
  fi
done
