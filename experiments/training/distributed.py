"""Several processes (one per host) joined into one JAX run with ``jax.distributed``.

A library module: the training command and ``python -m experiments.parallel``
call :func:`initialize_distributed` in ``main`` before JAX touches a device.
"""

from __future__ import annotations

import argparse
import os
from typing import Mapping

import jax

# Environment variables read when the matching flag is absent.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
  """Adds ``--coordinator-address``, ``--num-processes`` and ``--process-id``."""
  group = parser.add_argument_group(
      "several processes (jax.distributed; flags override the environment)")
  group.add_argument("--coordinator-address", default=None,
                     help=f"HOST:PORT of process 0 (env {ENV_COORDINATOR})")
  group.add_argument("--num-processes", type=int, default=None,
                     help=f"number of processes (env {ENV_NUM_PROCESSES})")
  group.add_argument("--process-id", type=int, default=None,
                     help=f"this process, 0 .. N-1 (env {ENV_PROCESS_ID})")


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None, *,
                           environ: Mapping[str, str] = os.environ) -> bool:
  """Joins a multi-process JAX run, or does nothing for a single process.

  Each argument falls back to an environment variable
  (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``).
  With none of them set, or one process, this is a no-op. Otherwise it calls
  ``jax.distributed.initialize``, which must happen before JAX touches a
  device; on CPU, cross-process collectives use gloo over TCP.

  Returns:
    Whether ``jax.distributed`` was initialized.

  Raises:
    ValueError: if only some of the three are set, or they are malformed.

  Example:
    >>> initialize_distributed(environ={})   # a single process
    False
  """
  def value(given, env, kind):
    if given is not None:
      return given
    raw = environ.get(env)
    if raw in (None, ""):
      return None
    try:
      return kind(raw)
    except ValueError:
      raise ValueError(f"{env}={raw!r} is not a valid {kind.__name__}") from None

  address = value(coordinator_address, ENV_COORDINATOR, str)
  count = value(num_processes, ENV_NUM_PROCESSES, int)
  index = value(process_id, ENV_PROCESS_ID, int)
  if address is None and count in (None, 1) and index in (None, 0):
    return False
  missing = [flag for flag, v in (("--coordinator-address", address),
                                  ("--num-processes", count),
                                  ("--process-id", index)) if v is None]
  if missing:
    raise ValueError(f"several processes need {', '.join(missing)} too "
                     "(or the JAX_* environment variables)")
  if count < 1 or not 0 <= index < count:
    raise ValueError(f"--process-id must be in [0, {count}), got {index}")
  # gloo is jax 0.10's default; naming it keeps CPU runs working if that changes.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=address, num_processes=count,
                             process_id=index)
  return True
