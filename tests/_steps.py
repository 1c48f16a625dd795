"""A jitted optimizer loop shared by the optimizer tests."""

import jax
import optax


def run(tx, params, grads_seq):
  """Applies tx for every gradient in grads_seq; returns (params after each step, state)."""
  state = tx.init(params)

  @jax.jit
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  trajectory = []
  for grads in grads_seq:
    params, state = step(params, state, grads)
    trajectory.append(params)
  return trajectory, state
