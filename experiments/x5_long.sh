#!/usr/bin/env bash
# The tuning against Muon's second scale at the long horizon: `small-x5`
# (experiments/configs/small-x5.toml,
# 22,560,000 parameters, 5x small's) at 1600 steps, each contender at its tuned point
# on `small` (rate swept at 1600 steps, then warmup, momentum and weight decay:
# tune-warmup.md, tune-more.md; no sweep at this scale): the training command's default
# until the tuning against Muon moved it (lowrank: the orthogonal tiers, rank-16 expert
# momentum,
# runs_folder.sh's RANK16_DEFAULT), Muon and AdamW, and muon_gap.sh's
# challenger (muon-scale: Muon's width scaling at Muon's rate), and its candidate at the
# point the contenders' procedure ended on for it on small (rank42-bf16: rank-42 expert
# momentum factors in bfloat16, warmup 640; seeds 0 and 1, decided before its seeds 1
# and 2 on small finished, and reported whatever they give); and, decided while its
# seed 0 ran (at step 1300 it was 3.9 behind the default's seed 0, still decaying from
# a warmup of 40 % of the run), the candidate at the 10 % warmup every command has
# (rank42-bf16-warmup-160, seed 0 first), which its three seeds on small measured level
# with 640's, so the form and the warmup are told apart (55.14 at seed 0 against 640's
# 55.66; its seed 1, rank42-bf16-warmup-160-seed1, decided after that). Decided after
# both its seeds were in (54.43 +- 1.00 against Muon's 54.75 +- 0.82, within the spread):
# a third seed of it and of Muon, rank42-bf16-warmup-160-seed2 and muon-seed2, reported
# whatever they give; and, with those two under way (2026-12-06), the candidate's third
# seed at its tuned point, rank42-bf16-seed2, so both of its rows have three, reported
# whatever it gives; and (2026-12-06), as rank 84 in int8 (the same bytes at moe-6.78b,
# muon_gap.sh) was ahead of rank 42 in bfloat16 on small at seeds 0 and 1 (57.16 against
# 57.53), that form at the same point here, seed 0 first, decided before it ran and
# reported whatever it gives: rank84-int8 (rank 84 is a third of small-x5's 256 expert
# rows, as rank 42 is of small's 128; 55.85, against rank42-bf16's 55.66 and Muon's 55.34);
# its seed 1, rank84-int8-seed1, decided while seed 0 ran (the issue asks for two seeds at
# this scale), lost with a session's machine at about step 600 and withdrawn (2026-12-06)
# rather than run again: the contenders' procedure then moved the int8 row's warmup on
# small to 320 (muon_gap.sh), so 640 is no longer its tuned point. Decided when the
# procedure ended there (2026-12-06: warmup 320, rate 1.5e-2, b1 0.9, weight decay 0.2),
# before its seeds 1 and 2 on small were in, and reported whatever they give: that point
# here, seeds 0 and 1, rank84-int8-warmup-320 and rank84-int8-warmup-320-seed1 (the
# training command's default since the rule chose it on small, 2026-12-07). Decided after
# that seed 0 gave 56.06 (0.72 behind Muon's, where rank 42 at the commands' 10 % warmup
# was ahead of Muon and at its tuned 640 behind), before its seed 1 finished and reported
# whatever it gives: the default as the training command runs it, at its 10 % warmup,
# rank84-int8-warmup-160 (seed 0; on small 57.46 against 320's 56.53; here 55.05, 0.28 ahead
# of Muon's seed 0 and 1.01 below 320's). Decided after
# seed 1 gave 53.38 (0.80 ahead of Muon's at that seed, so over seeds 0 and 1 level with
# Muon's), to set the default beside Muon's three seeds as rank 42's rows are, and run
# before rank84-int8-warmup-160, reported whatever it gives: rank84-int8-warmup-320-seed2
# (55.39, level with Muon's 55.40 at that seed; over seeds 0 to 2 level with Muon's).
# A row is CONTENDER
# (seed 0) or CONTENDER-seedN; ROWS picks them (empty: none, only the table).
# A run is hours on 2 CPU cores (at 400 steps: the default 50 min, Muon 33, AdamW 13),
# so each checkpoints every 100 steps and goes on from its last checkpoint when the
# script is run again after an interruption (a signal, a session's end). A finished
# row is not trained again, and its checkpoints are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
RUNS=experiments/results/x5-long-runs
source experiments/runs_folder.sh
runs_folder "$RUNS"
BASE=("${LONG_RUN[@]}" --config experiments/configs/small-x5.toml --no-progress
      --ckpt-every 100 --resume)
# muon_gap.sh's rank-42 bfloat16 candidate, each row at its own warmup
RANK42_BF16="--optimizer skewadam --lr 0.015 --expert-momentum lowrank --expert-lowrank-rank 42 --expert-lowrank-dtype bfloat16 --weight-decay 0.2 --backbone-orthogonal-scale width --expert-orthogonal-scale width"
# the same bytes at moe-6.78b in int8 codes: twice the rank (muon_gap.sh)
RANK84_INT8="$RANK42_BF16 --expert-lowrank-rank 84 --expert-lowrank-dtype int8"
declare -A FLAGS=(  # each contender at its tuned point on small (tune-warmup.md, tune-more.md)
  [lowrank]="--optimizer skewadam --lr 0.0135 $RANK16_DEFAULT --expert-momentum lowrank --warmup-steps 160"
  [muon]="--optimizer muon --lr 0.015 --warmup-steps 160 --weight-decay 0.2"
  [adamw]="--optimizer adamw --lr 0.0045 --warmup-steps 640 --weight-decay 0.4"
  # the challenger from experiments/muon_gap.sh: the default with Muon's width scaling
  # at Muon's rate and weight decay
  [muon-scale]="--optimizer skewadam --lr 0.015 $RANK16_DEFAULT --expert-momentum lowrank --warmup-steps 160 --weight-decay 0.2 --backbone-orthogonal-scale width --expert-orthogonal-scale width"
  # muon_gap.sh's rank-42 bfloat16 candidate at its tuned point on small (quality page)
  [rank42-bf16]="$RANK42_BF16 --warmup-steps 640"
  [rank42-bf16-warmup-160]="$RANK42_BF16 --warmup-steps 160"
  [rank84-int8]="$RANK84_INT8 --warmup-steps 640"
  # ... at the point the contenders' procedure ended on for it on small
  [rank84-int8-warmup-320]="$RANK84_INT8 --warmup-steps 320"
  # ... and at the training command's 10 % warmup
  [rank84-int8-warmup-160]="$RANK84_INT8 --warmup-steps 160"
)
for row in ${ROWS-}; do
  if ! finished "$RUNS/$row"; then
    # shellcheck disable=SC2086
    "$PYTHON" -m experiments.train "${BASE[@]}" ${FLAGS[$(row_point "$row")]} \
        --seed "$(row_seed "$row")" --out "$RUNS/$row"
  fi
  rm -rf "$RUNS/$row/ckpt"
done
# rewrites the committed experiments/results/x5-long.md: every finished row against
# Muon's seed 0, then each contender's mean and spread over its seeds
if finished "$RUNS/muon"; then
  finished=$(finished_runs "$RUNS"/*/)
  {
    "$PYTHON" -m experiments.compare --runs-table "$finished" --baseline "$RUNS/muon"
    echo
    seed_means "$RUNS"
  } > experiments/results/x5-long.md
fi
