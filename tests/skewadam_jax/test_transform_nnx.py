"""SkewAdam inside flax.nnx.Optimizer, against the same steps done functionally."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import skewadam_jax as sa


class TinyMoE(nnx.Module):
  """Backbone (embed, norm), router and a stacked expert bank: enough for the tiers."""

  def __init__(self, rngs: nnx.Rngs, d=4, e=3, f=5):
    init = nnx.initializers.normal(0.5)
    self.embed = nnx.Param(init(rngs.params(), (6, d)))
    self.norm = nnx.Param(jnp.ones((d,)))
    self.router = nnx.Linear(d, e, use_bias=False, rngs=rngs)
    self.experts = nnx.Param(init(rngs.params(), (e, d, f)))
    self.out = nnx.Param(init(rngs.params(), (f, 1)))

  def __call__(self, tokens):
    x = self.embed[...][tokens] * self.norm[...]
    gates = jax.nn.softmax(self.router(x), axis=-1)
    h = jnp.einsum("te,td,edf->tf", gates, x, self.experts[...])
    return (h @ self.out[...])[:, 0]


def loss_fn(model, tokens, targets):
  return jnp.mean((model(tokens) - targets) ** 2)


TOKENS = jnp.array([0, 1, 2, 3, 4, 5, 1, 2])
TARGETS = jnp.linspace(-1.0, 1.0, 8)


@pytest.fixture(scope="module")
def trained():
  model = TinyMoE(nnx.Rngs(0))
  # Pure arrays: nnx.state's Variables would be updated in place by training.
  initial = nnx.as_pure(nnx.state(model, nnx.Param))
  tx = sa.skewadam(3e-2, weight_decay=0.01)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(loss_fn)(model, TOKENS, TARGETS)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(30)]
  return model, optimizer, initial, losses, tx


def test_nnx_optimizer_trains_and_routes_tiers(trained):
  model, optimizer, _, losses, _ = trained
  assert losses[-1] < 0.5 * losses[0]
  state = nnx.as_pure(optimizer.opt_state)[0]
  # The state is shaped like the params: router exact v, experts sign bits and
  # factored v, backbone matrices factored v and the vector `norm` exact.
  assert state.nu["router"]["kernel"].shape == (4, 3)
  assert state.mu["experts"].dtype == jnp.uint8
  assert state.nu_row["experts"].shape == (3, 4, 1)
  assert state.nu_row["embed"].shape == (6, 1) and state.nu["embed"].shape == (1,)
  assert state.nu["norm"].shape == (4,)


def test_nnx_optimizer_matches_functional_skewadam(trained):
  model, _, initial, _, tx = trained
  graphdef, _ = nnx.split(TinyMoE(nnx.Rngs(0)), nnx.Param)
  params = initial

  def pure_loss(p):
    return loss_fn(nnx.merge(graphdef, p), TOKENS, TARGETS)

  @jax.jit
  def step(p, s):
    updates, s = tx.update(jax.grad(pure_loss)(p), s, p)
    return optax.apply_updates(p, updates), s

  state = tx.init(params)
  for _ in range(30):
    params, state = step(params, state)
  got = nnx.as_pure(nnx.state(model, nnx.Param))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, params)
