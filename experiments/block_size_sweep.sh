#!/usr/bin/env bash
# The MoE's rows per block against the model's FLOPs and the estimated step: the
# training command's default on moe-6.78b, A100-40GB target, at one sequence and at
# the largest batch that fits (11), for each block size (0: sized to the batch,
# models.grouped.auto_block_size). Deviceless compiles, no batch search; about
# 5 minutes on 2 cores. The table:
#   python -m experiments.memory --step-time-table experiments/results/step-time/block-size/*.json
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=experiments/results/step-time/block-size
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
for batch in 1 11; do
  for block in 0 128 256 512 1024; do
    name=moe-6.78b-a100-batch$batch-block$block
    "$PY" -m experiments.memory --preset moe-6.78b --optimizer skewadam --target a100-40gb \
      --batch-size "$batch" --seq-len 2048 --moe-block-size "$block" --no-search --json \
      > "$OUT/$name.json.tmp"
    mv "$OUT/$name.json.tmp" "$OUT/$name.json"
  done
done
