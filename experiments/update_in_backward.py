"""The optimizer update inside the backward pass, one layer of the stack at a time.

The standard train step (:func:`experiments.steps.make_step_fns`) keeps the
gradients of every layer alive until the backward pass ends, then updates all
parameters at once: at ``moe-6.78b`` that is 13.55 GB of bf16 gradients next
to 13.55 GB of parameters. This step applies each layer's update as soon as
that layer's gradients exist (as LOMO / AdaLomo and PyTorch's "optimizer in
backward" do), so one layer's gradients are alive at a time:

1. forward: embed, then scan the ``L`` blocks keeping only each block's input
   ``x_l`` (``[L, B, T, D]``), then the loss ``ℓ`` from the last output;
2. the head's VJP gives ``∂ℓ/∂x_L`` and the gradients of the final norm and
   the unembedding;
3. a reverse scan over ``l = L−1, …, 0`` recomputes block ``l`` from ``x_l``
   under ``jax.vjp``, takes its parameter gradient ``g_l`` and the input
   cotangent ``∂ℓ/∂x_l``, applies the optimizer to layer ``l``'s slice of the
   stacked parameters and optimizer state and writes both back in place
   (``dynamic_update_index_in_dim`` on the carried stacks; the train step
   donates parameters and state), and passes ``∂ℓ/∂x_l`` on;
4. the embedding's VJP, then one update of the parameters outside the stack
   (embedding, final norm, unembedding).

**Which optimizers.** Any optax transformation whose update of a leaf
depends only on that leaf (its gradient, state and parameter): SkewAdam,
AdamW, Lion, Adafactor, Muon on per-layer matrices. It sees one layer's slice
at a time, so it must be built for the slice's axes (:func:`slice_axes`
drops the leading ``layers`` axis). :func:`check_separable` refuses, naming
the leaf, a transformation that couples leaves (global-norm clipping,
``apply_if_finite``, anything that reads all gradients at once); those two
are provided by the step itself:

**Clipping and the non-finite skip** need the global gradient norm
``‖g‖ = √(Σ_l ‖g_l‖² + ‖g_outer‖²)`` before any update.

* ``clip_mode="exact"``: a first reverse pass computes only ``‖g‖`` and
  whether every gradient is finite (nothing is updated), then the updating
  pass applies ``g · min(1, c/‖g‖)`` exactly as ``optax.clip_by_global_norm``
  and skips the whole step (parameters, state and step count untouched) when
  a gradient is not finite, as ``optax.apply_if_finite`` does. Same result
  as the standard step up to float round-off; one more recompute and
  backward pass per step.
* ``clip_mode="stale"``: one pass; the clip factor uses the previous step's
  norm, ``g_t · min(1, c/‖g_{t−1}‖)`` (no clipping at the first step), and
  this step's norm is stored for the next. The non-finite skip is not
  available (a layer is updated before a later layer's gradient is seen).

Without clipping (``clip_norm=0``) and without the skip both modes are the
same single pass. The optimizer state is :class:`InBackwardState`, not the
standard step's, so a checkpoint resumes only in the mode it was written in.

Example::

  tx = optimizers.make_optimizer("skewadam", learning_rate=1e-3, axes=slice_axes(axes),
                                 clip_norm=0)
  train_step = make_train_step(graphdef, rest, tx, clip_norm=1.0)
  opt_state = init(tx, params)
  params, opt_state, metrics = jax.jit(train_step, donate_argnums=(0, 1))(
      params, opt_state, inputs, targets)
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import models
import skewadam_jax
from models import axes as model_axes

CLIP_MODES = ("exact", "stale")
LAYERS = model_axes.LAYERS  # the parameter tree's key of the layer stack


class InBackwardState(NamedTuple):
  """The optimizer state of the update-in-backward step.

  Attributes:
    layers: the transformation's state of one layer's slice, stacked: every
      leaf has a leading ``L`` axis (``jax.vmap(tx.init)`` over the stack).
    outer: its state of the parameters outside the stack.
    grad_norm: the last step's global gradient norm (the ``stale`` clip
      threshold's denominator; 0 before the first step).
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


def _raw(mapping):
  # An nnx.State's items are views; its raw mapping keeps the pytree's node types.
  return getattr(mapping, "raw_mapping", mapping)


def split_layers(params) -> tuple[Any, Any]:
  """``(layer part, outer part)`` of a parameter mapping, by its top-level keys.

  The layer part keeps the ``layers`` key, so both parts have the paths of the
  whole tree (path-matched masks and labels apply to either).
  """
  if LAYERS not in params:
    raise ValueError(f"the parameter tree has no {LAYERS!r} entry (the layer stack); "
                     f"top-level keys: {sorted(params)}")
  raw = _raw(params)
  make = type(params)
  return make({LAYERS: raw[LAYERS]}), make({k: v for k, v in raw.items() if k != LAYERS})


def join_layers(params_like, layer_part, outer_part):
  """The inverse of :func:`split_layers`, in ``params_like``'s key order."""
  layers, outer = _raw(layer_part), _raw(outer_part)
  return type(params_like)({k: layers[k] if k == LAYERS else outer[k] for k in params_like})


def slice_axes(axes: Mapping[str, tuple]) -> dict[str, tuple]:
  """The logical axes an optimizer sees for one layer's slice.

  A parameter stacked over ``layers`` loses that leading axis; the others
  are unchanged. Build the transformation for the update-in-backward step
  from these, so its matrix axes and tiers describe the slice.

  Example:
    >>> slice_axes({"layers/moe/experts/w_up": ("layers", "experts", "embed", "mlp"),
    ...             "final_norm/scale": ("embed",)})
    {'layers/moe/experts/w_up': ('experts', 'embed', 'mlp'), 'final_norm/scale': ('embed',)}
  """
  return {p: tuple(n[1:]) if n and n[0] == LAYERS else tuple(n) for p, n in axes.items()}


def _layer_slice(tree, index):
  return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False),
                      tree)


def _write_slice(tree, value, index):
  return jax.tree.map(lambda a, v: jax.lax.dynamic_update_index_in_dim(a, v, index, 0),
                      tree, value)


def init(tx: optax.GradientTransformation, params) -> InBackwardState:
  """The step's optimizer state: ``tx``'s per-slice state stacked over the layers."""
  layer_part, outer_part = split_layers(params)
  return InBackwardState(
      layers=jax.vmap(tx.init)(layer_part), outer=tx.init(outer_part),
      grad_norm=jnp.zeros((), jnp.float32), notfinite_count=jnp.zeros((), jnp.int32),
      last_finite=jnp.array(True), total_notfinite=jnp.zeros((), jnp.int32))


def state_shardings(tx: optax.GradientTransformation, params, param_shardings, replicated):
  """The shardings of :func:`init`'s state, from the parameters' (nothing allocated).

  Each layer's slice of the state is sharded as the standard step's state of
  that slice would be (:func:`skewadam_jax.state_shardings` on the slice's
  parameters and their shardings, the stacked parameters' specs without
  the layer axis); the stack then adds a leading unsplit ``L`` axis, which the
  reverse scan indexes. The outer parameters' state follows theirs; the norm
  and skip counters are ``replicated``.

  Args:
    tx: the per-slice optimizer (as for :func:`init`).
    params: the parameters or their ``ShapeDtypeStruct`` s.
    param_shardings: ``NamedSharding`` s with the structure of ``params``;
      the stacked parameters' layer axis must not be split (it is scanned).
    replicated: the sharding of scalars (a ``NamedSharding`` with ``P()``).

  Raises:
    ValueError: naming the parameter, if its layer axis is split.
  """
  layer_part, outer_part = split_layers(params)
  layer_shardings, outer_shardings = split_layers(param_shardings)
  for path, sharding in jax.tree_util.tree_flatten_with_path(layer_shardings)[0]:
    if sharding.spec and sharding.spec[0] is not None:
      raise ValueError(f"parameter {model_axes.path_to_str(path)!r}: its layer axis is split "
                       f"({sharding.spec}); the update-in-backward step scans over it")
  slice_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), layer_part)
  slice_shardings = jax.tree.map(
      lambda s: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:])),
      layer_shardings)
  stacked = jax.tree.map(
      lambda s: jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(None, *s.spec)),
      skewadam_jax.state_shardings(tx, slice_params, slice_shardings))
  return InBackwardState(
      layers=stacked, outer=skewadam_jax.state_shardings(tx, outer_part, outer_shardings),
      grad_norm=replicated, notfinite_count=replicated, last_finite=replicated,
      total_notfinite=replicated)


def _probe_tree(params, size: int = 3):
  """Small random stand-ins for ``params``: each axis cut to ``size``, paths kept."""
  leaves, treedef = jax.tree.flatten(params)
  rng = np.random.default_rng(0)
  probe = [jnp.asarray(rng.normal(size=tuple(min(s, size) for s in x.shape)), x.dtype)
           for x in leaves]
  return jax.tree.unflatten(treedef, probe)


def check_separable(tx: optax.GradientTransformation, params) -> None:
  """Refuses ``tx`` if a leaf's update depends on another leaf's gradient.

  Applied one layer at a time, such a transformation would silently change
  meaning (a global-norm clip would clip each slice by its own norm). The
  check runs ``tx`` on a small random stand-in of one layer's slice and of
  the outer parameters (same paths, dtypes and ranks; shapes or concrete
  arrays), then again with every other leaf's gradient scaled by 1e4 or set
  to NaN: each leaf's update must not change.

  Raises:
    ValueError: naming the first leaf whose update depended on the others.
  """
  layer_part, outer_part = split_layers(params)
  layer_slice = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), layer_part)
  probe = _probe_tree(join_layers(params, layer_slice, outer_part))
  grads = jax.tree.map(lambda x: x * 0.5 + 0.1, probe)
  paths = [model_axes.path_to_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(probe)[0]]
  treedef = jax.tree.structure(probe)
  leaves = jax.tree.leaves(grads)

  @jax.jit
  def run(g):
    return jax.tree.leaves(tx.update(g, tx.init(probe), probe)[0])

  base = run(grads)
  for name, perturb in (("scaled by 1e4", lambda x: x * 1e4),
                        ("set to NaN", lambda x: jnp.full_like(x, jnp.nan))):
    for kept in (0, len(leaves) - 1):
      other = [x if i == kept else perturb(x) for i, x in enumerate(leaves)]
      got = run(jax.tree.unflatten(treedef, other))[kept]
      if not np.allclose(np.asarray(got, np.float32), np.asarray(base[kept], np.float32),
                         rtol=1e-5, atol=1e-7, equal_nan=True):
        raise ValueError(
            f"the optimizer's update of {paths[kept]!r} changed when the other gradients "
            f"were {name}: it couples parameters (global-norm clipping, apply_if_finite, "
            "...), so it cannot run one layer at a time. Build it without them and pass "
            "clip_norm= / skip_nonfinite= to the update-in-backward step instead.")


def _sum_squares(tree) -> jax.Array:
  return sum((jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)),
             jnp.zeros((), jnp.float32))


def _all_finite(tree) -> jax.Array:
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def _scaled(tree, scale):
  return jax.tree.map(lambda g: g * jnp.asarray(scale, g.dtype), tree)


def make_train_step(graphdef, rest, tx: optax.GradientTransformation, *,
                    clip_norm: float = 1.0, clip_mode: str = "exact",
                    skip_nonfinite: int = 0, stochastic_rounding: bool = False):
  """The train step with the update inside the backward pass (not yet jitted).

  Same signature and metrics as :func:`experiments.steps.make_step_fns`'s
  ``train_step``: ``train_step(params, opt_state, inputs, targets, key=None,
  grad_scale=None) -> (params, opt_state, metrics)`` with ``opt_state`` from
  :func:`init`. Jit it with ``donate_argnums=(0, 1)`` so the stacks are
  updated in place.

  Args:
    graphdef, rest: the split :class:`models.Transformer` (as ``nnx.split(model,
      nnx.Param, ...)`` gives them).
    tx: the per-leaf optimizer, built for :func:`slice_axes` and without
      clipping or ``apply_if_finite`` (:func:`check_separable`).
    clip_norm: global gradient-norm clip (``0``: none).
    clip_mode: ``"exact"`` or ``"stale"`` (module docstring).
    skip_nonfinite: as ``optax.apply_if_finite(max_consecutive_errors=...)``:
      skip steps with non-finite gradients (``0``: off); needs ``"exact"``.
    stochastic_rounding: apply updates with
      :func:`skewadam_jax.apply_updates_stochastic`; ``key`` is then required
      (layer ``l`` draws from ``fold_in(key, l)``, so the bits differ from
      the standard step's).

  ``grad_scale`` (fault injection for tests) multiplies the gradients: a
  scalar for all of them, or an ``[L]`` vector for each layer's (the outer
  parameters' then unscaled).

  Raises:
    ValueError: for an unknown ``clip_mode`` or the skip without ``"exact"``.
  """
  if clip_mode not in CLIP_MODES:
    raise ValueError(f"clip mode must be one of {', '.join(CLIP_MODES)}, got {clip_mode!r}")
  if skip_nonfinite and clip_mode != "exact":
    raise ValueError("skipping non-finite steps needs clip mode 'exact': in 'stale' mode a "
                     "layer is updated before the later layers' gradients are seen")
  norm_first = skip_nonfinite > 0 or (clip_norm > 0 and clip_mode == "exact")

  def clip(grads, norm):
    if not clip_norm:
      return grads
    # optax.clip_by_global_norm's formula, so exact mode rounds as it does.
    return jax.tree.map(
        lambda g: jnp.where(norm < clip_norm, g, (g / norm.astype(g.dtype)) * clip_norm),
        grads)

  def apply(params, updates, key):
    if stochastic_rounding:
      return skewadam_jax.apply_updates_stochastic(params, updates, key)
    return optax.apply_updates(params, updates)

  def train_step(params, opt_state: InBackwardState, inputs, targets, key=None,
                 grad_scale=None):
    if stochastic_rounding and key is None:
      raise ValueError("train_step with stochastic rounding needs key=")
    layer_part, outer_part = split_layers(params)
    model = nnx.merge(graphdef, params, rest)
    block_def, _, block_rest = nnx.split(model.layers, nnx.Param, ...)
    num_layers = jax.tree.leaves(layer_part)[0].shape[0]
    sin_TK, cos_TK = model.rope(inputs.shape[-1])
    layer_scale = (None if grad_scale is None or np.ndim(grad_scale) == 0
                   else jnp.asarray(grad_scale))
    outer_scale = grad_scale if layer_scale is None else None

    def with_outer(outer):
      return nnx.merge(graphdef, join_layers(params, layer_part, outer), rest)

    def run_block(layer_slice, block_rest_l, x_BTD):
      return nnx.merge(block_def, layer_slice[LAYERS], block_rest_l)(x_BTD, sin_TK, cos_TK)

    def block(layer_slice, block_rest_l, x_BTD):  # the outputs the loss depends on
      y_BTD, aux = run_block(layer_slice, block_rest_l, x_BTD)
      return y_BTD, aux["lb_loss"], aux["z_loss"]

    # 1. Forward, keeping each block's input.
    x0_BTD, embed_vjp = jax.vjp(lambda outer: with_outer(outer).embed_tokens(inputs),
                                outer_part)

    def forward(x_BTD, layer):
      y_BTD, aux = run_block(*layer, x_BTD)
      return y_BTD, (x_BTD, aux)

    xL_BTD, (x_in_LBTD, aux_L) = jax.lax.scan(forward, x0_BTD, (layer_part, block_rest))

    # 2. The head: loss, its gradients for the outer parameters and the cotangents.
    def head(outer, x_BTD, lb_L, z_L):
      m = with_outer(outer)
      aux = models.mean_aux({"lb_loss": lb_L, "z_loss": z_L,
                             "expert_fraction": aux_L["expert_fraction"]})
      return models.loss_from_features(m, m.final_norm(x_BTD), aux, targets)

    _, head_vjp, metrics = jax.vjp(head, outer_part, xL_BTD, aux_L["lb_loss"],
                                   aux_L["z_loss"], has_aux=True)
    g_head, g_xL, g_lb_L, g_z_L = head_vjp(jnp.ones((), jnp.float32))

    def layer_grads(layer_slice, block_rest_l, l, g_y):
      _, vjp = jax.vjp(lambda p, x: block(p, block_rest_l, x), layer_slice, x_in_LBTD[l])
      g_p, g_x = vjp((g_y, g_lb_L[l], g_z_L[l]))
      if layer_scale is not None:
        g_p = _scaled(g_p, layer_scale[l])
      elif grad_scale is not None:
        g_p = _scaled(g_p, grad_scale)
      return g_p, g_x

    def outer_grads(g_x0):
      (g_embed,) = embed_vjp(g_x0)
      g = jax.tree.map(jnp.add, g_head, g_embed)
      return g if outer_scale is None else _scaled(g, outer_scale)

    # 3a. Exact mode: the global norm and finiteness first, nothing updated.
    if norm_first:
      def measure(carry, layer):
        g_y, sumsq, finite = carry
        layer_slice, block_rest_l, l = layer
        g_p, g_x = layer_grads(layer_slice, block_rest_l, l, g_y)
        return (g_x, sumsq + _sum_squares(g_p), finite & _all_finite(g_p)), None

      (g_x0, sumsq, finite), _ = jax.lax.scan(
          measure, (g_xL, jnp.zeros((), jnp.float32), jnp.array(True)),
          (layer_part, block_rest, jnp.arange(num_layers)), reverse=True)
      g_outer = outer_grads(g_x0)
      grad_norm = jnp.sqrt(sumsq + _sum_squares(g_outer))
      finite = finite & _all_finite(g_outer)
      clip_by = grad_norm
    else:
      clip_by = opt_state.grad_norm  # stale mode (or no clipping at all)
      finite = jnp.array(True)

    if skip_nonfinite:
      notfinite_count = jnp.where(finite, 0, opt_state.notfinite_count + 1)
      total_notfinite = jnp.where(finite, opt_state.total_notfinite,
                                  opt_state.total_notfinite + 1)
      do_update = finite | (notfinite_count > skip_nonfinite)
    else:
      notfinite_count, total_notfinite = opt_state.notfinite_count, opt_state.total_notfinite
      do_update = jnp.array(True)

    def keep_unless(new, old):
      return jax.tree.map(lambda n, o: jnp.where(do_update, n, o), new, old)

    # 3b. The updating pass: layer l's slice updated as soon as its gradient exists.
    def update(carry, l):
      g_y, stack, states, sumsq = carry
      layer_slice, state = _layer_slice(stack, l), _layer_slice(states, l)
      g_p, g_x = layer_grads(layer_slice, _layer_slice(block_rest, l), l, g_y)
      updates, new_state = tx.update(clip(g_p, clip_by), state, layer_slice)
      layer_key = None if key is None else jax.random.fold_in(key, l)
      new_slice = keep_unless(apply(layer_slice, updates, layer_key), layer_slice)
      new_state = keep_unless(new_state, state)
      return (g_x, _write_slice(stack, new_slice, l), _write_slice(states, new_state, l),
              sumsq + _sum_squares(g_p)), None

    (g_x0, layer_part, layer_states, layer_sumsq), _ = jax.lax.scan(
        update, (g_xL, layer_part, opt_state.layers, jnp.zeros((), jnp.float32)),
        jnp.arange(num_layers), reverse=True)

    # 4. The parameters outside the stack.
    g_outer = outer_grads(g_x0)
    if not norm_first:
      grad_norm = jnp.sqrt(layer_sumsq + _sum_squares(g_outer))
    updates, outer_state = tx.update(clip(g_outer, clip_by), opt_state.outer, outer_part)
    outer_key = None if key is None else jax.random.fold_in(key, num_layers)
    new_outer = keep_unless(apply(outer_part, updates, outer_key), outer_part)
    outer_state = keep_unless(outer_state, opt_state.outer)

    new_state = InBackwardState(
        layers=layer_states, outer=outer_state, grad_norm=grad_norm,
        notfinite_count=notfinite_count, last_finite=finite,
        total_notfinite=total_notfinite)
    metrics["grad_norm"] = grad_norm
    if skip_nonfinite:
      metrics["notfinite_count"] = notfinite_count
      metrics["total_notfinite"] = total_notfinite
    return join_layers(params, layer_part, new_outer), new_state, metrics

  return train_step
