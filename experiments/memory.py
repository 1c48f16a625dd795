"""Memory planner command: will this train step fit this GPU? Asked of XLA, without the GPU.

    python -m experiments.memory --preset moe-6.78b --optimizer skewadam --target a100-40gb --batch-size 1 --seq-len 2048 --json

For a preset and an optimizer it reports

* exact bytes from abstract shapes (``nnx.eval_shape`` / ``jax.eval_shape``;
  nothing is allocated): parameters, gradients (same dtype as the
  parameters), optimizer state by tier;
* XLA's compiled memory analysis of the whole jitted train step (forward,
  backward, optimizer update; parameters and optimizer state donated): the very
  ``train_step`` of ``experiments.training.steps``, compiled for the target GPU on a
  machine without one ("deviceless" compilation against the target description
  in ``experiments/planning/gpu_targets/``). ``peak = argument + output − alias + temp``;
* the verdict against the device's memory less a safety margin (2 GB by
  default: CUDA context, cuBLAS/cuDNN workspaces, fragmentation), and the
  largest batch that fits (doubling, then bisection); ``--device-memory-gb N``
  checks against a device of N GB instead (e.g. 24 for an L4 / RTX 4090).

``--update-in-backward [--clip-mode exact|stale]`` plans the step that applies
each layer's update inside the backward pass (``skewadam_jax.layerwise``);
``grad_bytes`` is then one layer's gradients plus those outside the stack, the
most alive at once. ``matmul_flops`` counts the step's matrix multiplies
(scan bodies times their length; ``experiments.planning.planner.matmul_flops``).

``flops_efficiency`` is the useful FLOPs of the step (``6 · active
parameters · tokens`` + causal attention, ``experiments.planning.planner.useful_flops``)
over ``matmul_flops``. ``model_matmul_flops`` is the model's own share (the
loss and its gradient as the standard step computes them: remat's recompute
and the MoE's padding included), ``model_flops_per_useful`` its ratio to the
useful FLOPs (also at the largest batch that fits), and
``optimizer_matmul_flops`` the rest of the step's (the optimizer's; with
``--update-in-backward``, also the exact clip's second backward pass).
``step_time`` and ``step_time_at_largest_batch`` are the roofline estimate of
the compiled step on a GPU target (``experiments/planning/roofline.py``):
seconds, tokens/s and MFU; ``--step-time-table`` tabulates them.
``--accumulate K`` plans ``K`` micro-batches of ``--batch-size`` a step (the
largest batch that fits is then the micro-batch's).

``--devices N`` compiles the step sharded over N devices of the target (an
N-GPU node; N TPU chips), with the training command's mesh and shardings
(``experiments/training/mesh.py``; the batch split over ``data``): ``--mesh
data=A,expert=B`` and ``--fsdp``/``--no-fsdp`` (split every matrix over
``data`` as well; off by default with a given mesh) choose the layout; by
default ``data=N`` with FSDP, which
is what fits and repeats no work with the dropless lowerings, or with
``--moe-impl expert_parallel`` ``expert = gcd(N, experts)``, ``data = N /
expert`` (``experiments.planning.planner.default_layout``).
Memory figures are then per device, ``--batch-size`` and the largest batch that
fits are global (multiples of ``data``), and ``collective_bytes`` gives the
bytes each collective kind handles per device per step, read from the
compiled HLO with the layer loop's trip count (``experiments/planning/hlo.py``).

``--target tpu-v5e | tpu-v5p | tpu-v6e`` compiles with libtpu's ahead-of-time
compiler, without a TPU (``pip install -e '.[tpu-compile]'``); ``--devices N``
is then N chips (a slice shape of that generation).

Parameters and gradients are bf16 by default (``--param-dtype``). The GPU
compile needs the ``gpu-compile`` extra (``pip install -e '.[gpu-compile]'``);
without it, or with ``--target cpu``, the step is compiled for this CPU and
the result carries a warning: XLA:CPU reports 2.5–4× the GPU's temporaries.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Sequence

import jax.numpy as jnp

import experiments
from experiments.training import config as config_lib
from experiments.training import flags
from experiments.training import optimizers
from experiments.planning import planner
from experiments.planning.planner import markdown_table, plan, use_deviceless_gpu_environment


def _human(nbytes: int) -> str:
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if nbytes >= size:
      return f"{nbytes / size:.2f} {unit}"
  return f"{nbytes} B"


STEP_FIELDS = ("update_in_backward", "clip_mode", "skip_nonfinite", "stochastic_rounding")
# Passed to the planner as the run's settings (--batch-size is then each micro-batch's).
ACCUMULATE_FIELDS = ("accumulate", "accumulate_dtype")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="python -m experiments.memory",
                                   description=__doc__.split("\n\n")[0],
                                   epilog="--table FILE.json ...: print reports as a Markdown "
                                   "table (--devices-table for --devices reports, "
                                   "--orthogonal-table for what Newton-Schulz costs in them, "
                                   "--step-time-table for the model's FLOPs and the "
                                   "estimated step)")
  parser.add_argument("--preset", default="moe-6.78b")
  parser.add_argument("--optimizer", default="skewadam",
                      help=f"one of {', '.join(optimizers.OPTIMIZERS)}")
  parser.add_argument("--target", default="a100-40gb",
                      help=f"one of {', '.join(planner.ALL_TARGETS)}")
  parser.add_argument("--batch-size", "--batch", action=flags.StoreWithDeprecatedAliases,
                      deprecated=("--batch",), type=int, default=1, dest="batch_size",
                      help="global batch (sequences)")
  parser.add_argument("--seq-len", "--seq", action=flags.StoreWithDeprecatedAliases,
                      deprecated=("--seq",), type=int, default=None, dest="seq_len",
                      help="default: the preset's max_seq_len")
  parser.add_argument("--margin-gb", type=float, default=2.0)
  parser.add_argument("--param-dtype", default="bfloat16")
  parser.add_argument("--no-search", action="store_true", help="skip the largest-batch search")
  # The settings that change the step, with the training command's flags.
  config_lib.add_flags(parser, config_lib.TIER_FIELDS + STEP_FIELDS + ACCUMULATE_FIELDS
                       + config_lib.MODEL_FIELDS
                       + config_lib.MODEL_OPTIONS)
  parser.add_argument("--device-memory-gb", type=float, default=None,
                      help="check the fit against a device of this many GB (default: "
                      "the target's memory)")
  parser.add_argument("--devices", type=int, default=None,
                      help="compile for this many devices of the target (GPUs, TPU chips)")
  parser.add_argument("--mesh", default=None, help="with --devices: data=A,expert=B "
                      "(default: data=N, or with --moe-impl expert_parallel expert = "
                      "gcd(N, experts) and data the rest)")
  parser.add_argument("--fsdp", action=argparse.BooleanOptionalAction, default=None,
                      help="with --devices: also split each matrix over the data axis "
                      "(default: on with the default mesh, except with --moe-impl "
                      "expert_parallel; off with a given --mesh)")
  parser.add_argument("--fsdp-experts", action="store_true",
                      help="with FSDP: split each expert bank along its experts (each expert's "
                      "matrices whole on a device, where Newton-Schulz then iterates them) "
                      "instead of its larger matrix axis")
  parser.add_argument("--moe-impl", default=None,
                      help="the MoE lowering (default: the preset's); expert_parallel "
                      "sends tokens to their experts' devices (models/expert_parallel.py)")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  return parser


# --table FILE.json ...: reports as one Markdown table, without compiling anything.
TABLES = {"--table": markdown_table, "--devices-table": planner.markdown_devices_table,
          "--orthogonal-table": planner.markdown_orthogonal_table,
          "--step-time-table": planner.markdown_step_time_table}


def main(argv: Sequence[str] | None = None) -> int:
  experiments.use_cpu_without_gpu()
  use_deviceless_gpu_environment()
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] in TABLES:
    table = TABLES[argv[0]]
    print(table([json.loads(pathlib.Path(p).read_text()) for p in argv[1:]]))
    return 0
  try:
    args, file_values = config_lib.parse_with_config_file(build_parser(), argv)
  except ValueError as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  if args.target == "cpu" and args.devices:
    planner.use_host_devices(args.devices)  # before JAX starts its CPU backend
  try:
    if args.optimizer not in optimizers.OPTIMIZERS:
      raise ValueError(f"unknown optimizer {args.optimizer!r}; "
                       f"choose from {', '.join(optimizers.OPTIMIZERS)}")
    report = plan(args.preset, args.optimizer, target=args.target, batch=args.batch_size,
                  seq=args.seq_len, margin_gb=args.margin_gb,
                  skewadam_tiers=config_lib.tiers_from_args(args),
                  param_dtype=jnp.dtype(args.param_dtype), search_batch=not args.no_search,
                  update_in_backward=args.update_in_backward, clip_mode=args.clip_mode,
                  skip_nonfinite=args.skip_nonfinite,
                  stochastic_rounding=args.stochastic_rounding,
                  device_memory_gb=args.device_memory_gb, devices=args.devices,
                  mesh=args.mesh, fsdp=args.fsdp, fsdp_experts=args.fsdp_experts,
                  moe_impl=args.moe_impl,
                  settings=_settings(args, file_values),
                  progress=lambda message: print(message, file=sys.stderr, flush=True))
  except ValueError as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  if args.json:
    print(json.dumps(report, indent=2))
  else:
    _print_report(report)
  return 0


def _settings(args, file_values: dict) -> dict:
  """The run's other settings: the model's shape flags, and what a ``--config`` file sets
  that this command has no flag for (the schedule, clipping, ...), as ``train`` reads them."""
  own = {"preset", "optimizer", "param_dtype", "moe_impl", "mesh", "fsdp", "batch_size",
         "seq_len", *config_lib.TIER_FIELDS, *STEP_FIELDS}
  settings = {k: v for k, v in file_values.items() if k not in own}
  settings.update({name: getattr(args, name)
                   for name in config_lib.MODEL_FIELDS + config_lib.MODEL_OPTIONS
                   + ACCUMULATE_FIELDS if getattr(args, name) is not None})
  return settings


def _print_report(report: dict) -> None:
  g = _human
  tiers = report["opt_state_bytes_by_tier"]
  mode = (f", update in backward ({report['clip_mode']} clip)"
          if report["update_in_backward"] else "")
  where = report["compiled_for"]
  if report["mesh"]:
    mesh = report["mesh"]
    where = (f"{report['devices']} x {where}, mesh data={mesh['data']} x "
             f"expert={mesh['expert']}{planner.fsdp_text(report['fsdp'])}")
  if report.get("accumulate", 1) > 1:
    mode += (f", {report['accumulate']} micro-batches a step ({report['accumulate_dtype']} "
             f"accumulator)")
  print(f"{report['preset']} ({report['num_params']:,} params, {report['param_dtype']}), "
        f"{report['optimizer']}{mode}, batch {report['batch']} x {report['seq']}, "
        f"compiled for {where}")
  print(f"  params {g(report['param_bytes'])}, grads {g(report['grad_bytes'])}, optimizer "
        f"state {g(report['opt_state_bytes'])} (backbone {g(tiers['backbone'])}, expert "
        f"{g(tiers['expert'])}, router {g(tiers['router'])})")
  x = report["xla"]
  per = " per device" if report["mesh"] else ""
  if report["mesh"]:
    print(f"  per device: params {g(report['per_device_param_bytes'])}, optimizer state "
          f"{g(report['per_device_opt_state_bytes'])}")
  if x is None:
    print(f"  XLA{per}: {report['out_of_memory']}")
  else:
    print(f"  XLA{per}: argument {g(x['argument'])}, output {g(x['output'])}, alias "
          f"{g(x['alias'])}, temp {g(x['temp'])} -> peak {g(report['peak_bytes'])}")
  print(f"  matrix-multiply FLOPs per step: {report['matmul_flops']:.3e}, useful "
        f"{report['useful_flops']:.3e} (efficiency {report['flops_efficiency']:.2f})")
  print(f"  of which the model (forward, backward, recompute, padding): "
        f"{report['model_matmul_flops']:.3e} = {report['model_flops_per_useful']:.2f}x useful; "
        f"the optimizer: {report['optimizer_matmul_flops']:.3e}")
  largest = report.get("model_flops_at_largest_batch")
  if largest:
    print(f"  the model at the largest batch ({largest['batch']}): "
          f"{largest['model_matmul_flops']:.3e} = {largest['model_flops_per_useful']:.2f}x useful")
  for key, label in (("step_time", "at this batch"),
                     ("step_time_at_largest_batch", "at the largest batch")):
    t = report.get(key)
    if t:
      print(f"  estimated step {label} ({t['batch']}): {t['step_seconds']:.3f} s "
            f"(compute {t['compute_seconds']:.3f}, memory {t['memory_seconds']:.3f}, "
            f"collectives {t['collective_seconds']:.3f}, {t['kernels']:,} kernels "
            f"{t['overhead_seconds']:.3f}), {t['tokens_per_second']:,.0f} tokens/s, "
            f"MFU {t['mfu']:.1%} (experiments/planning/roofline.py)")
  ortho = report.get("orthogonalisation")
  if ortho:
    size, rows, cols = ortho["chunk"]
    print(f"  orthogonalisation (Newton-Schulz, {ortho['matrices']:,} matrices): working set "
          f"{g(ortho['working_set_bytes'])} a device (a chunk of {size} x {rows}x{cols}, "
          f"{ortho['leaf']}), "
          f"matrix-multiply FLOPs {ortho['matmul_flops']:.3e} "
          f"({ortho['matmul_flops'] / report['matmul_flops']:.0%} of the step's)")
  if report["collective_bytes"] is not None:
    moved = ", ".join(f"{kind} {g(n)}" for kind, n in report["collective_bytes"].items() if n)
    print(f"  collectives per device per step: {moved or 'none'}")
  if report["device_bytes"] is not None:
    verdict = "FITS" if report["fits"] else "DOES NOT FIT"
    largest = report["max_batch_that_fits"]
    print(f"  {verdict} in {g(report['device_bytes'])}{per} with a "
          f"{g(report['margin_bytes'])} margin; largest batch that fits: "
          f"{'not searched' if largest is None else largest}")
  if report["warning"]:
    print(f"  warning: {report['warning']}")


if __name__ == "__main__":
  sys.exit(main())
