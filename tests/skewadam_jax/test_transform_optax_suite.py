"""optax's own common optimizer tests, run on SkewAdam.

The installed optax's test files are loaded, not copied
(tests/_optax_sharding_worker.py patches them with ``ast``), with SkewAdam
substituted for optax's optimizers:

* ``skewadam``: ``skewadam_jax.skewadam`` with its defaults (default tiers);
* ``skewadam_all_expert``: the same with every leaf in the expert tier
  (``param_labels="expert"``).

``optax/_src/alias_test.py``: the common tests of ``AliasTest`` (optimization
of the parabola and Rosenbrock targets in float32 and complex64, extra
arguments, ``inject_hyperparams``, dtype preservation, state shape/dtype
stability, ``MultiSteps``), exposed below as one unittest class per optimizer,
``OptaxAliasTest_<opt_name>``, with ``opt_kwargs={'learning_rate': 1e-1}`` as
optax's adam. Not run: ``LBFGSTest`` (LBFGS's own tests) and
``AliasTest.test_explicit_dtype`` (builds sgd/adam/adamw itself).

``optax/_src/sharding_test.py``: ``ShardingTest`` on 8 simulated CPU devices,
in a subprocess (the device count is fixed when JAX starts, and conftest.py
has started it), one pytest test per optax test, ``test_optax_sharding[<name>_<opt_name>]``.
Not run: ``test_microbatch_with_explicit_sharding`` (builds no optimizer).
optax guards these tests with ``jax.__version__ < '0.7.2'``, a string
comparison that is true for jax 0.10 and would skip them all; the patch
compares release numbers instead.

If the patch cannot find what it replaces (e.g. after an optax upgrade), the
``*_suite_loads`` tests fail.
"""

import ast
import json
import os
import re
import subprocess
import sys
import traceback

import pytest

from tests import _optax_sharding_worker as suite
from tests import _subprocess

# optax's tests name no experts or router, so the default labeller warns, as
# it should, that it put every leaf in the backbone tier.
pytestmark = pytest.mark.filterwarnings(
    "ignore:SkewAdam's default labeller found no expert:UserWarning")

# --------------------------------------------------------------------------
# alias_test.AliasTest, one class per optimizer.
# --------------------------------------------------------------------------


def _value_slug(value):
  """``<function _setup_rosenbrock>`` -> ``setup_rosenbrock``, ``<class 'jax.numpy.complex64'>``
  -> ``complex64``, ``'bfloat16'`` -> ``bfloat16``."""
  value = re.sub(r" at 0x[0-9a-fA-F]+", "", value)
  words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*", value)
  return words[-1].strip("_") if words else ""


def _params_suffix(params_repr):
  """The non-optimizer parameters of an absl ``product`` test, as a name suffix."""
  parts = []
  for key, value in re.findall(r"(\w+)=(<[^>]*>|\{[^}]*\}|'[^']*'|[^,)]*)", params_repr):
    if key in ("opt_name", "opt_kwargs"):
      continue
    parts.append(_value_slug(value))
  return "_".join(p for p in parts if p)


def _rename_parameterized(cls):
  """``test_optimization3`` -> ``test_optimization_setup_rosenbrock_complex64``.

  absl names ``product`` tests by index; the parameters are in
  ``_test_params_reprs``. Names that would collide keep absl's.
  """
  reprs = cls._test_params_reprs  # pylint: disable=protected-access
  for name, params_repr in list(reprs.items()):
    func = cls.__dict__.get(name)
    if func is None or not params_repr:
      continue
    suffix = _params_suffix(params_repr)
    new = f"{func.__name__}_{suffix}" if suffix else func.__name__
    if new == name or new in cls.__dict__ or not new.isidentifier():
      continue
    setattr(cls, new, func)
    delattr(cls, name)
    reprs[new] = reprs.pop(name)


def _load_alias_classes():
  classes, namespaces = {}, {}
  for opt_name in suite.FACTORIES:
    namespace = suite.load_alias_test((opt_name,), f"optax_alias_test_with_{opt_name}")
    cls = namespace["AliasTest"]
    _rename_parameterized(cls)
    cls.__name__ = cls.__qualname__ = f"OptaxAliasTest_{opt_name}"
    classes[cls.__name__] = cls
    namespaces[opt_name] = namespace
  return classes, namespaces


try:
  _ALIAS_CLASSES, _ALIAS_NAMESPACES = _load_alias_classes()
  _ALIAS_ERROR = None
except Exception:  # pylint: disable=broad-except
  _ALIAS_CLASSES, _ALIAS_NAMESPACES = {}, {}
  _ALIAS_ERROR = traceback.format_exc()

# pytest collects unittest classes from the module namespace.
globals().update(_ALIAS_CLASSES)

# AliasTest's tests that are not run (not common tests).
ALIAS_DROPPED = ("test_explicit_dtype",)


def test_optax_alias_suite_loads():
  """The patch found its targets, substituted our optimizers, and kept every common test."""
  assert _ALIAS_ERROR is None, _ALIAS_ERROR
  tree = ast.parse(suite.ALIAS_TEST.read_text())
  common = [m for m in suite.class_methods(tree, "AliasTest")
            if m.startswith("test") and m not in ALIAS_DROPPED]
  assert common, "optax's AliasTest has no tests"
  for opt_name, factory in suite.FACTORIES.items():
    namespace = _ALIAS_NAMESPACES[opt_name]
    assert namespace["_OPTIMIZERS_UNDER_TEST"] == (
        {"opt_name": opt_name, "opt_kwargs": suite.ALIAS_OPT_KWARGS[opt_name]},)
    assert namespace["_get_opt"](None, opt_name) is factory
    assert "LBFGSTest" not in namespace
    cls = _ALIAS_CLASSES[f"OptaxAliasTest_{opt_name}"]
    names = [n for n in dir(cls) if n.startswith("test")]
    for method in common:
      assert any(n == method or n.startswith(method + "_") or re.fullmatch(method + r"\d+", n)
                 for n in names), f"{cls.__name__} lacks optax's {method}"
    assert not any(n.startswith(ALIAS_DROPPED) for n in names)


# --------------------------------------------------------------------------
# sharding_test.ShardingTest, on 8 devices in a subprocess.
# --------------------------------------------------------------------------


def _sharding_names():
  # Loading optax's file sets XLA_FLAGS; this process's JAX has started
  # already, but the subprocesses of other tests inherit the environment.
  saved = os.environ.get("XLA_FLAGS")
  try:
    namespace = suite.load_sharding_test("optax_sharding_test_with_skewadam_names")
    return suite.sharding_test_names(namespace["ShardingTest"]), None
  except Exception:  # pylint: disable=broad-except
    return [], traceback.format_exc()
  finally:
    if saved is None:
      os.environ.pop("XLA_FLAGS", None)
    else:
      os.environ["XLA_FLAGS"] = saved


SHARDING_NAMES, _SHARDING_ERROR = _sharding_names()


def test_optax_sharding_suite_loads():
  assert _SHARDING_ERROR is None, _SHARDING_ERROR
  assert SHARDING_NAMES, "no sharding tests"
  for name in SHARDING_NAMES:
    assert name.endswith(tuple("_" + n for n in suite.FACTORIES)), name
  for opt_name in suite.FACTORIES:
    assert any(n.endswith("_" + opt_name) for n in SHARDING_NAMES), opt_name


@pytest.fixture(scope="module")
def sharding_results():
  proc = subprocess.run([sys.executable, suite.__file__], env=_subprocess.environment(devices=8), capture_output=True,
                        text=True, timeout=300, check=False, cwd=str(suite.ROOT))
  assert proc.returncode == 0, proc.stderr[-4000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert "load_error" not in out, out["load_error"]
  assert out["device_count"] == 8, out
  assert sorted(out["tests"]) == SHARDING_NAMES, (sorted(out["tests"]), SHARDING_NAMES)
  return out["tests"]


@pytest.mark.parametrize("name", SHARDING_NAMES)
def test_optax_sharding(sharding_results, name):
  outcome = sharding_results[name]
  if outcome["status"] == "skipped":
    pytest.skip(outcome["message"])
  assert outcome["status"] == "passed", f"{outcome['status']}:\n{outcome['message']}"
