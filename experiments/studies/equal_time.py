"""Equal wall-clock budgets: each contender's step time measured first, in one process.

A comparison at equal steps favours an optimizer whose step costs more. At
equal time every contender trains for the wall-clock AdamW takes for its step
count, on the same machine: each contender's train step is timed here, side by
side in one process (alternating rounds after a compiling round, the median
round kept, so a slow spell of a shared machine falls on every contender
alike), and its step count is the budget over its own step time. Each run's
schedule then ends at the budget (warmup and decay are fractions of its own
steps).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Mapping

import jax

from experiments.training import run as training
from experiments.training.config import TrainConfig

# The contender whose step count sets the budget.
REFERENCE = "adamw"


def measure_step_seconds(configs: Mapping[str, TrainConfig], *, steps: int = 10,
                         rounds: int = 3) -> dict[str, float]:
  """Seconds a train step of each configuration, measured side by side.

  Each configuration's step is compiled and run once (the first round), then
  ``rounds`` rounds of ``steps`` steps each run in turn, every configuration
  once a round, on the same batches; a configuration's time is its median
  round over ``steps``.

  Args:
    configs: name → the run's configuration (its optimizer, tiers and model).
    steps: steps a round.
    rounds: timed rounds.

  Returns:
    name → seconds a step.
  """
  if steps < 1 or rounds < 1:
    raise ValueError(f"steps and rounds must be >= 1, got {steps} and {rounds}")
  runs = {}
  for name, config in configs.items():
    # A schedule long enough for the timed steps (the rate does not change the time).
    run = training.Run(dataclasses.replace(config, steps=max(config.steps, steps * (rounds + 1))))
    params, state = run.init_state()
    batches = [run.dataset.batch_at(i) for i in range(steps)]
    runs[name] = [run, params, state, batches, []]
  for _ in range(rounds + 1):  # the first round compiles and warms up
    for entry in runs.values():
      run, params, state, batches, times = entry
      start = time.perf_counter()
      for inputs, targets in batches:
        params, state, _ = run.train_step(params, state, inputs, targets)
      jax.block_until_ready(params)
      times.append(time.perf_counter() - start)
      entry[1], entry[2] = params, state
  return {name: statistics.median(entry[4][1:]) / steps for name, entry in runs.items()}


def equal_time_steps(step_seconds: Mapping[str, float], reference_steps: int,
                     reference: str = REFERENCE) -> dict[str, int]:
  """Each contender's steps in the wall-clock ``reference`` takes for ``reference_steps``.

  Examples:
    >>> equal_time_steps({"adamw": 0.10, "muon": 0.125, "skewadam": 0.151}, 1600)
    {'adamw': 1600, 'muon': 1280, 'skewadam': 1060}
  """
  if reference not in step_seconds:
    raise ValueError(f"the budget is {reference}'s time: measure {reference!r} too "
                     f"(measured: {sorted(step_seconds)})")
  if reference_steps < 1:
    raise ValueError(f"the reference's steps must be >= 1, got {reference_steps}")
  bad = {k: v for k, v in step_seconds.items() if not v > 0}
  if bad:
    raise ValueError(f"step times must be > 0 seconds, got {bad}")
  budget = reference_steps * step_seconds[reference]
  return {name: max(1, round(budget / seconds)) for name, seconds in step_seconds.items()}
