"""The one step builder (experiments/training/steps.py): the planner compiles the step ``train`` runs.

For each setting that changes the step, the training command's compiled step
(``training.Run``, as ``experiments.train`` builds it) and the memory
planner's (``planner.compile_step`` of the same configuration) must be the
same program: the same optimised-HLO fingerprint. On a mesh: the 8-device
worker (tests/_parallel_worker.py, checked in tests/experiments/test_parallel.py).
"""

import jax
import pytest

from experiments.training import config as config_lib
from experiments.planning import planner
from experiments.training import steps
from experiments.training import run as training

BATCH, SEQ = 2, 16


@pytest.mark.parametrize("flags", [
    {},
    {"update_in_backward": True},
    {"skip_nonfinite": 2},
    {"stochastic_rounding": True, "param_dtype": "bfloat16"},
    {"accumulate": 2},
], ids=["defaults", "update-in-backward", "skip-nonfinite", "stochastic-rounding", "accumulate"])
def test_the_planner_compiles_the_step_the_training_command_runs(flags, corpus, cache_dir):
  config = config_lib.TrainConfig(preset="tiny", batch_size=BATCH, seq_len=SEQ, data=corpus,
                                  sample_tokens=0, **flags)
  run = training.Run(config, cache_dir=cache_dir)
  params, state = run.init_state()
  inputs, targets = run.batch_at(0)
  key = {"key": jax.random.fold_in(run.rounding_key, 0)} if config.stochastic_rounding else {}
  trained = run.train_step.lower(params, state, inputs, targets, **key).compile()
  planned = planner.compile_step(config, batch=BATCH, seq=SEQ, target="cpu")
  assert planned["fingerprint"] == planner.step_fingerprint(trained)
  assert planned["xla"]["temp"] == trained.memory_analysis().temp_size_in_bytes


def test_the_planners_flags_give_the_training_commands_configuration():
  config = planner.train_config("tiny", "skewadam", skewadam_tiers={"expert": {"momentum": "int8"}},
                                update_in_backward=True, clip_mode="stale", param_dtype="float32")
  # A report's tiers are the library's arguments: a direction they leave out is Adam's.
  assert config == config_lib.TrainConfig(preset="tiny", expert_momentum="int8",
                                          backbone_direction="adam", expert_direction="adam",
                                          update_in_backward=True, clip_mode="stale",
                                          param_dtype="float32")
  with pytest.raises(ValueError, match="tier setting expert.moment has no training flag"):
    planner.train_config("tiny", "skewadam", skewadam_tiers={"expert": {"moment": "int8"}})


def test_build_step_gives_the_layerwise_engine_only_with_the_flag():
  config = config_lib.TrainConfig(preset="tiny")
  step, params, state = steps.abstract_step(config)
  assert step.layerwise is None and type(state).__name__ != "LayerwiseState"
  step, _, state = steps.abstract_step(config_lib.TrainConfig(preset="tiny",
                                                              update_in_backward=True))
  assert step.layerwise is not None and type(state).__name__ == "LayerwiseState"
  one_layer = step.layerwise.per_layer_params(params)
  assert one_layer["layers"]["moe"]["experts"]["w_up"].shape == (
      params["layers"]["moe"]["experts"]["w_up"].shape[1:])

