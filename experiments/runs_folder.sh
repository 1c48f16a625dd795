# Sourced by the study scripts (experiments/*.sh): `runs_folder DIR...` makes each
# runs folder with the .gitignore that keeps only what --reuse-runs and
# --runs-table read back (each run's summary.json and metrics.jsonl); LONG_RUN is
# the long comparison's settings that every row of a study trains with
# (experiments/studies/sweeps.py: base_config at 1600 steps), to which a script
# adds its optimizer, rate, seed and warmup.
LONG_RUN=(--preset small --steps 1600 --batch-size 16 --eval-every 100 --eval-batches 16
          --log-every 1 --sample-tokens 0 --ckpt-every 1000000000)
runs_folder() {
  local dir
  for dir in "$@"; do
    mkdir -p "$dir"
    printf '%s\n' "# Only what --reuse-runs reads back: each run's summary and metrics." \
        '*/*' '!*/summary.json' '!*/metrics.jsonl' > "$dir/.gitignore"
  done
}
