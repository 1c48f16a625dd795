"""Loads the scripts in examples/ as modules (the folder is not a package)."""

import importlib.util
import pathlib

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def load(name: str):
  """``examples/NAME.py`` as a module, without running its ``main``."""
  spec = importlib.util.spec_from_file_location(f"examples.{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module
