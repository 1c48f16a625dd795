"""The step a run runs: built once from its :class:`~experiments.training.config.TrainConfig`.

A library module. :func:`build_step` is the one place that turns a run's
configuration into its optimizer, its train and eval steps, its state's
initialiser and the state's shardings: the training command, the SPMD
layout, the memory planner, the GPU check and the bench's train step take
their step from it, so the planner plans exactly the step ``train`` runs
(``--skip-nonfinite``, stochastic rounding and ``--update-in-backward``
included; ``experiments.parallel``, a demonstration with its own optimizer
flags, takes :func:`standard_step`). The standard step is
:func:`make_step_fns`; the layerwise one is the library's
:func:`skewadam_jax.layerwise.layerwise_step` through the model's adapter
(:mod:`models.layerwise`). The planners and the per-parameter plan read the
model's shapes and declared axes from :func:`abstract_model` and
:func:`abstract_axes` without allocating.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import models
import skewadam_jax
from experiments.training import mesh as mesh_lib
from experiments.training import optimizers
from models import layerwise as model_layerwise
from skewadam_jax import layerwise as layerwise_lib


class TrainStep(NamedTuple):
  """A run's step functions, from :func:`build_step` (none of them jitted).

  Attributes:
    tx: the optimizer as the step applies it (with ``--update-in-backward``
      the per-layer one; the step clips and skips itself).
    train_step: ``(params, opt_state, inputs, targets, key=None,
      grad_scale=None) -> (params, opt_state, metrics)``.
    eval_step: ``(params, inputs, targets) -> (sum of token cross-entropies,
      token count)``.
    init: ``params -> opt_state``, the state ``train_step`` takes.
    state_shardings: ``(params, param_shardings) -> opt_state`` shardings.
    layerwise: the library's :class:`~skewadam_jax.layerwise.LayerwiseStep`
      with ``--update-in-backward``, else ``None``.
  """
  tx: optax.GradientTransformation
  train_step: Callable
  eval_step: Callable
  init: Callable
  state_shardings: Callable
  layerwise: Any


def learning_rate_schedule(config):
  """The run's schedule: warmup to ``--lr`` (or the optimizer's default), then ``--schedule``."""
  lr = (config.lr if config.lr is not None
        else optimizers.default_lr(config.optimizer, config.skewadam_tiers()))
  return optimizers.lr_schedule(lr, config.steps, config.warmup_steps, kind=config.schedule,
                                decay_fraction=config.decay_fraction)


def make_tx(config, axes, schedule=None) -> optax.GradientTransformation:
  """The optimizer exactly as the run applies it.

  The standard step: the optimizer with its global-norm clipping, wrapped in
  ``optax.apply_if_finite`` for ``--skip-nonfinite``. With
  ``--update-in-backward``: the per-layer optimizer (built for
  :func:`models.layerwise.slice_axes`; the step clips and skips itself).
  ``schedule`` defaults to :func:`learning_rate_schedule`'s.
  """
  schedule = learning_rate_schedule(config) if schedule is None else schedule
  settings = dict(learning_rate=schedule, weight_decay=config.resolved_weight_decay,
                  skewadam_tiers=config.skewadam_tiers(), b1=config.b1,
                  muon_momentum=config.muon_momentum)
  if config.update_in_backward:
    return optimizers.make_optimizer(config.optimizer, axes=model_layerwise.slice_axes(axes),
                                     clip_norm=0, **settings)
  tx = optimizers.make_optimizer(config.optimizer, axes=axes, clip_norm=config.clip_norm,
                                 **settings)
  if config.skip_nonfinite:
    # Outermost, so a skipped step leaves every inner state untouched
    # (moments, step count, schedule): as if the batch had not been drawn.
    # optax applies the (K+1)-th bad update; the loop stops at the K-th.
    tx = optax.apply_if_finite(tx, max_consecutive_errors=config.skip_nonfinite)
  return tx


def standard_step(graphdef, rest, tx, *, stochastic_rounding: bool = False,
                  accumulate: int = 1, accumulate_dtype: str = "float32") -> TrainStep:
  """The standard step (:func:`make_step_fns`) of ``tx`` as a :class:`TrainStep`."""
  train_step, eval_step = make_step_fns(graphdef, rest, tx,
                                        stochastic_rounding=stochastic_rounding,
                                        accumulate=accumulate,
                                        accumulate_dtype=accumulate_dtype)
  return TrainStep(tx, train_step, eval_step, tx.init,
                   lambda p, s: skewadam_jax.state_shardings(tx, p, s), None)


def _shapes(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def build_step(config, graphdef, rest, params, axes, *, schedule=None) -> TrainStep:
  """The step ``config``'s run runs, for the split model ``(graphdef, params, rest)``.

  Args:
    config: the run's :class:`~experiments.training.config.TrainConfig`.
    graphdef, rest: the split :class:`models.Transformer`.
    params: its parameters, or their ``ShapeDtypeStruct`` s.
    axes: the parameters' declared logical axes by path.
    schedule: the learning rate (default :func:`learning_rate_schedule`).

  Raises:
    ValueError: with ``--update-in-backward``, for an optimizer that couples
      parameters (:func:`skewadam_jax.layerwise.check_separable`).
  """
  tx = make_tx(config, axes, schedule)
  if not config.update_in_backward:
    return standard_step(graphdef, rest, tx, stochastic_rounding=config.stochastic_rounding,
                         accumulate=config.accumulate,
                         accumulate_dtype=config.accumulate_dtype)
  return layerwise_step(graphdef, rest, tx, params, clip_norm=config.clip_norm,
                        clip_mode=config.clip_mode, skip_nonfinite=config.skip_nonfinite,
                        stochastic_rounding=config.stochastic_rounding,
                        micro_batches=config.accumulate,
                        accumulate_dtype=config.accumulate_dtype)


def layerwise_step(graphdef, rest, tx, params, **options) -> TrainStep:
  """The update-in-backward step of ``tx`` as a :class:`TrainStep`.

  The library's :func:`skewadam_jax.layerwise.layerwise_step` on the model's
  adapter (:mod:`models.layerwise`), with the standard step's signature
  (the rotary tables computed once per step); ``options`` are its clip,
  skip and rounding settings. ``tx`` (built for
  :func:`models.layerwise.slice_axes`) is checked to be separable here.
  """
  model = nnx.merge(graphdef, _shapes(params), rest)  # the structure only
  engine = model_layerwise.layerwise_step(model, tx, check=False, **options)
  layerwise_lib.check_separable(tx, engine.per_layer_params(params))
  model_config = model.config

  micro_batches = options.get("micro_batches", 1)

  def train_step(params, opt_state, inputs, targets, key=None, grad_scale=None):
    if micro_batches > 1:
      batch = model_layerwise.lm_micro_batches(model_config, inputs, targets, micro_batches)
    else:
      batch = model_layerwise.lm_batch(model_config, inputs, targets)
    return engine.step(params, opt_state, batch, key=key, grad_scale=grad_scale)

  _, eval_step = make_step_fns(graphdef, rest, tx)
  return TrainStep(tx, train_step, eval_step, engine.init, engine.state_shardings, engine)


def accumulated_value_and_grad(loss_fn, accumulate: int, accumulate_dtype: str = "float32"):
  """``loss_fn``'s mean value and gradient over ``accumulate`` micro-batches of its batch.

  ``loss_fn(params, inputs, targets) -> (loss, metrics)`` for a batch of
  ``[B, T]`` token ids. The returned function splits the ``[K·b, T]``
  batch it is given into ``K = accumulate`` micro-batches of ``b`` rows
  (micro-batch ``k`` holds rows ``k, K + k, 2K + k, ...``, so a batch split
  over a mesh's ``data`` axis stays split the same way), runs the loss and
  its gradient on each in turn (``lax.scan``: one micro-batch's activations
  alive at a time) and returns their means:

    g = (1/K) Σ_k ∇ L_k,   L = (1/K) Σ_k L_k,   metrics = (1/K) Σ_k metrics_k.

  Every micro-batch has the same number of tokens, so for a loss that is a
  mean over tokens (the cross-entropy, the router z-loss) this is the loss
  and gradient of the whole batch. The load-balancing loss is not such a
  mean (``E · Σ_e f_e P_e``, a product of two means): here it is computed
  per micro-batch and averaged.

  The running sum is kept in float32 (``accumulate_dtype="float32"``) or in
  each parameter's dtype (``"params"``) and handed back in the parameter's
  dtype. With ``accumulate=1`` this is ``jax.value_and_grad(loss_fn,
  has_aux=True)``.
  """
  value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)
  if accumulate == 1:
    return value_and_grad

  def accumulated(params, inputs, targets):
    rows = inputs.shape[0]
    if rows % accumulate:
      raise ValueError(f"a batch of {rows} sequences does not split into "
                       f"{accumulate} micro-batches")
    micro = lambda x: jnp.swapaxes(x.reshape(rows // accumulate, accumulate, *x.shape[1:]), 0, 1)
    acc_dtype = lambda p: jnp.float32 if accumulate_dtype == "float32" else p.dtype
    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, acc_dtype(p)), params)
    loss_shape, metrics_shape = jax.eval_shape(loss_fn, params, inputs[:rows // accumulate],
                                               targets[:rows // accumulate])
    metric_zeros = jax.tree.map(lambda m: jnp.zeros(m.shape, jnp.float32),
                                (loss_shape, metrics_shape))

    def one(carry, batch):
      grad_sum, value_sum = carry
      value, grads = value_and_grad(params, *batch)
      grad_sum = jax.tree.map(lambda a, g: a + g.astype(a.dtype), grad_sum, grads)
      value_sum = jax.tree.map(lambda a, v: a + v.astype(jnp.float32), value_sum, value)
      return (grad_sum, value_sum), None

    (grad_sum, value_sum), _ = jax.lax.scan(
        one, (zeros, metric_zeros), (micro(inputs), micro(targets)))
    grads = jax.tree.map(lambda a, p: (a / accumulate).astype(p.dtype), grad_sum, params)
    value = jax.tree.map(lambda v, like: (v / accumulate).astype(like.dtype), value_sum,
                         (loss_shape, metrics_shape))
    return value, grads
  return accumulated


def make_step_fns(graphdef, rest, tx, *, stochastic_rounding: bool = False,
                  accumulate: int = 1, accumulate_dtype: str = "float32"):
  """The train and eval step functions (not yet jitted) of a split NNX model.

  ``train_step(params, opt_state, inputs, targets, key=None, grad_scale=None)
  -> (params, opt_state, metrics)`` runs forward, backward and the optimizer
  update; the training command jits it with ``donate_argnums=(0, 1)`` and the
  memory planner compiles exactly this function. With
  ``stochastic_rounding`` the update is applied by
  :func:`skewadam_jax.apply_updates_stochastic` and ``key`` (a PRNG key,
  a new one every step) is required. ``grad_scale`` is fault injection for
  tests: the gradients are multiplied by it (NaN poisons the step). With
  ``accumulate=K`` the batch is ``K`` micro-batches whose gradients are
  averaged before the one optimizer update
  (:func:`accumulated_value_and_grad`). The
  metrics are :func:`models.lm_loss`'s (scalars and the per-layer
  ``models.ROUTING_METRICS``), ``grad_norm``, ``update_rms`` (the RMS of the
  parameter change over every entry) and, for the article's optimizer,
  ``floor_share`` (:func:`skewadam_jax.article.floor_share`); when ``tx`` is
  ``optax.apply_if_finite(...)`` they also hold its ``notfinite_count`` and
  ``total_notfinite``.
  ``eval_step(params, inputs, targets) -> (sum of token cross-entropies,
  token count)``.
  """
  def loss(params, inputs, targets):
    return models.lm_loss(nnx.merge(graphdef, params, rest), inputs, targets)

  def train_step(params, opt_state, inputs, targets, key=None, grad_scale=None):
    (_, metrics), grads = accumulated_value_and_grad(loss, accumulate, accumulate_dtype)(
        params, inputs, targets)
    grads = mesh_lib.in_parameter_layout(grads)
    if grad_scale is not None:  # in each leaf's dtype, so bf16 grads stay bf16
      grads = jax.tree.map(lambda g: g * jnp.asarray(grad_scale, g.dtype), grads)
    updates, opt_state = tx.update(grads, opt_state, params)
    if stochastic_rounding:
      if key is None:
        raise ValueError("train_step with stochastic rounding needs key=")
      params = skewadam_jax.apply_updates_stochastic(params, updates, key)
    else:
      params = optax.apply_updates(params, updates)
    metrics["grad_norm"] = optax.tree.norm(grads)
    # The step's size, any optimizer's: RMS of the parameter change over all entries.
    metrics["update_rms"] = optax.tree.norm(updates) / math.sqrt(
        max(1, sum(x.size for x in jax.tree.leaves(updates))))
    if skewadam_jax.article.article_states(opt_state):
      metrics["floor_share"] = skewadam_jax.article.floor_share(opt_state)
    if isinstance(opt_state, optax.ApplyIfFiniteState):
      metrics["notfinite_count"] = opt_state.notfinite_count
      metrics["total_notfinite"] = opt_state.total_notfinite
    return params, opt_state, metrics

  def eval_step(params, inputs, targets):
    _, metrics = loss(params, inputs, targets)
    return metrics["ce_loss"] * inputs.size, inputs.size

  return train_step, eval_step


def abstract_split(model_config: models.ModelConfig):
  """(graphdef, abstract params, abstract rest, declared axes) of a model, nothing allocated.

  The one abstract-model builder of the experiments: the planner, the
  accounting, the benchmarks and the GPU check all start from it. Params and
  rest are pure ``ShapeDtypeStruct`` trees (no Variables).
  """
  model = nnx.eval_shape(lambda: models.Transformer(model_config, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return graphdef, nnx.as_pure(params), nnx.as_pure(rest), models.logical_axes(params)


def abstract_model(preset: str, param_dtype=None, **overrides):
  """(model config, graphdef, abstract params, abstract rest), nothing allocated.

  ``param_dtype=None`` keeps the preset's; params and rest are pure
  ``ShapeDtypeStruct`` trees (no Variables).
  """
  if param_dtype is not None:
    overrides["param_dtype"] = param_dtype
  config = models.get_preset(preset, **overrides)
  graphdef, params, rest, _ = abstract_split(config)
  return config, graphdef, params, rest


def abstract_step(config) -> tuple[TrainStep, Any, Any]:
  """``(step, params, opt_state)`` of ``config``'s run, shapes only (nothing allocated)."""
  graphdef, params, rest, axes = abstract_split(config.model_config())
  step = build_step(config, graphdef, rest, params, axes)
  return step, params, jax.eval_shape(step.init, params)


def abstract_params(preset: str, dtype=None):
  """The preset's parameters as ``ShapeDtypeStruct``s (pure arrays, no Variables)."""
  return abstract_model(preset, dtype)[2]


@functools.cache
def abstract_axes(preset: str) -> dict[str, tuple]:
  """The preset's declared logical axes by path (:func:`models.logical_axes`)."""
  return abstract_split(models.get_preset(preset))[3]
