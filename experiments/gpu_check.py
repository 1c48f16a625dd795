"""On a real GPU: the 6.78B MoE step fits in 40 GB with SkewAdam, and AdamW does not.

    python -m experiments.gpu_check                      # on a machine with one NVIDIA GPU
    python -m experiments.gpu_check --preset tiny --cap-gb 0   # smoke test anywhere

Caps JAX's memory pool at ``--cap-gb`` (default 40: the A100-40GB's budget) of
the GPU through ``XLA_PYTHON_CLIENT_MEM_FRACTION``, builds the preset with bf16
parameters directly on the device, runs ``--steps`` donated train steps (the
training command's ``train_step``) with SkewAdam on random tokens, and reports
the measured peak (``device.memory_stats()["peak_bytes_in_use"]``) beside
what XLA's memory analysis of the same compiled step says (the planner's
estimate, ``xla["peak"]``, here from the device's own compiler), the compile
time, the step times, and the model FLOPs utilisation

    MFU = useful FLOPs / (median step time · peak bf16 FLOP/s)

with :func:`experiments.planning.planner.useful_flops` (``6 · N_active · tokens``
plus causal attention) and the vendor's dense bf16 peak for the device
(:data:`PEAK_BF16_FLOPS`, or ``--peak-tflops``); ``hardware_flops_utilisation``
counts every matrix multiply the step runs instead (recomputation and the
optimizer's Newton–Schulz products too). Then it tries the same with AdamW (fp32
moments) and reports the out-of-memory error XLA raises. One JSON line per
phase, on stdout (and appended to ``--out``).
``--update-in-backward [--clip-mode exact|stale]`` runs the step that updates
each layer inside the backward pass (``skewadam_jax.layerwise``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Sequence

import experiments
from experiments.training import config as config_lib
from experiments.training import flags

# Dense bf16 matrix FLOP/s by the vendors' datasheets (no sparsity), keyed by a
# substring of ``jax.Device.device_kind``; the first match wins.
PEAK_BF16_FLOPS = (("H100 PCIe", 756e12), ("H200", 989.4e12), ("H100", 989.4e12),
                   ("A100", 312e12), ("L4", 121e12))


def peak_bf16_flops(device_kind: str) -> float | None:
  """The datasheet's dense bf16 FLOP/s of ``device_kind``, or ``None`` if unknown."""
  return next((peak for name, peak in PEAK_BF16_FLOPS if name in device_kind), None)


def _total_gpu_bytes() -> int | None:
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    return int(out.split()[0]) * 2**20
  except (OSError, subprocess.SubprocessError, ValueError, IndexError):
    return None


def _cap_memory(cap_gb: float) -> dict:
  """Sets the memory fraction before JAX starts; returns what was set.

  No cap (``cap_gb=0``) means 95 % of the card, not JAX's default 75 %, which
  would cap a step that fits the card.
  """
  total = _total_gpu_bytes()
  if total is None:
    return {"cap_bytes": None, "gpu_total_bytes": total}
  fraction = min(0.99, cap_gb * 1e9 / total) if cap_gb else 0.95
  os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{fraction:.4f}"
  return {"cap_bytes": int(fraction * total), "gpu_total_bytes": total, "mem_fraction": fraction}


def default_tiers() -> dict:
  """SkewAdam's tiers when no tier flag is given: the training command's default."""
  return config_lib.tiers_from_args(build_parser().parse_args([]))


# The planner's roofline target of a device, by a substring of its kind; the first match wins.
ROOFLINE_TARGETS = (("H200", "h200"), ("H100", "h100-80gb"), ("A100", "a100-40gb"))


def roofline_target(device_kind: str) -> str | None:
  """The :mod:`experiments.planning.roofline` target of ``device_kind``, or ``None``."""
  return next((t for name, t in ROOFLINE_TARGETS if name in device_kind), None)


def step_spread(times: Sequence[float]) -> dict:
  """Min, 10th percentile, median, 90th percentile and max of the step times after the first.

  Example:
    >>> step_spread([9.0, 1.0, 2.0, 3.0, 4.0, 5.0])["median"]
    3.0
  """
  later = sorted(times[1:] or times)
  at = lambda q: later[min(len(later) - 1, round(q * (len(later) - 1)))]  # noqa: E731
  return {"steps": len(later), "min": later[0], "p10": at(0.1),
          "median": statistics.median(later), "p90": at(0.9), "max": later[-1]}


def run_phase(preset: str, optimizer: str, *, batch: int, seq: int | None, steps: int,
              update_in_backward: bool = False, clip_mode: str = "exact",
              skewadam_tiers: dict | None = None, peak_flops: float | None = None,
              settings: dict | None = None) -> dict:
  """Builds the model and optimizer on the device and runs ``steps`` train steps.

  ``skewadam_tiers``: the library's tier arguments (``{}``: ``skewadam()``'s);
  ``None``, the training command's default (:func:`default_tiers`), the
  configuration the planner's ``--optimizer skewadam`` plans.

  Returns the phase's JSON record: ``status`` (``ok``, ``out_of_memory`` or
  ``error``), the ``skewadam_tiers`` run, the measured ``peak_bytes_in_use``,
  XLA's analysis of the compiled step (``xla``), ``compile_seconds``,
  ``step_seconds`` (and their spread), with a known peak FLOP/s ``mfu``,
  and the planner's roofline estimate of the same compiled program
  (``estimate``: :mod:`experiments.planning.roofline` for the device's kind).
  ``settings``: other training-command fields (``moe_block_size``,
  ``accumulate``); ``batch`` is then each micro-batch's.
  """
  import jax
  import jax.numpy as jnp
  from flax import nnx

  import models
  from experiments.planning import planner
  from experiments.training import steps as steps_lib

  device = jax.devices()[0]
  peak_flops = peak_flops or peak_bf16_flops(device.device_kind)
  result = {"preset": preset, "optimizer": optimizer, "batch": batch, "device": str(device),
            "device_kind": device.device_kind, "jax": jax.__version__,
            "update_in_backward": update_in_backward, "peak_flops": peak_flops}
  if skewadam_tiers is None:
    skewadam_tiers = default_tiers()
  if optimizer == "skewadam":
    result["skewadam_tiers"] = skewadam_tiers
  settings = dict(settings or {})
  if settings:
    result["settings"] = settings
  overrides = {k: v for k, v in settings.items() if k in ("moe_block_size",)}
  config = models.get_preset(preset, param_dtype=jnp.bfloat16, **overrides)
  accumulate = settings.get("accumulate", 1)
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
    run_config = planner.train_config(preset, optimizer, skewadam_tiers=skewadam_tiers,
                                      update_in_backward=update_in_backward, clip_mode=clip_mode,
                                      **settings)
    built = steps_lib.build_step(run_config, graphdef, rest, params,
                                 steps_lib.abstract_axes(preset))
    opt_state = jax.jit(built.init)(params)
    train_step = built.train_step
    if update_in_backward:
      result["clip_mode"] = clip_mode
    key = jax.random.PRNGKey(0)
    def tokens_at(i):
      tokens = jax.random.randint(jax.random.fold_in(key, i), (batch * accumulate, seq + 1),
                                  0, config.vocab_size)
      return tokens[:, :-1], tokens[:, 1:]
    result["useful_flops"] = planner.useful_flops(config, batch * accumulate, seq)
    result["matmul_flops"] = planner.matmul_flops(train_step, params, opt_state, *tokens_at(0))
    t0 = time.perf_counter()
    step = jax.jit(train_step, donate_argnums=(0, 1)).lower(
        params, opt_state, *tokens_at(0)).compile()
    result["compile_seconds"] = time.perf_counter() - t0
    result["xla"] = planner.memory_analysis(step)
    result["step_fingerprint"] = planner.step_fingerprint(step)
    target = roofline_target(device.device_kind)
    if target:
      result["estimate"] = planner.step_time_report(
          planner.estimate_step(step.as_text(), target, config.num_layers, None), config,
          batch=batch, seq=seq, accumulate=accumulate, target=target, devices=1)
    times = []
    for i in range(steps):
      inputs, targets = tokens_at(i)
      jax.block_until_ready(inputs)
      t0 = time.perf_counter()
      params, opt_state, metrics = step(params, opt_state, inputs, targets)
      loss = float(metrics["loss"])  # waits for the step
      times.append(time.perf_counter() - t0)
    result.update(status="ok", loss=loss, step_seconds=times)
    # The first step pays one-off costs (autotuning, allocation): left out
    # of the median when there are later ones.
    median = statistics.median(times[1:] or times)
    result["median_step_seconds"] = median
    result["step_seconds_spread"] = step_spread(times)
    result["tokens_per_second"] = batch * accumulate * seq / median
    if peak_flops:
      result["mfu"] = result["useful_flops"] / median / peak_flops
      result["hardware_flops_utilisation"] = result["matmul_flops"] / median / peak_flops
  except Exception as err:  # pylint: disable=broad-except
    message = str(err)
    result.update(status="out_of_memory" if "RESOURCE_EXHAUSTED" in message or
                  "out of memory" in message.lower() else "error",
                  error=f"{type(err).__name__}: {message[:400]}")
  stats = device.memory_stats() or {}
  result["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
  result["bytes_limit"] = stats.get("bytes_limit")
  return result


# Training-command settings a phase passes on (run_phase's ``settings``).
PHASE_SETTINGS = ("moe_block_size", "accumulate", "accumulate_dtype")


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
  parser.add_argument("--cap-gb", type=float, default=40.0,
                      help="the memory pool's size in GB (0: 95%% of the card)")
  parser.add_argument("--optimizers", default="skewadam,adamw")
  # The step's settings, with the training command's flags (and defaults).
  config_lib.add_flags(parser, config_lib.TIER_FIELDS + ("update_in_backward", "clip_mode")
                       + PHASE_SETTINGS)
  parser.add_argument("--peak-tflops", type=float, default=None,
                      help="the device's dense bf16 peak (default: its datasheet's, if known)")
  parser.add_argument("--phase-timeout", type=float, default=None,
                      help="seconds each phase may take before it is stopped")
  parser.add_argument("--out", default=None, help="also append each phase's JSON line here")
  parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
  return parser


def _tiers(record: dict) -> dict | None:
  """SkewAdam's tiers of a phase or a plan (``None`` for another optimizer)."""
  # Records written before gpu_check saved its tiers (the 2026-12-04 H200 run)
  # ran planner.train_config without tiers: the library's skewadam().
  return record.get("skewadam_tiers", {}) if record["optimizer"] == "skewadam" else None


def _key(record: dict) -> tuple:
  return (record["preset"], record["optimizer"], record["batch"],
          bool(record.get("update_in_backward")), json.dumps(_tiers(record), sort_keys=True))


def comparison_table(phases: list[dict], plans: list[dict]) -> str:
  """Markdown: each measured phase beside the planner's report of the same step.

  The measured peak is the allocator's (``-`` where the step ran out of
  memory); ``device / planner`` compares XLA's analysis of the step compiled
  on the device with the planner's deviceless one.

  A plan matches a phase by preset, optimizer, batch, update-in-backward and
  SkewAdam's tiers; ``same program`` says whether their step fingerprints
  (:func:`experiments.planning.planner.step_fingerprint`) agree, where the
  phase recorded one.
  """
  by_key = {_key(p): p for p in plans}
  gb = lambda b: f"{b / 1e9:.3f}" if b else "-"  # noqa: E731
  rows = ["| preset | optimizer | tiers | batch | update in backward | status | measured peak GB "
          "| XLA's peak on the device GB | planner's peak GB (target) | device / planner "
          "| same program | compile s | median step s | tokens/s | MFU "
          "| estimated step s (roofline) | measured / estimated |",
          "|" + "---|" * 17]
  for r in phases:
    if r.get("status") in ("crashed", "timed_out") or "xla" not in r:
      rows.append(f"| {r.get('preset')} | {r.get('optimizer')} | | {r.get('batch')} | | "
                  f"{r.get('status')} |" + " |" * 11)
      continue
    plan = by_key.get(_key(r))
    measured = r.get("peak_bytes_in_use") if r["status"] == "ok" else None
    tiers = _tiers(r)
    tiers_text = "-" if tiers is None else (json.dumps(tiers, sort_keys=True) if tiers
                                            else "skewadam() (library)")
    same = ("-" if not plan or "step_fingerprint" not in r
            else "yes" if r["step_fingerprint"] == plan["step_fingerprint"] else "no")
    ratio = f"{r['xla']['peak'] / plan['peak_bytes']:.4f}" if plan else "-"
    planned = f"{gb(plan['peak_bytes'])} ({plan['target']})" if plan else "-"
    step_s = f"{r['median_step_seconds']:.3f}" if "median_step_seconds" in r else "-"
    tokens = f"{r['tokens_per_second']:.0f}" if "tokens_per_second" in r else "-"
    mfu = f"{r['mfu']:.3f}" if "mfu" in r else "-"
    estimate = r.get("estimate")
    estimated = f"{estimate['step_seconds']:.3f}" if estimate else "-"
    off = (f"{r['median_step_seconds'] / estimate['step_seconds']:.2f}"
           if estimate and "median_step_seconds" in r else "-")
    rows.append(
        f"| {r['preset']} | {r['optimizer']} | {tiers_text.replace('|', '/')} | {r['batch']} "
        f"| {'yes' if r.get('update_in_backward') else 'no'} | {r['status']} "
        f"| {gb(measured)} | {gb(r['xla']['peak'])} "
        f"| {planned} "
        f"| {ratio} "
        f"| {same} | {r['compile_seconds']:.1f} | {step_s} | {tokens} | {mfu} "
        f"| {estimated} | {off} |")
  return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if argv and argv[0] == "--table":  # --table PHASES.jsonl PLAN.json ...: no JAX started
    phases = [json.loads(l) for l in open(argv[1], encoding="utf-8") if l.strip()]
    plans = [json.load(open(p, encoding="utf-8")) for p in argv[2:]]
    print(comparison_table(phases, plans))
    return 0
  experiments.use_cpu_without_gpu()
  args = build_parser().parse_args(argv)
  if args.phase:  # a child process: one optimizer, a fresh memory pool
    cap = _cap_memory(args.cap_gb)
    result = run_phase(args.preset, args.phase, batch=args.batch_size, seq=args.seq_len,
                       steps=args.steps,
                       update_in_backward=args.update_in_backward, clip_mode=args.clip_mode,
                       skewadam_tiers=config_lib.tiers_from_args(args),
                       peak_flops=args.peak_tflops and args.peak_tflops * 1e12,
                       settings={name: getattr(args, name) for name in PHASE_SETTINGS
                                 if getattr(args, name) is not None})
    print(json.dumps({**cap, **result}), flush=True)
    return 0
  # Each optimizer in its own process, so the peak and an OOM of one phase do
  # not leak into the other.
  for name in args.optimizers.split(","):
    # The same flags (the last of a repeated one wins), one optimizer.
    cmd = [sys.executable, "-m", "experiments.gpu_check", *argv, "--phase", name]
    phase = {"preset": args.preset, "optimizer": name, "batch": args.batch_size}
    try:
      out = subprocess.run(cmd, capture_output=True, text=True, check=False,
                           timeout=args.phase_timeout)
      lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
      line = lines[-1] if lines else json.dumps(
          {**phase, "status": "crashed", "returncode": out.returncode,
           "stderr_tail": out.stderr[-800:]})
    except subprocess.TimeoutExpired:
      line = json.dumps({**phase, "status": "timed_out", "phase_timeout": args.phase_timeout})
    print(line, flush=True)
    if args.out:
      with open(args.out, "a", encoding="utf-8") as f:
        f.write(line + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
