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
# The sweep centres: the rates 0.2.0's comparison tuned (frozen, so that a rerun
# after compare-long.json is rewritten finds the same runs).
RATES=experiments/results/compare-long-0.2.0.json,experiments/results/orthogonal/quick-normalized.json
# SkewAdam's rows by their directions, spelt out with the packed-sign expert
# momentum they were measured with (this comparison chose the orthogonal row; the
# training command's default has since taken low-rank expert momentum instead,
# experiments/expert_momentum.sh, so `--optimizers skewadam` is another row), and with
# the orthogonal tiers' settings of then: Adam's update RMS, weight decay 0.1.
THEN="backbone_scale=adam_rms,expert_scale=adam_rms,wd=0.1"
NORMALIZED="backbone_dir=normalized_orthogonal,expert_dir=normalized_orthogonal,expert_m=sign,$THEN"
ORTHOGONAL="backbone_dir=orthogonal,expert_dir=orthogonal,expert_m=sign,$THEN"
ADAM="backbone_dir=adam,expert_dir=adam,expert_m=sign"  # the library's skewadam()
PROTOCOL=(--steps 1600 --sweep-steps 1600 --seeds 0,1,2 --lr-factors 0.5,1
          --lr-from "$RATES" --runs "$RUNS" --reuse-runs --no-progress)
one() {  # one contender: its partial table goes to runs/, not the results
  "$PYTHON" -m experiments.compare "${PROTOCOL[@]}" --out runs/compare-long-partial "$@"
}
one --optimizers "" --skewadam-configs "$NORMALIZED"
one --optimizers muon
one --optimizers "" --skewadam-configs "$ORTHOGONAL"
one --optimizers "" --skewadam-configs "$ADAM"
one --optimizers adamw
ALL=(--optimizers adamw,muon --skewadam-configs "$ADAM;$NORMALIZED;$ORTHOGONAL")
# Every 1600-step run is finished: this only reads them back and writes the table.
"$PYTHON" -m experiments.compare "${PROTOCOL[@]}" "${ALL[@]}" --out experiments/results \
    --name compare-long --plans experiments/results/memory
# The same rows at 400 steps, 3 seeds each at the rates the 1600-step sweep
# chose, in their own runs folder (a run's folder name does not hold its steps).
"$PYTHON" -m experiments.compare --steps 400 --seeds 0,1,2 "${ALL[@]}" \
    --lr-from experiments/results/compare-long.json --runs experiments/results/compare-400-runs \
    --reuse-runs --no-progress --out experiments/results --name compare-400
# Both horizons in one table (a redraw: nothing trains).
"$PYTHON" -m experiments.compare --render experiments/results/compare-long.json \
    --shorter experiments/results/compare-400.json --out experiments/results --name compare-long \
    --plans experiments/results/memory
# Where the orthogonal row's gap to Muon lives: that row's command at its
# 1600-step rate with one difference from Muon removed at a time, seed 0 (the
# attribution of the gap between the orthogonal default and Muon; each row's state
# at moe-6.78b: python -m experiments.state_bytes with the same flags). Muon's width
# scaling runs at Muon's rate, for which it
# is tuned. Nesterov's bias correction is not a row: it changes the direction
# only while b1^t is not negligible (skewadam_jax.transform._orthogonal_step).
lr_of() {  # the 1600-step rate of a row of compare-long.json: optimizer, direction
  "$PYTHON" -c "import json, sys; print(next(r['lr'] for r in json.load(open(
      'experiments/results/compare-long.json')) if r['optimizer'] == sys.argv[1]
      and (r['config'] == 'default' or r['config'].get('backbone_dir', 'adam') == sys.argv[2])))" "$@"
}
ATTRIBUTION=experiments/results/attribution-runs
attribution() {  # NAME LR FLAGS...: one row, unless its run has finished
  local name=$1 lr=$2; shift 2
  [ -f "$ATTRIBUTION/$name/summary.json" ] && return 0
  "$PYTHON" -m experiments.train --optimizer skewadam --steps 1600 --lr "$lr" \
      --warmup-steps 160 --eval-every 100 --eval-batches 16 --log-every 1 \
      --sample-tokens 0 --ckpt-every 1000000000 --seed 0 --no-progress \
      --backbone-direction orthogonal --expert-direction orthogonal --expert-momentum sign \
      --backbone-orthogonal-scale adam_rms --expert-orthogonal-scale adam_rms --weight-decay 0.1 \
      --out "$ATTRIBUTION/$name" "$@"
}
ORTHO_LR=$(lr_of skewadam orthogonal)
attribution rest-router "$ORTHO_LR" --orthogonal-rest-tier router
attribution width-scale "$(lr_of muon adam)" --backbone-orthogonal-scale width \
    --expert-orthogonal-scale width
attribution b1-0.95 "$ORTHO_LR" --b1 0.95
attribution fp32-momentum "$ORTHO_LR" --backbone-momentum fp32 --expert-momentum fp32
# Which tier's compact momentum costs the most: fp32 in one tier at a time.
attribution fp32-expert-momentum "$ORTHO_LR" --expert-momentum fp32
attribution fp32-backbone-momentum "$ORTHO_LR" --backbone-momentum fp32
# Within the budget: the article's expert tier (no momentum) and a shorter momentum.
attribution no-expert-momentum "$ORTHO_LR" --expert-momentum none
attribution b1-0.85 "$ORTHO_LR" --b1 0.85
# The rows against the orthogonal row's seed-0 run (nothing trains).
"$PYTHON" -m experiments.compare --runs-table "$(ls -d "$ATTRIBUTION"/*/ | paste -sd, -)" \
    --baseline "$RUNS/skewadam-bf16-factored-sign-exact-orthogonal-orthogonal-sweep-lr$(
        printf '%.2e' "$ORTHO_LR")" > experiments/results/attribution.md
# The second scale (5.06x small's parameters), one seed a row at the 1600-step
# rates, 400 steps.
"$PYTHON" -m experiments.compare --config experiments/configs/small-x5.toml --steps 400 \
    --seeds 0 "${ALL[@]}" --lr-from experiments/results/compare-long.json \
    --runs experiments/results/compare-x5-runs --reuse-runs --no-progress \
    --out experiments/results --name compare-x5
