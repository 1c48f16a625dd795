#!/usr/bin/env bash
# The long-horizon comparison (experiments/results/compare-long.json): each
# contender's rate swept at 1600 steps around the rate the shorter sweep tuned
# (x0.5, x1, one more point past an edge), then 3 seeds at the best rate.
# About 36 min a run on 2 CPU cores, 4-5 runs a contender: it takes several
# sessions. Each run's folder is kept in experiments/results/compare-long-runs,
# so running this again reads the finished runs and trains only the rest;
# contenders go one at a time, the most informative first.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
RUNS=experiments/results/compare-long-runs
RATES=experiments/results/compare-long.json,experiments/results/orthogonal/quick-normalized.json
NORMALIZED="backbone_dir=normalized_orthogonal,expert_dir=normalized_orthogonal"
ORTHOGONAL="backbone_dir=orthogonal,expert_dir=orthogonal"
PROTOCOL=(--steps 1600 --sweep-steps 1600 --seeds 0,1,2 --lr-factors 0.5,1
          --lr-from "$RATES" --runs "$RUNS" --reuse-runs --no-progress)
one() {  # one contender: its partial table goes to runs/, not the results
  "$PYTHON" -m experiments.compare "${PROTOCOL[@]}" --out runs/compare-long-partial "$@"
}
one --optimizers "" --skewadam-configs "$NORMALIZED"
one --optimizers muon
one --optimizers "" --skewadam-configs "$ORTHOGONAL"
one --optimizers skewadam
one --optimizers adamw
# Every run is finished: this only reads them back and writes the table.
"$PYTHON" -m experiments.compare "${PROTOCOL[@]}" --optimizers adamw,skewadam,muon \
    --skewadam-configs "$NORMALIZED;$ORTHOGONAL" --out experiments/results --name compare-long \
    --shorter experiments/results/orthogonal/compare.json
