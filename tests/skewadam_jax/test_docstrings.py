"""Every runnable example in the library's docstrings runs and prints what it says; no case passes empty."""

import doctest
import importlib
import pkgutil
import warnings

import pytest

import skewadam_jax

# The library's public modules; each must carry at least one example.
MODULES = sorted(m.name for m in pkgutil.iter_modules(skewadam_jax.__path__, "skewadam_jax.")
                 if not m.name.rsplit(".", 1)[1].startswith("_"))
def _run_examples(name: str) -> doctest.TestResults:
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)   # label warnings on toy trees
    return doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
  result = _run_examples(name)
  assert result.attempted > 0, f"{name} has no example"
  assert result.failed == 0


def test_every_public_name_is_documented():
  for name in skewadam_jax.__all__:
    obj = getattr(skewadam_jax, name)
    if callable(obj) and not isinstance(obj, (str, tuple, dict)):
      assert (obj.__doc__ or "").strip(), name
