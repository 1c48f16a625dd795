"""Every runnable example in the library's docstrings runs and prints what it says."""

import doctest
import importlib
import pkgutil
import warnings

import pytest

import skewadam_jax

MODULES = sorted(m.name for m in pkgutil.iter_modules(skewadam_jax.__path__, "skewadam_jax."))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  module = importlib.import_module(name)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)   # label warnings on toy trees
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
  assert result.failed == 0


def test_every_public_name_is_documented():
  for name in skewadam_jax.__all__:
    obj = getattr(skewadam_jax, name)
    if callable(obj) and not isinstance(obj, (str, tuple, dict)):
      assert (obj.__doc__ or "").strip(), name


@pytest.mark.parametrize("name", ["models.axes", "experiments.metrics_log",
                                  "experiments.distributed", "experiments.optimizers",
                                  "models.layerwise", "experiments.config", "experiments.monitoring",
                                  "experiments.sampling", "experiments.hlo",
                                  "experiments.planner", "experiments.schedules"])
def test_model_and_experiment_library_examples(name):
  pytest.importorskip("flax")  # absent where the library is tested alone (.ci/run)
  result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
  assert result.failed == 0
