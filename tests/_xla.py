"""XLA flags this suite compiles with, in its own process and its subprocesses."""

# LLVM's optimisation level 0 halves XLA:CPU's compile time, most of this
# suite's time (tests/experiments/training/test_steps.py and tests/experiments/test_train.py: 112 s -> 54 s
# on 2 cores). It changes no HLO, shape, buffer or sharding (fixed before the
# backend runs) and no float result (XLA:CPU uses no fast-math), only how
# fast the tiny compiled programs run.
COMPILE_FLAGS = "--xla_backend_optimization_level=0"


def with_devices(devices: int) -> str:
  """``XLA_FLAGS`` for a subprocess with ``devices`` simulated CPU devices."""
  return f"--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}"
