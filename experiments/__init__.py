"""Experiments: training, optimizer comparison, memory planner, benchmarks, data."""

import importlib.util
import os


def use_cpu_without_gpu() -> None:
  """Chooses the CPU when the CUDA plugin is installed but no NVIDIA GPU is.

  The ``gpu-compile`` extra installs JAX's CUDA plugin for deviceless XLA:GPU
  compilation; on a machine without a GPU, JAX would otherwise try to start it
  and print a long CUDA error before falling back to the CPU. An explicit
  ``JAX_PLATFORMS`` always wins, and machines with a TPU runtime are left alone.
  Every command calls it first thing in ``main`` (JAX reads the variable when
  it starts a backend, not on import); importing the package changes nothing.
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
    os.environ["JAX_PLATFORMS"] = "cpu"

