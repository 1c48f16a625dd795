"""The step-time estimate against the GPU steps it was calibrated on (experiments/step_time.py)."""

import gzip

import pytest

from experiments import step_time
from experiments.planning import roofline


@pytest.fixture(scope="module")
def calibration():
  return step_time.calibrate()


def test_the_per_kernel_cost_is_the_one_the_measurements_fit(calibration):
  assert calibration["fitted_kernel_overhead_s"] == pytest.approx(
      roofline.KERNEL_OVERHEAD_S, rel=0.01)


def test_each_measured_step_is_within_5_percent_of_its_estimate(calibration):
  assert len(calibration["steps"]) == 3
  for row in calibration["steps"]:
    assert 0.95 < row["measured_over_estimate"] < 1.05, row
    # The roofline alone is a lower bound on every measured step.
    assert row["roofline_seconds"] < row["measured_seconds"], row


def test_the_committed_calibration_is_the_commands_output(calibration):
  import json
  committed = json.loads((step_time.RESULTS / "step-time" / "calibration.json").read_text())
  assert committed["kernel_overhead_s"] == calibration["kernel_overhead_s"]
  assert committed["fitted_kernel_overhead_s"] == pytest.approx(
      calibration["fitted_kernel_overhead_s"], rel=1e-9)
  for saved, now in zip(committed["steps"], calibration["steps"], strict=True):
    assert saved["program"] == now["program"] and saved["kernels"] == now["kernels"]
    for key in ("measured_seconds", "roofline_seconds", "estimate_seconds"):
      assert saved[key] == pytest.approx(now[key], rel=1e-9)


def test_one_saved_program(tmp_path, capsys):
  text = """ENTRY %main (a: f32[1000000]) -> f32[1000000] {
  %a = f32[1000000]{0} parameter(0)
  ROOT %n = f32[1000000]{0} negate(f32[1000000]{0} %a)
}"""
  path = tmp_path / "step.hlo.gz"
  path.write_bytes(gzip.compress(text.encode()))
  assert step_time.main(["--hlo", str(path), "--target", "a100-40gb"]) == 0
  out = capsys.readouterr().out
  assert '"kernels": 1' in out and '"bytes": 8000000' in out


def test_an_unknown_target_is_refused(capsys):
  assert step_time.main(["--calibrate", "--target", "v100"]) == 2
  assert "--target must be one of a100-40gb, h100-80gb, h200" in capsys.readouterr().err
