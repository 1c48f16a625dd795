"""The experiments package: a library plus thin commands, no import cycles, no
environment changes on import."""

import ast
import json
import os
import pathlib

import pytest

from tests import _subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "experiments"


def module_name(path: pathlib.Path) -> str:
  """``experiments/training/run.py`` -> ``training.run``; a package's ``__init__`` is the package."""
  parts = path.relative_to(PACKAGE).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


MODULES = {module_name(p) for p in PACKAGE.rglob("*.py") if "results" not in p.parts}


def _target(module: str, name: str | None = None) -> str:
  """The experiments module an import names (``from experiments.training import run``)."""
  inner = module.split(".", 1)[1] if "." in module else ""
  if name is not None and (f"{inner}.{name}" if inner else name) in MODULES:
    return f"{inner}.{name}" if inner else name
  return inner


def import_graph() -> dict[str, set[str]]:
  """Module -> the experiments modules it imports (anywhere in the file)."""
  graph = {}
  for path in PACKAGE.rglob("*.py"):
    if "results" in path.parts:
      continue
    deps = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("experiments"):
        deps |= {_target(node.module, alias.name) for alias in node.names}
      elif isinstance(node, ast.Import):
        deps |= {_target(a.name) for a in node.names if a.name.startswith("experiments.")}
    graph[module_name(path)] = deps - {""}
  return graph


COMMANDS = {"train", "compare", "memory", "bench", "parallel", "state_bytes", "gpu_check",
            "step_time",
            "sample", "schedules", "data.__main__"}


def test_the_top_level_holds_the_commands_and_the_packages_the_library():
  top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__", "startup"}
  assert top == COMMANDS - {"data.__main__"}
  assert {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} == {
      "training", "data", "planning", "studies"}


def private_uses() -> list[str]:
  """``module._name`` uses of another experiments module's private names."""
  found = []
  for path in PACKAGE.rglob("*.py"):
    tree = ast.parse(path.read_text())
    aliases = set()
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("experiments"):
        aliases |= {a.asname or a.name for a in node.names}
    for node in ast.walk(tree):
      if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
          and node.value.id in aliases and node.attr.startswith("_")
          and not node.attr.startswith("__")):
        found.append(f"{module_name(path)}: {node.value.id}.{node.attr}")
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("experiments"):
        found += [f"{module_name(path)}: from {node.module} import {a.name}"
                  for a in node.names if a.name.startswith("_")]
  return found


def test_library_modules_import_no_command():
  graph = import_graph()
  assert COMMANDS <= set(graph), "a command module is missing"
  library = set(graph) - COMMANDS - {"__init__"}
  assert {"training.run", "training.mesh", "training.distributed", "training.steps",
          "planning.planner", "planning.accounting", "training.metrics_log", "training.config",
          "training.optimizers", "training.checkpoint", "data", "studies.sweeps"} <= library
  bad = {m: sorted(graph[m] & COMMANDS) for m in library if graph[m] & COMMANDS}
  assert not bad, f"library modules import commands: {bad}"
  # Nor does one command lean on another: what they share lives in the library.
  bad = {m: sorted(graph[m] & COMMANDS - {m}) for m in COMMANDS if graph[m] & COMMANDS - {m}}
  assert not bad, f"commands import commands: {bad}"


def test_no_private_cross_module_use():
  assert private_uses() == []


def test_commands_have_short_mains():
  for name in COMMANDS:
    tree = ast.parse((PACKAGE / f"{name.replace('.', '/')}.py").read_text())
    mains = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"]
    assert mains, f"{name} has no main()"
    assert mains[0].end_lineno - mains[0].lineno < 80, f"{name}.main is long"


def test_no_import_cycles():
  graph = import_graph()
  assert {"train", "training.run", "training.mesh", "training.steps", "training.config"} <= set(graph)
  done, active = set(), []

  def visit(module):
    if module in active:
      raise AssertionError("import cycle: " + " -> ".join(active[active.index(module):]
                                                          + [module]))
    if module in done or module not in graph:
      return
    active.append(module)
    for dep in sorted(graph[module]):
      visit(dep)
    active.pop()
    done.add(module)

  for module in sorted(graph):
    visit(module)


def test_importing_the_commands_changes_no_environment_variable():
  code = ("import os, json; before = dict(os.environ); "
          "import experiments.memory, experiments.bench, experiments.gpu_check, "
          "experiments.train, experiments.parallel; "
          "print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))")
  out = _subprocess.run_python(["-c", code], platforms=None).stdout
  assert out.strip().splitlines()[-1] == "{}"


def test_commands_choose_the_cpu_quietly_without_a_gpu():
  # JAX reads JAX_PLATFORMS when it is imported: a command that decides in
  # main() must set the config option too, or JAX starts the CUDA plugin
  # (installed by the gpu-compile extra) and prints its failure.
  code = ("import jax, experiments; experiments.use_cpu_without_gpu(); "
          "print(jax.default_backend())")
  done = _subprocess.run_python(["-c", code], platforms=None)
  has_gpu = os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")
  if not has_gpu:
    assert done.stdout.strip() == "cpu"
    assert "Unable to load CUDA" not in done.stderr and "Traceback" not in done.stderr


def _stderr_of(args):
  return _subprocess.run_python(args, platforms=None).stderr


def test_the_commands_start_jax_silently():
  # With the gpu-compile extra (JAX's CUDA plugin) on a machine without a GPU,
  # JAX alone prints absl/cudart_stub lines and a plugin traceback here.
  assert _stderr_of(["-c", "import experiments, jax; jax.numpy.zeros(1)"]) == ""
  assert _stderr_of(["-m", "experiments.train", "--help"]) == ""


def test_the_library_imports_and_computes_silently_without_the_cuda_plugin():
  """The dev environment has no CUDA plugin: a user's script prints nothing from JAX."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  if any(importlib.util.find_spec(f"jax_plugins.{name}") for name in
         ("xla_cuda12", "xla_cuda13") if importlib.util.find_spec("jax_plugins")):
    pytest.skip("JAX's CUDA plugin is installed here (the gpu-compile extra)")
  assert _stderr_of(["-c", "import skewadam_jax, jax; jax.numpy.zeros(1)"]) == ""


def test_importing_the_library_changes_nothing_outside_it():
  # A library must not choose the platform or touch the process's streams
  # (optax does neither): importing it after JAX leaves JAX's options, the
  # environment and file descriptor 2 as they were, and starts no backend.
  code = ("import os, json, jax; from jax._src import xla_bridge; "
          "env = dict(os.environ); platforms = jax.config.jax_platforms; "
          "fd2 = os.fstat(2).st_ino; import skewadam_jax; "
          "print(json.dumps([dict(os.environ) == env, jax.config.jax_platforms == platforms, "
          "os.fstat(2).st_ino == fd2, xla_bridge.backends_are_initialized()]))")
  out = _subprocess.run_python(["-c", code], platforms=None).stdout
  assert json.loads(out.strip().splitlines()[-1]) == [True, True, True, False]
  assert not (ROOT / "skewadam_jax" / "startup.py").exists()


def test_filtered_stderr_drops_only_the_known_lines(capfd):
  from experiments import startup  # pylint: disable=import-outside-toplevel
  with startup.filtered_stderr(startup.CUDA_PLUGIN_NOISE):
    os.write(2, b"I0000 00:00:1.0 1 cudart_stub.cc:31] Could not find cuda drivers on "
                b"your machine, GPU will not be used.\nkept from C++\n")
  assert capfd.readouterr().err == "kept from C++\n"


def test_a_tpu_is_a_tpu_pci_device_not_the_libtpu_package(tmp_path):
  # libtpu (the tpu-compile extra) installed without a TPU must not count as a
  # TPU machine: JAX would then try to start libtpu and print its errors.
  from experiments import startup  # pylint: disable=import-outside-toplevel
  assert not startup.tpu_present(root=str(tmp_path))
  device = tmp_path / "sys/bus/pci/devices/0000:00:04.0"
  device.mkdir(parents=True)
  (device / "vendor").write_text("0x1ae0\n")
  (device / "device").write_text("0x0042\n")  # Google's gVNIC network card
  assert not startup.tpu_present(root=str(tmp_path))
  (device / "device").write_text("0x006f\n")  # a TPU v6e chip
  assert startup.tpu_present(root=str(tmp_path))
  (device / "device").write_text("0x0042\n")
  (tmp_path / "dev").mkdir()
  (tmp_path / "dev/accel0").write_text("")
  assert startup.tpu_present(root=str(tmp_path))


def test_no_module_names_an_undefined_name():
  # A name left behind by a refactor fails only on the path that runs it
  # (the parallel command's --check did); pyflakes finds every one at once.
  from pyflakes import api, reporter  # pylint: disable=import-outside-toplevel
  import io  # pylint: disable=import-outside-toplevel
  out = io.StringIO()
  for folder in ("experiments", "skewadam_jax", "models", "examples"):
    for path in sorted((ROOT / folder).rglob("*.py")):
      api.checkPath(str(path), reporter.Reporter(out, out))
  undefined = [line for line in out.getvalue().splitlines() if "undefined name" in line]
  assert undefined == []

