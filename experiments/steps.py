"""The train and eval step functions of a split NNX model, and the abstract model.

A library module: the training command, the SPMD layout, the memory planner
and the GPU check all compile exactly these functions; the planners and the
per-parameter plan read the model's shapes and declared axes from
:func:`abstract_model` and :func:`abstract_axes` without allocating.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import models
import skewadam_jax


def make_step_fns(graphdef, rest, tx, *, stochastic_rounding: bool = False):
  """The train and eval step functions (not yet jitted) of a split NNX model.

  ``train_step(params, opt_state, inputs, targets, key=None, grad_scale=None)
  -> (params, opt_state, metrics)`` runs forward, backward and the optimizer
  update; the training command jits it with ``donate_argnums=(0, 1)`` and the
  memory planner compiles exactly this function. With
  ``stochastic_rounding`` the update is applied by
  :func:`skewadam_jax.apply_updates_stochastic` and ``key`` (a PRNG key,
  a new one every step) is required. ``grad_scale`` is fault injection for
  tests: the gradients are multiplied by it (NaN poisons the step). The
  metrics are :func:`models.lm_loss`'s (scalars and the per-layer
  ``models.ROUTING_METRICS``) and ``grad_norm``; when ``tx`` is
  ``optax.apply_if_finite(...)`` they also hold its ``notfinite_count`` and
  ``total_notfinite``.
  ``eval_step(params, inputs, targets) -> (sum of token cross-entropies,
  token count)``.
  """
  def loss(params, inputs, targets):
    return models.lm_loss(nnx.merge(graphdef, params, rest), inputs, targets)

  def train_step(params, opt_state, inputs, targets, key=None, grad_scale=None):
    (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, inputs, targets)
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
    if isinstance(opt_state, optax.ApplyIfFiniteState):
      metrics["notfinite_count"] = opt_state.notfinite_count
      metrics["total_notfinite"] = opt_state.total_notfinite
    return params, opt_state, metrics

  def eval_step(params, inputs, targets):
    _, metrics = loss(params, inputs, targets)
    return metrics["ce_loss"] * inputs.size, inputs.size

  return train_step, eval_step


def abstract_model(preset: str, param_dtype=None, **overrides):
  """(model config, graphdef, abstract params, abstract rest), nothing allocated.

  ``param_dtype=None`` keeps the preset's; params and rest are pure
  ``ShapeDtypeStruct`` trees (no Variables).
  """
  if param_dtype is not None:
    overrides["param_dtype"] = param_dtype
  config = models.get_preset(preset, **overrides)
  model = nnx.eval_shape(lambda: models.Transformer(config, rngs=nnx.Rngs(0)))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  return config, graphdef, nnx.as_pure(params), nnx.as_pure(rest)


def abstract_params(preset: str, dtype=None):
  """The preset's parameters as ``ShapeDtypeStruct``s (pure arrays, no Variables)."""
  return abstract_model(preset, dtype)[2]


@functools.cache
def abstract_axes(preset: str) -> dict[str, tuple]:
  """The preset's declared logical axes by path (:func:`models.logical_axes`)."""
  return models.logical_axes(models.abstract_params(models.get_preset(preset)))
