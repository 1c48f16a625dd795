"""A quiet JAX start where an accelerator plugin is installed but no accelerator is.

Installing the CUDA plugin (e.g. for deviceless XLA:GPU compilation) on a
machine without a GPU makes every ``import jax`` print absl's
``All log messages before absl::InitializeLog()`` warning and
``cudart_stub.cc ... Could not find cuda drivers`` lines from C++, and the
first computation print a 19-line plugin traceback before JAX falls back to
the CPU. Installing ``libtpu`` (for ahead-of-time XLA:TPU compilation) on a
machine without a TPU makes that first computation print libtpu's
host-bounds and worker-hostname errors instead. :func:`quiet_jax_start`
(run when the ``experiments`` package is imported, before it imports JAX) avoids both in
exactly that case (:func:`accelerator_plugin_without_device`): it chooses
the CPU (what JAX falls back to anyway; an explicit ``JAX_PLATFORMS``
always wins) and imports JAX with the CUDA plugin's known lines filtered
out of the process's standard error. Every other line still reaches it. On
a machine with an NVIDIA GPU or a TPU attached it does nothing. Import
``experiments`` before JAX for a silent start: JAX prints its first lines while it
is imported.

:func:`filtered_stderr` is the filter itself, for other known-noise lines
(the memory planner drops XLA's rematerialisation warnings with it).
"""

from __future__ import annotations

import contextlib
import glob
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


# PCI ids of TPU chips (Google's vendor id; the device ids JAX itself checks in
# jax._src.hardware_utils: v3, v4, v5p, v5e, v6e, 7x and one unnamed). Google's
# other PCI devices (the gVNIC network card) are not TPUs.
GOOGLE_PCI_VENDOR_ID = "0x1ae0"
TPU_PCI_DEVICE_IDS = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f",
                                "0x0076"})


def _has_module(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except ModuleNotFoundError:  # a parent package is missing
    return False


def nvidia_gpu_present() -> bool:
  """Whether an NVIDIA GPU driver is loaded on this machine."""
  return os.path.exists("/dev/nvidiactl") or os.path.exists("/proc/driver/nvidia")


def tpu_present(root: str = "/") -> bool:
  """Whether a TPU chip is attached to this machine.

  A PCI device with Google's vendor id and a TPU device id (the check JAX
  makes before starting libtpu), or the device files TPU VMs expose
  (``/dev/accel*``, ``/dev/vfio/<group>``). Having the ``libtpu`` package
  installed is not enough: the memory planner's TPU targets need it on
  machines without a TPU. ``root`` is the file-system root to look under.

  Example:
    >>> tpu_present(root="/nonexistent")
    False
  """
  for vendor_path in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
    try:
      with open(vendor_path) as f:
        vendor = f.read().strip()
      if vendor != GOOGLE_PCI_VENDOR_ID:
        continue
      with open(os.path.join(os.path.dirname(vendor_path), "device")) as f:
        if f.read().strip() in TPU_PCI_DEVICE_IDS:
          return True
    except OSError:
      continue
  return bool(glob.glob(os.path.join(root, "dev/accel*"))
              or glob.glob(os.path.join(root, "dev/vfio/[0-9]*")))


def accelerator_plugin_without_device() -> bool:
  """Whether JAX's CUDA plugin or libtpu is installed but no NVIDIA GPU or TPU is attached.

  There JAX would try to start the plugin's backend, print its failure and
  fall back to the CPU.
  """
  has_plugin = _has_module("jax_plugins.xla_cuda12") or _has_module("libtpu")
  return has_plugin and not nvidia_gpu_present() and not tpu_present()


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
  """Starts JAX on the CPU without the accelerator plugins' noise, where there is no accelerator.

  A no-op unless :func:`accelerator_plugin_without_device`. Imports JAX (if it is not
  imported yet) and registers its plugins inside the filter (they print again
  when they are loaded); no backend is started, so ``jax.distributed.initialize``
  and platform choices made later still work. Imported after JAX, it can no
  longer hide JAX's import-time lines, but still avoids the traceback of the
  first computation, as long as no backend has started.
  """
  if not accelerator_plugin_without_device():
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
