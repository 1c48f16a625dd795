"""What the tests that start a Python process share: the checkout's root and the child's environment."""

import os
import pathlib
import subprocess
import sys

from tests import _xla

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Set by this process (its devices, or a multi-process run under test); a child
# chooses its own.
_CHOSEN_PER_PROCESS = ("XLA_FLAGS", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES",
                       "JAX_PROCESS_ID")


def environment(*, devices: int = 1, platforms: str | None = "cpu", **extra) -> dict:
  """The environment of a child Python process: this one's, on its own devices.

  Args:
    devices: simulated CPU devices (``XLA_FLAGS``, with the suite's compile
      flags, tests/_xla.py).
    platforms: ``JAX_PLATFORMS`` for the child; ``None`` leaves it unset, for
      the tests of how a command chooses its platform.
    **extra: further variables.
  """
  env = {k: v for k, v in os.environ.items()
         if k not in _CHOSEN_PER_PROCESS and k != "JAX_PLATFORMS"}
  env.update(XLA_FLAGS=_xla.with_devices(devices), PYTHONPATH=str(ROOT))
  if platforms is not None:
    env["JAX_PLATFORMS"] = platforms
  env.update(extra)
  return env


def run_python(args, **environment_options):
  """``python ARGS`` in the checkout with :func:`environment`, output captured; raises if it fails."""
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=environment(**environment_options),
                        check=True, capture_output=True, text=True)
