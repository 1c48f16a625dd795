#!/usr/bin/env bash
# The memory planner's figures of the training command's default (the orthogonal tiers
# with rank-84 int8 expert momentum and Muon's width scaling since the tuning against
# Muon, Newton–Schulz in chunks: TierConfig.orthogonal_chunk="auto"),
# re-planned whenever the default's step changes. Deviceless compiles on this CPU machine; the GPU rows need the
# gpu-compile extra, the TPU rows the tpu-compile extra. About an hour on 2 cores.
# Usage: bash experiments/plan_defaults.sh [NAME ...]   (default: every row)
# The planner's side of the real-GPU check (experiments/gpu_check.sh) is
# experiments/results/gpu-check/plans/, the same command with --target h200 --no-search.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=experiments/results/memory
PY=${PYTHON:-.venv/bin/python}
plan() {  # plan NAME ARGS...: one report, experiments/results/memory/NAME.json
  local name=$1; shift
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local dir=${DIR:-$OUT}
  echo "== $name: python -m experiments.memory $* --json" >&2
  "$PY" -m experiments.memory "$@" --json > "$dir/$name.json.tmp"
  mv "$dir/$name.json.tmp" "$dir/$name.json"
}
ONLY="$*"
A100=(--preset moe-6.78b --optimizer skewadam --target a100-40gb --batch-size 1 --seq-len 2048)
plan skewadam "${A100[@]}"
plan skewadam-update-in-backward "${A100[@]}" --update-in-backward
plan skewadam-update-in-backward-24gb "${A100[@]}" --update-in-backward --device-memory-gb 24
# Throughput: the same on the H100 target (the README's estimated step), the MoE's blocks
# sized to the batch (moe_block_size = 0: the model's FLOPs within 1.55x the useful ones),
# and gradient accumulation, in the standard step (a second parameter-sized buffer) and
# inside the backward pass (one buffer, updated layer by layer).
plan skewadam-h100 --preset moe-6.78b --optimizer skewadam --target h100-80gb --batch-size 1 \
  --seq-len 2048
plan skewadam-moe-block-auto "${A100[@]}" --moe-block-size 0
plan skewadam-accumulate8 "${A100[@]}" --accumulate 8 --accumulate-dtype params
plan skewadam-update-in-backward-accumulate16 "${A100[@]}" --update-in-backward \
  --accumulate 16 --accumulate-dtype params
# The library's skewadam() (Adam's direction in both tiers, with the library's own defaults),
# and SkewAdam's reference row (Adam's backbone): re-planned whenever the library's step changes.
# The expert momentum orthogonalised through its rank-84 factors (a rank-84 update; the
# backbone's matrices as the default's)
FACTORS=(--expert-lowrank-orthogonalise factors)
plan skewadam-factors "${A100[@]}" "${FACTORS[@]}"
plan skewadam-factors-update-in-backward "${A100[@]}" "${FACTORS[@]}" --update-in-backward
ADAM=(--backbone-direction adam --expert-direction adam)
plan skewadam-adam "${A100[@]}" "${ADAM[@]}"
plan skewadam-adam-update-in-backward "${A100[@]}" "${ADAM[@]}" --update-in-backward
plan skewadam-adam-update-in-backward-24gb "${A100[@]}" "${ADAM[@]}" --update-in-backward \
  --device-memory-gb 24
plan skewadam-reference "${A100[@]}" "${ADAM[@]}" --backbone-momentum fp32 \
  --backbone-second-moment exact
# The orthogonal tiers' settings of the default before the tuning against Muon moved it
# (rank-16 float32 expert factors, Adam's update RMS): the rows planned with them spell
# them.
ADAM_RMS=(--backbone-orthogonal-scale adam_rms --expert-orthogonal-scale adam_rms)
RANK16=(--expert-lowrank-rank 16 --expert-lowrank-dtype float32 "${ADAM_RMS[@]}")
# The normalized row and the whole-bank schedule as they were measured: packed-sign
# expert momentum (the default's expert momentum before rank 16).
NORMALIZED=(--backbone-direction normalized_orthogonal --expert-direction normalized_orthogonal
            --expert-momentum sign "${ADAM_RMS[@]}")
plan skewadam-normalized-orthogonal "${A100[@]}" "${NORMALIZED[@]}"
plan skewadam-normalized-orthogonal-update-in-backward-batch1 "${A100[@]}" "${NORMALIZED[@]}" \
  --update-in-backward --no-search
H200=(--preset moe-47b --optimizer skewadam --target h200 --batch-size 1 --seq-len 2048)
plan moe-47b-h200-skewadam-orthogonal-update-in-backward "${H200[@]}" --update-in-backward
EIGHT=(--preset moe-47b --optimizer skewadam --target a100-40gb --devices 8 --batch-size 8 --seq-len 2048)
plan moe-47b-8xa100-skewadam-orthogonal "${EIGHT[@]}"
plan moe-47b-8xa100-skewadam-orthogonal-update-in-backward-data8-fsdp "${EIGHT[@]}" \
  --update-in-backward
# The same FSDP layout with the expert momentum orthogonalised through its factors: the
# collectives Newton-Schulz adds (at batch 8 only)
plan moe-47b-8xa100-skewadam-orthogonal-factors "${EIGHT[@]}" --expert-lowrank-orthogonalise factors \
  --no-search
# and each backbone matrix iterated whole on one owner device of the data axis
plan moe-47b-8xa100-skewadam-orthogonal-factors-owners "${EIGHT[@]}" \
  --expert-lowrank-orthogonalise factors --orthogonal-owner-axes data --no-search
# and the default's whole expert matrices on owner devices too (each bank's experts spread
# over the data axis, a group of banks along its experts)
plan moe-47b-8xa100-skewadam-orthogonal-owners "${EIGHT[@]}" --orthogonal-owner-axes data \
  --no-search
# FSDP that splits each expert bank along its experts (each expert's matrices whole on a
# device, where Newton-Schulz iterates them), alone and with the backbone's owners
plan moe-47b-8xa100-skewadam-orthogonal-fsdp-experts "${EIGHT[@]}" --fsdp-experts --no-search
plan moe-47b-8xa100-skewadam-orthogonal-fsdp-experts-owners "${EIGHT[@]}" --fsdp-experts \
  --orthogonal-owner-axes data --no-search
plan moe-47b-8xa100-adamw-fsdp-experts --preset moe-47b --optimizer adamw --target a100-40gb \
  --devices 8 --batch-size 8 --seq-len 2048 --fsdp-experts --no-search
plan moe-47b-8xa100-skewadam-orthogonal-expert-parallel-update-in-backward "${EIGHT[@]}" \
  --moe-impl expert_parallel --update-in-backward
plan moe-47b-8xa100-skewadam-orthogonal-expert-parallel-fsdp "${EIGHT[@]}" \
  --moe-impl expert_parallel --fsdp
# The packed-sign momentum's row of the layout above, planned again with today's library
# (its first plan, ...-expert-sign-expert-parallel-update-in-backward.json, predates the
# update clip's second pass), at batch 8 only.
plan moe-47b-8xa100-skewadam-expert-sign-expert-parallel-update-in-backward-replanned \
  "${EIGHT[@]}" --moe-impl expert_parallel --update-in-backward --expert-momentum sign --no-search \
  "${ADAM_RMS[@]}"
V6E=(--preset moe-6.78b --optimizer skewadam --target tpu-v6e --batch-size 1 --seq-len 2048)
plan moe-6.78b-tpu-v6e-skewadam-orthogonal "${V6E[@]}"
plan moe-6.78b-tpu-v6e-skewadam-orthogonal-update-in-backward "${V6E[@]}" --update-in-backward
# The schedule before TierConfig.orthogonal_chunk (a layer's whole bank at once), for comparison
# (moe-6.78b's is skewadam-update-in-backward-whole-bank.json, planned at commit b08a297).
plan moe-47b-h200-skewadam-orthogonal-whole-bank-update-in-backward "${H200[@]}" \
  --update-in-backward --orthogonal-chunk all --no-search --expert-momentum sign "${ADAM_RMS[@]}"
# The planner's side of the real-GPU check (experiments/gpu_check.sh): the phases' steps for
# the H200 target, without the batch search, in experiments/results/gpu-check/plans/.
GPU=experiments/results/gpu-check/plans
H200_6B=(--preset moe-6.78b --target h200 --seq-len 2048 --no-search)
DIR=$GPU plan moe-6.78b-h200-skewadam-default "${H200_6B[@]}" --optimizer skewadam --batch-size 1
DIR=$GPU plan moe-6.78b-h200-skewadam-default-batch11 "${H200_6B[@]}" --optimizer skewadam \
  --batch-size 11
DIR=$GPU plan moe-6.78b-h200-skewadam-default-update-in-backward "${H200_6B[@]}" \
  --optimizer skewadam --batch-size 1 --update-in-backward
DIR=$GPU plan moe-6.78b-h200-adamw "${H200_6B[@]}" --optimizer adamw --batch-size 1
DIR=$GPU plan moe-6.78b-h200-skewadam-library "${H200_6B[@]}" --optimizer skewadam "${ADAM[@]}" \
  --batch-size 1
DIR=$GPU plan moe-6.78b-h200-skewadam-library-batch12 "${H200_6B[@]}" --optimizer skewadam \
  "${ADAM[@]}" --batch-size 12
DIR=$GPU plan moe-6.78b-h200-skewadam-library-update-in-backward "${H200_6B[@]}" \
  --optimizer skewadam "${ADAM[@]}" --batch-size 1 --update-in-backward
DIR=$GPU plan moe-47b-h200-skewadam-library-update-in-backward --preset moe-47b --target h200 \
  --seq-len 2048 --no-search --optimizer skewadam "${ADAM[@]}" --batch-size 1 --update-in-backward
# The same step of skewadam() planned for the H100: Hopper's program, 80 GB.
DIR=$GPU plan moe-6.78b-h100-skewadam-library --preset moe-6.78b --target h100-80gb --seq-len 2048 \
  --no-search --optimizer skewadam "${ADAM[@]}" --batch-size 1
# The tuning against Muon's first candidate spelled out (muon_gap.sh's
# muon-scale-rank-42-bf16: rank-42
# bfloat16 expert factors under Muon's width scaling), the default from when the rule
# chose it until rank 84 in int8 replaced it: the steps of skewadam,
# skewadam-update-in-backward and moe-47b-h200-skewadam-orthogonal-update-in-backward above.
candidate() {  # candidate TAG ARGS...: the three steps above for a candidate's flags
  local tag=$1; shift
  plan "skewadam-$tag" "${A100[@]}" "$@"
  plan "skewadam-$tag-update-in-backward" "${A100[@]}" "$@" --update-in-backward
  plan "moe-47b-h200-skewadam-$tag-update-in-backward" "${H200[@]}" "$@" --update-in-backward
}
candidate rank42-bf16 --backbone-orthogonal-scale width --expert-orthogonal-scale width \
  --expert-lowrank-rank 42 --expert-lowrank-dtype bfloat16
# The tuning against Muon's rank 84 in int8 (muon_gap.sh's
# muon-scale-rank-84-int8-warmup-640: the same bytes
# at moe-6.78b as rank 42 in bfloat16, twice the rank), planned before any rule weighed it:
# the same steps as the rank-42 rows above (the default's since the rule chose it, so the
# same plans as skewadam, skewadam-update-in-backward and
# moe-47b-h200-skewadam-orthogonal-update-in-backward).
candidate rank84-int8 --backbone-orthogonal-scale width --expert-orthogonal-scale width \
  --expert-lowrank-rank 84 --expert-lowrank-dtype int8
# The default before the tuning against Muon moved it (rank-16 float32 expert factors,
# Adam's update RMS), the
# rows above that are the default's, kept for the pages that set the two side by side.
plan skewadam-expert-lowrank16 "${A100[@]}" "${RANK16[@]}"
plan skewadam-expert-lowrank16-update-in-backward "${A100[@]}" "${RANK16[@]}" --update-in-backward
plan skewadam-expert-lowrank16-update-in-backward-24gb "${A100[@]}" "${RANK16[@]}" \
  --update-in-backward --device-memory-gb 24
plan moe-47b-h200-skewadam-expert-lowrank16-update-in-backward "${H200[@]}" "${RANK16[@]}" \
  --update-in-backward
plan moe-47b-8xa100-skewadam-expert-lowrank16 "${EIGHT[@]}" "${RANK16[@]}"
plan moe-47b-8xa100-skewadam-expert-lowrank16-update-in-backward-data8-fsdp "${EIGHT[@]}" \
  "${RANK16[@]}" --update-in-backward
plan moe-47b-8xa100-skewadam-expert-lowrank16-expert-parallel-update-in-backward "${EIGHT[@]}" \
  "${RANK16[@]}" --moe-impl expert_parallel --update-in-backward
plan moe-47b-8xa100-skewadam-expert-lowrank16-expert-parallel-fsdp "${EIGHT[@]}" "${RANK16[@]}" \
  --moe-impl expert_parallel --fsdp
plan moe-6.78b-tpu-v6e-skewadam-expert-lowrank16 "${V6E[@]}" "${RANK16[@]}"
plan moe-6.78b-tpu-v6e-skewadam-expert-lowrank16-update-in-backward "${V6E[@]}" "${RANK16[@]}" \
  --update-in-backward
DIR=$GPU plan moe-6.78b-h200-skewadam-expert-lowrank16 "${H200_6B[@]}" --optimizer skewadam \
  "${RANK16[@]}" --batch-size 1
DIR=$GPU plan moe-6.78b-h200-skewadam-expert-lowrank16-batch12 "${H200_6B[@]}" \
  --optimizer skewadam "${RANK16[@]}" --batch-size 12
DIR=$GPU plan moe-6.78b-h200-skewadam-expert-lowrank16-update-in-backward "${H200_6B[@]}" \
  --optimizer skewadam "${RANK16[@]}" --batch-size 1 --update-in-backward
