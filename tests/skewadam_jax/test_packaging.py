"""The library as a package: one version, dependency ranges that CI tests at their lower bound."""

import importlib.metadata
import pathlib
import re
import tomllib

import skewadam_jax

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_one_version_source():
  project = PYPROJECT["project"]
  assert "version" not in project and "version" in project["dynamic"]
  assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {
      "attr": "skewadam_jax.__version__"}
  assert importlib.metadata.version("skewadam-jax") == skewadam_jax.__version__


def _lower_bounds() -> dict[str, str]:
  bounds = {}
  for requirement in PYPROJECT["project"]["dependencies"]:
    name, lower = re.fullmatch(r"([a-z_-]+)>=([0-9.]+),<[0-9.]+", requirement).groups()
    bounds[name] = lower
  return bounds


def test_ci_tests_the_library_on_its_lowest_declared_jax_and_optax():
  bounds = _lower_bounds()
  assert set(bounds) == {"jax", "optax"}  # the library needs nothing else
  ci = (ROOT / ".ci" / "run").read_text()
  lowest = dict(re.findall(r'"([a-z]+)==([0-9.]+)"', ci.split("LOWEST=", 1)[1].splitlines()[0]))
  assert lowest == {"jax": bounds["jax"], "jaxlib": bounds["jax"], "optax": bounds["optax"]}
  # Wide enough for the frameworks users train with: Levanter pins optax<0.2.7,
  # EasyDeL jax~=0.9, MaxText jax>=0.11.1.
  assert bounds["optax"] < "0.2.7" and bounds["jax"] <= "0.9.2"


def test_the_library_tests_listed_for_ci_need_only_jax_and_optax():
  listed = (ROOT / ".ci" / "library-tests").read_text().split()
  for path in listed:
    text = (ROOT / path).read_text()
    assert not re.search(r"^\s*(import|from) (flax|models|orbax|tokenizers)\b", text, re.M), path
    assert not re.search(r"^\s*(import|from) experiments\b", text, re.M), path


def test_the_license_file_is_the_one_pyproject_names():
  assert PYPROJECT["project"]["license"] == {"text": "Apache-2.0"}
  text = (ROOT / "LICENSE").read_text()
  assert "Apache License" in text and "Version 2.0, January 2004" in text
  assert "END OF TERMS AND CONDITIONS" in text


# Modules over the bound that are yet to be split by concern, as transform.py was.
LONG_MODULES = {"layerwise.py"}


def test_no_library_module_outgrows_one_concern():
  """``skewadam_jax/`` is split by concern, as optax's ``_src`` is: no module over 650 lines."""
  lengths = {path.name: len(path.read_text().splitlines())
             for path in (ROOT / "skewadam_jax").glob("*.py")}
  assert "transform.py" in lengths
  long = {name: n for name, n in lengths.items() if n > 650 and name not in LONG_MODULES}
  assert not long, long
