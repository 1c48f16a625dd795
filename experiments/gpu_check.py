"""On a real GPU: the 6.78B MoE step fits in 40 GB with SkewAdam, and AdamW does not.

    python -m experiments.gpu_check                      # on a machine with one NVIDIA GPU
    python -m experiments.gpu_check --preset tiny --cap-gb 0   # smoke test anywhere

Caps JAX's memory pool at ``--cap-gb`` (default 40: the A100-40GB's budget) of
the GPU through ``XLA_PYTHON_CLIENT_MEM_FRACTION``, builds the preset with bf16
parameters directly on the device, runs ``--steps`` donated train steps (the
training command's ``train_step``) with SkewAdam on random tokens, and reports
the measured peak (``device.memory_stats()["peak_bytes_in_use"]``) and step
times. Then it tries the same with AdamW (fp32 moments) and reports the
out-of-memory error XLA raises. One JSON line per phase, on stdout.
``--update-in-backward [--clip-mode exact|stale]`` runs the step that updates
each layer inside the backward pass (``skewadam_jax.layerwise``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Sequence

import experiments
from experiments.training import flags


def _total_gpu_bytes() -> int | None:
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return int(out.split()[0]) * 2**20
  except (OSError, subprocess.SubprocessError, ValueError, IndexError):
    return None


def _cap_memory(cap_gb: float) -> dict:
  """Sets the memory fraction before JAX starts; returns what was set."""
  total = _total_gpu_bytes()
  if not cap_gb or total is None:
    return {"cap_bytes": None, "gpu_total_bytes": total}
  fraction = min(0.99, cap_gb * 1e9 / total)
  os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"
  return {"cap_bytes": int(cap_gb * 1e9), "gpu_total_bytes": total, "mem_fraction": fraction}


def run_phase(preset: str, optimizer: str, *, batch: int, seq: int | None, steps: int,
              update_in_backward: bool = False, clip_mode: str = "exact") -> dict:
  """Builds the model and optimizer on the device and runs ``steps`` train steps."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import models
  from experiments.planning import planner
  from experiments.training import steps as steps_lib

  device = jax.devices()[0]
  result = {"preset": preset, "optimizer": optimizer, "batch": batch, "device": str(device),
            "update_in_backward": update_in_backward}
  config = models.get_preset(preset, param_dtype=jnp.bfloat16)
  seq = seq or config.max_seq_len
  result["seq"] = seq
  try:
    @jax.jit
    def init_params():  # on the device, in bf16: no host copy of 13.6 GB
      model = models.Transformer(config, rngs=nnx.Rngs(0))
      return nnx.as_pure(nnx.state(model, nnx.Param))

    _, graphdef, _, rest = steps_lib.abstract_model(preset, jnp.bfloat16)
    params = init_params()
    # The step the training command runs, as the planner compiles it.
    run_config = planner.train_config(preset, optimizer, update_in_backward=update_in_backward,
                                      clip_mode=clip_mode)
    built = steps_lib.build_step(run_config, graphdef, rest, params,
                                 steps_lib.abstract_axes(preset))
    opt_state = jax.jit(built.init)(params)
    train_step = built.train_step
    if update_in_backward:
      result["clip_mode"] = clip_mode
    step = jax.jit(train_step, donate_argnums=(0, 1))
    key = jax.random.PRNGKey(0)
    times = []
    for i in range(steps):
      tokens = jax.random.randint(jax.random.fold_in(key, i), (batch, seq + 1), 0, config.vocab_size)
      t0 = time.perf_counter()
      params, opt_state, metrics = step(params, opt_state, tokens[:, :-1], tokens[:, 1:])
      loss = float(metrics["loss"])
      times.append(time.perf_counter() - t0)
    result.update(status="ok", loss=loss, step_seconds=times)
  except Exception as err:  # pylint: disable=broad-except
    message = str(err)
    result.update(status="out_of_memory" if "RESOURCE_EXHAUSTED" in message or
                  "out of memory" in message.lower() else "error",
                  error=f"{type(err).__name__}: {message[:400]}")
  stats = device.memory_stats() or {}
  result["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
  result["bytes_limit"] = stats.get("bytes_limit")
  return result


def build_parser() -> argparse.ArgumentParser:
  """The command's flags."""
  parser = argparse.ArgumentParser(prog="python -m experiments.gpu_check",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="moe-6.78b")
  parser.add_argument("--batch-size", "--batch", action=flags.StoreWithDeprecatedAliases,
                      deprecated=("--batch",), type=int, default=1, dest="batch_size")
  parser.add_argument("--seq-len", "--seq", action=flags.StoreWithDeprecatedAliases,
                      deprecated=("--seq",), type=int, default=None, dest="seq_len")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--cap-gb", type=float, default=40.0, help="0: no cap")
  parser.add_argument("--optimizers", default="skewadam,adamw")
  parser.add_argument("--update-in-backward", action="store_true",
                      help="the step that updates each layer inside the backward pass")
  parser.add_argument("--clip-mode", default="exact", help="exact | stale")
  parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  experiments.use_cpu_without_gpu()
  args = build_parser().parse_args(argv)
  if args.phase:  # a child process: one optimizer, a fresh memory pool
    cap = _cap_memory(args.cap_gb)
    result = run_phase(args.preset, args.phase, batch=args.batch_size, seq=args.seq_len,
                       steps=args.steps,
                       update_in_backward=args.update_in_backward, clip_mode=args.clip_mode)
    print(json.dumps({**cap, **result}), flush=True)
    return 0
  # Each optimizer in its own process, so the peak and an OOM of one phase do
  # not leak into the other.
  for name in args.optimizers.split(","):
    cmd = [sys.executable, "-m", "experiments.gpu_check", "--phase", name, "--preset", args.preset,
           "--batch-size", str(args.batch_size), "--steps", str(args.steps),
           "--cap-gb", str(args.cap_gb)]
    if args.seq_len:
      cmd += ["--seq-len", str(args.seq_len)]
    if args.update_in_backward:
      cmd += ["--update-in-backward", "--clip-mode", args.clip_mode]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    print(lines[-1] if lines else json.dumps(
        {"optimizer": name, "status": "crashed", "returncode": out.returncode,
         "stderr_tail": out.stderr[-800:]}), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
