# Sourced by the study scripts (experiments/*.sh): `runs_folder DIR...` makes each
# runs folder with the .gitignore that keeps only what --reuse-runs and
# --runs-table read back (each run's summary.json and metrics.jsonl); LONG_RUN is
# the long comparison's settings that every row of a study trains with
# (experiments/studies/sweeps.py: base_config at 1600 steps), to which a script
# adds its optimizer, rate, seed and warmup. The rest reads a study's rows, one
# run folder each, named POINT (seed 0) or POINT-seedN (the same point at seed N).
LONG_RUN=(--preset small --steps 1600 --batch-size 16 --eval-every 100 --eval-batches 16
          --log-every 1 --sample-tokens 0 --ckpt-every 1000000000)
# The orthogonal tiers' settings of the training command's default before the tuning
# against Muon moved it
# to rank-42 bfloat16 expert factors, Muon's width scaling and weight decay 0.2
# (skewadam_jax.ORTHOGONAL_TIER_SETTINGS): float32 factors (rank 16 unless a row names
# one), Adam's update RMS, weight decay 0.1. A row measured with them spells them, so
# that it names the runs it ran; a flag after it (a row's own) wins.
RANK16_DEFAULT="--expert-lowrank-rank 16 --expert-lowrank-dtype float32 --backbone-orthogonal-scale adam_rms --expert-orthogonal-scale adam_rms --weight-decay 0.1"
# The same as a comparison row's keys (experiments.compare --skewadam-configs).
RANK16_DEFAULT_KEYS="expert_rank=16,expert_dtype=float32,backbone_scale=adam_rms,expert_scale=adam_rms,wd=0.1"
runs_folder() {
  local dir
  for dir in "$@"; do
    mkdir -p "$dir"
    printf '%s\n' "# Only what --reuse-runs reads back: each run's summary and metrics." \
        '*/*' '!*/summary.json' '!*/metrics.jsonl' > "$dir/.gitignore"
  done
}
# finished DIR: whether the run in DIR trained to its last step.
finished() {
  [ -f "$1/summary.json" ] && grep -q '"completed": true' "$1/summary.json"
}
# finished_runs DIR...: the finished runs among DIRs, comma-separated, as
# experiments.compare --runs-table reads them; empty when none is.
finished_runs() {
  local dir list=
  for dir in "$@"; do
    if finished "$dir"; then list+=${list:+,}$dir; fi
  done
  echo "$list"
}
# row_seed ROW: the seed a row names ("muon-320-seed2": 2; no "-seedN": 0).
row_seed() {
  if [[ $1 == *-seed* ]]; then echo "${1##*-seed}"; else echo 0; fi
}
# row_point ROW: the row without its "-seedN" ("muon-320-seed2": "muon-320").
row_point() {
  echo "${1%-seed*}"
}
# contender_tables RUNS CONTENDER...: each contender's finished rows (RUNS/CONTENDER-*;
# one still training is left out)
# against its run ${BASELINE[CONTENDER]}, a table each (experiments.compare --runs-table).
contender_tables() {
  local runs=$1 contender finished
  for contender in "${@:2}"; do
    finished=$(finished_runs "$runs/$contender"-*/)
    [ -n "$finished" ] || continue
    echo "### $contender"
    echo
    "$PYTHON" -m experiments.compare --runs-table "$finished" --baseline "${BASELINE[$contender]}"
    echo
  done
}
# seed_means RUNS: each point in RUNS that has finished runs at other seeds
# (POINT-seedN beside POINT): its mean and spread over them, a line each.
seed_means() {
  "$PYTHON" - "$1" <<'PY'
import json, pathlib, statistics, sys
runs = pathlib.Path(sys.argv[1])
done = lambda d: (d / "summary.json").exists() and json.loads(  # noqa: E731
    (d / "summary.json").read_text()).get("completed")
for point in sorted({d.name.rsplit("-seed", 1)[0] for d in runs.glob("*-seed*") if done(d)}):
  seeds = {0: runs / point} | {int(d.name.rsplit("-seed", 1)[1]): d
                               for d in runs.glob(f"{point}-seed*")}
  ppl = {s: json.loads((d / "summary.json").read_text())["val_ppl"]
         for s, d in sorted(seeds.items()) if done(d)}
  if len(ppl) < 2:
    continue
  named = (f"0 to {len(ppl) - 1}" if list(ppl) == list(range(len(ppl)))
           else ", ".join(map(str, ppl)))
  print(f"`{point}` over seeds {named}: {statistics.mean(ppl.values()):.2f} ± "
        f"{statistics.stdev(ppl.values()):.2f} (by seed: "
        f"{', '.join(f'{p:.2f}' for p in ppl.values())}).")
  print()
PY
}
