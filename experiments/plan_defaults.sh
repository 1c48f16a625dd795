#!/usr/bin/env bash
# The memory planner's figures of the training command's default (the orthogonal tiers
# with rank-16 expert momentum, Newton–Schulz in chunks: TierConfig.orthogonal_chunk="auto"),
# re-planned whenever the default's step changes. Deviceless compiles on this CPU machine; the GPU rows need the
# gpu-compile extra, the TPU rows the tpu-compile extra. About an hour on 2 cores.
# Usage: bash experiments/plan_defaults.sh [NAME ...]   (default: every row)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=experiments/results/memory
PY=${PYTHON:-.venv/bin/python}
plan() {  # plan NAME ARGS...: one report, experiments/results/memory/NAME.json
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  echo "== $name: python -m experiments.memory $* --json" >&2
  "$PY" -m experiments.memory "$@" --json > "$OUT/$name.json.tmp"
  mv "$OUT/$name.json.tmp" "$OUT/$name.json"
}
ONLY="$*"
A100=(--preset moe-6.78b --optimizer skewadam --target a100-40gb --batch-size 1 --seq-len 2048)
plan skewadam "${A100[@]}"
plan skewadam-update-in-backward "${A100[@]}" --update-in-backward
plan skewadam-update-in-backward-24gb "${A100[@]}" --update-in-backward --device-memory-gb 24
# The normalized row and the whole-bank schedule as they were measured: packed-sign
# expert momentum (the default's expert momentum before rank 16).
NORMALIZED=(--backbone-direction normalized_orthogonal --expert-direction normalized_orthogonal
            --expert-momentum sign)
plan skewadam-normalized-orthogonal "${A100[@]}" "${NORMALIZED[@]}"
plan skewadam-normalized-orthogonal-update-in-backward-batch1 "${A100[@]}" "${NORMALIZED[@]}" \
  --update-in-backward --no-search
H200=(--preset moe-47b --optimizer skewadam --target h200 --batch-size 1 --seq-len 2048)
plan moe-47b-h200-skewadam-orthogonal-update-in-backward "${H200[@]}" --update-in-backward
EIGHT=(--preset moe-47b --optimizer skewadam --target a100-40gb --devices 8 --batch-size 8 --seq-len 2048)
plan moe-47b-8xa100-skewadam-orthogonal "${EIGHT[@]}"
plan moe-47b-8xa100-skewadam-orthogonal-update-in-backward-data8-fsdp "${EIGHT[@]}" \
  --update-in-backward
plan moe-47b-8xa100-skewadam-orthogonal-expert-parallel-update-in-backward "${EIGHT[@]}" \
  --moe-impl expert_parallel --update-in-backward
plan moe-47b-8xa100-skewadam-orthogonal-expert-parallel-fsdp "${EIGHT[@]}" \
  --moe-impl expert_parallel --fsdp
V6E=(--preset moe-6.78b --optimizer skewadam --target tpu-v6e --batch-size 1 --seq-len 2048)
plan moe-6.78b-tpu-v6e-skewadam-orthogonal "${V6E[@]}"
plan moe-6.78b-tpu-v6e-skewadam-orthogonal-update-in-backward "${V6E[@]}" --update-in-backward
# The schedule before TierConfig.orthogonal_chunk (a layer's whole bank at once), for comparison
# (moe-6.78b's is skewadam-update-in-backward-whole-bank.json, planned at commit b08a297).
plan moe-47b-h200-skewadam-orthogonal-whole-bank-update-in-backward "${H200[@]}" \
  --update-in-backward --orthogonal-chunk all --no-search --expert-momentum sign
