"""Every runnable example in the models' and experiments' docstrings runs; no case passes empty."""

import pytest

from tests.skewadam_jax.test_docstrings import _run_examples

# The models' and experiments' modules that carry examples (the others document
# commands and training loops, whose tests run them end to end).
WITH_EXAMPLES = ["models.axes", "models.layerwise", "experiments.training.config",
                 "experiments.training.distributed", "experiments.training.mesh",
                 "experiments.training.metrics_log", "experiments.training.monitoring",
                 "experiments.training.optimizers", "experiments.training.sampling",
                 "experiments.planning.hlo", "experiments.planning.planner",
                 "experiments.studies.comparison", "experiments.studies.schedule_study",
                 "experiments.startup"]


@pytest.mark.parametrize("name", WITH_EXAMPLES)
def test_model_and_experiment_library_examples(name):
  result = _run_examples(name)
  assert result.attempted > 0, f"{name} has no example"
  assert result.failed == 0
