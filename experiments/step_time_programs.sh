#!/usr/bin/env bash
# The programs `python -m experiments.step_time --calibrate` checks its estimate
# on: the steps measured on an H200 on 2026-12-04 (experiments/results/gpu-check/),
# compiled for the h200 target without a GPU from the code of commit 7d6fae6 (the
# last before the estimate; the H200 ran the 2026-12-04 code under jax 0.11.2,
# these compile under this checkout's jax). Needs the gpu-compile extra; 39 s
# on the 2-core AMD EPYC (2026-12-07), and `--calibrate --programs OUT_DIR` then
# gives the committed table.
#
#   bash experiments/step_time_programs.sh [OUT_DIR]   # default experiments/results/step-time/programs
set -eu
out=$(realpath -m "${1:-experiments/results/step-time/programs}")
py=${PYTHON:-.venv/bin/python}
[[ $py == /* ]] || py=$PWD/$py  # absolute, not resolved: a venv's python is a symlink
dump=$(realpath experiments/planning/dump_step_hlo.py)
old=$(mktemp -d)/checkout
git worktree add --detach "$old" 7d6fae6 >/dev/null
trap 'git worktree remove --force "$old"' EXIT
mkdir -p "$out"
cd "$old"
PYTHONPATH="$old" "$py" "$dump" "$out/moe-6.78b-adamw-batch1-h200.hlo.gz" \
  '{"preset": "moe-6.78b", "optimizer": "adamw", "batch": 1, "target": "h200"}'
PYTHONPATH="$old" "$py" "$dump" "$out/moe-6.78b-skewadam-update-in-backward-batch1-h200.hlo.gz" \
  '{"preset": "moe-6.78b", "optimizer": "skewadam", "batch": 1, "target": "h200", "update_in_backward": true, "tiers": {}}'
PYTHONPATH="$old" "$py" "$dump" "$out/moe-47b-skewadam-update-in-backward-batch1-h200.hlo.gz" \
  '{"preset": "moe-47b", "optimizer": "skewadam", "batch": 1, "target": "h200", "update_in_backward": true, "tiers": {}}'
