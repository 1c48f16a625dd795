"""Data and expert parallelism with JAX SPMD: mesh, shardings, the sharded train step.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m experiments.parallel --preset tiny --mesh data=2,expert=4 --check

runs a few steps of the training command's own step (``experiments.train.
make_step_fns``) on synthetic tokens, sharded over the mesh, prints the loss,
the optimizer-state bytes each device holds, and (``--check``) the largest
parameter difference from the same steps on one device.

The layout, on a ``jax.sharding.Mesh`` with axes ``("data", "expert")``:

| what | sharding |
|---|---|
| expert banks ``[L, E, d_in, d_out]``, router ``[L, D, E]`` | the ``experts`` axis split over ``expert`` |
| everything else | replicated (``fsdp=True``: the larger matrix axis of each matrix split over ``data`` where it divides) |
| batch ``[B, T]`` | ``B`` split over ``data`` |
| optimizer state | derived by :func:`skewadam_jax.state_shardings` |
| metrics | replicated |

XLA's SPMD partitioner inserts the collectives: gradients of replicated
parameters are all-reduced over ``data``. With ``moe_impl="dense"`` every
device runs its own experts on its data shard's tokens and the combine sums
over ``expert`` (no expert weights move). The ``"ragged"`` and ``"blocked"``
lowerings pick experts by dynamic index, which the partitioner serves by
all-gathering one layer's expert bank at a time inside the layer scan:
parameters, gradients and optimizer state stay sharded, but the expert
compute is then data-parallel (token dispatch with all-to-all under
``shard_map`` would be needed for expert-parallel compute there). The batch is
not split over ``expert``: devices that share a data shard repeat the dense
(attention) work, which keeps the expert layer free of all-to-alls.

The train step is compiled with explicit ``in_shardings``/``out_shardings`` and
donated parameters and state, so each device keeps only its shards from one
step to the next. Several processes (one per host) use the same code after
:func:`initialize_distributed`; every process feeds the same global batch and
keeps only its own devices' part of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import skewadam_jax
import experiments
from experiments.steps import make_step_fns
from models import axes as model_axes

DATA, EXPERT = "data", "expert"
MESH_AXES = (DATA, EXPERT)

# Environment variables read when the matching flag is absent.
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"


# --------------------------------------------------------------------------
# Mesh.
# --------------------------------------------------------------------------


def parse_mesh(spec: str) -> dict[str, int]:
  """Parses ``"data=4,expert=2"`` into ``{"data": 4, "expert": 2}``.

  Axes left out are absent from the result (:func:`make_mesh` gives ``expert``
  size 1 and ``data`` every device left).

  Raises:
    ValueError: for an unknown axis, a repeated axis or a size that is not a
      positive integer.

  Example:
    >>> parse_mesh("data=4, expert=2")
    {'data': 4, 'expert': 2}
  """
  sizes = {}
  for part in filter(None, (p.strip() for p in spec.split(","))):
    name, sep, value = part.partition("=")
    name = name.strip()
    if not sep or name not in MESH_AXES:
      raise ValueError(f"bad --mesh entry {part!r} in {spec!r}: expected "
                       f"AXIS=SIZE with AXIS one of {', '.join(MESH_AXES)}")
    if name in sizes:
      raise ValueError(f"--mesh {spec!r} names {name!r} twice")
    try:
      size = int(value)
    except ValueError:
      size = 0
    if size < 1:
      raise ValueError(f"--mesh {spec!r}: {name} must be a positive integer, "
                       f"got {value.strip()!r}")
    sizes[name] = size
  return sizes


def make_mesh(data: int | None = None, expert: int = 1, *,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``("data", "expert")`` mesh over all devices (of every process).

  The axes are ``AxisType.Auto`` (``jax.make_mesh`` defaults to ``Explicit``):
  the model is written for the SPMD partitioner to propagate shardings from
  the step's inputs and outputs, not to annotate every operation.

  Args:
    data: data-parallel size; default ``len(devices) // expert``.
    expert: expert-parallel size (the expert banks' ``E`` must divide by it).
    devices: default ``jax.devices()``, which spans every process.

  Raises:
    ValueError: if ``data * expert`` is not the number of devices (no device
      is silently left idle).

  Example:
    >>> mesh = make_mesh(data=1, expert=1, devices=jax.devices()[:1])
    >>> dict(mesh.shape)
    {'data': 1, 'expert': 1}
  """
  devices = list(jax.devices() if devices is None else devices)
  if expert < 1 or (data is not None and data < 1):
    raise ValueError(f"mesh sizes must be >= 1, got data={data}, expert={expert}")
  if data is None:
    data = len(devices) // expert
  if data * expert != len(devices):
    raise ValueError(
        f"mesh data={data} x expert={expert} needs {data * expert} devices, "
        f"but there are {len(devices)} (on CPU, simulate more with "
        "XLA_FLAGS=--xla_force_host_platform_device_count=N)")
  return jax.make_mesh((data, expert), MESH_AXES, devices=devices,
                       axis_types=(AxisType.Auto, AxisType.Auto))


# --------------------------------------------------------------------------
# Shardings.
# --------------------------------------------------------------------------


def param_shardings(params, mesh: Mesh, *, axes: Mapping[str, tuple], fsdp: bool = False):
  """``NamedSharding`` s for the model's parameters on ``mesh``, from their logical axes.

  Each parameter's declared logical axes (:func:`models.logical_axes`) go to
  mesh axes by :data:`models.axes.MESH_RULES`: an ``experts`` axis is split
  over ``expert`` (the expert banks ``[L, E, d_in, d_out]`` and the router's
  columns ``[L, D, E]``); everything else is replicated. With ``fsdp`` the
  larger matrix axis of every matrix that divides evenly is also split over
  ``data`` (never a layer axis, which the layers are scanned over; never a
  vector).

  Args:
    params: parameters or ``ShapeDtypeStruct`` s (paths and shapes are read).
    mesh: a mesh with axes ``data`` and ``expert``.
    axes: the logical axes by path (:func:`models.logical_axes`).
    fsdp: also shard parameters (and so their optimizer state) over ``data``.

  Returns:
    A tree of ``NamedSharding`` with the structure of ``params``.

  Raises:
    ValueError: naming the path, if an ``experts`` axis does not divide by
      the mesh's ``expert`` size, or a parameter has no declared axes.

  Example:
    >>> mesh = make_mesh(devices=jax.devices()[:1])
    >>> params = {"embed": jnp.zeros((16, 4)),
    ...           "moe": {"experts": {"w_up": jnp.zeros((2, 4, 4, 8))}}}
    >>> axes = {"embed": ("vocab", "embed"),
    ...         "moe/experts/w_up": ("layers", "experts", "embed", "mlp")}
    >>> param_shardings(params, mesh, axes=axes)["moe"]["experts"]["w_up"].spec
    P(None, 'expert', None, None)
  """
  sizes = dict(mesh.shape)

  def one(path, leaf):
    name = model_axes.path_to_str(path)
    if name not in axes:
      raise ValueError(f"parameter {name!r} has no declared logical axes")
    try:
      spec = model_axes.partition_spec(axes[name], leaf.shape, sizes,
                                       fsdp_axis=DATA if fsdp else None)
    except ValueError as err:
      raise ValueError(f"parameter {name!r}: {err}") from None
    return NamedSharding(mesh, P(*spec))

  return jax.tree_util.tree_map_with_path(one, params)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Token batches ``[B, T]``: ``B`` split over ``data``, the rest replicated.

  Example:
    >>> batch_sharding(make_mesh(devices=jax.devices()[:1])).spec
    P('data',)
  """
  return NamedSharding(mesh, P(DATA))


@dataclasses.dataclass(frozen=True)
class TrainShardings:
  """Where every input and output of the train step lives.

  Attributes:
    mesh: the device mesh.
    params: ``NamedSharding`` tree of the parameters (:func:`param_shardings`).
    opt_state: ``NamedSharding`` tree of the optimizer state
      (:func:`skewadam_jax.state_shardings`).
    batch: sharding of ``inputs`` and ``targets`` (:func:`batch_sharding`).
    replicated: sharding of metrics and other scalars.
  """
  mesh: Mesh
  params: Any
  opt_state: Any
  batch: NamedSharding
  replicated: NamedSharding


def train_shardings(mesh: Mesh, tx, params, *, axes: Mapping[str, tuple],
                    fsdp: bool = False) -> TrainShardings:
  """All the train step's shardings for optimizer ``tx`` (nothing allocated).

  ``axes`` and ``fsdp`` as in :func:`param_shardings`.

  Example:
    >>> import optax
    >>> mesh = make_mesh(devices=jax.devices()[:1])
    >>> params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    >>> s = train_shardings(mesh, optax.adam(1e-3), params, axes={"w": ("embed", "mlp")})
    >>> s.opt_state[0].mu["w"].spec, s.batch.spec
    (P(None, None), P('data',))
  """
  shardings = param_shardings(params, mesh, axes=axes, fsdp=fsdp)
  return TrainShardings(
      mesh=mesh, params=shardings,
      opt_state=skewadam_jax.state_shardings(tx, params, shardings),
      batch=batch_sharding(mesh), replicated=NamedSharding(mesh, P()))


def put(tree, shardings):
  """Places every leaf of ``tree`` on its sharding; leaves already there stay.

  Host arrays (numpy, or arrays on one local device) must hold the same global
  value in every process: each process keeps only its own devices' shards.
  Arrays already sharded differently (a checkpoint restored onto another
  layout) are resharded.

  Example:
    >>> mesh = make_mesh(devices=jax.devices()[:1])
    >>> x = put(np.ones((4, 2)), batch_sharding(mesh))
    >>> x.sharding.spec
    P('data',)
  """
  def one(x, sharding):
    if isinstance(x, jax.Array):
      if x.sharding == sharding:
        return x
      if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # typed PRNG keys
        return jax.random.wrap_key_data(one(jax.random.key_data(x), sharding),
                                        impl=jax.random.key_impl(x))
      if x.is_fully_addressable and not sharding.is_fully_addressable:
        x = np.asarray(x)  # a local value, to be split across processes
    return jax.device_put(x, sharding)
  return jax.tree.map(one, tree, shardings)


# --------------------------------------------------------------------------
# Compiled steps.
# --------------------------------------------------------------------------


def sharded_init(tx, shardings: TrainShardings) -> Callable:
  """``tx.init`` compiled to create each device's shards of the state directly.

  Example:
    >>> import optax
    >>> mesh = make_mesh(devices=jax.devices()[:1])
    >>> params = {"w": jnp.ones((4, 4))}
    >>> s = train_shardings(mesh, optax.adam(1e-3), params, axes={"w": ("embed", "mlp")})
    >>> state = sharded_init(optax.adam(1e-3), s)(put(params, s.params))
    >>> state[0].mu["w"].sharding == s.opt_state[0].mu["w"]
    True
  """
  return jax.jit(tx.init, in_shardings=(shardings.params,),
                 out_shardings=shardings.opt_state)


def sharded_train_step(train_step: Callable, shardings: TrainShardings, *,
                       donate: bool = True) -> Callable:
  """Compiles ``train_step(params, opt_state, inputs, targets, **kwargs)`` for the mesh.

  ``train_step`` is the training command's (``experiments.steps.make_step_fns``).
  Inputs and outputs have explicit shardings, so parameters and optimizer
  state come out exactly as they went in (step after step, nothing drifts to
  replicated) and metrics come out replicated. ``jit`` takes no keyword
  arguments with ``in_shardings``, so the compiled step takes ``train_step``'s
  keyword arguments (a PRNG key, a gradient scale) as one dict, replicated.
  The arguments must already be placed (:func:`put`); :func:`spmd_steps`
  wraps that.

  Args:
    train_step: ``(params, opt_state, inputs, targets, **kwargs) ->
      (params, opt_state, metrics)``.
    shardings: from :func:`train_shardings`.
    donate: donate the parameters' and state's buffers to the outputs.

  Returns:
    The jitted ``(params, opt_state, inputs, targets, kwargs)`` step
    (``.lower(params, opt_state, inputs, targets, {})`` for memory analysis).
  """
  s = shardings

  def step(params, opt_state, inputs, targets, kwargs):
    return train_step(params, opt_state, inputs, targets, **kwargs)

  return jax.jit(step,
                 in_shardings=(s.params, s.opt_state, s.batch, s.batch, s.replicated),
                 out_shardings=(s.params, s.opt_state, s.replicated),
                 donate_argnums=(0, 1) if donate else ())


def sharded_eval_step(eval_step: Callable, shardings: TrainShardings) -> Callable:
  """Compiles ``eval_step(params, inputs, targets)`` with replicated outputs."""
  s = shardings
  return jax.jit(eval_step, in_shardings=(s.params, s.batch, s.batch),
                 out_shardings=s.replicated)


class SpmdSteps(NamedTuple):
  """A run's steps on a mesh, taking host batches (as ``experiments.train.Run``).

  Attributes:
    shardings: the :class:`TrainShardings`.
    init: ``params -> (params, opt_state)``, both sharded; the argument (host
      or device arrays) is copied, never donated.
    train_step: ``(params, opt_state, inputs, targets, **kwargs) -> (params,
      opt_state, metrics)``; places its arguments (:func:`put`), then runs
      the compiled step.
    eval_step: ``(params, inputs, targets) -> outputs``, likewise.
  """
  shardings: TrainShardings
  init: Callable
  train_step: Callable
  eval_step: Callable


def spmd_steps(mesh: Mesh, tx, params, train_step: Callable,
               eval_step: Callable | None = None, *, axes: Mapping[str, tuple],
               fsdp: bool = False) -> SpmdSteps:
  """Shardings and compiled steps of one run on ``mesh``.

  Args:
    mesh: from :func:`make_mesh`.
    tx: the optimizer.
    params: the parameters (or ``ShapeDtypeStruct`` s).
    train_step, eval_step: as returned by ``experiments.steps.make_step_fns``.
    axes, fsdp: see :func:`param_shardings`.
  """
  s = train_shardings(mesh, tx, params, axes=axes, fsdp=fsdp)
  init_state = sharded_init(tx, s)
  step = sharded_train_step(train_step, s)

  def init(params):
    params = put(jax.device_get(params), s.params)  # fresh buffers: donatable
    return params, init_state(params)

  def placed_train_step(params, opt_state, inputs, targets, **kwargs):
    replicated = jax.tree.map(lambda _: s.replicated, kwargs)
    return step(*put((params, opt_state, inputs, targets, kwargs),
                     (s.params, s.opt_state, s.batch, s.batch, replicated)))

  placed_eval_step = None
  if eval_step is not None:
    evaluate = sharded_eval_step(eval_step, s)
    placed_eval_step = lambda *args: evaluate(*put(args, (s.params, s.batch, s.batch)))
  return SpmdSteps(s, init, placed_train_step, placed_eval_step)


# --------------------------------------------------------------------------
# Bytes per device.
# --------------------------------------------------------------------------


def device_state_bytes_by_tier(state, shardings=None) -> dict[str, int]:
  """Optimizer-state bytes that one device holds, by tier.

  Every ``NamedSharding`` splits evenly, so every device of the mesh holds the
  same amount: the bytes of each array's shard shape. Works on a live state
  (its own shardings) and on an abstract one (``jax.eval_shape``) with the
  matching ``shardings`` (e.g. ``TrainShardings.opt_state``), so a layout can
  be sized without allocating it.

  Returns:
    ``{"backbone", "expert", "router", "other", "total"}`` in bytes, as
    :func:`skewadam_jax.state_bytes_by_tier`.

  Example:
    >>> import optax
    >>> mesh = make_mesh(devices=jax.devices()[:1])
    >>> params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    >>> s = train_shardings(mesh, optax.adam(1e-3), params, axes={"w": ("embed", "mlp")})
    >>> state = jax.eval_shape(optax.adam(1e-3).init, params)
    >>> device_state_bytes_by_tier(state, s.opt_state)["total"]  # mu, nu, count
    132
  """
  if shardings is None:
    shardings = jax.tree.map(lambda x: x.sharding, state)
  shard = lambda x, sh: jax.ShapeDtypeStruct(sh.shard_shape(x.shape), x.dtype)
  return skewadam_jax.state_bytes_by_tier(jax.tree.map(shard, state, shardings))


# --------------------------------------------------------------------------
# Several processes.
# --------------------------------------------------------------------------


def add_distributed_flags(parser: argparse.ArgumentParser) -> None:
  """Adds ``--coordinator-address``, ``--num-processes`` and ``--process-id``."""
  group = parser.add_argument_group(
      "several processes (jax.distributed; flags override the environment)")
  group.add_argument("--coordinator-address", default=None,
                     help=f"HOST:PORT of process 0 (env {ENV_COORDINATOR})")
  group.add_argument("--num-processes", type=int, default=None,
                     help=f"number of processes (env {ENV_NUM_PROCESSES})")
  group.add_argument("--process-id", type=int, default=None,
                     help=f"this process, 0 .. N-1 (env {ENV_PROCESS_ID})")


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None, *,
                           environ: Mapping[str, str] = os.environ) -> bool:
  """Joins a multi-process JAX run, or does nothing for a single process.

  Each argument falls back to an environment variable
  (``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``).
  With none of them set, or one process, this is a no-op. Otherwise it calls
  ``jax.distributed.initialize``, which must happen before JAX touches a
  device; on CPU, cross-process collectives use gloo over TCP.

  Returns:
    Whether ``jax.distributed`` was initialized.

  Raises:
    ValueError: if only some of the three are set, or they are malformed.

  Example:
    >>> initialize_distributed(environ={})   # a single process
    False
  """
  def value(given, env, kind):
    if given is not None:
      return given
    raw = environ.get(env)
    if raw in (None, ""):
      return None
    try:
      return kind(raw)
    except ValueError:
      raise ValueError(f"{env}={raw!r} is not a valid {kind.__name__}") from None

  address = value(coordinator_address, ENV_COORDINATOR, str)
  count = value(num_processes, ENV_NUM_PROCESSES, int)
  index = value(process_id, ENV_PROCESS_ID, int)
  if address is None and count in (None, 1) and index in (None, 0):
    return False
  missing = [flag for flag, v in (("--coordinator-address", address),
                                  ("--num-processes", count),
                                  ("--process-id", index)) if v is None]
  if missing:
    raise ValueError(f"several processes need {', '.join(missing)} too "
                     "(or the JAX_* environment variables)")
  if count < 1 or not 0 <= index < count:
    raise ValueError(f"--process-id must be in [0, {count}), got {index}")
  # gloo is jax 0.10's default; naming it keeps CPU runs working if that changes.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=address, num_processes=count,
                             process_id=index)
  return True


# --------------------------------------------------------------------------
# Command line: a few sharded steps on synthetic tokens.
# --------------------------------------------------------------------------


def _synthetic_batch(step: int, batch_size: int, seq_len: int, vocab: int, seed: int):
  """The same random tokens in every process (a pure function of the step)."""
  rng = np.random.default_rng([seed, step])
  tokens = rng.integers(0, vocab, (batch_size, seq_len + 1), dtype=np.int32)
  return tokens[:, :-1], tokens[:, 1:]


def _run(args) -> dict:
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import models  # pylint: disable=import-outside-toplevel
  from experiments import optimizers  # pylint: disable=import-outside-toplevel

  overrides = {"compute_dtype": args.compute_dtype} if args.compute_dtype else {}
  config = models.get_preset(args.preset, **overrides)
  seq_len = args.seq_len or config.max_seq_len
  model = models.Transformer(config, rngs=nnx.Rngs(args.seed))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  axes = models.logical_axes(params)
  params = nnx.as_pure(params)
  tx = optimizers.make_optimizer(args.optimizer, learning_rate=args.lr, axes=axes)
  train_step, _ = make_step_fns(graphdef, rest, tx)
  batches = [_synthetic_batch(s, args.batch_size, seq_len, config.vocab_size, args.seed)
             for s in range(args.steps)]

  mesh = make_mesh(**parse_mesh(args.mesh))
  spmd = spmd_steps(mesh, tx, params, train_step, axes=axes, fsdp=args.fsdp)
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
    step = jax.jit(train_step)
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


def main(argv: Sequence[str] | None = None) -> int:
  experiments.use_cpu_without_gpu()
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
  add_distributed_flags(parser)
  args = parser.parse_args(argv)
  try:
    initialize_distributed(args.coordinator_address, args.num_processes,
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
