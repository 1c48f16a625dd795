"""Learning-rate schedules against hand-computed values, and their settings' checks."""

import math

import pytest

from experiments.training import optimizers
from experiments.training.config import TrainConfig, with_defaults


def _at(schedule, step):
  return float(schedule(step))


def test_cosine_warms_up_then_decays_to_a_tenth():
  s = optimizers.lr_schedule(2.0, 100, 10)
  assert _at(s, 5) == pytest.approx(1.0)
  assert _at(s, 10) == pytest.approx(2.0)
  mid = 10 + 45
  assert _at(s, mid) == pytest.approx(0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-5)
  assert _at(s, 100) == pytest.approx(0.2)


@pytest.mark.parametrize("kind, shape", [("wsd", lambda f: 1 - math.sqrt(f)),
                                          ("cooldown", lambda f: 1 - f)])
def test_constant_phase_then_the_decay_over_the_last_fraction(kind, shape):
  s = optimizers.lr_schedule(2.0, 100, 10, kind=kind, decay_fraction=0.2)
  assert _at(s, 5) == pytest.approx(1.0)
  for step in (10, 50, 80):  # stable until the decay starts at 100 - 20
    assert _at(s, step) == pytest.approx(2.0)
  for step in (85, 90, 99):
    assert _at(s, step) == pytest.approx(2.0 * shape((step - 80) / 20), rel=1e-5, abs=1e-6)
  assert _at(s, 100) == pytest.approx(0.0, abs=1e-7)


def test_bad_schedules_are_refused_with_the_reason():
  with pytest.raises(ValueError, match="unknown schedule 'linear'"):
    optimizers.lr_schedule(1.0, 100, 10, kind="linear")
  with pytest.raises(ValueError, match="overlap the 10 warmup steps"):
    optimizers.lr_schedule(1.0, 100, 10, kind="wsd", decay_fraction=0.95)
  with pytest.raises(ValueError, match="--schedule must be one of"):
    TrainConfig(schedule="step").validate()
  with pytest.raises(ValueError, match="--decay-fraction must be in"):
    TrainConfig(schedule="wsd", decay_fraction=0.0).validate()
  with pytest.raises(ValueError, match="overlap"):
    TrainConfig(schedule="cooldown", steps=100, warmup_steps=60, decay_fraction=0.5).validate()


def test_saved_configs_take_the_defaults_of_fields_they_predate():
  saved = {"preset": "tiny", "lr": 0.1}
  full = with_defaults(saved)
  assert full["schedule"] == "cosine" and full["decay_fraction"] == 0.2
  assert full["lr"] == 0.1 and full["preset"] == "tiny"
  assert full["sample_tokens"] == 0  # what runs did before the flag, not its default
