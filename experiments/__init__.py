"""Experiments: training, optimizer comparison, memory planner, benchmarks, data.

A library plus thin commands. The library modules (``config``, ``steps``,
``optimizers``, ``training``, ``metrics_log``, ``checkpoint``, ``data``,
``update_in_backward``, ``mesh``, ``distributed``, ``planner``,
``accounting``) never import a
command; the commands (``python -m experiments.NAME`` for ``train``,
``compare``, ``memory``, ``gpu_check``, ``parallel``, ``bench``,
``state_bytes``) are short ``main()`` s over them. Nothing here changes the
environment on import: a command chooses its platform in ``main``.
"""

import importlib.util
import os


def use_cpu_without_gpu() -> None:
  """Chooses the CPU when the CUDA plugin is installed but no NVIDIA GPU is.

  The ``gpu-compile`` extra installs JAX's CUDA plugin for deviceless XLA:GPU
  compilation; on a machine without a GPU, JAX would otherwise try to start it
  and print a long CUDA error before falling back to the CPU. An explicit
  ``JAX_PLATFORMS`` always wins, and machines with a TPU runtime are left alone.
  Every command calls it first thing in ``main``, before JAX starts a
  backend; importing the package changes nothing.
  """
  if "JAX_PLATFORMS" in os.environ:
    return
  try:
    has_cuda_plugin = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:  # no jax_plugins package at all
    has_cuda_plugin = False
  has_nvidia_gpu = os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")
  has_tpu = importlib.util.find_spec("libtpu") is not None
  if has_cuda_plugin and not has_nvidia_gpu and not has_tpu:
    use_platforms("cpu")


def use_platforms(platforms: str) -> None:
  """Makes JAX start only ``platforms`` (e.g. ``"cpu"``), in this process and its children.

  JAX reads ``JAX_PLATFORMS`` when it is imported, so a command that decides
  in ``main`` sets the config option as well as the variable (which the
  processes it starts read).
  """
  import jax  # pylint: disable=import-outside-toplevel
  os.environ["JAX_PLATFORMS"] = platforms
  jax.config.update("jax_platforms", platforms)

