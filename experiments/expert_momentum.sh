#!/usr/bin/env bash
# The tuning against Muon's attribution rows for the expert bank's momentum, on the
# library's 0.3.0
# defaults: the orthogonal tiers' row with packed-sign expert momentum (rate 1.35e-2,
# `small`, 1600 steps, seed 0) with only the expert momentum changed, against that
# row's seed-0 run on the same defaults (experiments/safe_defaults.sh). Rank 16 is
# the row the comparison's rule chose: the training command's default since. Rows:
#   lowrank-2   rank-2 factors: at `small`'s 128 x 256 experts, the bytes a
#               parameter that rank 16 costs at moe-6.78b's 1024 x 1400
#   lowrank-16  the library's default rank (1.064 GB of state at moe-6.78b)
#   none        no expert momentum (the attribution's 59.39 row, re-run here)
#   lowrank-16-seed1, lowrank-16-seed2   the best row's seeds 1 and 2
#   lowrank-16-lr0.00675, lowrank-16-lr0.027   its rate at half and twice 1.35e-2 (seed 0)
#   lowrank-20, lowrank-20-seed1, lowrank-20-seed2   the largest rank within the 1.29 GB
#               budget (1.242 GB at moe-6.78b; rank 21: 1.287 GB), at rank 16's swept rate
#   fp32        full-precision expert momentum (26.8 GB at moe-6.78b, far outside the
#               budget): not a candidate but a measure of what the compression costs on
#               today's defaults, beside Muon's fp32 momentum (the attribution's 57.35 row
#               was on the defaults before 0.3.0)
# ROWS picks some ("lowrank-2 none"; empty: none, only the table); each is about 45 min on 2 CPU cores beside
# another. A finished row is not trained again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
RUNS=experiments/results/expert-momentum-runs
source experiments/runs_folder.sh
runs_folder "$RUNS"
# The comparison's base configuration (experiments/studies/sweeps.py: base_config,
# and its 10 % warmup), so that only the expert momentum differs from the baseline.
# The default's settings as these rows ran (RANK16_DEFAULT), which each row's flags amend.
# shellcheck disable=SC2206
BASE=("${LONG_RUN[@]}" --optimizer skewadam --lr 0.0135 --seed 0 --warmup-steps 160
      $RANK16_DEFAULT)
declare -A FLAGS=(
  [lowrank-2]="--expert-momentum lowrank --expert-lowrank-rank 2"
  [lowrank-16]="--expert-momentum lowrank --expert-lowrank-rank 16"
  [none]="--expert-momentum none"
  # the best row's other seeds (its seed 0 is lowrank-16)
  [lowrank-16-seed1]="--expert-momentum lowrank --expert-lowrank-rank 16 --seed 1"
  [lowrank-16-seed2]="--expert-momentum lowrank --expert-lowrank-rank 16 --seed 2"
  # its rate coordinate at seed 0: half and twice the default row's 1.35e-2
  [lowrank-16-lr0.00675]="--expert-momentum lowrank --expert-lowrank-rank 16 --lr 0.00675"
  [lowrank-16-lr0.027]="--expert-momentum lowrank --expert-lowrank-rank 16 --lr 0.027"
  [lowrank-20]="--expert-momentum lowrank --expert-lowrank-rank 20"
  [lowrank-20-seed1]="--expert-momentum lowrank --expert-lowrank-rank 20 --seed 1"
  [lowrank-20-seed2]="--expert-momentum lowrank --expert-lowrank-rank 20 --seed 2"
  [fp32]="--expert-momentum fp32"
)
for row in ${ROWS-lowrank-2 lowrank-16 none}; do
  finished "$RUNS/$row" && continue
  # shellcheck disable=SC2086
  "$PYTHON" -m experiments.train "${BASE[@]}" ${FLAGS[$row]} --out "$RUNS/$row"
done
# rewrites the committed experiments/results/expert-momentum.md
"$PYTHON" -m experiments.compare --runs-table "$(ls -d $RUNS/*/ | paste -sd, -)" \
    --baseline experiments/results/safe-defaults-1600-runs/skewadam-bf16-factored-sign-exact-orthogonal-orthogonal-stochastic-auto-on-seed0 \
    > experiments/results/expert-momentum.md
# Each rank's row over its seeds, beside Muon's and the sign row's of the long comparison;
# rewrites the committed experiments/results/expert-momentum.json (those rows as numbers).
"$PYTHON" - >> experiments/results/expert-momentum.md <<'PY'
import json, pathlib, statistics
from experiments.studies import comparison, sweeps
runs = pathlib.Path("experiments/results/expert-momentum-runs")
summary = []
rows = {r["optimizer"] if r["config"] == "default" else r["config"].get("backbone_dir", "adam"): r
        for r in json.loads(pathlib.Path("experiments/results/compare-long.json").read_text())}
for rank in (16, 20):
  name = f"lowrank-{rank}"
  ppl = [json.loads((runs / d / "summary.json").read_text())["val_ppl"]
         for d in (name, f"{name}-seed1", f"{name}-seed2") if (runs / d / "summary.json").exists()]
  if not ppl:
    continue
  if len(ppl) == 1:
    print(f"\n`{name}` at seed 0 only: {ppl[0]:.2f}.")
  else:
    print(f"\n`{name}` over seeds 0 to {len(ppl) - 1}: {statistics.mean(ppl):.2f} ± "
          f"{statistics.stdev(ppl):.2f} (by seed: {', '.join(f'{p:.2f}' for p in ppl)}).")
  # A comparison row (experiments.compare's form), so the rule can weigh it.
  row = {"name": name, "optimizer": "skewadam", "lr": 0.0135, "seeds": list(range(len(ppl))),
         "config": sweeps.resolve_entry("skewadam", {
             "expert_m": "lowrank", "expert_rank": rank, "expert_dtype": "float32",
             "backbone_scale": "adam_rms", "expert_scale": "adam_rms", "wd": 0.1}),
         "val_ppl": ppl, "val_ppl_mean": statistics.mean(ppl),
         "val_ppl_std": statistics.stdev(ppl) if len(ppl) > 1 else 0.0}
  row["opt_state_bytes_6p78b"] = comparison.state_bytes_6p78b("skewadam", comparison.row_tiers(row))
  summary.append(row)
print(f"\nIn `compare-long.json`, Muon {rows['muon']['val_ppl_mean']:.2f} ± "
      f"{rows['muon']['val_ppl_std']:.2f}, the orthogonal tiers with packed-sign expert momentum "
      f"(the default before rank 16, before 0.3.0's safe defaults) "
      f"{rows['orthogonal']['val_ppl_mean']:.2f} ± {rows['orthogonal']['val_ppl_std']:.2f}.")
pathlib.Path("experiments/results/expert-momentum.json").write_text(
    json.dumps(summary, indent=1) + "\n")
PY
