"""The study scripts' shared shell pieces (experiments/runs_folder.sh): how a
row names its seed, which runs count as finished, and the per-point seed means."""

import json
import os
import pathlib
import statistics
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "experiments").glob("*.sh"))


def sourced(script: str, runs: pathlib.Path, python: str = sys.executable) -> str:
  """Runs ``script`` in bash after sourcing runs_folder.sh; its standard output."""
  result = subprocess.run(
      ["bash", "-c", f"set -euo pipefail; source experiments/runs_folder.sh; {script}"],
      cwd=ROOT, env={**os.environ, "PYTHON": python, "RUNS": str(runs)},
      capture_output=True, text=True, check=True)
  return result.stdout


def write_run(runs: pathlib.Path, name: str, val_ppl: float, completed: bool = True) -> None:
  (runs / name).mkdir(parents=True)
  (runs / name / "summary.json").write_text(
      json.dumps({"completed": completed, "val_ppl": val_ppl}, indent=2))


@pytest.mark.parametrize("row, seed, point", [
    ("muon-320", "0", "muon-320"),
    ("muon-320-seed2", "2", "muon-320"),
    ("muon-weight-decay-0.05-seed11", "11", "muon-weight-decay-0.05"),
    ("lowrank", "0", "lowrank"),
    ("lowrank-seed1", "1", "lowrank"),
])
def test_a_row_names_its_seed_and_point(tmp_path, row, seed, point):
  assert sourced(f'row_seed {row}; row_point {row}', tmp_path).split() == [seed, point]


def test_only_a_run_that_reached_its_last_step_is_finished(tmp_path):
  write_run(tmp_path, "done", 60.0)
  write_run(tmp_path, "stopped", 70.0, completed=False)
  (tmp_path / "started").mkdir()  # training, no summary yet
  out = sourced('for d in done stopped started absent; do '
                'if finished "$RUNS/$d"; then echo "$d yes"; else echo "$d no"; fi; done', tmp_path)
  assert out.split("\n")[:4] == ["done yes", "stopped no", "started no", "absent no"]


def test_finished_runs_lists_only_finished_runs_comma_separated(tmp_path):
  write_run(tmp_path, "a", 60.0)
  write_run(tmp_path, "b", 61.0)
  write_run(tmp_path, "stopped", 70.0, completed=False)
  (tmp_path / "started").mkdir()
  assert sorted(sourced('finished_runs "$RUNS"/*/', tmp_path).strip().split(",")) == [
      f"{tmp_path}/a/", f"{tmp_path}/b/"]
  # none finished: an empty line, which the scripts test with [ -n ... ]
  assert sourced('finished_runs "$RUNS"/stopped/ "$RUNS"/started/', tmp_path) == "\n"


def test_seed_means_agree_with_statistics_and_skip_unfinished_runs(tmp_path):
  ppl = {"adamw-640": 64.52, "adamw-640-seed1": 64.01, "adamw-640-seed2": 64.05}
  for name, value in ppl.items():
    write_run(tmp_path, name, value)
  write_run(tmp_path, "adamw-640-seed3", 99.0, completed=False)
  # a point with one finished seed has no spread: no line
  write_run(tmp_path, "muon", 58.3)
  write_run(tmp_path, "muon-seed1", 59.0, completed=False)
  # seeds 0 and 2 finished, 1 not: the line names the seeds it averaged
  write_run(tmp_path, "lowrank", 57.9)
  write_run(tmp_path, "lowrank-seed2", 59.1)
  lines = [line for line in sourced('seed_means "$RUNS"', tmp_path).split("\n") if line]
  values = list(ppl.values())
  assert lines == [
      f"`adamw-640` over seeds 0 to 2: {statistics.mean(values):.2f} ± "
      f"{statistics.stdev(values):.2f} (by seed: 64.52, 64.01, 64.05).",
      f"`lowrank` over seeds 0, 2: {statistics.mean([57.9, 59.1]):.2f} ± "
      f"{statistics.stdev([57.9, 59.1]):.2f} (by seed: 57.90, 59.10).",
  ]


def test_contender_tables_pass_only_finished_runs_to_the_table(tmp_path):
  write_run(tmp_path, "muon-60", 59.0)
  write_run(tmp_path, "muon-320", 58.4)
  (tmp_path / "muon-640").mkdir()  # still training
  write_run(tmp_path, "adamw-60", 66.0, completed=False)
  stub = tmp_path / "python"  # prints the command the table would run
  stub.write_text('#!/usr/bin/env bash\necho "$@"\n')
  stub.chmod(0o755)
  out = sourced('declare -A BASELINE=([muon]=/base/muon [adamw]=/base/adamw); '
                'contender_tables "$RUNS" muon adamw', tmp_path, python=str(stub))
  assert out.split("\n")[0] == "### muon"
  command = out.split("\n")[2].split()
  assert command[:3] == ["-m", "experiments.compare", "--runs-table"]
  assert sorted(command[3].split(",")) == [f"{tmp_path}/muon-320/", f"{tmp_path}/muon-60/"]
  assert command[4:] == ["--baseline", "/base/muon"]
  assert "### adamw" not in out  # no finished row: no table


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_study_scripts_parse(script):
  subprocess.run(["bash", "-n", str(script)], check=True)
