"""Data and expert parallelism with JAX SPMD: mesh, shardings, the sharded train step.

A library module (the training command and ``python -m experiments.parallel``
use it); :mod:`experiments.training.distributed` joins several processes.

The layout, on a ``jax.sharding.Mesh`` with axes ``("data", "expert")``; the
parameters' rows follow from their declared logical axes
(:data:`models.axes.MESH_RULES`, :func:`models.axes.partition_spec`):

| what | sharding |
|---|---|
| expert banks ``[L, E, d_in, d_out]``, router ``[L, D, E]`` | the ``experts`` axis split over ``expert`` |
| everything else | replicated (``fsdp=True``: the larger matrix axis of each matrix split over the batch's mesh axes where it divides: ``data``, with the expert-parallel MoE ``data`` and ``expert``) |
| batch ``[B, T]`` | ``B`` split over ``data`` (with the expert-parallel MoE, ``data`` and ``expert``) |
| optimizer state | derived by :func:`skewadam_jax.state_shardings` |
| metrics | replicated |

XLA's SPMD partitioner inserts the collectives: gradients of replicated
parameters are all-reduced over ``data``. With ``moe_impl="dense"`` every
device runs its own experts on its data shard's tokens and the combine sums
over ``expert`` (no expert weights move). The ``"ragged"`` and ``"blocked"``
lowerings pick experts by dynamic index, which the partitioner serves by
all-gathering one layer's expert bank at a time inside the layer scan:
parameters, gradients and optimizer state stay sharded, but the expert
compute is then data-parallel, and the batch is not split over ``expert``
(devices that share a data shard repeat the dense work). With
``moe_impl="expert_parallel"`` (``models/expert_parallel.py``,
``expert_parallel=True`` here) the tokens travel instead: the batch is split
over ``data`` and ``expert``, each MoE layer sends every token to the devices
holding its experts with ``all_to_all`` under ``shard_map`` and back, and no
expert bank is gathered. The steps are traced with the mesh as the context
mesh for that ``shard_map``.

The train step is compiled with explicit ``in_shardings``/``out_shardings`` and
donated parameters and state, so each device keeps only its shards from one
step to the next. Several processes (one per host) use the same code after
joining them (:func:`experiments.training.distributed.initialize_distributed`): a host
array given to :func:`put` must be the same global batch in every process,
which keeps only its own devices' part of it; :func:`batch_from_rows` (the
training command's batches) has each process read only its own rows.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp  # noqa: F401  (the examples use it)
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import skewadam_jax
from models import axes as model_axes

DATA, EXPERT = "data", "expert"
MESH_AXES = (DATA, EXPERT)


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


# param_shardings(fsdp=FSDP_EXPERTS): FSDP with each expert's matrices whole on a device.
FSDP_EXPERTS = "experts"


def param_shardings(params, mesh: Mesh, *, axes: Mapping[str, tuple],
                    fsdp: bool | str = False, expert_parallel: bool = False):
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
    fsdp: also shard parameters (and so their optimizer state) over the
      axes the batch is split over: ``data``, and with ``expert_parallel``
      ``expert`` too (the expert-parallel MoE splits the batch over both,
      so the backbone is split eight ways on ``data=1 x expert=8``; an expert
      bank, already split over ``expert``, adds ``data``). ``"experts"``: the
      same, but an expert bank is split along its experts where they divide
      (each expert's matrices whole on a device; :func:`models.axes.partition_spec`).
    expert_parallel: the model's ``moe_impl`` is ``'expert_parallel'``.

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
  fsdp_axes = (DATA, EXPERT) if expert_parallel else (DATA,)

  def one(path, leaf):
    name = model_axes.path_to_str(path)
    if name not in axes:
      raise ValueError(f"parameter {name!r} has no declared logical axes")
    try:
      spec = model_axes.partition_spec(axes[name], leaf.shape, sizes,
                                       fsdp_axis=fsdp_axes if fsdp else None,
                                       fsdp_experts=fsdp == FSDP_EXPERTS)
    except ValueError as err:
      raise ValueError(f"parameter {name!r}: {err}") from None
    return NamedSharding(mesh, P(*spec))

  return jax.tree_util.tree_map_with_path(one, params)


def batch_sharding(mesh: Mesh, *, expert_parallel: bool = False) -> NamedSharding:
  """Token batches ``[B, T]``: ``B`` split over ``data`` (and ``expert`` with
  expert parallelism, so no device repeats another's dense work).

  Example:
    >>> batch_sharding(make_mesh(devices=jax.devices()[:1])).spec
    P('data',)
  """
  return NamedSharding(mesh, P((DATA, EXPERT) if expert_parallel else DATA))


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
                    fsdp: bool | str = False, expert_parallel: bool = False,
                    state_shardings: Callable | None = None) -> TrainShardings:
  """All the train step's shardings for optimizer ``tx`` (nothing allocated).

  ``axes`` and ``fsdp`` as in :func:`param_shardings`; ``expert_parallel``
  as in :func:`batch_sharding`. ``state_shardings(params, param_shardings)``
  gives the optimizer state's (default :func:`skewadam_jax.state_shardings`
  of ``tx``; a step with its own state layout, such as the layerwise step,
  passes its own: ``experiments.training.steps.TrainStep.state_shardings``).

  Example:
    >>> import optax
    >>> mesh = make_mesh(devices=jax.devices()[:1])
    >>> params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    >>> s = train_shardings(mesh, optax.adam(1e-3), params, axes={"w": ("embed", "mlp")})
    >>> s.opt_state[0].mu["w"].spec, s.batch.spec
    (P(None, None), P('data',))
  """
  shardings = param_shardings(params, mesh, axes=axes, fsdp=fsdp,
                              expert_parallel=expert_parallel)
  return TrainShardings(
      mesh=mesh, params=shardings,
      opt_state=(state_shardings(params, shardings) if state_shardings is not None
                 else skewadam_jax.state_shardings(tx, params, shardings)),
      batch=batch_sharding(mesh, expert_parallel=expert_parallel),
      replicated=NamedSharding(mesh, P()))


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


def batch_from_rows(read_rows: Callable[[slice], tuple[np.ndarray, np.ndarray]],
                    shape: tuple[int, int], sharding: NamedSharding):
  """A global ``(inputs, targets)`` batch of which this process reads only its rows.

  Each process calls ``read_rows`` only for the row ranges that its own
  devices hold under ``sharding`` (once per distinct range), so no process
  reads another's rows; the result is the same global array :func:`put` would
  make from the whole batch.

  Args:
    read_rows: ``rows -> (inputs, targets)``, those rows of the global batch.
    shape: the global batch shape ``[B, T]``.
    sharding: where the batch goes (:func:`batch_sharding`).

  Example:
    >>> mesh = make_mesh(devices=jax.devices()[:1])
    >>> batch = np.arange(12).reshape(4, 3)
    >>> inputs, _ = batch_from_rows(lambda r: (batch[r], batch[r]), (4, 3),
    ...                             batch_sharding(mesh))
    >>> inputs.sharding.spec, int(inputs.sum())
    (P('data',), 66)
  """
  pieces = {}

  def rows_of(index):
    rows = slice(*index[0].indices(shape[0]))
    key = (rows.start, rows.stop, rows.step)
    if key not in pieces:
      pieces[key] = read_rows(rows)
    return pieces[key]

  def array(which):
    return jax.make_array_from_callback(
        shape, sharding, lambda index: rows_of(index)[which][(slice(None),) + index[1:]])

  return array(0), array(1)


# --------------------------------------------------------------------------
# Compiled steps.
# --------------------------------------------------------------------------


def sharded_init(tx, shardings: TrainShardings) -> Callable:
  """``tx.init`` compiled to create each device's shards of the state directly.

  ``tx`` is an optax transformation or any ``init(params)`` function.

  Example:
    >>> import optax
    >>> mesh = make_mesh(devices=jax.devices()[:1])
    >>> params = {"w": jnp.ones((4, 4))}
    >>> s = train_shardings(mesh, optax.adam(1e-3), params, axes={"w": ("embed", "mlp")})
    >>> state = sharded_init(optax.adam(1e-3), s)(put(params, s.params))
    >>> state[0].mu["w"].sharding == s.opt_state[0].mu["w"]
    True
  """
  return jax.jit(getattr(tx, "init", tx), in_shardings=(shardings.params,),
                 out_shardings=shardings.opt_state)


# The parameters' shardings while a sharded step is traced (sharded_train_step).
_PARAMETER_LAYOUT = contextvars.ContextVar("parameter_layout", default=None)


@contextlib.contextmanager
def parameter_layout(shardings):
  """While tracing, :func:`in_parameter_layout` pins gradients to ``shardings``."""
  token = _PARAMETER_LAYOUT.set(shardings)
  try:
    yield
  finally:
    _PARAMETER_LAYOUT.reset(token)


def in_parameter_layout(grads):
  """``grads`` constrained to their parameters' shardings inside :func:`sharded_train_step`.

  The backward pass then lays the gradients out as the parameters are, whatever
  the optimizer does with them next: a layout the optimizer asks for (owner
  devices for the orthogonalisation, ``TierConfig.orthogonal_owner_axes``) is
  reached by resharding the gradients, not propagated back into the layer
  loop's gradient stacks. Outside a sharded step it returns ``grads`` as they are.
  """
  shardings = _PARAMETER_LAYOUT.get()
  return grads if shardings is None else jax.lax.with_sharding_constraint(grads, shardings)


def sharded_train_step(train_step: Callable, shardings: TrainShardings, *,
                       donate: bool = True) -> Callable:
  """Compiles ``train_step(params, opt_state, inputs, targets, **kwargs)`` for the mesh.

  ``train_step`` is the training command's (``experiments.training.steps.make_step_fns``).
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
    # The mesh is the context while tracing: the expert-parallel MoE layer
    # (models/expert_parallel.py) runs its shard_map on it.
    with jax.sharding.use_abstract_mesh(s.mesh.abstract_mesh), parameter_layout(s.params):
      return train_step(params, opt_state, inputs, targets, **kwargs)

  return jax.jit(step,
                 in_shardings=(s.params, s.opt_state, s.batch, s.batch, s.replicated),
                 out_shardings=(s.params, s.opt_state, s.replicated),
                 donate_argnums=(0, 1) if donate else ())


def sharded_eval_step(eval_step: Callable, shardings: TrainShardings) -> Callable:
  """Compiles ``eval_step(params, inputs, targets)`` with replicated outputs."""
  s = shardings

  def step(params, inputs, targets):
    with jax.sharding.use_abstract_mesh(s.mesh.abstract_mesh):
      return eval_step(params, inputs, targets)
  return jax.jit(step, in_shardings=(s.params, s.batch, s.batch), out_shardings=s.replicated)


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


def spmd_steps(mesh: Mesh, step, params, *, axes: Mapping[str, tuple],
               fsdp: bool | str = False, expert_parallel: bool = False) -> SpmdSteps:
  """Shardings and compiled steps of one run on ``mesh``.

  Args:
    mesh: from :func:`make_mesh`.
    step: the run's :class:`experiments.training.steps.TrainStep` (its optimizer, train
      and eval steps, state initialiser and state shardings).
    params: the parameters (or ``ShapeDtypeStruct`` s).
    axes, fsdp: see :func:`param_shardings`.
    expert_parallel: the model's ``moe_impl`` is ``'expert_parallel'``: the
      batch is split over ``data`` and ``expert`` (:func:`batch_sharding`).
  """
  s = train_shardings(mesh, step.tx, params, axes=axes, fsdp=fsdp,
                      expert_parallel=expert_parallel, state_shardings=step.state_shardings)
  init_state = sharded_init(step.init, s)
  compiled_step = sharded_train_step(step.train_step, s)

  def init(params):
    params = put(jax.device_get(params), s.params)  # fresh buffers: donatable
    return params, init_state(params)

  def placed_train_step(params, opt_state, inputs, targets, **kwargs):
    replicated = jax.tree.map(lambda _: s.replicated, kwargs)
    return compiled_step(*put((params, opt_state, inputs, targets, kwargs),
                     (s.params, s.opt_state, s.batch, s.batch, replicated)))

  placed_eval_step = None
  if step.eval_step is not None:
    evaluate = sharded_eval_step(step.eval_step, s)
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
