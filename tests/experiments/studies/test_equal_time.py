"""Equal wall-clock budgets: the steps each contender gets, its timing, and compare --equal-time."""

import json

import pytest

from experiments import compare
from experiments.studies import comparison
from experiments.studies import equal_time
from experiments.training.config import TrainConfig


def test_each_contender_gets_the_reference_time_over_its_own_step_time():
  steps = equal_time.equal_time_steps({"adamw": 0.2, "slow": 0.5, "fast": 0.1}, 400)
  assert steps == {"adamw": 400, "slow": 160, "fast": 800}
  assert equal_time.equal_time_steps({"adamw": 1.0, "glacial": 1e6}, 10)["glacial"] == 1
  with pytest.raises(ValueError, match="measure 'adamw' too"):
    equal_time.equal_time_steps({"muon": 0.1}, 400)
  with pytest.raises(ValueError, match="step times must be > 0"):
    equal_time.equal_time_steps({"adamw": 0.1, "muon": 0.0}, 400)
  with pytest.raises(ValueError, match="must be >= 1"):
    equal_time.equal_time_steps({"adamw": 0.1}, 0)


def test_a_step_time_is_measured_on_tiny(corpus):
  base = TrainConfig(preset="tiny", batch_size=2, data=corpus, steps=4)
  seconds = equal_time.measure_step_seconds({"skewadam": base}, steps=2, rounds=1)
  assert set(seconds) == {"skewadam"} and 0 < seconds["skewadam"] < 60
  with pytest.raises(ValueError, match="steps and rounds must be >= 1"):
    equal_time.measure_step_seconds({"adamw": base}, steps=0)


def test_compare_equal_time_trains_each_contender_for_adamws_wall_clock(monkeypatch, tmp_path,
                                                                          capsys):
  trained = []

  def fake_run(base, out, cache_dir, *, lr, steps, seed, warmup_steps, optimizer, **overrides):
    del base, cache_dir, overrides
    trained.append((optimizer, out.name, steps, warmup_steps))
    return {"val_ppl": 50.0 + seed, "tokens_per_s": 1.0, "median_step_s": 1.0,
            "opt_state_bytes": 1, "curve": []}

  timed = {}

  def fake_timing(configs, **kwargs):
    timed.update(configs)
    # AdamW 0.1 s a step, Muon 0.125 s: Muon gets 4/5 of AdamW's steps.
    return {key: 0.125 if key[0] == "muon" else 0.1 for key in configs}

  monkeypatch.setattr(comparison, "run_or_reuse", fake_run)
  monkeypatch.setattr(comparison.accounting, "state_bytes", lambda *a, **k: {"total": 1})
  monkeypatch.setattr(equal_time, "measure_step_seconds", fake_timing)
  assert compare.main(["--optimizers", "muon", "--steps", "400", "--seeds", "0,1", "--lr", "0.01",
                       "--equal-time", "--out", str(tmp_path), "--no-progress"]) == 0
  # AdamW is timed for the budget though it is not a contender.
  assert sorted(key[0] for key in timed) == ["adamw", "muon"]
  assert all(c.steps == 400 for c in timed.values())
  assert trained == [("muon", f"muon-steps320-seed{s}", 320, 32) for s in (0, 1)]
  (row,) = json.loads((tmp_path / "compare.json").read_text())
  assert row["steps"] == 320 and row["budget"] == {
      "kind": "equal time", "reference": "adamw", "reference_steps": 400,
      "step_seconds": 0.125, "reference_step_seconds": 0.1}
  assert "| lr | steps | val ppl" in (tmp_path / "compare.md").read_text()
  assert "| 320 | 50.50 ± 0.71 |" in capsys.readouterr().out
  # Without --equal-time every contender trains the steps asked, and the table has no steps.
  trained.clear()
  assert compare.main(["--optimizers", "muon", "--steps", "400", "--seeds", "0", "--lr", "0.01",
                       "--out", str(tmp_path / "steps"), "--no-progress"]) == 0
  assert trained == [("muon", "muon-seed0", 400, 40)]
  assert "| steps |" not in (tmp_path / "steps" / "compare.md").read_text()
