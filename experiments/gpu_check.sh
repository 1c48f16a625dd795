#!/usr/bin/env bash
# The real-GPU check, every phase in one call, in order of value: on a machine
# with one NVIDIA GPU (written for an 80-141 GB card; an A100-40GB runs the
# capped phases as they are).
#
#   bash experiments/gpu_check.sh [OUT_DIR]      # default experiments/results/gpu-check
#
# OUT_DIR/phases.jsonl gets one line per phase (experiments.gpu_check's
# record: measured peak, XLA's analysis of the same compiled step, compile and
# step times, MFU); OUT_DIR/env.json the device and package versions. A tiny
# step runs first: if it fails, nothing else is tried. Each phase is stopped
# after PHASE_TIMEOUT seconds (default 240). On a 141 GB H200 the batch-1 phases
# took 257 s (2026-12-04); the throughput phases before them add roughly 10
# minutes (22 steps of a few seconds each, plus a compile, five times), so a
# 15-minute lease may end during the batch-1 phases, which were measured then. Beside the planner's reports of the same steps:
#   python -m experiments.gpu_check --table OUT_DIR/phases.jsonl PLAN.json ...
# (the H200 plans: experiments/results/gpu-check/plans/, from plan_defaults.sh).
# The cap bounds the allocator, not the compiler: XLA still compiles for the
# card it runs on, so a capped phase answers "does this card's program fit in
# 42.33 GB", not "does the A100's".
set -u
out=${1:-experiments/results/gpu-check}
py=${PYTHON:-python3}
mkdir -p "$out"
log=$out/phases.jsonl
: > "$log"
# The A100-40GB budget the planner uses (experiments.planning.planner.TARGETS):
# the capped phases ask whether the step fits that card.
a100=42.331013120

"$py" - > "$out/env.json" <<'EOF'
import json, subprocess
import jax, optax, flax
try:
  smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                        "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
except OSError:
  smi = None
print(json.dumps({"jax": jax.__version__, "optax": optax.__version__, "flax": flax.__version__,
                  "devices": [d.device_kind for d in jax.devices()], "nvidia_smi": smi}))
EOF
cat "$out/env.json"

phase() { "$py" -m experiments.gpu_check --phase-timeout "${PHASE_TIMEOUT:-240}" --out "$log" "$@"; }

phase --preset tiny --optimizers skewadam --cap-gb 0 --steps 2 --phase-timeout 300
if ! tail -n 1 "$log" | grep -q '"status": "ok"'; then
  echo "the tiny step failed: nothing else tried" >&2
  exit 1
fi
# The training command's default SkewAdam (no tier flag) unless a phase says otherwise.
# In order of value, so that a lent GPU's 15 minutes are spent on what is not yet
# measured: the throughput phases first (about 2 min each on an H200 by the
# estimate), the batch-1 phases of 2026-12-04 last.
# Throughput at the A100-40GB plan's largest batch (11), 22 steps each (the first
# left out of the spread): the default, then Adam's direction in every tier;
# each record carries the roofline estimate of its own compiled program.
phase --preset moe-6.78b --optimizers skewadam --cap-gb "$a100" --steps 22 --batch-size 11
phase --preset moe-6.78b --optimizers skewadam --cap-gb "$a100" --steps 22 --batch-size 11 \
  --backbone-direction adam --expert-direction adam
# The MoE's block size at that batch, measured (the estimate prefers larger blocks:
# XLA copies each block's expert weights): 1024, then sized to the batch (0).
phase --preset moe-6.78b --optimizers skewadam --cap-gb "$a100" --steps 22 --batch-size 11 \
  --moe-block-size 1024
phase --preset moe-6.78b --optimizers skewadam --cap-gb "$a100" --steps 22 --batch-size 11 \
  --moe-block-size 0
# Accumulation inside the backward pass in 40 GB: 4 micro-batches of 8, two steps
# (the planner's 16 x 11 is the same program with a longer loop).
phase --preset moe-6.78b --optimizers skewadam --cap-gb "$a100" --steps 2 --batch-size 8 \
  --update-in-backward --accumulate 4 --accumulate-dtype params
# The batch-1 phases of 2026-12-04 again, now with their estimates: moe-6.78b in the
# A100-40GB budget (SkewAdam, then AdamW), with the update inside the backward pass,
# and moe-47b on the whole card.
phase --preset moe-6.78b --optimizers skewadam,adamw --cap-gb "$a100" --steps 5
phase --preset moe-6.78b --optimizers skewadam --cap-gb "$a100" --steps 5 --update-in-backward
phase --preset moe-47b --optimizers skewadam --cap-gb 141 --steps 3 --update-in-backward
# AdamW on the whole card, for its step time.
phase --preset moe-6.78b --optimizers adamw --cap-gb 0 --steps 5

# Each phase beside the planner's report of the same step, where one is committed.
"$py" -m experiments.gpu_check --table "$log" experiments/results/gpu-check/plans/*.json \
  experiments/results/memory/moe-47b-h200-skewadam-orthogonal-update-in-backward.json
