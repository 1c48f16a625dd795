"""Saves the training command's step, compiled for a GPU target without a GPU, as HLO text.

    python experiments/planning/dump_step_hlo.py OUT.hlo.gz '{"preset": "moe-6.78b",
        "optimizer": "adamw", "batch": 1, "target": "h200"}'

A standalone script (run by path, with the checkout to compile on
``PYTHONPATH``) so that it also compiles the step of an older checkout:
``experiments/step_time_programs.sh`` saves the programs of the H200 steps
of 2026-12-04 with it. The JSON's keys: ``preset``, ``optimizer``, ``batch``,
``target``, and optionally ``update_in_backward`` and ``tiers`` (the
library's tier arguments; ``{}`` is ``skewadam()``).
"""

import gzip
import json
import sys

import experiments

experiments.use_cpu_without_gpu()
from experiments.planning import planner  # noqa: E402

planner.use_deviceless_gpu_environment()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from experiments.training import steps as steps_lib  # noqa: E402


def main(out: str, spec: dict) -> None:
  config = planner.train_config(spec["preset"], spec["optimizer"],
                                skewadam_tiers=spec.get("tiers"),
                                update_in_backward=spec.get("update_in_backward", False))
  step, params, opt_state = steps_lib.abstract_step(config)
  sharding, warning = planner.target_sharding(spec["target"])
  if warning:
    raise SystemExit(f"no deviceless GPU compile here: {warning}")
  seq = config.model_config().max_seq_len
  tokens = jax.ShapeDtypeStruct((spec["batch"], seq), jnp.int32, sharding=sharding)
  args = (planner.with_sharding(params, sharding), planner.with_sharding(opt_state, sharding),
          tokens, tokens)
  compiled = jax.jit(step.train_step, donate_argnums=(0, 1)).lower(*args).compile()
  with open(out, "wb") as f:
    f.write(gzip.compress(compiled.as_text().encode(), compresslevel=9))
  print(out, f"peak {planner.memory_analysis(compiled)['peak'] / 1e9:.3f} GB")


if __name__ == "__main__":
  main(sys.argv[1], json.loads(sys.argv[2]))
