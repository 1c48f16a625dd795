"""The schedule study's protocol (grid, extra seeds at the best rate, divergence, spikes) with
stand-in runs, and divergence kept as a result by the shared run helper."""

import json
import math

import pytest

from experiments.studies import schedule_study
from experiments.studies import sweeps
from experiments.training.config import TrainConfig


def test_loss_spikes_counts_jumps_over_the_running_median():
  flat = [3.0] * 25
  assert schedule_study.loss_spikes(flat) == 0
  assert schedule_study.loss_spikes(flat + [3.2]) == 0          # within 10 %
  assert schedule_study.loss_spikes(flat + [3.4, 3.5, 3.0]) == 1  # one spike over two steps
  assert schedule_study.loss_spikes(flat + [3.4, 3.0, 3.4]) == 2
  assert schedule_study.loss_spikes(flat + [math.nan]) == 1
  assert schedule_study.loss_spikes([9.0] * 5) == 0              # shorter than the window


def test_grid_extra_seeds_at_the_best_rate_and_divergence(monkeypatch, tmp_path):
  calls = []

  def fake_run(base, out, cache_dir, *, reuse, allow_divergence, optimizer, lr, steps, seed,
               warmup_steps, schedule, **overrides):
    assert allow_divergence and warmup_steps == steps // 10
    calls.append((optimizer, schedule, round(lr, 6), seed))
    diverged = lr > 0.02
    ppl = math.inf if diverged else 100 * (1 + abs(math.log(lr / 0.01))) + seed
    losses = [(t, 3.0) for t in range(30)] + [(30, 4.0)]
    return {"val_ppl": ppl, "diverged": diverged, "losses": losses, "curve": []}
  monkeypatch.setattr(schedule_study, "run_or_reuse", fake_run)
  tuned = [{"optimizer": "adamw", "config": "default", "lr": 0.01}]
  rows = schedule_study.sweep_schedules(
      [("adamw", None)], base=TrainConfig(), out_dir=tmp_path, tuned=tuned,
      schedules=["cosine", "wsd"], steps=50, seeds=[0, 1, 2], lr_factors=[0.5, 1, 4],
      log=lambda m: None)
  # The grid at seed 0, then seeds 1 and 2 at the best rate, per schedule.
  assert calls[:5] == [("adamw", "cosine", 0.005, 0), ("adamw", "cosine", 0.01, 0),
                       ("adamw", "cosine", 0.04, 0), ("adamw", "cosine", 0.01, 1),
                       ("adamw", "cosine", 0.01, 2)]
  assert len(calls) == 10
  best = next(r for r in rows if r["schedule"] == "wsd" and r["lr_factor"] == 1)
  assert best["seeds"] == [0, 1, 2] and best["val_ppl_mean"] == pytest.approx(101.0)
  assert best["val_ppl_std"] == pytest.approx(1.0) and best["loss_spikes"] == [1, 1, 1]
  high = next(r for r in rows if r["schedule"] == "wsd" and r["lr_factor"] == 4)
  assert high["diverged"] == 1 and high["val_ppl_mean"] is None
  assert high["val_ppl_by_seed"] == [None]
  json.dumps(rows, allow_nan=False)  # strict JSON: no Infinity
  table = schedule_study.summary_table(rows)
  assert "| adamw | wsd | 1.00e-02 | 101.00 ± 1.00 (3) |" in table
  assert "div" in table
  paths = schedule_study.plot(rows, tmp_path)
  assert [p.name for p in paths] == ["schedule_cosine.png", "schedule_wsd.png"]
  with pytest.raises(ValueError, match="no tuned learning rate for muon"):
    schedule_study.sweep_schedules([("muon", None)], base=TrainConfig(), out_dir=tmp_path,
                              tuned=tuned, schedules=["cosine"], steps=50, seeds=[0])
  with pytest.raises(ValueError, match="unknown schedule 'step'"):
    schedule_study.sweep_schedules([("adamw", None)], base=TrainConfig(), out_dir=tmp_path,
                              tuned=tuned, schedules=["step"], steps=50, seeds=[0])


def test_a_diverged_run_is_a_result_and_is_remembered(monkeypatch, tmp_path):
  def diverging(config, out_dir, **kwargs):
    out_dir.mkdir(parents=True)
    (out_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.0}) + "\n")
    raise sweeps.training.TrainingError("step 2: the loss is nan")
  monkeypatch.setattr(sweeps.training, "train", diverging)
  base = TrainConfig(preset="tiny")
  with pytest.raises(sweeps.training.TrainingError):
    sweeps.run_or_reuse(base, tmp_path / "a", None, lr=1.0)
  result = sweeps.run_or_reuse(base, tmp_path / "b", None, lr=1.0, allow_divergence=True)
  assert result["diverged"] and result["val_ppl"] == math.inf
  assert result["losses"] == [(1, 9.0)]

  def no_training(*args, **kwargs):
    raise AssertionError("a diverged run was trained again")
  monkeypatch.setattr(sweeps.training, "train", no_training)
  again = sweeps.run_or_reuse(base, tmp_path / "b", None, lr=1.0, allow_divergence=True,
                              reuse=True)
  assert again["diverged"]
  with pytest.raises(AssertionError, match="trained again"):  # another configuration
    sweeps.run_or_reuse(base, tmp_path / "b", None, lr=2.0, allow_divergence=True, reuse=True)
