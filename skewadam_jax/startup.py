"""A quiet JAX start where JAX's CUDA plugin is installed but no NVIDIA GPU is.

Installing the CUDA plugin (e.g. for deviceless XLA:GPU compilation) on a
machine without a GPU makes every ``import jax`` print absl's
``All log messages before absl::InitializeLog()`` warning and
``cudart_stub.cc ... Could not find cuda drivers`` lines from C++, and the
first computation print a 19-line plugin traceback before JAX falls back to
the CPU. :func:`quiet_jax_start` (run when this package is imported, before
it imports JAX) avoids both in exactly that case: it chooses the CPU (what
JAX falls back to anyway; an explicit ``JAX_PLATFORMS`` always wins, and a
machine with a TPU runtime is left alone) and imports JAX with those known
lines filtered out of the process's standard error. Every other line still
reaches it. On a machine with a GPU it does nothing. Import this package
before JAX for a silent start: JAX prints its first lines while it is
imported.

:func:`filtered_stderr` is the filter itself, for other known-noise lines
(the memory planner drops XLA's rematerialisation warnings with it).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import tempfile
from typing import Iterator, Sequence

# What a CPU-only machine with the CUDA plugin prints on every JAX start.
CUDA_PLUGIN_NOISE = (
    r"^WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR$",
    r"cudart_stub\.cc:\d+\] Could not find cuda drivers on your machine",
)


def cuda_plugin_without_gpu() -> bool:
  """Whether JAX's CUDA plugin is installed on a machine without an NVIDIA GPU or TPU."""
  try:
    has_cuda_plugin = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
  except ModuleNotFoundError:  # no jax_plugins package at all
    has_cuda_plugin = False
  has_nvidia_gpu = os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")
  has_tpu = importlib.util.find_spec("libtpu") is not None
  return has_cuda_plugin and not has_nvidia_gpu and not has_tpu


@contextlib.contextmanager
def filtered_stderr(patterns: Sequence[str]) -> Iterator[None]:
  """Drops the lines matching ``patterns`` from what the process writes to stderr.

  Captures file descriptor 2 (so C++ logs are caught too) into a temporary
  file for the duration of the block, then writes every other line to
  ``sys.stderr``, in order.

  Example:
    >>> with filtered_stderr([r"^noise"]):
    ...   _ = os.write(2, b"noise from C++\\n")
  """
  compiled = [re.compile(p) for p in patterns]
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as capture:
    os.dup2(capture.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      capture.seek(0)
      text = capture.read().decode("utf-8", errors="replace")
      kept = [line for line in text.splitlines(keepends=True)
              if not any(p.search(line.rstrip("\n")) for p in compiled)]
      if kept:
        sys.stderr.write("".join(kept))
        sys.stderr.flush()


def quiet_jax_start() -> None:
  """Starts JAX on the CPU without the CUDA plugin's noise, where there is no GPU.

  A no-op unless :func:`cuda_plugin_without_gpu`. Imports JAX (if it is not
  imported yet) and registers its plugins inside the filter (they print again
  when they are loaded); no backend is started, so ``jax.distributed.initialize``
  and platform choices made later still work. Imported after JAX, it can no
  longer hide JAX's import-time lines, but still avoids the traceback of the
  first computation, as long as no backend has started.
  """
  if not cuda_plugin_without_gpu():
    return
  with filtered_stderr(CUDA_PLUGIN_NOISE):
    import jax  # pylint: disable=import-outside-toplevel
    from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
    if getattr(xla_bridge, "backends_are_initialized", lambda: True)():
      return
    if "JAX_PLATFORMS" not in os.environ:
      # The config option, not the variable: child processes decide for themselves.
      jax.config.update("jax_platforms", "cpu")
    register = getattr(xla_bridge, "_discover_and_register_pjrt_plugins", None)
    if register is not None:  # private: absent in other JAX versions, then skipped
      register()
