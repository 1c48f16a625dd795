"""Memory planner (library): will this train step fit this GPU? Asked of XLA, without the GPU.

For a preset and an optimizer, :func:`plan` reports

* exact bytes from abstract shapes (``nnx.eval_shape`` / ``jax.eval_shape``;
  nothing is allocated): parameters, gradients (same dtype as the
  parameters), optimizer state by tier;
* XLA's compiled memory analysis of the whole jitted train step (forward,
  backward, optimizer update; parameters and optimizer state donated): the very
  ``train_step`` of :func:`experiments.steps.make_step_fns`, compiled for the
  target GPU on a machine without one ("deviceless" compilation against the
  target description in ``experiments/gpu_targets/``).
  ``peak = argument + output − alias + temp``;
* the verdict against the device's memory less a safety margin (2 GB by
  default: CUDA context, cuBLAS/cuDNN workspaces, fragmentation), and the
  largest batch that fits (doubling, then bisection).

``python -m experiments.memory`` is the command around it. A command that
compiles for a GPU target calls :func:`use_deviceless_gpu_environment` in its
``main``, before JAX starts; importing this module changes nothing.
"""

from __future__ import annotations

import functools
import math
import os
import pathlib
import re
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp

import skewadam_jax
from skewadam_jax import startup
import experiments
from experiments import optimizers
from experiments import steps as steps_lib
from experiments import update_in_backward as uib

TARGET_DIR = pathlib.Path(__file__).resolve().parent / "gpu_targets"
TARGETS = {"a100-40gb": "a100_sxm_40gb.txtpb", "h100-80gb": "h100_sxm.txtpb", "cpu": None}
CPU_WARNING = ("compiled for the CPU, not the GPU: XLA:CPU reports 2.5-4x the GPU's "
               "temporaries (bf16 upcast to f32, ragged_dot computed densely); "
               "install the gpu-compile extra for a GPU figure")
GB = 1e9
XLA_REMAT_WARNINGS = (
    r"hlo_rematerialization\.cc:\d+\] Can't reduce memory use below",
    *startup.CUDA_PLUGIN_NOISE)


def target_device_bytes(target: str) -> int | None:
  """Device memory of a GPU target, read from its description."""
  if TARGETS.get(target) is None:
    return None
  text = (TARGET_DIR / TARGETS[target]).read_text()
  return int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))


@functools.lru_cache(maxsize=None)
def use_deviceless_gpu_environment() -> None:
  """Sets what deviceless GPU compilation needs; call before JAX starts a backend.

  The CPU as the only runtime platform, and XLA:GPU's CUB radix sort off: it
  asks the CUDA runtime (absent here) for scratch space on sorts of 65,536 or
  more elements. Commands that compile for a GPU target without one
  (``memory``, ``bench --update-temp``) call it first thing in ``main``;
  importing this module changes nothing, so a process on a real GPU
  (``gpu_check``) keeps the sort training uses.
  """
  if "JAX_PLATFORMS" not in os.environ:
    experiments.use_platforms("cpu")
  if "--xla_gpu_enable_cub_radix_sort" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_enable_cub_radix_sort=false").strip()


def target_sharding(target: str):
  """(sharding, warning) to compile for: the GPU target's one device, or the CPU."""
  if target not in TARGETS:
    raise ValueError(f"unknown target {target!r}; choose from {', '.join(TARGETS)}")
  if TARGETS[target] is not None:
    try:
      from jax.experimental import topologies
      topology = topologies.get_topology_desc(
          platform="cuda", target_config=(TARGET_DIR / TARGETS[target]).read_text(),
          topology="1x1x1")
      mesh = topologies.make_mesh(topology, (1,), ("x",))
      return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), None
    except Exception as err:  # pylint: disable=broad-except
      warning = f"GPU compiler unavailable ({type(err).__name__}: {str(err)[:120]}); {CPU_WARNING}"
      warnings.warn(warning)
      return jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]), warning
  return jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0]), CPU_WARNING


def gpu_compile_available(target: str = "a100-40gb") -> bool:
  """Whether deviceless compilation for ``target`` works in this environment."""
  return target_sharding(target)[1] is None


def abstract_model(preset: str, param_dtype: Any = jnp.bfloat16, **overrides):
  """(model config, graphdef, abstract params, abstract rest); bf16 by default."""
  return steps_lib.abstract_model(preset, param_dtype, **overrides)


def make_tx(optimizer: str, preset: str, skewadam_tiers: dict | None = None, *,
            update_in_backward: bool = False):
  """The training command's optimizer for ``preset`` (schedule values do not change memory).

  With ``update_in_backward``: the per-slice optimizer of that step (built for
  :func:`~experiments.update_in_backward.slice_axes`, clipping done by the step).
  """
  axes = steps_lib.abstract_axes(preset)
  if update_in_backward:
    axes = uib.slice_axes(axes)
  return optimizers.make_optimizer(
      optimizer, learning_rate=optimizers.lr_schedule(1e-3, 1000, 100), axes=axes,
      skewadam_tiers=skewadam_tiers, clip_norm=0 if update_in_backward else 1.0)


def abstract_train_step(preset: str, optimizer: str, *, skewadam_tiers: dict | None = None,
                        param_dtype: Any = jnp.bfloat16, update_in_backward: bool = False,
                        clip_mode: str = "exact", **overrides):
  """(train step, abstract params, abstract optimizer state) as the training command builds them."""
  _, graphdef, params, rest = abstract_model(preset, param_dtype, **overrides)
  tx = make_tx(optimizer, preset, skewadam_tiers, update_in_backward=update_in_backward)
  if update_in_backward:
    train_step = uib.make_train_step(graphdef, rest, tx, clip_norm=1.0, clip_mode=clip_mode)
    return train_step, params, jax.eval_shape(lambda p: uib.init(tx, p), params)
  train_step, _ = steps_lib.make_step_fns(graphdef, rest, tx)
  return train_step, params, jax.eval_shape(tx.init, params)


def with_sharding(tree, sharding):
  """``tree``'s shapes and dtypes as ``ShapeDtypeStruct``s placed with ``sharding``."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def compile_step(preset: str, optimizer: str, *, batch: int, seq: int,
                 target: str = "a100-40gb", skewadam_tiers: dict | None = None,
                 param_dtype: Any = jnp.bfloat16, update_in_backward: bool = False,
                 clip_mode: str = "exact", **overrides) -> dict:
  """XLA's memory analysis of the donated train step, compiled for ``target``, and
  its :func:`matmul_flops`."""
  train_step, params, opt_state = abstract_train_step(
      preset, optimizer, skewadam_tiers=skewadam_tiers, param_dtype=param_dtype,
      update_in_backward=update_in_backward, clip_mode=clip_mode, **overrides)
  sharding, warning = target_sharding(target)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=sharding)
  args = (with_sharding(params, sharding), with_sharding(opt_state, sharding), tokens, tokens)
  # XLA warns when rematerialisation cannot reach its own memory target; the
  # report says whether the step fits, so those lines are not passed on.
  with startup.filtered_stderr(XLA_REMAT_WARNINGS):
    compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(*args).compile()
  analysis = compiled.memory_analysis()
  xla = {"argument": int(analysis.argument_size_in_bytes),
         "output": int(analysis.output_size_in_bytes),
         "alias": int(analysis.alias_size_in_bytes),
         "temp": int(analysis.temp_size_in_bytes)}
  xla["peak"] = xla["argument"] + xla["output"] - xla["alias"] + xla["temp"]
  return {"xla": xla, "matmul_flops": matmul_flops(train_step, *args), "warning": warning}


def matmul_flops(fn, *args) -> int:
  """Matrix-multiply FLOPs of one call of ``fn(*args)``, counted from its jaxpr.

  ``2 · |output| · |contracted axes|`` per ``dot_general`` (and ``ragged_dot``
  as if dense), each ``scan`` body times its length, the larger branch of a
  ``cond``, every rematerialised recompute where the backward pass has it.
  Not XLA's compiled ``cost_analysis()``: that counts a loop body once,
  whatever its trip count, so a scanned layer stack would look as cheap as one
  layer. Elementwise work (norms, softmax, the optimizer update) is left out:
  it is a small share of a transformer step.
  """
  return _jaxpr_matmul_flops(jax.make_jaxpr(fn)(*args).jaxpr)


def _sub_jaxprs(value):
  if hasattr(value, "eqns"):
    yield value
  elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
    yield value.jaxpr
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _sub_jaxprs(item)


def _jaxpr_matmul_flops(jaxpr) -> int:
  total = 0
  for eqn in jaxpr.eqns:
    name = eqn.primitive.name
    if name in ("dot_general", "ragged_dot", "ragged_dot_general"):
      lhs = eqn.invars[0].aval.shape
      out = eqn.outvars[0].aval.shape
      if name == "dot_general":
        contract = math.prod(lhs[i] for i in eqn.params["dimension_numbers"][0][0])
      else:
        contract = lhs[-1]
      total += 2 * math.prod(out) * contract
      continue
    subs = [f for v in eqn.params.values() for f in [_jaxpr_matmul_flops(j) for j in _sub_jaxprs(v)]]
    if not subs:
      continue
    if name == "cond":
      total += max(subs)
    elif name == "scan":
      total += eqn.params["length"] * sum(subs)
    else:
      total += sum(subs)
  return total


def _fits(peak: int, device_bytes: int | None, margin_bytes: int) -> bool | None:
  return None if device_bytes is None else peak + margin_bytes <= device_bytes


def max_batch_that_fits(peak_at, device_bytes: int, margin_bytes: int, *,
                        limit: int = 1024) -> int:
  """Largest batch ``b <= limit`` with ``peak_at(b) + margin <= device_bytes`` (0 if none).

  Doubles from 1 until a batch does not fit, then bisects; assumes the peak
  grows with the batch.
  """
  fits = lambda b: peak_at(b) + margin_bytes <= device_bytes
  if not fits(1):
    return 0
  good = 1
  while good < limit and fits(min(2 * good, limit)):
    good = min(2 * good, limit)
  bad = min(2 * good, limit + 1)
  while bad - good > 1:
    mid = (good + bad) // 2
    good, bad = (mid, bad) if fits(mid) else (good, mid)
  return good


def plan(preset: str, optimizer: str, *, target: str = "a100-40gb", batch: int = 1,
         seq: int | None = None, margin_gb: float = 2.0, skewadam_tiers: dict | None = None,
         param_dtype: Any = jnp.bfloat16, search_batch: bool = True,
         update_in_backward: bool = False, clip_mode: str = "exact",
         device_memory_gb: float | None = None, progress=None) -> dict:
  """The planner's report (see the module docstring); JSON-serialisable.

  ``device_memory_gb`` checks the fit against a device of that size instead
  of the target's own memory (same margin rule), e.g. 24 for a 24 GB card.
  ``progress(message)``, if given, is told about each compile.
  """
  if batch < 1:
    raise ValueError(f"--batch must be >= 1, got {batch}")
  if clip_mode not in uib.CLIP_MODES:
    raise ValueError(f"--clip-mode must be one of {', '.join(uib.CLIP_MODES)}, got {clip_mode!r}")
  if device_memory_gb is not None and not device_memory_gb > 0:
    raise ValueError(f"--device-memory-gb must be > 0, got {device_memory_gb}")
  config, _, params, _ = abstract_model(preset, param_dtype)
  seq = seq or config.max_seq_len
  if not 1 <= seq <= config.max_seq_len:
    raise ValueError(f"--seq must be in [1, {config.max_seq_len}] for {preset}, got {seq}")
  _, _, opt_state = abstract_train_step(preset, optimizer, skewadam_tiers=skewadam_tiers,
                                        param_dtype=param_dtype,
                                        update_in_backward=update_in_backward)
  state_by_tier = skewadam_jax.state_bytes_by_tier(opt_state)
  param_bytes = skewadam_jax.tree_bytes(params)
  if update_in_backward:  # one layer's slice and the parameters outside the stack
    layer_part, outer_part = uib.split_layers(params)
    num_layers = jax.tree.leaves(layer_part)[0].shape[0]
    grad_bytes = (skewadam_jax.tree_bytes(layer_part) // num_layers
                  + skewadam_jax.tree_bytes(outer_part))
  else:
    grad_bytes = param_bytes
  step_options = dict(seq=seq, target=target, skewadam_tiers=skewadam_tiers,
                      param_dtype=param_dtype, update_in_backward=update_in_backward,
                      clip_mode=clip_mode)

  def compile_at(b):
    if progress:
      progress(f"compiling the train step at batch {b} x {seq} for {target}")
    return compile_step(preset, optimizer, batch=b, **step_options)

  compiled = compile_at(batch)
  device_bytes = (int(device_memory_gb * GB) if device_memory_gb is not None
                  else target_device_bytes(target))
  margin_bytes = int(margin_gb * GB)
  report = {
      "preset": preset, "optimizer": optimizer, "skewadam_tiers": skewadam_tiers or {},
      "target": target, "batch": batch, "seq": seq,
      "param_dtype": jnp.dtype(param_dtype).name,
      "update_in_backward": update_in_backward,
      "clip_mode": clip_mode if update_in_backward else None,
      "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
      "param_bytes": param_bytes, "grad_bytes": grad_bytes,
      "opt_state_bytes": state_by_tier["total"], "opt_state_bytes_by_tier": state_by_tier,
      "xla": {k: v for k, v in compiled["xla"].items() if k != "peak"},
      "matmul_flops": compiled["matmul_flops"],
      "peak_bytes": compiled["xla"]["peak"],
      "device_bytes": device_bytes, "margin_bytes": margin_bytes,
      "fits": _fits(compiled["xla"]["peak"], device_bytes, margin_bytes),
      "max_batch_that_fits": None,
      "compiled_for": "cpu" if compiled["warning"] else target,
      "warning": compiled["warning"],
  }
  if search_batch and device_bytes is not None:
    peaks = {batch: compiled["xla"]["peak"]}

    def peak_at(b):
      if b not in peaks:
        peaks[b] = compile_at(b)["xla"]["peak"]
        if progress:
          verdict = "fits" if _fits(peaks[b], device_bytes, margin_bytes) else "does not fit"
          progress(f"batch {b}: peak {peaks[b] / GB:.2f} GB, {verdict}")
      return peaks[b]

    report["max_batch_that_fits"] = max_batch_that_fits(peak_at, device_bytes, margin_bytes)
    report["peak_bytes_by_batch"] = {str(b): p for b, p in sorted(peaks.items())}
  return report


def markdown_table(reports: Sequence[dict]) -> str:
  """A Markdown table of planner reports (as written by ``--json``)."""
  lines = ["| optimizer | configuration | state | peak at batch 1 | fits (2 GB margin) "
           "| largest batch that fits |", "|---|---|---|---|---|---|"]
  for r in reports:
    config = ", ".join(f"{tier}: " + "/".join(f"{v}" for v in spec.values())
                       for tier, spec in r.get("skewadam_tiers", {}).items()) or "defaults"
    if r["optimizer"] != "skewadam":
      config = "fp32 state"
    if r.get("update_in_backward"):
      config += f", update in backward ({r['clip_mode']} clip)"
    lines.append(f"| {r['optimizer']} | {config} | {r['opt_state_bytes'] / GB:.2f} GB "
                 f"| {r['peak_bytes'] / GB:.2f} GB | {'yes' if r['fits'] else 'no'} "
                 f"| {r['max_batch_that_fits']} |")
  return "\n".join(lines)
