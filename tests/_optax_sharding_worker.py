"""optax's own test modules, loaded with SkewAdam substituted for optax's optimizers.

Used by tests/skewadam_jax/test_transform_optax_suite.py, and run by it as a script for optax's
sharding tests, which need 8 devices: the CPU device count is fixed when JAX
starts, so they run in their own process
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``, set here before JAX is
imported). As a script it runs the patched ``ShardingTest`` and prints one JSON
object (test name -> status and message) as its last line. Standalone:

    python tests/_optax_sharding_worker.py

optax's test files are not copied: the installed ones
(``optax/_src/alias_test.py``, ``optax/_src/sharding_test.py``) are read,
parsed with ``ast``, and a few named nodes replaced (the tuple or dict of
optimizers under test, the body of ``_get_opt``) or dropped (tests that do not
apply to SkewAdam), and sharding_test's version guards ``jax.__version__ <
'0.7.2'`` (string comparisons, true for jax 0.10, which would skip every
test) compare release numbers instead; the result is compiled and executed in
a fresh namespace.
Whatever the patch cannot find raises :class:`PatchError` (e.g. after an optax
upgrade), which the test file turns into a failing test.
"""

import os
import sys

if __name__ == "__main__":
  # Before JAX is imported anywhere in this process.
  os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count=8 "
                             f"{os.environ.get('XLA_FLAGS', '')}").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import ast  # noqa: E402
import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402
import unittest  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
# First, ahead of this script's own folder: tests/skewadam_jax/ would shadow the library.
sys.path.insert(0, str(ROOT))

import optax  # noqa: E402

import skewadam_jax  # noqa: E402

OPTAX_SRC = pathlib.Path(optax.__file__).resolve().parent / "_src"
ALIAS_TEST = OPTAX_SRC / "alias_test.py"
SHARDING_TEST = OPTAX_SRC / "sharding_test.py"


# --------------------------------------------------------------------------
# The optimizers under test.
# --------------------------------------------------------------------------

_SKEWADAM_SIGNATURE = inspect.signature(skewadam_jax.skewadam)


def skewadam_all_expert(learning_rate, **kwargs):
  """``skewadam_jax.skewadam`` with every leaf in the expert tier.

  Its signature is ``skewadam``'s without ``param_labels`` (set below), so
  ``optax.inject_hyperparams`` sees the same named hyperparameters with the
  library's defaults. A plain ``(learning_rate, **kw)`` signature would not do:
  ``inject_hyperparams`` binds the signature and applies its defaults, which
  gives ``kw={}``, and then calls the factory with ``kw={}`` as a keyword.
  """
  return skewadam_jax.skewadam(learning_rate, param_labels="expert", **kwargs)


skewadam_all_expert.__signature__ = _SKEWADAM_SIGNATURE.replace(parameters=[
    p for p in _SKEWADAM_SIGNATURE.parameters.values() if p.name != "param_labels"])

# opt_name -> factory; no functools.partial and no callable arguments, so
# optax's inject_hyperparams test can wrap them without static_args.
FACTORIES = {
    "skewadam": skewadam_jax.skewadam,
    "skewadam_all_expert": skewadam_all_expert,
}

# The keyword arguments alias_test's common tests pass, as optax passes
# {'learning_rate': 1e-1} to adam.
ALIAS_OPT_KWARGS = {
    "skewadam": {"learning_rate": 1e-1},
    "skewadam_all_expert": {"learning_rate": 1e-1},
}

# sharding_test builds every optimizer with learning rate 1.0.
SHARDING_LEARNING_RATE = 1.0


def sharding_optimizers():
  return {name: factory(SHARDING_LEARNING_RATE) for name, factory in FACTORIES.items()}


# --------------------------------------------------------------------------
# AST patching.
# --------------------------------------------------------------------------


class PatchError(RuntimeError):
  """optax's test file does not have what the patch replaces."""


def _module_assign(tree, name):
  hits = [node for node in tree.body
          if isinstance(node, (ast.Assign, ast.AnnAssign))
          and any(isinstance(t, ast.Name) and t.id == name
                  for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))]
  if len(hits) != 1:
    raise PatchError(f"expected one module-level assignment to {name!r}, found {len(hits)}")
  return hits[0]


def _named(body, kind, name, where):
  hits = [node for node in body if isinstance(node, kind) and node.name == name]
  if len(hits) != 1:
    raise PatchError(f"expected one {kind.__name__} {name!r} in {where}, found {len(hits)}")
  return hits[0]


def replace_value(tree, name, global_name):
  """``name = <anything>`` at module level becomes ``name = global_name``."""
  node = _module_assign(tree, name)
  node.value = ast.Name(id=global_name, ctx=ast.Load())


def replace_function_body(tree, name, source, params):
  """The body of module-level ``def name`` becomes ``source``; checks its parameters."""
  func = _named(tree.body, ast.FunctionDef, name, "the module")
  got = [a.arg for a in func.args.posonlyargs + func.args.args]
  if got != list(params):
    raise PatchError(f"{name} takes {got}, expected {list(params)}")
  func.body = ast.parse(source).body


def drop_class(tree, name):
  tree.body.remove(_named(tree.body, ast.ClassDef, name, "the module"))


def drop_method(tree, class_name, name):
  cls = _named(tree.body, ast.ClassDef, class_name, "the module")
  cls.body.remove(_named(cls.body, ast.FunctionDef, name, f"class {class_name}"))


def class_methods(tree, class_name):
  cls = _named(tree.body, ast.ClassDef, class_name, "the module")
  return [n.name for n in cls.body if isinstance(n, ast.FunctionDef)]


@contextlib.contextmanager
def stub_modules(names):
  """Empty modules for ``names`` while the first is not installed.

  Only the stubs are removed afterwards: modules imported meanwhile stay.
  """
  added = []
  if importlib.util.find_spec(names[0]) is None:
    for name in names:
      module = types.ModuleType(name)
      module.__doc__ = "Stub (not installed); only tests that are not run use it."
      sys.modules[name] = module
      added.append(name)
      parent, _, child = name.rpartition(".")
      if parent:
        setattr(sys.modules[parent], child, module)
  try:
    yield
  finally:
    for name in added:
      sys.modules.pop(name, None)


def _version_tuple(version):
  return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def version_lt(version, other):
  """``version < other`` by release numbers (``'0.10.2' < '0.7.2'`` is False)."""
  return _version_tuple(version) < _version_tuple(other)


class _FixVersionCompare(ast.NodeTransformer):
  """``jax.__version__ < '0.7.2'`` -> ``__skewadam_version_lt__(jax.__version__, '0.7.2')``.

  optax compares version strings, so with jax 0.10 its sharding tests skip
  themselves as if jax were older than 0.7.2.
  """

  def __init__(self):
    self.count = 0

  def visit_Compare(self, node):  # pylint: disable=invalid-name
    self.generic_visit(node)
    if (len(node.ops) == 1 and isinstance(node.ops[0], ast.Lt)
        and isinstance(node.left, ast.Attribute) and node.left.attr == "__version__"
        and isinstance(node.comparators[0], ast.Constant)
        and isinstance(node.comparators[0].value, str)):
      self.count += 1
      return ast.copy_location(ast.Call(
          func=ast.Name(id="__skewadam_version_lt__", ctx=ast.Load()),
          args=[node.left, node.comparators[0]], keywords=[]), node)
    return node


def exec_patched(tree, path, module_name, namespace):
  ast.fix_missing_locations(tree)
  code = compile(tree, str(path), "exec")
  namespace.setdefault("__name__", module_name)
  namespace.setdefault("__file__", str(path))
  namespace.setdefault("__builtins__", __builtins__)
  exec(code, namespace)  # pylint: disable=exec-used
  return namespace


def load_alias_test(opt_names, module_name):
  """optax's alias_test with ``_OPTIMIZERS_UNDER_TEST`` = ``opt_names``.

  Returns the namespace; its ``AliasTest`` holds the common tests only
  (``LBFGSTest`` and ``test_explicit_dtype``, which builds sgd/adam/adamw
  itself, are dropped).
  """
  tree = ast.parse(ALIAS_TEST.read_text(), str(ALIAS_TEST))
  replace_value(tree, "_OPTIMIZERS_UNDER_TEST", "__skewadam_optimizers_under_test__")
  replace_function_body(tree, "_get_opt", "return __skewadam_factories__[opt_name]",
                        params=("self", "opt_name"))
  drop_class(tree, "LBFGSTest")
  drop_method(tree, "AliasTest", "test_explicit_dtype")
  namespace = {
      "__skewadam_optimizers_under_test__": tuple(
          {"opt_name": n, "opt_kwargs": dict(ALIAS_OPT_KWARGS[n])} for n in opt_names),
      "__skewadam_factories__": dict(FACTORIES),
  }
  # alias_test imports sklearn at the top; only the LBFGS tests use it.
  with stub_modules(("sklearn", "sklearn.datasets", "sklearn.linear_model")):
    return exec_patched(tree, ALIAS_TEST, module_name, namespace)


# sharding_test's test that builds no optimizer.
SHARDING_DROPPED = ("test_microbatch_with_explicit_sharding",)


def load_sharding_test(module_name):
  """optax's sharding_test with ``OPTIMIZERS`` = ours; returns the namespace.

  ``test_microbatch_with_explicit_sharding`` (no optimizer) is dropped, and
  version guards are fixed (:class:`_FixVersionCompare`).

  Importing it sets ``XLA_FLAGS`` in ``os.environ`` (as optax's file does);
  the caller restores it where that matters.
  """
  tree = ast.parse(SHARDING_TEST.read_text(), str(SHARDING_TEST))
  replace_value(tree, "OPTIMIZERS", "__skewadam_optimizers__")
  for name in SHARDING_DROPPED:
    drop_method(tree, "ShardingTest", name)
  fix = _FixVersionCompare()
  tree = fix.visit(tree)
  namespace = {"__skewadam_optimizers__": sharding_optimizers(),
               "__skewadam_version_lt__": version_lt,
               "__skewadam_version_fixes__": fix.count}
  return exec_patched(tree, SHARDING_TEST, module_name, namespace)


def sharding_test_names(test_case_class):
  return sorted(unittest.defaultTestLoader.getTestCaseNames(test_case_class))


# --------------------------------------------------------------------------
# As a script: run ShardingTest on 8 devices.
# --------------------------------------------------------------------------


class _Result(unittest.TestResult):

  def __init__(self):
    super().__init__()
    self.outcomes = {}

  def _set(self, test, status, message=""):
    self.outcomes[test._testMethodName] = {"status": status, "message": message}  # pylint: disable=protected-access

  def addSuccess(self, test):
    super().addSuccess(test)
    self._set(test, "passed")

  def addFailure(self, test, err):
    super().addFailure(test, err)
    self._set(test, "failed", "".join(traceback.format_exception(*err))[-6000:])

  def addError(self, test, err):
    super().addError(test, err)
    self._set(test, "error", "".join(traceback.format_exception(*err))[-6000:])

  def addSkip(self, test, reason):
    super().addSkip(test, reason)
    self._set(test, "skipped", reason)

  def addSubTest(self, test, subtest, err):
    super().addSubTest(test, subtest, err)
    if err is not None:
      status = "failed" if issubclass(err[0], test.failureException) else "error"
      self._set(test, status, f"{subtest}: " + "".join(traceback.format_exception(*err))[-6000:])


def main():
  from absl import flags  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel

  flags.FLAGS.mark_as_parsed()
  out = {"device_count": jax.device_count(), "jax_version": jax.__version__}
  try:
    namespace = load_sharding_test("optax_sharding_test_with_skewadam")
  except Exception:  # pylint: disable=broad-except
    out["load_error"] = traceback.format_exc()[-6000:]
    print(json.dumps(out))
    return
  cls = namespace["ShardingTest"]
  result = _Result()
  unittest.defaultTestLoader.loadTestsFromTestCase(cls).run(result)
  out["tests"] = result.outcomes
  print(json.dumps(out))


if __name__ == "__main__":
  main()
