"""Memory planner (library): will this train step fit this GPU? Asked of XLA, without the GPU.

For a preset and an optimizer, :func:`plan` reports

* exact bytes from abstract shapes (``nnx.eval_shape`` / ``jax.eval_shape``;
  nothing is allocated): parameters, gradients (same dtype as the
  parameters), optimizer state by tier;
* XLA's compiled memory analysis of the whole jitted train step (forward,
  backward, optimizer update; parameters and optimizer state donated): the very
  ``train_step`` of :func:`experiments.training.steps.make_step_fns`, compiled for the
  target GPU on a machine without one ("deviceless" compilation against the
  target description in ``experiments/planning/gpu_targets/``).
  ``peak = argument + output − alias + temp``;
* the verdict against the device's memory less a safety margin (2 GB by
  default: CUDA context, cuBLAS/cuDNN workspaces, fragmentation), and the
  largest batch that fits (doubling, then bisection);
* ``flops_efficiency``: the step's useful FLOPs (:func:`useful_flops`) over
  the matrix-multiply FLOPs it computes (:func:`matmul_flops`).

With ``devices=N`` the step is compiled for N devices of the target (an
N-GPU node, or N TPU chips), with the training command's mesh and shardings
(:mod:`experiments.training.mesh`; the batch split over ``data``): the memory figures
are then one device's (XLA's analysis of the SPMD program), the batch is the
global one, and the report adds the bytes each collective kind handles per
device per step (:func:`experiments.planning.hlo.collective_bytes`).

TPU targets (``tpu-v5e``, ``tpu-v5p``, ``tpu-v6e``) compile through libtpu's
ahead-of-time compiler, also without the hardware (the ``tpu-compile``
extra).

``python -m experiments.memory`` is the command around it. A command that
compiles for a GPU target calls :func:`use_deviceless_gpu_environment` in its
``main``, before JAX starts; importing this module changes nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import importlib.util
import math
import os
import pathlib
import re
import warnings
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

import models
import skewadam_jax
from experiments import startup
import experiments
from experiments.training import config as config_lib
from experiments.planning import hlo
from experiments.planning import orthogonal_cost
from experiments.planning import roofline
from experiments.training import mesh as mesh_lib
from experiments.training import steps as steps_lib

TARGET_DIR = pathlib.Path(__file__).resolve().parent / "gpu_targets"
# GPU descriptions for deviceless compiles. The A100 and H100 files are what
# XLA reports on those GPUs; h200_sxm.txtpb is the H100's (the same Hopper
# die) with the H200's datasheet memory, 141 GB, and bandwidth, 4.8 TB/s, not
# read from a real H200: the memory a JAX process sees there may differ.
TARGETS = {"a100-40gb": "a100_sxm_40gb.txtpb", "h100-80gb": "h100_sxm.txtpb",
           "h200": "h200_sxm.txtpb", "cpu": None}
CPU_WARNING = ("compiled for the CPU, not the GPU: XLA:CPU reports 2.5-4x the GPU's "
               "temporaries (bf16 upcast to f32, ragged_dot computed densely); "
               "install the gpu-compile extra for a GPU figure")
GB = 1e9
XLA_REMAT_WARNINGS = (
    r"hlo_rematerialization\.cc:\d+\] Can't reduce memory use below",
    # XLA:GPU's scheduler, when the arguments alone exceed the device: the
    # report says so.
    r"gpu_hlo_schedule\.cc:\d+\] The byte size of input/output arguments",
    *startup.CUDA_PLUGIN_NOISE)


@dataclasses.dataclass(frozen=True)
class TpuTarget:
  """A TPU generation as a compile target.

  Attributes:
    generation: libtpu's name in topology strings (``"v6e"``).
    accelerator_type: Cloud TPU's accelerator type for ``n`` chips, as the
      TPU runtime spells it (``v5p`` counts TensorCores, two a chip).
    hbm_bytes: memory per chip (the Cloud TPU documentation's figure in GB;
      the compile-only topology does not report it).
    topologies: chip count -> topology (``"2x4"``): the slice shapes Cloud
      TPU offers (v5p's smallest is 4 chips; its one-chip entry plans a chip
      alone).
  """
  generation: str
  accelerator_type: str
  hbm_bytes: int
  topologies: dict


# HBM per chip from https://cloud.google.com/tpu/docs/v5e, /v5p and /v6e
# ("HBM capacity per chip": 16 GB, 95 GB, 32 GB).
TPU_TARGETS = {
    "tpu-v5e": TpuTarget("v5e", "v5litepod-{n}", 16 * 10**9,
                         {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8"}),
    "tpu-v5p": TpuTarget("v5p", "v5p-{cores}", 95 * 10**9,
                         {1: "1x1x1", 4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4",
                          64: "4x4x4"}),
    "tpu-v6e": TpuTarget("v6e", "v6e-{n}", 32 * 10**9,
                         {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8"}),
}
ALL_TARGETS = (*TARGETS, *TPU_TARGETS)
TPU_COMPILE_HINT = "pip install -e '.[tpu-compile]'"


def fsdp_text(fsdp) -> str:
  """How a report's ``fsdp`` reads in a table's layout column."""
  return (", fsdp by experts" if fsdp == mesh_lib.FSDP_EXPERTS else ", fsdp" if fsdp
          else "")


def target_device_bytes(target: str) -> int | None:
  """Memory of one device of ``target``: a GPU's from its description, a TPU chip's HBM."""
  if target in TPU_TARGETS:
    return TPU_TARGETS[target].hbm_bytes
  if TARGETS.get(target) is None:
    return None
  text = (TARGET_DIR / TARGETS[target]).read_text()
  return int(re.search(r"device_memory_size:\s*(\d+)", text).group(1))


def _check_target(target: str) -> None:
  if target not in ALL_TARGETS:
    raise ValueError(f"unknown target {target!r}; choose from {', '.join(ALL_TARGETS)}")


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


def use_host_devices(count: int) -> None:
  """Gives this process ``count`` CPU devices (``--target cpu --devices N``).

  Call before JAX starts a backend; an ``XLA_FLAGS`` that already sets the
  count wins.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def target_sharding(target: str):
  """(sharding, warning) to compile for: the GPU target's one device, or the CPU."""
  _check_target(target)
  if target in TPU_TARGETS:
    return jax.sharding.SingleDeviceSharding(target_devices(target, 1)[0][0]), None
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


def tpu_compile_available() -> bool:
  """Whether libtpu (the ``tpu-compile`` extra) is installed, for the TPU targets."""
  try:
    return importlib.util.find_spec("libtpu") is not None
  except ModuleNotFoundError:
    return False


def check_tpu_target(target: str, count: int) -> None:
  """Raises a one-line ValueError unless ``count`` chips of TPU ``target`` can be compiled for."""
  spec = TPU_TARGETS[target]
  if count not in spec.topologies:
    raise ValueError(f"--devices {count} is not a {target} slice; choose from "
                     f"{', '.join(map(str, spec.topologies))} chips")
  if not tpu_compile_available():
    raise ValueError(f"--target {target} needs libtpu, the TPU compiler: {TPU_COMPILE_HINT}")


def _tpu_devices(target: str, count: int) -> list:
  check_tpu_target(target, count)
  spec = TPU_TARGETS[target]
  shape = spec.topologies[count]
  bounds = [int(d) for d in shape.split("x")] + [1] * (3 - shape.count("x") - 1)
  # libtpu reads these when it loads; a compile-only process has no TPU to ask
  # (unset, libtpu prints host-bounds and worker-hostname errors), shares no
  # chip with other processes (libtpu otherwise takes a lock file for the
  # host's TPUs), and wants the analysis of a step that does not fit (by
  # default XLA:TPU refuses to compile it: RESOURCE_EXHAUSTED).
  os.environ.setdefault("TPU_ACCELERATOR_TYPE",
                        spec.accelerator_type.format(n=count, cores=2 * count))
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  if "xla_tpu_no_crash_on_oom" not in os.environ.get("LIBTPU_INIT_ARGS", ""):
    os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "")
                                      + " --xla_tpu_no_crash_on_oom=true").strip()
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  # One host holding the whole slice: the default host shape (2x2x1) cannot
  # describe one chip, and a compile does not care where the hosts are.
  topology = topologies.get_topology_desc(
      platform="tpu", topology_name=f"{spec.generation}:{shape}",
      chips_per_host_bounds=bounds)
  return list(topology.devices)


def target_devices(target: str, count: int) -> tuple[list, str | None]:
  """(``count`` devices of ``target`` to compile for, warning).

  GPU targets: an N-GPU node of the target (``topology="1xNx1"``), without
  GPUs; the CPU with a warning where the GPU compiler is missing and this
  process has ``count`` CPU devices. TPU targets: ``count`` chips of that
  generation (one of :data:`TPU_TARGETS`' slice shapes), without TPUs. The
  CPU target: this process's CPU devices
  (``XLA_FLAGS=--xla_force_host_platform_device_count=N`` makes N).

  Raises:
    ValueError: for an unknown target, a count that target cannot have, or
      a missing compiler that nothing stands in for (one line, naming the fix).
  """
  _check_target(target)
  if count < 1:
    raise ValueError(f"--devices must be >= 1, got {count}")
  if target in TPU_TARGETS:
    return _tpu_devices(target, count), None
  warning = CPU_WARNING
  if TARGETS[target] is not None:
    try:
      from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
      topology = topologies.get_topology_desc(
          platform="cuda", target_config=(TARGET_DIR / TARGETS[target]).read_text(),
          topology=f"1x{count}x1")
      return list(topology.devices), None
    except Exception as err:  # pylint: disable=broad-except
      warning = f"GPU compiler unavailable ({type(err).__name__}: {str(err)[:120]}); {CPU_WARNING}"
  cpus = jax.devices("cpu")
  if len(cpus) < count:
    raise ValueError(
        f"--devices {count} on the CPU needs {count} CPU devices, this process has "
        f"{len(cpus)} (XLA_FLAGS=--xla_force_host_platform_device_count={count}, or the "
        "gpu-compile extra for a GPU target)")
  if TARGETS[target] is not None:
    warnings.warn(warning)
  return cpus[:count], warning


def default_layout(devices: int, num_experts: int, *,
                   expert_parallel: bool = False) -> tuple[dict[str, int], bool]:
  """The planner's default ``(mesh, fsdp)`` for ``devices``: what fits best as measured.

  With the expert-parallel MoE (tokens sent to their experts' devices), the
  expert banks split over ``expert`` as far as the counts allow
  (:func:`default_mesh_shape`), the batch over both axes, and FSDP splits the
  backbone over both axes too (``moe-47b`` on 8 x A100-40GB: 30.11 GB a
  device and 40 sequences, against 43.64 GB, not fitting, with the backbone
  replicated; docs/guides/scaling-out.md, "Past one machine"). With the
  dropless lowerings (blocked, ragged, dense), an expert axis makes XLA
  gather whole banks to the tokens and devices repeat each other's work
  (docs/guides/scaling-out.md, "Past one machine"), so every device takes a share of the batch
  (``data = devices``) and every matrix is split over ``data`` (FSDP,
  parameters, gradients and optimizer state alike). One device: no FSDP.

  Example:
    >>> default_layout(8, 8), default_layout(8, 8, expert_parallel=True)
    (({'data': 8, 'expert': 1}, True), ({'data': 1, 'expert': 8}, True))
  """
  if expert_parallel:
    return default_mesh_shape(devices, num_experts), devices > 1
  return {"data": devices, "expert": 1}, devices > 1


def default_mesh_shape(devices: int, num_experts: int) -> dict[str, int]:
  """The mesh that splits the experts furthest: ``expert = gcd(devices, num_experts)``.

  The expert banks split as far as both counts allow (one expert per device
  when there are as many experts as devices), and the devices left over
  split the batch: ``data = devices / expert``.

  Example:
    >>> default_mesh_shape(8, 8), default_mesh_shape(8, 64), default_mesh_shape(12, 8)
    ({'data': 1, 'expert': 8}, {'data': 1, 'expert': 8}, {'data': 3, 'expert': 4})
  """
  expert = math.gcd(devices, num_experts)
  return {"data": devices // expert, "expert": expert}


def mesh_shape(devices: int, num_experts: int, spec: str | None = None) -> dict[str, int]:
  """``{"data": a, "expert": b}`` for ``devices`` from a ``--mesh`` spec, or
  :func:`default_mesh_shape`.

  An axis left out of ``spec`` takes what the other leaves (``expert``
  defaults to 1 when only ``data`` is given).

  Raises:
    ValueError: one line, if the sizes do not multiply to ``devices`` or
      ``expert`` does not divide ``num_experts``.
  """
  if not spec:
    return default_mesh_shape(devices, num_experts)
  sizes = mesh_lib.parse_mesh(spec)
  if "data" in sizes and "expert" not in sizes:
    sizes["expert"] = devices // sizes["data"] if devices % sizes["data"] == 0 else 0
  if "expert" in sizes and "data" not in sizes:
    sizes["data"] = devices // sizes["expert"] if devices % sizes["expert"] == 0 else 0
  if not sizes or sizes.get("data", 0) * sizes.get("expert", 0) != devices:
    raise ValueError(f"--mesh {spec} does not fit --devices {devices}: data x expert must "
                     f"be {devices}")
  if num_experts % sizes["expert"]:
    raise ValueError(f"--mesh {spec}: expert={sizes['expert']} does not divide the "
                     f"{num_experts} experts")
  return {"data": sizes["data"], "expert": sizes["expert"]}


def train_config(preset: str, optimizer: str, *, skewadam_tiers: dict | None = None,
                 param_dtype: Any = jnp.bfloat16, update_in_backward: bool = False,
                 clip_mode: str = "exact", skip_nonfinite: int = 0,
                 stochastic_rounding: bool = False, moe_impl: str | None = None,
                 **settings) -> config_lib.TrainConfig:
  """The training command's :class:`~experiments.training.config.TrainConfig` for these settings.

  The planner plans the step this configuration's ``train`` runs
  (:func:`experiments.training.steps.build_step`); the schedule's values do not change
  memory, so the command's default schedule stands. ``settings`` are any
  other :class:`~experiments.training.config.TrainConfig` fields (the model's shape,
  the clip norm, ...).
  """
  config = config_lib.TrainConfig(
      preset=preset, optimizer=optimizer, param_dtype=jnp.dtype(param_dtype).name,
      update_in_backward=update_in_backward, clip_mode=clip_mode,
      skip_nonfinite=skip_nonfinite, stochastic_rounding=stochastic_rounding,
      moe_impl=moe_impl, **config_lib.tier_fields(skewadam_tiers or {}), **settings)
  config.validate()
  return config


def make_tx(optimizer: str, preset: str, skewadam_tiers: dict | None = None, *,
            update_in_backward: bool = False):
  """The training command's optimizer for ``preset`` (:func:`experiments.training.steps.make_tx`)."""
  config = train_config(preset, optimizer, skewadam_tiers=skewadam_tiers,
                        update_in_backward=update_in_backward)
  return steps_lib.make_tx(config, steps_lib.abstract_axes(preset))


def abstract_train_step(preset: str, optimizer: str, **settings):
  """(train step, abstract params, abstract optimizer state) as the training command builds
  them (``settings``: :func:`train_config`'s)."""
  step, params, opt_state = steps_lib.abstract_step(train_config(preset, optimizer, **settings))
  return step.train_step, params, opt_state


def with_sharding(tree, sharding):
  """``tree``'s shapes and dtypes as ``ShapeDtypeStruct``s placed with ``sharding``."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def batch_shards(mesh: Mapping[str, int], expert_parallel: bool) -> int:
  """How many ways the global batch is split: over ``data``, and ``expert``
  too with the expert-parallel MoE layer (``experiments.training.mesh.batch_sharding``)."""
  return mesh["data"] * (mesh["expert"] if expert_parallel else 1)


def _batch_shards_text(mesh: Mapping[str, int], expert_parallel: bool) -> str:
  if expert_parallel:
    return f"data={mesh['data']} x expert={mesh['expert']} (expert parallelism)"
  return f"data={mesh['data']}"


def memory_analysis(compiled) -> dict:
  """XLA's memory analysis of a compiled step, in bytes.

  ``peak = argument + output − alias + temp``: the buffers live while the step
  runs, donated inputs counted once. This is the planner's estimate; on a real
  device, :mod:`experiments.gpu_check` sets it beside the allocator's measured peak.
  """
  analysis = compiled.memory_analysis()
  xla = {"argument": int(analysis.argument_size_in_bytes),
         "output": int(analysis.output_size_in_bytes),
         "alias": int(analysis.alias_size_in_bytes),
         "temp": int(analysis.temp_size_in_bytes)}
  xla["peak"] = xla["argument"] + xla["output"] - xla["alias"] + xla["temp"]
  return xla


def compile_step(config: config_lib.TrainConfig, *, batch: int, seq: int,
                 target: str = "a100-40gb", devices: int | None = None,
                 mesh: dict | None = None, fsdp: bool = False) -> dict:
  """XLA's memory analysis of the donated train step of ``config``'s run, compiled for
  ``target``, and its :func:`matmul_flops`.

  The step is :func:`experiments.training.steps.build_step`'s: the one ``train`` runs.
  With ``devices``: compiled for that many devices of ``target`` on a
  ``mesh`` (``{"data": a, "expert": b}``, default :func:`default_mesh_shape`)
  with the training command's shardings (``batch`` is the global batch, split
  over ``data``); the analysis is then one device's and the result adds
  ``collective_bytes`` (:func:`experiments.planning.hlo.collective_bytes`, layer loops
  of unknown trip count taken as the preset's layer count). A TPU target
  always compiles this way (one chip by default).
  """
  step, params, opt_state = steps_lib.abstract_step(config)
  model_config = config.model_config()
  train_step = step.train_step
  if devices is None and target in TPU_TARGETS:
    devices = 1
  rows = batch * config.accumulate  # the step's batch: its micro-batches together
  if devices is None:
    sharding, warning = target_sharding(target)
    tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32, sharding=sharding)
    args = (with_sharding(params, sharding), with_sharding(opt_state, sharding), tokens, tokens)
    kwargs = _step_kwargs(config)
    # XLA warns when rematerialisation cannot reach its own memory target; the
    # report says whether the step fits, so those lines are not passed on.
    with startup.filtered_stderr(XLA_REMAT_WARNINGS):
      compiled = jax.jit(train_step, donate_argnums=(0, 1)).lower(*args, **kwargs).compile()
    text = compiled.as_text()
    return {"xla": memory_analysis(compiled), "matmul_flops": _step_matmul_flops(train_step, args, kwargs),
            "device_matmul_flops": hlo.device_matmul_flops(text, model_config.num_layers),
            "estimate": estimate_step(text, target, model_config.num_layers, warning),
            "warning": warning, "fingerprint": step_fingerprint(compiled)}

  mesh = mesh or default_mesh_shape(devices, model_config.num_experts)
  expert_parallel = model_config.moe_impl == "expert_parallel"
  if batch % batch_shards(mesh, expert_parallel):
    raise ValueError(f"--batch-size {batch} does not split over the mesh's "
                     f"{_batch_shards_text(mesh, expert_parallel)}")
  device_list, warning = target_devices(target, devices)
  device_mesh = mesh_lib.make_mesh(mesh["data"], mesh["expert"], devices=device_list)
  shardings = mesh_lib.train_shardings(
      device_mesh, step.tx, params, axes=steps_lib.abstract_axes(config.preset), fsdp=fsdp,
      expert_parallel=expert_parallel, state_shardings=step.state_shardings)
  tokens = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
  kwargs = _step_kwargs(config)
  flops = _step_matmul_flops(train_step, (params, opt_state, tokens, tokens), kwargs)
  try:
    with startup.filtered_stderr(XLA_REMAT_WARNINGS):
      compiled = mesh_lib.sharded_train_step(train_step, shardings).lower(
          params, opt_state, tokens, tokens, kwargs).compile()
  except jax.errors.JaxRuntimeError as err:
    # XLA:TPU still refuses a single buffer larger than the chip's memory.
    if target not in TPU_TARGETS or "RESOURCE_EXHAUSTED" not in str(err):
      raise
    return {"xla": None, "out_of_memory": str(err).splitlines()[0][:300],
            "matmul_flops": flops, "device_matmul_flops": None, "collectives": None,
            "estimate": None,
            "warning": warning, "fingerprint": None}
  text = compiled.as_text()
  return {"xla": memory_analysis(compiled), "matmul_flops": flops,
          "device_matmul_flops": hlo.device_matmul_flops(text, model_config.num_layers),
          "estimate": estimate_step(text, target, model_config.num_layers, warning),
          "collectives": hlo.collective_bytes(text, default_trip_count=model_config.num_layers),
          "warning": warning, "fingerprint": step_fingerprint(compiled),
          "per_device_param_bytes": _shard_bytes(params, shardings.params),
          "per_device_opt_state_bytes": _shard_bytes(opt_state, shardings.opt_state)}


def estimate_step(hlo_text: str, target: str, num_layers: int, warning) -> dict | None:
  """The roofline step-time estimate of a program compiled for a GPU target (else None)."""
  if warning or target not in roofline.TARGETS:
    return None
  return roofline.estimate(hlo_text, target, default_trip_count=num_layers).to_json()


def step_time_report(estimate: dict | None, config, *, batch: int, seq: int, accumulate: int,
                     target: str, devices: int) -> dict | None:
  """Estimated step seconds, tokens/s and MFU at ``batch`` (× ``accumulate``) from an estimate."""
  if estimate is None:
    return None
  return {"batch": batch, **estimate,
          **roofline.throughput(estimate["seconds"], tokens=batch * accumulate * seq,
                                target=target, devices=devices,
                                useful_flops=useful_flops(config, batch * accumulate, seq))}


def _step_matmul_flops(train_step, args, kwargs) -> int:
  """:func:`matmul_flops` of ``train_step(*args, **kwargs)``, the keywords traced too."""
  names = sorted(kwargs)

  def positional(*values):
    return train_step(*values[:len(args)], **dict(zip(names, values[len(args):])))
  return matmul_flops(positional, *args, *(kwargs[n] for n in names))


def _step_kwargs(config) -> dict:
  """The train step's keyword arguments a run passes: the stochastic-rounding key."""
  if not config.stochastic_rounding:
    return {}
  return {"key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype)}


def step_fingerprint(compiled) -> str:
  """A hash of the compiled step's program: every instruction's shape and opcode, counted.

  Names, metadata (source lines, argument paths) and sharding annotations of a
  one-device program are left out, so the same step compiled from concrete
  arrays (the training command) and from placed shapes (the planner) hashes
  the same; another step (a missing ``apply_if_finite``, stochastic rounding,
  the layerwise loop) does not.
  """
  instructions = collections.Counter(
      f"{m.group(1)} {m.group(2)}" for m in re.finditer(
          r"^\s*(?:ROOT )?%\S+ = (.+?) ([a-z][a-z0-9-]*)\(", compiled.as_text(), re.M))
  text = "\n".join(f"{n} {k}" for k, n in sorted(instructions.items()))
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _shard_bytes(tree, shardings) -> int:
  return sum(math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
             for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))


def useful_flops(config, batch: int, seq: int) -> int:
  """FLOPs a step of ``config`` needs at ``batch`` x ``seq``, without waste.

  ``6 · N_active · B · T + 6 · L · B · T² · D``: forward (2 per multiply-add)
  and backward (twice the forward) over the parameters a token uses
  (``N_active``: all but the input embedding, a lookup, and the ``E − k`` of
  ``E`` experts a token skips), plus causal attention: ``QKᵀ`` and ``AV`` are
  ``2 · B · T² · D`` each per layer forward, halved by the causal mask, times
  3 for forward and backward (``12 · L · D · T² · B / 2``). Recomputation
  (remat), padding and dense masked work are what this leaves out.

  Example:
    >>> cfg = models.get_preset("tiny")
    >>> useful_flops(cfg, 1, 1) == 6 * (models.count_params(cfg)["total"] - 256 * 32
    ...     - models.count_params(cfg)["expert"] // 2) + 6 * 2 * 32
    True
  """
  counts = models.count_params(config)
  skipped = counts["expert"] * (config.num_experts - config.top_k) // config.num_experts
  active = counts["total"] - config.vocab_size * config.d_model - skipped
  tokens = batch * seq
  return 6 * active * tokens + 6 * config.num_layers * batch * seq * seq * config.d_model


def model_matmul_flops(config, batch: int, seq: int) -> int:
  """:func:`matmul_flops` of the model alone: the loss and its gradient, no optimizer.

  The same count a standard train step makes of its forward and backward
  passes (remat's recompute and the MoE lowering's padding included), from
  the model's jaxpr at ``batch`` x ``seq``; nothing is compiled, so any batch
  is cheap to count. The step's count less this one is the optimizer's.

  Example:
    >>> cfg = models.get_preset("tiny", moe_impl="blocked", remat=False)
    >>> model_matmul_flops(cfg, 2, 8) >= useful_flops(cfg, 2, 8)
    True
  """
  graphdef, params, rest, _ = steps_lib.abstract_split(config)
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

  def loss_and_grad(params, inputs, targets):
    loss = lambda p: models.lm_loss(nnx.merge(graphdef, p, rest), inputs, targets)
    return jax.value_and_grad(loss, has_aux=True)(params)
  return matmul_flops(loss_and_grad, params, tokens, tokens)


def model_flops_report(config, batch: int, seq: int, accumulate: int = 1) -> dict:
  """The model's matmul FLOPs at ``batch`` (times ``accumulate`` micro-batches)
  beside the useful ones, and their ratio."""
  counted = accumulate * model_matmul_flops(config, batch, seq)
  useful = useful_flops(config, batch * accumulate, seq)
  return {"batch": batch, "model_matmul_flops": counted, "useful_flops": useful,
          "model_flops_per_useful": counted / useful}


def matmul_flops(fn, *args) -> int:
  """Matrix-multiply FLOPs of one call of ``fn(*args)``, counted from its jaxpr.

  ``2 · |output| · |contracted axes|`` per ``dot_general`` (and ``ragged_dot``
  as if dense), each ``scan`` body times its length, a ``shard_map`` body
  times its number of shards (the body sees one shard's shapes), the larger
  branch of a ``cond``, every rematerialised recompute where the backward
  pass has it: the whole step's count, however it is partitioned.
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
    elif name == "shard_map":  # the body's shapes are one shard's; every shard runs it
      sizes = dict(eqn.params["mesh"].shape)
      manual = eqn.params.get("newly_manual_axes", eqn.params.get("manual_axes", sizes))
      total += math.prod(sizes[a] for a in manual) * sum(subs)
    else:
      total += sum(subs)
  return total


def _peak(compiled: dict) -> int | None:
  """The compiled step's peak, or None where XLA:TPU refused it for lack of memory."""
  return None if compiled["xla"] is None else compiled["xla"]["peak"]


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
         skip_nonfinite: int = 0, stochastic_rounding: bool = False,
         device_memory_gb: float | None = None, devices: int | None = None,
         mesh: str | None = None, fsdp: bool | None = None, fsdp_experts: bool = False,
         moe_impl: str | None = None, settings: Mapping[str, Any] | None = None,
         progress=None) -> dict:
  """The planner's report (see the module docstring); JSON-serialisable.

  ``device_memory_gb`` checks the fit against a device of that size instead
  of the target's own memory (same margin rule), e.g. 24 for a 24 GB card.
  ``devices``, ``mesh`` (a ``--mesh`` spec such as ``"data=2,expert=4"``;
  ``None``: :func:`default_layout`'s) and ``fsdp`` (``None``: the same): plan the step sharded
  over that many devices (:func:`compile_step`); ``fsdp_experts``: FSDP splits
  each expert bank along its experts (``mesh.FSDP_EXPERTS``); ``batch`` and the largest
  batch that fits are then global, searched over multiples of the ``data``
  size. ``progress(message)``, if given, is told about each compile. The
  step is the one ``train`` runs with the same settings (:func:`train_config`,
  :func:`experiments.training.steps.build_step`).
  """
  if batch < 1:
    raise ValueError(f"--batch-size must be >= 1, got {batch}")
  if device_memory_gb is not None and not device_memory_gb > 0:
    raise ValueError(f"--device-memory-gb must be > 0, got {device_memory_gb}")
  _check_target(target)
  if devices is not None and devices < 1:
    raise ValueError(f"--devices must be >= 1, got {devices}")
  if devices is None and (mesh or fsdp):
    raise ValueError("--mesh and --fsdp need --devices")
  run_config = train_config(preset, optimizer, skewadam_tiers=skewadam_tiers,
                            param_dtype=param_dtype, update_in_backward=update_in_backward,
                            clip_mode=clip_mode, skip_nonfinite=skip_nonfinite,
                            stochastic_rounding=stochastic_rounding, moe_impl=moe_impl,
                            **(settings or {}))
  config = run_config.model_config()
  if devices is None and target in TPU_TARGETS:
    devices = 1
  if target in TPU_TARGETS:
    check_tpu_target(target, devices)
  layout = None
  if devices is not None:
    default_mesh, default_fsdp = default_layout(
        devices, config.num_experts, expert_parallel=config.moe_impl == "expert_parallel")
    layout = "default" if mesh is None and fsdp is None else "given"
    mesh_sizes = default_mesh if mesh is None else mesh_shape(devices, config.num_experts, mesh)
    if fsdp is None:  # FSDP by default only with the default mesh
      fsdp = default_fsdp if mesh is None else False
    if fsdp and fsdp_experts:
      fsdp = mesh_lib.FSDP_EXPERTS
  else:
    mesh_sizes, fsdp = None, False
  if mesh_sizes and run_config.mesh is None:  # the run's mesh, as train would be given it
    run_config = dataclasses.replace(
        run_config, mesh=f"data={mesh_sizes['data']},expert={mesh_sizes['expert']}")
  data = batch_shards(mesh_sizes, config.moe_impl == "expert_parallel") if mesh_sizes else 1
  if batch % data:
    raise ValueError(f"--batch-size {batch} does not split over the mesh's "
                     f"{_batch_shards_text(mesh_sizes, config.moe_impl == 'expert_parallel')}: "
                     f"use a multiple of {data}")
  seq = seq or config.max_seq_len
  if not 1 <= seq <= config.max_seq_len:
    raise ValueError(f"--seq-len must be in [1, {config.max_seq_len}] for {preset}, got {seq}")
  step, params, opt_state = steps_lib.abstract_step(run_config)
  state_by_tier = skewadam_jax.state_bytes_by_tier(opt_state)
  param_bytes = skewadam_jax.tree_bytes(params)
  if step.layerwise is not None:  # one layer's slice and the parameters outside the stack
    grad_bytes = skewadam_jax.tree_bytes(step.layerwise.per_layer_params(params))
  else:
    grad_bytes = param_bytes
  step_options = dict(seq=seq, target=target, devices=devices, mesh=mesh_sizes, fsdp=fsdp)
  where = target if devices is None else f"{devices} x {target}"

  def compile_at(b):
    if progress:
      progress(f"compiling the train step at batch {b} x {seq} for {where}")
    return compile_step(run_config, batch=b, **step_options)

  compiled = compile_at(batch)
  device_bytes = (int(device_memory_gb * GB) if device_memory_gb is not None
                  else target_device_bytes(target))
  margin_bytes = int(margin_gb * GB)
  peak = _peak(compiled)
  counted = compiled["matmul_flops"]
  accumulate = run_config.accumulate
  useful = useful_flops(config, batch * accumulate, seq)
  model_flops = model_flops_report(config, batch, seq, accumulate)
  collectives = compiled.get("collectives")
  device_flops = compiled["device_matmul_flops"]
  report = {
      "preset": preset, "optimizer": optimizer, "skewadam_tiers": skewadam_tiers or {},
      "target": target, "batch": batch, "seq": seq, "accumulate": accumulate,
      "accumulate_dtype": run_config.accumulate_dtype if accumulate > 1 else None,
      "tokens_per_step": batch * accumulate * seq,
      "param_dtype": jnp.dtype(param_dtype).name,
      "update_in_backward": update_in_backward,
      "clip_mode": clip_mode if update_in_backward else None,
      "skip_nonfinite": skip_nonfinite, "stochastic_rounding": stochastic_rounding,
      "step_fingerprint": compiled.get("fingerprint"),
      "devices": devices or 1, "mesh": mesh_sizes, "fsdp": fsdp if devices else None,
      "layout": layout,
      "moe_impl": config.moe_impl, "moe_block_size": config.moe_block_size,
      "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
      "param_bytes": param_bytes, "grad_bytes": grad_bytes,
      "opt_state_bytes": state_by_tier["total"], "opt_state_bytes_by_tier": state_by_tier,
      "per_device_param_bytes": compiled.get("per_device_param_bytes", param_bytes),
      "per_device_opt_state_bytes": compiled.get("per_device_opt_state_bytes",
                                                 state_by_tier["total"]),
      "xla": {k: v for k, v in (compiled["xla"] or {}).items() if k != "peak"} or None,
      "matmul_flops": counted, "useful_flops": useful,
      "flops_efficiency": useful / counted if counted else None,
      "model_matmul_flops": model_flops["model_matmul_flops"],
      "model_flops_per_useful": model_flops["model_flops_per_useful"],
      "optimizer_matmul_flops": counted - model_flops["model_matmul_flops"],
      "model_flops_at_largest_batch": None,
      "step_time": step_time_report(compiled.get("estimate"), config, batch=batch, seq=seq,
                                    accumulate=accumulate, target=target,
                                    devices=devices or 1),
      "step_time_at_largest_batch": None,
      "device_matmul_flops": device_flops,
      "hardware_flops_efficiency": (useful / ((devices or 1) * device_flops)
                                    if device_flops else None),
      "collective_bytes": collectives.bytes if collectives else None,
      "collective_counts": collectives.counts if collectives else None,
      "collective_loop_trip_counts": collectives.trip_counts if collectives else None,
      "peak_bytes": peak, "per_device_peak_bytes": peak,
      "device_bytes": device_bytes, "margin_bytes": margin_bytes,
      "fits": False if peak is None else _fits(peak, device_bytes, margin_bytes),
      "max_batch_that_fits": None,
      "compiled_for": "cpu" if compiled["warning"] else target,
      "warning": compiled["warning"],
  }
  report["orthogonalisation"] = (
      orthogonal_cost.orthogonalisation(
          params, steps_lib.abstract_axes(preset), run_config.skewadam_tiers(),
          sharding=target_sharding(target)[0], matmul_flops=matmul_flops,
          expert_shards=mesh_sizes["expert"] if mesh_sizes else 1)
      if optimizer == "skewadam" else None)
  if compiled.get("out_of_memory"):
    report["out_of_memory"] = compiled["out_of_memory"]
  if collectives and collectives.assumed_trip_counts:
    report["collective_assumed_trip_counts"] = collectives.assumed_trip_counts
  if search_batch and device_bytes is not None:
    peaks = {batch: peak}
    estimates = {batch: compiled.get("estimate")}

    def peak_at(multiple):  # the global batch is a multiple of the data size
      b = multiple * data
      if b not in peaks:
        at_b = compile_at(b)
        peaks[b], estimates[b] = _peak(at_b), at_b.get("estimate")
        if progress:
          verdict = ("fits" if peaks[b] is not None and _fits(peaks[b], device_bytes, margin_bytes)
                     else "does not fit")
          shown = "out of memory" if peaks[b] is None else f"{peaks[b] / GB:.2f} GB"
          progress(f"batch {b}: peak {shown}, {verdict}")
      return math.inf if peaks[b] is None else peaks[b]

    report["max_batch_that_fits"] = data * max_batch_that_fits(
        peak_at, device_bytes, margin_bytes, limit=max(1, 1024 // data))
    report["peak_bytes_by_batch"] = {str(b): p for b, p in sorted(peaks.items())}
    if report["max_batch_that_fits"]:
      largest = report["max_batch_that_fits"]
      report["model_flops_at_largest_batch"] = model_flops_report(config, largest, seq,
                                                                   accumulate)
      report["step_time_at_largest_batch"] = step_time_report(
          estimates.get(largest), config, batch=largest, seq=seq, accumulate=accumulate,
          target=target, devices=devices or 1)
  return report


def markdown_table(reports: Sequence[dict]) -> str:
  """A Markdown table of planner reports (as written by ``--json``).

  "grads alive" is the most gradient bytes alive at once; "matmul FLOPs" is
  each step's matrix-multiply count (:func:`matmul_flops`) relative to the
  first row's; a largest batch the report did not search is "not searched".
  """
  lines = ["| optimizer | configuration | state | grads alive | peak at batch 1 "
           "| fits (2 GB margin) | largest batch that fits | matmul FLOPs |",
           "|---|---|---|---|---|---|---|---|"]
  first_flops = reports[0].get("matmul_flops") if reports else None
  for r in reports:
    config = ", ".join(  # a tier's settings, or the rest tier's name
        f"{tier}: " + ("/".join(f"{v}" for v in spec.values()) if isinstance(spec, dict)
                       else f"{spec}")
        for tier, spec in r.get("skewadam_tiers", {}).items()) or "skewadam()'s defaults"
    if r["optimizer"] != "skewadam":
      config = "fp32 state"
    if r.get("update_in_backward"):
      config += f", update in backward ({r['clip_mode']} clip)"
    flops = r.get("matmul_flops")
    ratio = f"{flops / first_flops:.2f}×" if flops and first_flops else "—"
    batch = r["max_batch_that_fits"]
    lines.append(f"| {r['optimizer']} | {config} | {r['opt_state_bytes'] / GB:.2f} GB "
                 f"| {_gb(r.get('grad_bytes'))} | {r['peak_bytes'] / GB:.2f} GB "
                 f"| {'yes' if r['fits'] else 'no'} "
                 f"| {'not searched' if batch is None else batch} | {ratio} |")
  return "\n".join(lines)


def _block_rows(report: dict, batch: int) -> str:
  """The MoE's rows per block at ``batch`` (``auto`` sizes them to the batch)."""
  size = report.get("moe_block_size")
  if size is None or report.get("moe_impl") not in ("blocked", "expert_parallel"):
    return "-"
  if size:
    return str(size)
  config = models.get_preset(report["preset"])
  rows = batch * report.get("accumulate", 1) * report["seq"] * config.top_k
  return f"auto ({models.grouped.auto_block_size(rows, config.num_experts)})"


def markdown_step_time_table(reports: Sequence[dict]) -> str:
  """Markdown: each report's model FLOPs per useful FLOP and its estimated step.

  One row per report at its batch and, where it searched, one at the largest
  batch that fits: the MoE's rows per block, the model's matmul FLOPs over
  the useful ones (:func:`model_matmul_flops`), the peak, and the roofline
  estimate (:mod:`experiments.planning.roofline`): step seconds (how much
  of it is kernel overhead), tokens/s and MFU.
  """
  lines = ["| preset | optimizer | target | batch | rows per block | model FLOPs / useful "
           "| peak | estimated step s (kernel overhead) | tokens/s | MFU |",
           "|" + "---|" * 10]
  for r in reports:
    points = [(r["batch"], r.get("model_flops_per_useful"), r.get("peak_bytes"),
               r.get("step_time"))]
    largest = r.get("model_flops_at_largest_batch")
    if largest and largest["batch"] != r["batch"]:
      peak = (r.get("peak_bytes_by_batch") or {}).get(str(largest["batch"]))
      points.append((largest["batch"], largest["model_flops_per_useful"], peak,
                     r.get("step_time_at_largest_batch")))
    for batch, ratio, peak, t in points:
      micro = f" x {r['accumulate']}" if r.get("accumulate", 1) > 1 else ""
      step = f"{t['step_seconds']:.3f} ({t['overhead_seconds']:.3f})" if t else "-"
      tokens = f"{t['tokens_per_second']:,.0f}" if t else "-"
      mfu = f"{t['mfu']:.1%}" if t else "-"
      lines.append(
          f"| {r['preset']} | {r['optimizer']} | {r['target']} | {batch}{micro} "
          f"| {_block_rows(r, batch)} | {f'{ratio:.3f}' if ratio else '-'} "
          f"| {_gb(peak) if peak else '-'} | {step} | {tokens} | {mfu} |")
  return "\n".join(lines)


def markdown_orthogonal_table(reports: Sequence[dict]) -> str:
  """A Markdown table of what Newton–Schulz costs in planner reports (``--json``) that have it.

  Its FLOPs do not grow with the batch (one orthogonalisation per matrix per
  step) while the model's do: per token they are given at the planned batch
  and at the largest batch that fits, beside the model's useful FLOPs a token
  (:func:`useful_flops`, the same at any batch).
  """
  lines = ["| preset | step | target | expert matrices | chunk (largest working set) "
           "| working set a device | Newton–Schulz FLOPs a step | a token, planned batch "
           "| a token, largest batch | useful FLOPs a token |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in reports:
    ortho = r.get("orthogonalisation")
    if not ortho:
      continue
    tokens = r["batch"] * r["seq"]
    useful = r["useful_flops"] / tokens
    largest = r.get("max_batch_that_fits")
    at_largest = (f"{ortho['matmul_flops'] / (largest * r['seq']):.3g} "
                  f"({ortho['matmul_flops'] / (largest * r['seq']) / useful:.2f}×, batch {largest})"
                  if largest else "—")
    step = "update in backward" if r.get("update_in_backward") else "standard"
    where = r["target"] if r.get("devices", 1) == 1 else f"{r['devices']} x {r['target']}"
    size, rows, cols = ortho["chunk"]
    expert = (r.get("skewadam_tiers") or {}).get("expert") or {}
    experts = (f"through rank-{expert.get('lowrank_rank', 16)} factors"
               if expert.get("lowrank_orthogonalise") in skewadam_jax.tiers.THROUGH_FACTORS
               else "whole")
    lines.append(
        f"| {r['preset']} | {step} | {where} | {experts} | {size} × {rows}×{cols} "
        f"| {ortho['working_set_bytes'] / GB:.3f} GB | {ortho['matmul_flops']:.3g} "
        f"| {ortho['matmul_flops'] / tokens:.3g} ({ortho['matmul_flops'] / tokens / useful:.2f}×, "
        f"batch {r['batch']}) | {at_largest} | {useful:.3g} |")
  return "\n".join(lines)


def _gb(nbytes) -> str:
  return "—" if nbytes is None else f"{nbytes / GB:.2f} GB"


def _traffic_gb(nbytes: float) -> str:
  """Collective bytes in GB; a few MB stay visible (a moved bank is 1e4 times more)."""
  gb = nbytes / GB
  return f"{gb:,.1f}" if gb == 0 or gb >= 0.05 else f"{gb:.3f}"


def markdown_devices_table(reports: Sequence[dict]) -> str:
  """A Markdown table of ``--devices`` planner reports: one device's bytes, the step's traffic.

  Columns: the mesh, one device's parameters + optimizer state, its peak at
  the report's global batch, the fit, the largest global batch that fits,
  the bytes each collective kind handles on one device per step
  (all-gather / reduce-scatter / all-reduce / all-to-all), and
  ``useful / counted`` FLOPs then ``useful / (devices × one device's)``.
  A one-device report is a row too (its layout "one device", no traffic), to
  set a mesh beside it.
  """
  lines = ["| preset | optimizer | step | devices, mesh | params + state per device "
           "| peak per device (batch) | fits | largest batch | AG / RS / AR / A2A per device "
           "per step | FLOPs efficiency: step, hardware |", "|---" * 10 + "|"]
  for r in reports:
    step = "in backward" if r.get("update_in_backward") else "standard"
    if r.get("moe_impl") == "expert_parallel":
      step += ", expert-parallel MoE"
    if ((r.get("skewadam_tiers") or {}).get("expert") or {}).get(
        "lowrank_orthogonalise") in skewadam_jax.tiers.THROUGH_FACTORS:
      step += ", experts orthogonalised through their factors"
    owned = [t for t in ("backbone", "expert")
             if ((r.get("skewadam_tiers") or {}).get(t) or {}).get("orthogonal_owner_axes")]
    if owned:
      step += f", {' and '.join(owned)} matrices on owner devices"
    devices = r.get("devices", 1)
    mesh = r.get("mesh") or {"data": 1, "expert": 1}
    layout = (f"one {r['target']}" if devices == 1 else
              f"{devices} x {r['target']}, data={mesh['data']} x "
              f"expert={mesh['expert']}{fsdp_text(r.get('fsdp'))}"
              f"{' (default)' if r.get('layout') == 'default' else ''}")
    held = r["per_device_param_bytes"] + r["per_device_opt_state_bytes"]
    moved = r.get("collective_bytes") or {}
    traffic = "—" if devices == 1 else " / ".join(
        _traffic_gb(moved.get(kind, 0)) for kind in
        ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")) + " GB"
    hardware = r.get("hardware_flops_efficiency")
    efficiency = (f"{r['flops_efficiency']:.2f}, "
                  f"{'—' if hardware is None else f'{hardware:.3f}'}")
    largest = "not searched" if r["max_batch_that_fits"] is None else r["max_batch_that_fits"]
    lines.append(f"| {r['preset']} | {r['optimizer']} | {step} | {layout} | {_gb(held)} "
                 f"| {_gb(r['peak_bytes'])} ({r['batch']}) | {'yes' if r['fits'] else 'no'} "
                 f"| {largest} | {traffic} | {efficiency} |")
  return "\n".join(lines)
