"""Experiments: training, optimizer comparison, memory planner, benchmarks, data.

Four library packages and thin commands over them:

* :mod:`experiments.training`: the configuration (and config files), the
  optimizers, the one step builder, the run and its loop, checkpoints,
  metrics, monitoring, sampling, meshes and processes;
* :mod:`experiments.data`: corpora, the tokenizer, batches, prepared
  (memory-mapped) corpora, a synthetic corpus;
* :mod:`experiments.planning`: the memory planner, its GPU/TPU targets, costs
  read from compiled HLO, optimizer-state accounting;
* :mod:`experiments.studies`: what sweeps of runs share, the optimizer
  comparison and the schedule study.

The commands are the top-level modules (``python -m experiments.NAME`` for
``train``, ``sample``, ``compare``, ``schedules``, ``memory``, ``gpu_check``,
``parallel``, ``bench``, ``state_bytes``; ``python -m experiments.data``),
each a short ``main()``; no library module imports a command
(``tests/experiments/test_layout.py``). Nothing here changes the environment
on import, except on a machine with JAX's CUDA plugin or libtpu and no GPU or
TPU: there JAX starts on the CPU without the plugins' start-up noise
(:mod:`experiments.startup`). The optimizer library itself (``skewadam_jax``)
does nothing on import.
"""

import os

# Quiet JAX start on a machine with the CUDA plugin and no GPU (before any
# experiments module imports JAX); a no-op anywhere else.
from experiments import startup

startup.quiet_jax_start()


def use_cpu_without_gpu() -> None:
  """Chooses the CPU when an accelerator plugin is installed but no accelerator is.

  The ``gpu-compile`` extra installs JAX's CUDA plugin for deviceless XLA:GPU
  compilation, the ``tpu-compile`` extra libtpu for XLA:TPU; on a machine
  without a GPU (or TPU), JAX would otherwise try to start them and print
  long errors before falling back to the CPU. An explicit ``JAX_PLATFORMS``
  always wins, and machines with a GPU or a TPU attached are left alone
  (:func:`experiments.startup.accelerator_plugin_without_device`). Importing
  this package already does it, quietly, when JAX is not imported yet; every
  command also calls it first thing in ``main``.
  """
  if "JAX_PLATFORMS" not in os.environ and startup.accelerator_plugin_without_device():
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

