"""XLA flags this suite compiles with, in its own process and its subprocesses."""

# XLA:CPU's compile time is most of this suite's time, and these two flags cut
# it by about 3x without changing what is tested:
# - LLVM's optimisation level 0 (the tiny compiled programs run slower, but
#   they run for milliseconds);
# - the legacy elemental emitters instead of the MLIR fusion emitters, which
#   cost about 1 ms of compile time a fusion (the whole suite: 8:34 -> 5:03
#   on 2 cores, one run after the other).
# What they change is the CPU programs' code, not what the tests check: the
# legacy emitters fuse a little differently (tiny's train step: 357 fusions
# against 432, temp bytes within 1 %), and XLA:CPU uses no fast-math, so float
# results move by summation-order round-off at most. The GPU and TPU targets'
# programs, where the planner's figures come from, do not read these flags.
def _jaxlib_version() -> tuple[int, ...]:
  """jaxlib's (major, minor), read without importing JAX (the flags must be set first)."""
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  try:
    return tuple(int(part) for part in metadata.version("jaxlib").split(".")[:2])
  except (metadata.PackageNotFoundError, ValueError):
    return (0, 0)


# jaxlib 0.12 has no legacy emitters, and XLA exits on a flag it does not know
# ("Unknown flag in XLA_FLAGS", exit status 1, before any test reports).
COMPILE_FLAGS = "--xla_backend_optimization_level=0" + (
    " --xla_cpu_use_fusion_emitters=false" if _jaxlib_version() < (0, 12) else "")


def require_gpu_compile() -> None:
  """Skips a ``gpu_compile`` test where XLA:GPU's compiler is not installed; with
  ``SKEWADAM_REQUIRE_GPU_COMPILE=1`` (.ci/run's GPU-compile environment) fails instead."""
  import os  # pylint: disable=import-outside-toplevel
  import pytest  # pylint: disable=import-outside-toplevel
  from experiments.planning import planner  # pylint: disable=import-outside-toplevel
  if planner.gpu_compile_available("a100-40gb"):
    return
  why = ("gpu-compile extra not installed (jax-cuda12-plugin, nvidia-cuda-nvcc-cu12): "
         "cannot compile for the A100 target here")
  if os.environ.get("SKEWADAM_REQUIRE_GPU_COMPILE") == "1":
    pytest.fail(why)
  pytest.skip(why)


def with_devices(devices: int) -> str:
  """``XLA_FLAGS`` for a subprocess with ``devices`` simulated CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}"
