"""The optimizer update inside the backward pass of a scanned layer stack.

A standard train step keeps the gradient of every parameter alive until the
backward pass ends, then updates all parameters at once. For a model whose
blocks are stacked on a layer axis and scanned (the layout every large JAX
model uses: ``nn.scan``, ``nnx.scan``, MaxText's ``scan_layers``, Levanter's
``Stacked``), :func:`layerwise_step` applies each layer's update as soon as
that layer's gradient exists, so one layer's gradients are alive at a time
instead of all of them. XLA does not do this by itself once the layers are
scanned (jax-ml/jax#30338).

The model is given as three pure functions of the parameters and a ``batch``
(anything: token ids, targets, masks, rotary tables, dropout keys):

* ``embed(params, batch) -> x₀``: the part before the stack;
* ``block(params, x, batch, layer) -> (y, aux)``: one block, with ``params``
  holding one layer's slice of every stacked parameter and ``layer`` its
  index (an ``int32`` scalar, to index per-layer constants); ``aux`` is any
  pytree of per-layer outputs (MoE load-balancing and z-losses), ``None``
  when there are none;
* ``head(params, x_L, aux_L, batch) -> (loss, metrics)``: the loss from the
  last block's output and every layer's ``aux`` stacked on a leading axis.

Each function sees the whole parameter tree's structure with only its own
leaves: ``embed`` and ``head`` the parameters outside the stack, ``block`` one
slice of the stacked ones; the others are ``optax.MaskedNode()`` (the
placeholder ``optax.partition`` uses), so a block that reads a parameter
outside the stack fails loudly instead of silently getting no gradient.
With ``L`` layers the step is

1. ``x₀ = embed(θ_out)``, then ``x_{l+1}, a_l = block(θ_l, x_l)`` for
   ``l = 0 … L−1``, keeping each block's input ``x_l``;
2. ``ℓ, m = head(θ_out, x_L, a)``, and its VJP: ``∂ℓ/∂x_L``, ``∂ℓ/∂a_l`` and
   the head's share of ``∂ℓ/∂θ_out``;
3. a reverse scan over ``l = L−1 … 0`` recomputes block ``l`` from ``x_l``
   under ``jax.vjp``, takes ``g_l = ∂ℓ/∂θ_l`` and ``∂ℓ/∂x_l``, applies ``tx``
   to layer ``l``'s slice of the parameters and of the state, and writes both
   back in place (jit the step with ``donate_argnums=(0, 1)``);
4. the embedding's VJP, then one update of the parameters outside the stack.

**Which transformations.** Any optax transformation whose update of a leaf
depends only on that leaf's gradient, state and parameter: SkewAdam, AdamW,
Lion, Adafactor, Muon on per-layer matrices. It sees one layer's slice at a
time, so build it for the slice's axes (one layer axis fewer;
:meth:`LayerwiseStep.per_layer_params` gives that tree). :func:`check_separable`
refuses, naming the leaf, a transformation that couples leaves (global-norm
clipping, ``apply_if_finite``); the step provides those two itself:

**Clipping and the non-finite skip** need the global norm
``‖g‖ = √(Σ_l ‖g_l‖² + ‖g_out‖²)`` before any update.

* ``clip_mode="exact"``: a first reverse pass computes only ``‖g‖`` and
  whether every gradient is finite (nothing is updated); the updating pass
  then applies ``g · min(1, c/‖g‖)`` as ``optax.clip_by_global_norm`` does,
  and with ``skip_nonfinite`` skips the whole step (parameters, state, step
  counts) on a non-finite gradient as ``optax.apply_if_finite`` does. The
  standard step's result up to float round-off, for one more recompute and
  backward pass of the stack.
* ``clip_mode="stale"``: one pass, clipping by the previous step's norm,
  ``g_t · min(1, c/‖g_{t−1}‖)`` (none at the first step). No skip: a layer is
  updated before a later layer's gradient is seen.
* ``clip_mode="none"`` (or ``clip_norm=None``): one pass, no clipping.

With ``contain_nonfinite`` (the default, as :func:`skewadam_jax.skewadam`'s)
the norm is that of the gradients with each NaN, Inf or overflowing entry
counted as zero, so one bad entry neither turns every layer's clip factor
into NaN (for good, in ``"stale"`` mode, which clips by the stored norm) nor
scales every other leaf to nothing.

**Gradient accumulation** is refused (``optax.MultiSteps`` raises at
:meth:`~LayerwiseStep.init`): summing gradients over micro-batches keeps a
gradient of every parameter alive between backward passes, which is exactly
the memory this step exists to save. Use a larger batch with activation
rematerialisation instead.

Example (a plain-JAX residual MLP stack, its 3 blocks stacked on axis 0)::

  >>> import jax, jax.numpy as jnp, optax
  >>> import skewadam_jax
  >>> from skewadam_jax.layerwise import layerwise_step
  >>> key = jax.random.key(0)
  >>> params = {"embed": jax.random.normal(key, (16, 8)) * 0.1,
  ...           "blocks": {"w": jax.random.normal(key, (3, 8, 8)) * 0.1},
  ...           "head": jax.random.normal(key, (8, 16)) * 0.1}
  >>> def embed(p, batch):
  ...   return p["embed"][batch["inputs"]]
  >>> def block(p, x, batch, layer):
  ...   return x + jnp.tanh(x @ p["blocks"]["w"]), None
  >>> def head(p, x, aux, batch):
  ...   logits = x @ p["head"]
  ...   loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
  ...   return loss, {"loss": loss}
  >>> engine = layerwise_step(optax.adamw(1e-2), embed, block, head, stack="blocks",
  ...                         clip_norm=1.0)
  >>> state = engine.init(params)
  >>> step = jax.jit(engine.step, donate_argnums=(0, 1))
  >>> batch = {"inputs": jnp.arange(8) % 16, "targets": (jnp.arange(8) + 1) % 16}
  >>> params, state, metrics = step(params, state, batch)
  >>> sorted(metrics)
  ['grad_norm', 'loss']
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from skewadam_jax import axes as axes_lib
from skewadam_jax import labels as labels_lib
from skewadam_jax import rounding
from skewadam_jax import sharding as sharding_lib
from skewadam_jax import transform

CLIP_MODES = ("exact", "stale", "none")

StackSpec = Union[str, Sequence[str], Callable[[str], bool]]
LayerAxis = Union[int, Callable[[str], int]]
_HOLE = optax.MaskedNode()


class LayerwiseState(NamedTuple):
  """The optimizer state of :func:`layerwise_step`.

  Attributes:
    layers: the transformation's state of one layer's slice, stacked: every
      leaf has a leading ``L`` axis (whatever axis the parameters stack on).
    outer: its state of the parameters outside the stack.
    grad_norm: the last step's global gradient norm (the ``stale`` clip's
      denominator; 0 before the first step).
    notfinite_count: consecutive steps skipped for non-finite gradients.
    last_finite: whether the last step's gradients were finite.
    total_notfinite: steps skipped in total.
  """
  layers: Any
  outer: Any
  grad_norm: jax.Array
  notfinite_count: jax.Array
  last_finite: jax.Array
  total_notfinite: jax.Array


class LayerwiseStep(NamedTuple):
  """What :func:`layerwise_step` returns.

  Attributes:
    init: ``init(params) -> LayerwiseState``.
    step: ``step(params, state, batch, *, key=None, grad_scale=None) ->
      (params, state, metrics)``; ``metrics`` is the head's with
      ``grad_norm`` (and the skip counters with ``skip_nonfinite``) added.
      ``key`` is the stochastic-rounding key; ``grad_scale`` (fault
      injection for tests) multiplies the gradients: a scalar for all, or an
      ``[L]`` vector for each layer's (the outer parameters' then unscaled).
    state_shardings: ``state_shardings(params, param_shardings) ->
      LayerwiseState`` of ``NamedSharding`` s (nothing allocated).
    per_layer_params: ``per_layer_params(params)``: the parameter tree with
      every stacked leaf replaced by one layer's ``ShapeDtypeStruct``: the
      tree ``tx`` acts on, for :func:`skewadam_jax.plan_table` and
      :func:`check_separable`.
  """
  init: Callable[..., LayerwiseState]
  step: Callable[..., tuple]
  state_shardings: Callable[..., LayerwiseState]
  per_layer_params: Callable[[Any], Any]


class _Stack(NamedTuple):
  """Where the stack is in one parameter tree: each leaf's layer axis or ``None``."""
  treedef: Any
  axes: tuple  # per leaf of the whole tree
  num_layers: int

  @property
  def stacked_axes(self) -> list[int]:
    return [a for a in self.axes if a is not None]

  def split(self, tree) -> tuple[Any, Any]:
    """``(stacked part, outer part)``: the whole structure, the other leaves ``MaskedNode``."""
    leaves = self.treedef.flatten_up_to(tree)
    return (self.treedef.unflatten([x if a is not None else _HOLE
                                    for x, a in zip(leaves, self.axes)]),
            self.treedef.unflatten([_HOLE if a is not None else x
                                    for x, a in zip(leaves, self.axes)]))

  def join(self, stacked, outer):
    stacked, outer = iter(jax.tree.leaves(stacked)), iter(jax.tree.leaves(outer))
    return self.treedef.unflatten([next(stacked) if a is not None else next(outer)
                                   for a in self.axes])

  def _map_stacked(self, fn, stacked, *rest):
    structure = jax.tree.structure(stacked)
    columns = [jax.tree.leaves(stacked)] + [structure.flatten_up_to(r) for r in rest]
    return structure.unflatten([fn(a, *leaves)
                                for a, *leaves in zip(self.stacked_axes, *columns)])

  def index(self, stacked, layer):
    return self._map_stacked(
        lambda a, x: jax.lax.dynamic_index_in_dim(x, layer, a, keepdims=False), stacked)

  def write(self, stacked, value, layer):
    return self._map_stacked(
        lambda a, x, v: jax.lax.dynamic_update_index_in_dim(x, v, layer, a), stacked, value)

  def one_layer(self, stacked):
    return self._map_stacked(
        lambda a, x: jax.ShapeDtypeStruct(x.shape[:a] + x.shape[a + 1:], x.dtype), stacked)

  def in_axes(self, stacked):
    return jax.tree.unflatten(jax.tree.structure(stacked), self.stacked_axes)


def _stack_predicate(stack: StackSpec) -> Callable[[str], bool]:
  if callable(stack):
    return stack
  prefixes = (stack,) if isinstance(stack, str) else tuple(stack)
  prefixes = tuple(p.strip("/").replace(".", "/") for p in prefixes)
  return lambda path: any(path == p or path.startswith(p + "/") for p in prefixes)


def _find_stack(params, stack: StackSpec, layer_axis: LayerAxis) -> _Stack:
  paths, leaves, treedef = labels_lib.flatten_with_paths(params)
  in_stack = _stack_predicate(stack)
  axes, sizes = [], {}
  for path, leaf in zip(paths, leaves):
    if not in_stack(path):
      axes.append(None)
      continue
    ndim = len(np.shape(leaf))
    axis = layer_axis(path) if callable(layer_axis) else layer_axis
    if not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
      raise ValueError(f"stacked parameter {path!r} of shape {tuple(np.shape(leaf))} has no "
                       f"layer axis {axis!r}")
    axis = int(axis) % ndim
    axes.append(axis)
    sizes.setdefault(np.shape(leaf)[axis], path)
  if not sizes:
    raise ValueError(f"no parameter is in the stack {stack!r}; the tree's paths look like "
                     f"{paths[:4]} (name the stack by its path prefix, e.g. stack='layers')")
  if all(a is not None for a in axes):
    raise ValueError(f"every parameter is in the stack {stack!r}: the step needs at least "
                     "the head's parameters outside it")
  if len(sizes) > 1:
    raise ValueError("the stacked parameters disagree on the number of layers: "
                     + ", ".join(f"{p!r} has {n}" for n, p in sizes.items())
                     + " along their layer axes (is layer_axis right?)")
  return _Stack(treedef, tuple(axes), next(iter(sizes)))


def scanned_matrix_axes(stack: StackSpec, layer_axis: LayerAxis = 0) -> Callable[[Any], Any]:
  """SkewAdam's ``matrix_axes`` for a whole scanned tree, as one layer's slice sees it.

  SkewAdam's default guess (the last two axes of every leaf with two or
  more) is right for one layer's slice but not for the stacked tree: a
  per-layer bias ``[L, H]`` would count as a matrix, factored and decayed
  across layers. With this spec, a stacked leaf is a matrix over its last two
  axes other than the layer axis (and not a matrix if it has fewer), the
  other leaves keep the default guess, so the standard step's optimizer
  treats every leaf as :func:`layerwise_step`'s does. The layer axis is
  declared too (``MatrixAxes.layer``): the orthogonal direction steps a bank
  stacked over layers and experts one layer at a time.

  Args:
    stack, layer_axis: as for :func:`layerwise_step`.

  Returns:
    A callable for ``skewadam(..., matrix_axes=...)``.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> params = {"blocks": {"w": jnp.ones((4, 8, 16)), "b": jnp.ones((4, 16))},
    ...           "head": jnp.ones((8, 3))}
    >>> axes = scanned_matrix_axes("blocks")(params)
    >>> axes["blocks"]["b"] is None, axes["blocks"]["w"], axes["head"]
    (True, MatrixAxes(rows=1, cols=2, layer=0), MatrixAxes(rows=0, cols=1, layer=None))
  """
  in_stack = _stack_predicate(stack)

  def spec(tree):
    paths, leaves, treedef = labels_lib.flatten_with_paths(tree)
    out = []
    for path, leaf in zip(paths, leaves):
      ndim = len(np.shape(leaf))
      axis = None
      if in_stack(path):
        axis = (layer_axis(path) if callable(layer_axis) else layer_axis) % ndim
      kept = [a for a in range(ndim) if a != axis]
      out.append(axes_lib.MatrixAxes(rows=kept[-2], cols=kept[-1], layer=axis)
                 if len(kept) >= 2 else None)
    return treedef.unflatten(out)
  return spec


def _probe_tree(params, size: int = 3):
  """Small random stand-ins for ``params``: each axis cut to ``size``, paths kept."""
  leaves, treedef = jax.tree.flatten(params)
  rng = np.random.default_rng(0)
  return treedef.unflatten([
      jnp.asarray(rng.normal(size=tuple(min(s, size) for s in np.shape(x))), x.dtype)
      for x in leaves])


def check_separable(tx: optax.GradientTransformation, params) -> None:
  """Refuses ``tx`` if a leaf's update depends on another leaf's gradient.

  Applied one layer at a time, such a transformation would silently change
  meaning (a global-norm clip would clip each slice by its own norm). The
  check runs ``tx`` on a small random stand-in of ``params`` (same paths,
  dtypes and ranks), then again with every other leaf's gradient scaled by
  1e4 or set to NaN: the first and last leaves' updates must not change.

  Args:
    tx: the per-layer transformation.
    params: the tree it acts on (arrays or ``ShapeDtypeStruct`` s), e.g.
      :meth:`LayerwiseStep.per_layer_params`.

  Raises:
    ValueError: naming the first leaf whose update depended on the others.

  Examples:
    >>> import jax.numpy as jnp, optax
    >>> params = {"a": jnp.ones(3), "b": jnp.ones(3)}
    >>> check_separable(optax.adam(1e-3), params)
    >>> check_separable(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), params)
    Traceback (most recent call last):
    ...
    ValueError: the optimizer's update of 'a' changed when the other gradients were scaled by 1e4: ...
  """
  probe = _probe_tree(params)
  paths, leaves, treedef = labels_lib.flatten_with_paths(jax.tree.map(lambda x: x * 0.5 + 0.1,
                                                                      probe))
  if len(leaves) < 2:
    return

  @jax.jit
  def run(g):
    return jax.tree.leaves(tx.update(g, tx.init(probe), probe)[0])

  base = run(treedef.unflatten(leaves))
  for name, perturb in (("scaled by 1e4", lambda x: x * 1e4),
                        ("set to NaN", lambda x: jnp.full_like(x, jnp.nan))):
    for kept in (0, len(leaves) - 1):
      other = [x if i == kept else perturb(x) for i, x in enumerate(leaves)]
      got = run(treedef.unflatten(other))[kept]
      if not np.allclose(np.asarray(got, np.float32), np.asarray(base[kept], np.float32),
                         rtol=1e-5, atol=1e-7, equal_nan=True):
        raise ValueError(
            f"the optimizer's update of {paths[kept]!r} changed when the other gradients "
            f"were {name}: it couples parameters (global-norm clipping, apply_if_finite, "
            "...), so it cannot run one layer at a time. Build it without them and pass "
            "clip_norm= / skip_nonfinite= to layerwise_step instead.")


def _sum_squares(tree) -> jax.Array:
  return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)),
             jnp.zeros((), jnp.float32))


def _all_finite(tree) -> jax.Array:
  checks = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(checks)) if checks else jnp.array(True)


def _scaled(tree, scale):
  return jax.tree.map(lambda g: g * jnp.asarray(scale, g.dtype), tree)


def _is_tracer(tree) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def _refuse_accumulation(state) -> None:
  found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.MultiStepsState))
  if any(isinstance(x, optax.MultiStepsState) for x in found):
    raise ValueError(
        "gradient accumulation (optax.MultiSteps) cannot run inside the backward pass: it "
        "keeps a gradient of every parameter alive between micro-batches, the memory this "
        "step exists to save. Use layerwise_step(..., micro_batches=K): it accumulates "
        "layer by layer into one parameter-sized buffer.")


def _cotangent_slice(tree, layer):
  """Layer ``layer``'s slice of the aux cotangents; integer outputs get ``float0`` zeros."""
  def one(g):
    if g.dtype == jax.dtypes.float0:
      return np.zeros(g.shape[1:], jax.dtypes.float0)
    return jax.lax.dynamic_index_in_dim(g, layer, 0, keepdims=False)
  return jax.tree.map(one, tree)


def layerwise_step(tx: optax.GradientTransformation, embed: Callable, block: Callable,
                   head: Callable, *, stack: StackSpec, layer_axis: LayerAxis = 0,
                   clip_norm: float | None = None, clip_mode: str = "exact",
                   skip_nonfinite: int = 0, contain_nonfinite: bool = True,
                   stochastic_rounding: bool = False, check: bool = True,
                   micro_batches: int = 1, accumulate_dtype: str = "float32") -> LayerwiseStep:
  """A train step that updates each layer of a scanned stack inside the backward pass.

  See the module docstring for the functions, the algorithm and the clip modes.

  Args:
    tx: the per-layer optimizer: separable (no global-norm clipping, no
      ``apply_if_finite``), built for one layer's slice of the stack.
    embed: ``embed(params, batch) -> x`` (``x`` any pytree of arrays).
    block: ``block(params, x, batch, layer) -> (y, aux)``, ``y`` shaped as ``x``.
    head: ``head(params, x, aux, batch) -> (loss, metrics)``; ``loss`` a float
      scalar, ``metrics`` a mapping (or ``None``).
    stack: which parameters are stacked: a path prefix (``"layers"``,
      ``"params/decoder/layers"``; ``/`` or ``.`` separated, as
      :func:`skewadam_jax.plan_table` prints paths), several, or a predicate
      on the path.
    layer_axis: the stacked parameters' layer axis: an int for all of them
      (``1`` for MaxText's ``param_scan_axis=1`` or ``nn.scan(...,
      variable_axes={"params": 1})``), or a function of the path.
    clip_norm: global gradient-norm clip; ``None`` or ``0``: none.
    clip_mode: ``"exact"``, ``"stale"`` or ``"none"``.
    skip_nonfinite: as ``optax.apply_if_finite(max_consecutive_errors=...)``:
      skip steps with a non-finite gradient (``0``: off); needs ``"exact"``.
    contain_nonfinite: the global norm counts each non-finite (or
      overflowing) gradient entry as zero; the entry itself reaches ``tx``,
      whose own containment (SkewAdam's default) treats it as zero too.
      ``False``: the norm of the raw gradients, as ``optax.global_norm``.
    stochastic_rounding: apply updates with
      :func:`skewadam_jax.apply_updates_stochastic` (``step`` then needs
      ``key``; layer ``l`` draws from ``fold_in(key, l)``, the outer
      parameters from ``fold_in(key, L)``).
    check: run :func:`check_separable` in ``init`` (skipped when ``init`` is
      traced, e.g. under ``jax.eval_shape``).
    micro_batches: ``K > 1``: gradient accumulation. ``step``'s ``batch``
      then holds ``K`` micro-batches along the leading axis of every leaf,
      and the update is the one of the mean gradient ``(1/K) Σ_k g_k`` (and
      the metrics their means over the micro-batches). The first ``K - 1``
      run forward and backward into a stacked accumulator updated layer by
      layer in place; the last one's passes add their gradients to it as
      they go. Memory: one parameter-sized accumulator, never the full
      gradient of a micro-batch beside it.
    accumulate_dtype: the accumulator's dtype: ``"float32"`` or
      ``"params"`` (each parameter's own).

  Returns:
    A :class:`LayerwiseStep` (``init``, ``step``, ``state_shardings``,
    ``per_layer_params``).

  Raises:
    ValueError: for an unknown ``clip_mode``, or the skip without ``"exact"``;
      at ``init``/``step``, for a stack that matches no parameter (showing the
      tree's paths) or whose layer counts disagree (naming the paths).
  """
  if clip_mode not in CLIP_MODES:
    raise ValueError(f"clip_mode must be one of {', '.join(CLIP_MODES)}, got {clip_mode!r}")
  if skip_nonfinite and clip_mode != "exact":
    raise ValueError(f"skip_nonfinite needs clip_mode='exact' (got {clip_mode!r}): in one "
                     "pass a layer is updated before the later layers' gradients are seen")
  if not isinstance(micro_batches, (int, np.integer)) or isinstance(micro_batches, bool) \
      or micro_batches < 1:
    raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
  if accumulate_dtype not in ("float32", "params"):
    raise ValueError(f"accumulate_dtype must be 'float32' or 'params', got {accumulate_dtype!r}")
  clip_norm = 0.0 if clip_mode == "none" or not clip_norm else float(clip_norm)
  if clip_norm < 0:
    raise ValueError(f"clip_norm must be positive, got {clip_norm}")
  norm_first = skip_nonfinite > 0 or (clip_norm > 0 and clip_mode == "exact")

  def sum_squares(grads):
    return _sum_squares(transform.contained(grads) if contain_nonfinite else grads)

  def find(params) -> _Stack:
    return _find_stack(params, stack, layer_axis)

  def per_layer_params(params):
    where = find(params)
    stacked, outer = where.split(params)
    outer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), outer)
    return where.join(where.one_layer(stacked), outer)

  def init(params) -> LayerwiseState:
    where = find(params)
    if check and not _is_tracer(params):
      check_separable(tx, per_layer_params(params))
    stacked, outer = where.split(params)
    state = LayerwiseState(
        layers=jax.vmap(tx.init, in_axes=(where.in_axes(stacked),))(stacked),
        outer=tx.init(outer), grad_norm=jnp.zeros((), jnp.float32),
        notfinite_count=jnp.zeros((), jnp.int32), last_finite=jnp.array(True),
        total_notfinite=jnp.zeros((), jnp.int32))
    _refuse_accumulation(state)
    return state

  def state_shardings(params, param_shardings) -> LayerwiseState:
    """Each layer's state sharded as the standard step's state of that slice would
    be, with a leading unsplit ``L`` axis; scalars replicated."""
    where = find(params)
    stacked, outer = where.split(params)
    stacked_shardings, outer_shardings = where.split(param_shardings)
    paths = labels_lib.flatten_with_paths(params)[0]
    stacked_paths = [p for p, a in zip(paths, where.axes) if a is not None]

    def drop_layer_axis(axis, sharding, path):
      spec = tuple(sharding.spec) + (None,) * (axis + 1 - len(sharding.spec))
      if spec[axis] is not None:
        raise ValueError(f"parameter {path!r}: its layer axis {axis} is split "
                         f"({sharding.spec}); the layerwise step scans over it")
      return NamedSharding(sharding.mesh, PartitionSpec(*spec[:axis], *spec[axis + 1:]))

    slice_shardings = where._map_stacked(drop_layer_axis, stacked_shardings,
                                         jax.tree.unflatten(jax.tree.structure(stacked),
                                                            stacked_paths))
    mesh = jax.tree.leaves(param_shardings)[0].mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    layers = jax.tree.map(
        lambda s: NamedSharding(s.mesh, PartitionSpec(None, *s.spec), memory_kind=s.memory_kind),
        sharding_lib.state_shardings(tx, where.one_layer(stacked), slice_shardings))
    return LayerwiseState(
        layers=layers, outer=sharding_lib.state_shardings(tx, outer, outer_shardings),
        grad_norm=replicated, notfinite_count=replicated, last_finite=replicated,
        total_notfinite=replicated)

  def clip(grads, norm):
    if not clip_norm:
      return grads
    # optax.clip_by_global_norm's formula, so exact mode rounds as it does.
    return jax.tree.map(
        lambda g: jnp.where(norm < clip_norm, g, (g / norm.astype(g.dtype)) * clip_norm),
        grads)

  def apply(params, updates, key):
    if stochastic_rounding:
      return rounding.apply_updates_stochastic(params, updates, key)
    return optax.apply_updates(params, updates)

  def _accumulated(backward_of, batch, where, stacked, outer):
    """``backward_of``'s interface for the mean over the micro-batches of ``batch``.

    Micro-batches ``0 .. K-2`` run forward and backward now, each layer's
    gradient added in place into a stacked accumulator; the last one's
    gradients are added to it when the updating passes ask for them, so the
    update sees ``(1/K) Σ_k g_k`` and no second parameter-sized buffer exists.
    """
    first = jax.tree.map(lambda x: x[:-1], batch)
    last = jax.tree.map(lambda x: x[-1], batch)
    acc_dtype = lambda x: jnp.float32 if accumulate_dtype == "float32" else x.dtype
    zeros = lambda tree: jax.tree.map(lambda x: jnp.zeros(np.shape(x), acc_dtype(x)), tree)
    add = lambda acc, g: jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)

    def one(carry, micro):
      acc_stack, acc_outer, metric_sum = carry
      g_xL, layer_grads, outer_grads, metrics = backward_of(micro)

      def back(c, layer):
        g_y, acc = c
        g_p, g_x = layer_grads(where.index(stacked, layer), layer, g_y)
        return (g_x, where.write(acc, add(where.index(acc, layer), g_p), layer)), None

      (g_x0, acc_stack), _ = jax.lax.scan(back, (g_xL, acc_stack), jnp.arange(num_layers),
                                          reverse=True)
      return (acc_stack, add(acc_outer, outer_grads(g_x0)), add(metric_sum, metrics)), None

    num_layers = where.num_layers
    metric_shapes = jax.eval_shape(lambda b: backward_of(b)[3], last)
    (acc_stack, acc_outer, metric_sum), _ = jax.lax.scan(
        one, (zeros(stacked), zeros(outer), zeros(metric_shapes)), first)
    g_xL, layer_grads, outer_grads, metrics = backward_of(last)

    def mean(acc, g):
      return jax.tree.map(lambda a, b: ((a + b.astype(a.dtype)) / micro_batches).astype(b.dtype),
                          acc, g)

    def mean_layer_grads(layer_slice, layer, g_y):
      g_p, g_x = layer_grads(layer_slice, layer, g_y)
      return mean(where.index(acc_stack, layer), g_p), g_x

    def mean_outer_grads(g_x0):
      return mean(acc_outer, outer_grads(g_x0))
    metrics = jax.tree.map(lambda a, m: ((a + m) / micro_batches).astype(m.dtype),
                           metric_sum, metrics)
    return g_xL, mean_layer_grads, mean_outer_grads, metrics

  def step(params, state: LayerwiseState, batch, *, key=None, grad_scale=None):
    if stochastic_rounding and key is None:
      raise ValueError("a layerwise step with stochastic rounding needs key=")
    where = find(params)
    num_layers = where.num_layers
    stacked, outer = where.split(params)
    layer_scale = (None if grad_scale is None or np.ndim(grad_scale) == 0
                   else jnp.asarray(grad_scale))
    outer_scale = grad_scale if layer_scale is None else None

    def backward_of(batch):
      """Forward and head of ``batch``; its layers' and the outer gradients on demand."""
      # 1. Forward, keeping each block's input.
      x0, embed_vjp = jax.vjp(lambda o: embed(o, batch), outer)

      def forward(x, layer):
        y, aux = block(where.index(stacked, layer), x, batch, layer)
        return y, (x, aux)

      xL, (x_in, aux_L) = jax.lax.scan(forward, x0, jnp.arange(num_layers))

      # 2. The head: the loss, the outer parameters' share of its gradient, the cotangents.
      loss, head_vjp, metrics = jax.vjp(lambda o, x, a: head(o, x, a, batch), outer, xL,
                                        aux_L, has_aux=True)
      if np.shape(loss) != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(f"head must return a float scalar loss first; got {loss.dtype} "
                         f"of shape {np.shape(loss)}")
      g_head, g_xL, g_aux_L = head_vjp(jnp.ones_like(loss))

      def layer_grads(layer_slice, layer, g_y):
        x_l = jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), x_in)
        _, vjp = jax.vjp(lambda p, x: block(p, x, batch, layer), layer_slice, x_l)
        g_p, g_x = vjp((g_y, _cotangent_slice(g_aux_L, layer)))
        if layer_scale is not None:
          g_p = _scaled(g_p, layer_scale[layer])
        elif grad_scale is not None:
          g_p = _scaled(g_p, grad_scale)
        return g_p, g_x

      def outer_grads(g_x0):
        (g_embed,) = embed_vjp(g_x0)
        g = jax.tree.map(jnp.add, g_head, g_embed)
        return g if outer_scale is None else _scaled(g, outer_scale)
      return g_xL, layer_grads, outer_grads, metrics

    if micro_batches == 1:
      g_xL, layer_grads, outer_grads, metrics = backward_of(batch)
    else:
      g_xL, layer_grads, outer_grads, metrics = _accumulated(
          backward_of, batch, where, stacked, outer)

    # 3a. Exact mode: the global norm and finiteness first, nothing updated.
    if norm_first:
      def measure(carry, layer):
        g_y, sumsq, finite = carry
        g_p, g_x = layer_grads(where.index(stacked, layer), layer, g_y)
        return (g_x, sumsq + sum_squares(g_p), finite & _all_finite(g_p)), None

      (g_x0, sumsq, finite), _ = jax.lax.scan(
          measure, (g_xL, jnp.zeros((), jnp.float32), jnp.array(True)),
          jnp.arange(num_layers), reverse=True)
      g_outer = outer_grads(g_x0)
      grad_norm = jnp.sqrt(sumsq + sum_squares(g_outer))
      finite = finite & _all_finite(g_outer)
      clip_by = grad_norm
    else:
      clip_by = state.grad_norm
      finite = jnp.array(True)

    if skip_nonfinite:
      notfinite_count = jnp.where(finite, 0, state.notfinite_count + 1)
      total_notfinite = jnp.where(finite, state.total_notfinite, state.total_notfinite + 1)
      do_update = finite | (notfinite_count > skip_nonfinite)
    else:
      notfinite_count, total_notfinite = state.notfinite_count, state.total_notfinite
      do_update = jnp.array(True)

    def keep_unless(new, old):
      return jax.tree.map(lambda n, o: jnp.where(do_update, n, o), new, old)

    def state_slice(states, layer):
      return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False),
                          states)

    def write_state(states, value, layer):
      return jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, layer, 0),
                          states, value)

    # 3b. The updating pass: layer l's slice updated as soon as its gradient exists.
    def update(carry, layer):
      g_y, params_stack, states, sumsq = carry
      layer_slice, layer_state = where.index(params_stack, layer), state_slice(states, layer)
      g_p, g_x = layer_grads(layer_slice, layer, g_y)
      updates, new_state = tx.update(clip(g_p, clip_by), layer_state, layer_slice)
      layer_key = None if key is None else jax.random.fold_in(key, layer)
      new_slice = keep_unless(apply(layer_slice, updates, layer_key), layer_slice)
      new_state = keep_unless(new_state, layer_state)
      return (g_x, where.write(params_stack, new_slice, layer),
              write_state(states, new_state, layer), sumsq + sum_squares(g_p)), None

    (g_x0, stacked, layer_states, layer_sumsq), _ = jax.lax.scan(
        update, (g_xL, stacked, state.layers, jnp.zeros((), jnp.float32)),
        jnp.arange(num_layers), reverse=True)

    # 4. The parameters outside the stack.
    g_outer = outer_grads(g_x0)
    if not norm_first:
      grad_norm = jnp.sqrt(layer_sumsq + sum_squares(g_outer))
    updates, outer_state = tx.update(clip(g_outer, clip_by), state.outer, outer)
    outer_key = None if key is None else jax.random.fold_in(key, num_layers)
    new_outer = keep_unless(apply(outer, updates, outer_key), outer)
    outer_state = keep_unless(outer_state, state.outer)

    new_state = LayerwiseState(
        layers=layer_states, outer=outer_state, grad_norm=grad_norm,
        notfinite_count=notfinite_count, last_finite=finite, total_notfinite=total_notfinite)
    metrics = {} if metrics is None else dict(metrics)
    metrics["grad_norm"] = grad_norm
    if skip_nonfinite:
      metrics["notfinite_count"] = notfinite_count
      metrics["total_notfinite"] = total_notfinite
    return where.join(stacked, new_outer), new_state, metrics

  return LayerwiseStep(init=init, step=step, state_shardings=state_shardings,
                       per_layer_params=per_layer_params)
