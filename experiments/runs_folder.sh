# Sourced by the study scripts (experiments/*.sh): `runs_folder DIR...` makes each
# runs folder with the .gitignore that keeps only what --reuse-runs and
# --runs-table read back (each run's summary.json and metrics.jsonl).
runs_folder() {
  local dir
  for dir in "$@"; do
    mkdir -p "$dir"
    printf '%s\n' "# Only what --reuse-runs reads back: each run's summary and metrics." \
        '*/*' '!*/summary.json' '!*/metrics.jsonl' > "$dir/.gitignore"
  done
}
