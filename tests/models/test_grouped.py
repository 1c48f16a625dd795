"""Grouped SwiGLU blocks: the block-size rule, exact gradients, no recomputed matmul."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import experts_blocked, experts_dense, grouped

TOL = dict(rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize('rows,groups', [(16_384, 64), (11 * 16_384, 64), (4096, 8),
                                         (12, 4), (10**7, 2), (100, 1)])
def test_auto_block_size_is_the_largest_power_of_two_within_the_budget(rows, groups):
  # Brute force over the candidates, from the rule's statement.
  candidates = [2**i for i in range(4, 10)]  # 16 .. 512
  within = [b for b in candidates if groups * b <= rows / 8]
  expected = max(within) if within else 16
  assert grouped.auto_block_size(rows, groups) == expected


def test_auto_block_size_refuses_empty_shapes():
  with pytest.raises(ValueError, match='rows >= 1 and groups >= 1, got 0, 4'):
    grouped.auto_block_size(0, 4)


def _problem(T=40, K=2, E=4, D=8, F=6, routing=None):
  ks = jax.random.split(jax.random.key(1), 6)
  x = jax.random.normal(ks[0], (T, D))
  w = jax.nn.softmax(jax.random.normal(ks[1], (T, K)), axis=-1)
  if routing is None:  # uneven: expert 0 gets most rows, expert 3 none
    routing = jnp.stack([jax.random.randint(ks[5], (T,), 0, 2),
                         jnp.full((T,), 2)], axis=1)
  weights = [jax.random.normal(k, s) for k, s in
             zip(ks[2:5], [(E, D, F), (E, D, F), (E, F, D)])]
  return x, w, jnp.asarray(routing, jnp.int32), *weights


@pytest.mark.parametrize('block_size', [0, 1, 7, 64])
def test_blocked_gradients_equal_the_dense_reference(block_size):
  x, w, experts, wg, wu, wd = _problem()
  r = jax.random.normal(jax.random.key(2), x.shape)

  def loss(impl, **kw):
    return lambda *a: jnp.sum(impl(a[0], w, experts, *a[1:], **kw) * r)
  argnums = (0, 1, 2, 3)
  ref = jax.jit(jax.grad(loss(experts_dense), argnums))(x, wg, wu, wd)
  got = jax.jit(jax.grad(loss(experts_blocked, block_size=block_size), argnums))(x, wg, wu, wd)
  for name, a, b in zip(('x', 'w_gate', 'w_up', 'w_down'), got, ref):
    np.testing.assert_allclose(a, b, **TOL, err_msg=name)


def _dot_flops(jaxpr) -> int:
  """2 * |out| * |contracted| over every dot, scan bodies times their length."""
  total = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == 'dot_general':
      (contract, _), _ = eqn.params['dimension_numbers']
      lhs = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[i] for i in contract)
      continue
    for value in eqn.params.values():
      inner = getattr(value, 'jaxpr', value)
      if hasattr(inner, 'eqns'):
        times = eqn.params['length'] if eqn.primitive.name == 'scan' else 1
        total += times * _dot_flops(inner)
  return total


def test_backward_recomputes_no_matmul():
  """Forward + backward = 3x the forward's matmuls (no rematerialised projections)."""
  x, w, experts, wg, wu, wd = _problem()
  forward = lambda x, wg, wu, wd: experts_blocked(x, w, experts, wg, wu, wd, block_size=8)
  both = jax.grad(lambda *a: jnp.sum(forward(*a)), (0, 1, 2, 3))
  f_fwd = _dot_flops(jax.make_jaxpr(forward)(x, wg, wu, wd).jaxpr)
  f_both = _dot_flops(jax.make_jaxpr(both)(x, wg, wu, wd).jaxpr)
  # The combine einsum ('tkd,tk->td') is a dot too; with the routing
  # weights held fixed its backward is one more.
  T, K, D = x.shape[0], w.shape[1], x.shape[1]
  combine = 2 * T * K * D
  assert f_both - 2 * combine == 3 * (f_fwd - combine)
