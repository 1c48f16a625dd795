"""A few sharded training steps on synthetic tokens: checks a mesh layout.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.parallel --preset tiny --mesh data=2,expert=4 --check

runs a few steps of the training command's own step
(:func:`experiments.training.steps.make_step_fns`) on synthetic tokens, sharded over the
mesh (:mod:`experiments.training.mesh` documents the layout), prints the loss, the
optimizer-state bytes each device holds, and (``--check``) the largest
parameter difference from the same steps on one device. Several processes
join with ``--coordinator-address``, ``--num-processes``, ``--process-id``
(:mod:`experiments.training.distributed`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import experiments
import models
import skewadam_jax
from experiments.training import distributed
from experiments.training import optimizers
from experiments.training.mesh import make_mesh, parse_mesh, spmd_steps, device_state_bytes_by_tier
from experiments.training.steps import standard_step


# --------------------------------------------------------------------------
# Command line: a few sharded steps on synthetic tokens.
# --------------------------------------------------------------------------


def synthetic_batch(step: int, batch_size: int, seq_len: int, vocab: int, seed: int):
  """The same random tokens in every process (a pure function of the step)."""
  rng = np.random.default_rng([seed, step])
  tokens = rng.integers(0, vocab, (batch_size, seq_len + 1), dtype=np.int32)
  return tokens[:, :-1], tokens[:, 1:]


def _run(args) -> dict:
  overrides = {"compute_dtype": args.compute_dtype} if args.compute_dtype else {}
  config = models.get_preset(args.preset, **overrides)
  seq_len = args.seq_len or config.max_seq_len
  model = models.Transformer(config, rngs=nnx.Rngs(args.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  axes = models.logical_axes(params)
  params = nnx.as_pure(params)
  tx = optimizers.make_optimizer(args.optimizer, learning_rate=args.lr, axes=axes)
  batches = [synthetic_batch(s, args.batch_size, seq_len, config.vocab_size, args.seed)
             for s in range(args.steps)]

  mesh = make_mesh(**parse_mesh(args.mesh))
  step_fns = standard_step(graphdef, rest, tx)
  spmd = spmd_steps(mesh, step_fns, params, axes=axes, fsdp=args.fsdp)
  p, state = spmd.init(params)
  losses = []
  for inputs, targets in batches:
    p, state, metrics = spmd.train_step(p, state, inputs, targets)
    losses.append(float(metrics["loss"]))
  result = {
      "mesh": dict(mesh.shape), "devices": mesh.size,
      "processes": jax.process_count(), "losses": losses,
      "state_bytes_per_device": device_state_bytes_by_tier(state),
      "state_bytes": skewadam_jax.state_bytes_by_tier(state),
  }
  if args.check or args.save_params:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
    final = multihost_utils.process_allgather(p, tiled=True)
    if args.save_params and jax.process_index() == 0:
      flat = {skewadam_jax.labels.path_to_str(k): np.asarray(v)
              for k, v in jax.tree_util.tree_flatten_with_path(final)[0]}
      np.savez(args.save_params, **flat)
  if args.check:  # the same steps on one device, unsharded
    step = jax.jit(step_fns.train_step)
    ref_p = jax.tree.map(jnp.copy, params)
    ref_state = tx.init(ref_p)
    ref_losses = []
    for inputs, targets in batches:
      ref_p, ref_state, metrics = step(ref_p, ref_state, inputs, targets)
      ref_losses.append(float(metrics["loss"]))
    diffs = [np.abs(np.asarray(a) - np.asarray(b)).ravel()
             for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(ref_p))]
    diffs = np.concatenate(diffs)
    result["single_device_losses"] = ref_losses
    result["max_abs_param_diff"] = float(diffs.max())
    # Adam divides by each gradient's own size: where a gradient is rounding
    # noise, summing it in another order moves that entry by up to ~lr.
    result["params_off_by_over_1e-5"] = [int((diffs > 1e-5).sum()), int(diffs.size)]
  return result


def _print_report(result: dict) -> None:
  mesh = " x ".join(f"{k}={v}" for k, v in result["mesh"].items())
  print(f"mesh {mesh} on {result['devices']} devices in "
        f"{result['processes']} process(es)")
  for step, loss in enumerate(result["losses"], 1):
    ref = result.get("single_device_losses")
    extra = f"   (one device: {ref[step - 1]:.6f})" if ref else ""
    print(f"step {step}: loss {loss:.6f}{extra}")
  per, whole = result["state_bytes_per_device"], result["state_bytes"]
  kb = lambda b: f"{b / 1e3:,.1f} kB"
  print("optimizer state per device (whole state): " + ", ".join(
      f"{t} {kb(per[t])} ({kb(whole[t])})"
      for t in ("backbone", "expert", "router", "total")))
  if "max_abs_param_diff" in result:
    over, size = result["params_off_by_over_1e-5"]
    print(f"max |param - one-device param| after {len(result['losses'])} "
          f"steps: {result['max_abs_param_diff']:.3g} ({over:,} of {size:,} "
          "entries off by more than 1e-5)")


def build_parser() -> argparse.ArgumentParser:
  """The command's flags."""
  parser = argparse.ArgumentParser(
      prog="python -m experiments.parallel", description=__doc__.split("\n\n")[0])
  parser.add_argument("--preset", default="tiny")
  parser.add_argument("--optimizer", default="skewadam")
  parser.add_argument("--mesh", default="", help="e.g. data=2,expert=4 (default: "
                      "every device on data)")
  parser.add_argument("--fsdp", action="store_true",
                      help="also shard parameters and state over data")
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--batch-size", type=int, default=8)
  parser.add_argument("--seq-len", type=int, default=None)
  parser.add_argument("--lr", type=float, default=3e-3)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--compute-dtype", default=None,
                      help="override the preset's (float32 makes --check exact "
                      "to float rounding)")
  parser.add_argument("--check", action="store_true",
                      help="also run the steps on one device and compare")
  parser.add_argument("--save-params", default=None,
                      help="write the final parameters to this .npz (process 0)")
  parser.add_argument("--json", action="store_true", help="print JSON only")
  distributed.add_distributed_flags(parser)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  experiments.use_cpu_without_gpu()
  args = build_parser().parse_args(argv)
  try:
    distributed.initialize_distributed(args.coordinator_address, args.num_processes,
                           args.process_id)
    result = _run(args)
  except ValueError as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  if jax.process_index() == 0:
    if args.json:
      print(json.dumps(result))
    else:
      _print_report(result)
  return 0


if __name__ == "__main__":
  sys.exit(main())
