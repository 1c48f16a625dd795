"""Gradient accumulation (``--accumulate K``): K micro-batches, one optimizer step.

The reference is the same step on the whole K-times batch at once
(``accumulate=1``): with the load-balancing loss off, every other term is a
mean over tokens, so both must give the same parameters to float round-off.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models
from experiments.training import config as config_lib
from experiments.training import steps

K, MICRO, SEQ = 3, 2, 16


def _batch(rows, seed=0):
  config = models.get_preset("tiny")
  tokens = jax.random.randint(jax.random.key(seed), (rows, SEQ + 1), 0, config.vocab_size)
  return tokens[:, :-1], tokens[:, 1:]


@functools.cache  # each configuration compiled once for the whole file
def _cached_step(optimizer, accumulate, settings):
  return _one_step_uncached(optimizer, accumulate, **dict(settings))


def _one_step(optimizer, accumulate, **settings):
  return _cached_step(optimizer, accumulate, tuple(sorted(settings.items())))


def _one_step_uncached(optimizer, accumulate, **settings):
  config = config_lib.TrainConfig(preset="tiny", optimizer=optimizer, batch_size=MICRO,
                                  accumulate=accumulate, seq_len=SEQ, **settings)
  model = models.Transformer(config.model_config(), rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  axes = models.logical_axes(params)
  params = nnx.as_pure(params)
  # A constant learning rate: the schedule's first step is warmup's zero.
  step = steps.build_step(config, graphdef, nnx.as_pure(rest), params, axes, schedule=3e-3)
  inputs, targets = _batch(MICRO * K)
  new_params, _, metrics = jax.jit(step.train_step)(params, step.init(params), inputs, targets)
  return params, new_params, metrics


@pytest.mark.parametrize("optimizer", ["adamw", "skewadam"])
def test_accumulating_equals_the_whole_batch_step(optimizer):
  settings = dict(lb_loss_coef=0.0, compute_dtype="float32")
  before, whole, whole_metrics = _one_step(optimizer, 1, **settings)
  _, accumulated, metrics = _one_step(optimizer, K, **settings)
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(jnp.max(jnp.abs(a - b))),
                                       whole, before))
  assert max(moved) > 1e-4  # the step did something
  # Adam's first step is about lr * g / (|g| + eps): a round-off in a gradient
  # near eps shows as up to ~1 % of lr (3e-3) in that one entry.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=5e-5),
               accumulated, whole)
  np.testing.assert_allclose(metrics["ce_loss"], whole_metrics["ce_loss"], rtol=1e-6)
  np.testing.assert_allclose(metrics["z_loss"], whole_metrics["z_loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], whole_metrics["grad_norm"], rtol=1e-5)


def test_accumulated_gradients_equal_the_whole_batch_gradients():
  config = config_lib.TrainConfig(preset="tiny", lb_loss_coef=0.0, compute_dtype="float32")
  model = models.Transformer(config.model_config(), rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss = lambda p, i, t: models.lm_loss(nnx.merge(graphdef, p, rest), i, t)
  inputs, targets = _batch(MICRO * K, seed=1)
  (value, _), grads = jax.jit(steps.accumulated_value_and_grad(loss, K))(params, inputs, targets)
  (whole_value, _), whole = jax.jit(jax.value_and_grad(loss, has_aux=True))(
      params, inputs, targets)
  np.testing.assert_allclose(value, whole_value, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7),
               nnx.to_pure_dict(grads), nnx.to_pure_dict(whole))


def test_the_load_balancing_loss_is_the_mean_over_micro_batches():
  """Not the whole batch's: E·Σ f_e P_e is a product of two means (documented)."""
  config = config_lib.TrainConfig(preset="tiny", batch_size=MICRO, seq_len=SEQ)
  model = models.Transformer(config.model_config(), rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss = lambda p, i, t: models.lm_loss(nnx.merge(graphdef, p, rest), i, t)
  inputs, targets = _batch(MICRO * K)
  (_, metrics), _ = steps.accumulated_value_and_grad(loss, K)(params, inputs, targets)
  # Micro-batch k holds rows k, K + k, ...
  per_micro = [loss(params, inputs[k::K], targets[k::K])[1]["lb_loss"] for k in range(K)]
  np.testing.assert_allclose(metrics["lb_loss"], np.mean(per_micro), rtol=1e-5)
  whole = loss(params, inputs, targets)[1]["lb_loss"]
  assert abs(float(whole) - float(np.mean(per_micro))) > 1e-6


@pytest.mark.parametrize("accumulate_dtype,expected", [("float32", jnp.float32),
                                                       ("params", jnp.bfloat16)])
def test_the_accumulator_dtype(accumulate_dtype, expected):
  params = {"w": jnp.ones((3,), jnp.bfloat16)}

  def loss(p, inputs, targets):
    return jnp.sum(p["w"].astype(jnp.float32) * inputs.sum()), {}

  fn = steps.accumulated_value_and_grad(loss, 2, accumulate_dtype)
  jaxpr = jax.make_jaxpr(fn)(params, jnp.ones((4, 1)), jnp.ones((4, 1)))
  scan = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan")
  seen = [v.aval.dtype for v in scan.outvars]
  assert expected in seen
  (_, _), grads = fn(params, jnp.ones((4, 1)), jnp.ones((4, 1)))
  assert grads["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(grads["w"], np.float32), 2.0)  # mean of 2 and 2


def test_a_batch_that_does_not_split_is_refused():
  fn = steps.accumulated_value_and_grad(lambda p, i, t: (jnp.sum(p * i), {}), 3)
  with pytest.raises(ValueError, match="a batch of 4 sequences does not split into 3"):
    fn(jnp.ones(()), jnp.ones((4, 1)), jnp.ones((4, 1)))


def test_accumulating_inside_the_backward_pass_equals_the_whole_batch_step():
  """The layerwise step with K micro-batches against itself on the K-times batch."""
  settings = dict(lb_loss_coef=0.0, compute_dtype="float32", update_in_backward=True,
                  clip_norm=0.05)  # an exact clip that acts
  _, whole, whole_metrics = _one_step("skewadam", 1, **settings)
  _, accumulated, metrics = _one_step("skewadam", K, **settings)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=5e-5),
               accumulated, whole)
  np.testing.assert_allclose(metrics["ce_loss"], whole_metrics["ce_loss"], rtol=1e-6)
  np.testing.assert_allclose(metrics["grad_norm"], whole_metrics["grad_norm"], rtol=1e-5)


def test_the_layerwise_accumulation_matches_the_standard_one():
  """With the load-balancing loss on: both average it over the micro-batches."""
  settings = dict(lb_loss_coef=0.01, compute_dtype="float32", clip_norm=0.0)
  _, standard, _ = _one_step("adamw", K, **settings)
  _, layerwise, _ = _one_step("adamw", K, update_in_backward=True, **settings)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=5e-5),
               layerwise, standard)
