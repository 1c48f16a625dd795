"""MoE layer: loop reference, implementation agreement, auxiliary losses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import MoE, ModelConfig, get_preset, route

B, S = 2, 3  # 6 tokens, 12 assignments.
TOL = dict(rtol=2e-5, atol=2e-5)


def _config(impl, **kw):
  return get_preset('tiny', compute_dtype=jnp.float32, moe_impl=impl, **kw)


# Block sizes for 'blocked': several blocks per expert with padding, and one
# block larger than all assignments.
IMPLS = [('dense', {}), ('ragged', {}),
         ('blocked', {'moe_block_size': 3}), ('blocked', {'moe_block_size': 64}),
         ('blocked', {'moe_block_size': 0})]
IMPL_IDS = ['dense', 'ragged', 'blocked3', 'blocked64', 'blocked_auto']


def _reference(params, x_BTD, chosen_TK, r_BTD, top_k):
  """Per-token, per-expert loop; ``chosen_TK`` fixes the (piecewise-constant)
  top-k selection so the loop is differentiable."""
  W_r = params['router']['kernel']
  ex = params['experts']
  E = W_r.shape[-1]
  x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
  T = x_TD.shape[0]
  ys, probs, lse = [], [], []
  for t in range(T):
    logits = jnp.dot(x_TD[t], W_r, precision='highest')
    p = jax.nn.softmax(logits)
    probs.append(p)
    lse.append(jax.nn.logsumexp(logits))
    sel = chosen_TK[t]
    w = p[sel] / jnp.sum(p[sel])
    y = 0.0
    for j in range(top_k):
      e = int(sel[j])
      h = jax.nn.silu(x_TD[t] @ ex['w_gate'][e]) * (x_TD[t] @ ex['w_up'][e])
      y = y + w[j] * (h @ ex['w_down'][e])
    ys.append(y)
  y_BTD = jnp.stack(ys).reshape(x_BTD.shape)
  f = np.bincount(chosen_TK.reshape(-1), minlength=E) / chosen_TK.size
  lb = E * jnp.sum(f * jnp.mean(jnp.stack(probs), axis=0))
  z = jnp.mean(jnp.square(jnp.stack(lse)))
  return jnp.sum(y_BTD * r_BTD) + lb + z, (y_BTD, lb, z)


@pytest.fixture(scope='module')
def setup():
  cfg = _config('dense')
  moe = MoE(cfg, rngs=nnx.Rngs(0))
  params = nnx.state(moe, nnx.Param)
  kx, kr = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (B, S, cfg.d_model), jnp.float32)
  r = jax.random.normal(kr, (B, S, cfg.d_model), jnp.float32)
  # Fixed selection from concrete probabilities; require a clear margin at
  # the k-th place so the reference and the model pick the same experts.
  probs = np.asarray(jax.nn.softmax(
      x.reshape(-1, cfg.d_model) @ nnx.to_pure_dict(params)['router']['kernel']))
  order = np.argsort(-probs, axis=-1)
  chosen = order[:, :cfg.top_k]
  sp = np.sort(probs, axis=-1)[:, ::-1]
  assert np.min(sp[:, cfg.top_k - 1] - sp[:, cfg.top_k]) > 1e-4
  ref_fn = jax.jit(jax.value_and_grad(
      lambda p, x: _reference(p, x, chosen, r, cfg.top_k),
      argnums=(0, 1), has_aux=True))
  (_, ref_aux), ref_grads = ref_fn(nnx.to_pure_dict(params), x)
  return dict(cfg=cfg, params=params, x=x, r=r, ref_aux=ref_aux,
              ref_grads=ref_grads)


def _moe_loss_and_grads(cfg, params, x, r):
  graphdef = nnx.graphdef(MoE(cfg, rngs=nnx.Rngs(0)))

  def loss(params, x):
    y, aux = nnx.merge(graphdef, params)(x)
    return jnp.sum(y * r) + aux['lb_loss'] + aux['z_loss'], (y, aux)

  (_, (y, aux)), grads = jax.jit(
      jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
  return y, aux, grads


@pytest.fixture(scope='module')
def results(setup):
  out = {}
  for (impl, kw), name in zip(IMPLS, IMPL_IDS):
    out[name] = _moe_loss_and_grads(
        _config(impl, **kw), setup['params'], setup['x'], setup['r'])
  return out


@pytest.mark.parametrize('name', IMPL_IDS)
def test_matches_loop_reference(setup, results, name):
  y, aux, (g_params, g_x) = results[name]
  ref_y, ref_lb, ref_z = setup['ref_aux']
  ref_g_params, ref_g_x = setup['ref_grads']
  np.testing.assert_allclose(y, ref_y, **TOL)
  np.testing.assert_allclose(aux['lb_loss'], ref_lb, **TOL)
  np.testing.assert_allclose(aux['z_loss'], ref_z, **TOL)
  np.testing.assert_allclose(g_x, ref_g_x, **TOL)
  g = nnx.to_pure_dict(g_params)
  np.testing.assert_allclose(
      g['router']['kernel'], ref_g_params['router']['kernel'], **TOL)
  for w in ('w_gate', 'w_up', 'w_down'):
    np.testing.assert_allclose(
        g['experts'][w], ref_g_params['experts'][w], **TOL, err_msg=w)


@pytest.mark.parametrize('name', IMPL_IDS[1:])
def test_impls_agree(results, name):
  y0, aux0, g0 = results['dense']
  y1, aux1, g1 = results[name]
  np.testing.assert_allclose(y1, y0, **TOL)
  np.testing.assert_allclose(aux1['expert_fraction'], aux0['expert_fraction'])
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **TOL),
               nnx.to_pure_dict(g1[0]), nnx.to_pure_dict(g0[0]))
  np.testing.assert_allclose(g1[1], g0[1], **TOL)


@pytest.mark.parametrize('impl', ['dense', 'ragged', 'blocked'])
def test_router_gets_task_gradient(setup, impl):
  """The task loss alone (no aux losses) trains the router via the weights."""
  cfg = _config(impl, moe_block_size=4)
  graphdef = nnx.graphdef(MoE(cfg, rngs=nnx.Rngs(0)))
  task = lambda p: jnp.sum(nnx.merge(graphdef, p)(setup['x'])[0] * setup['r'])
  g = nnx.to_pure_dict(jax.jit(jax.grad(task))(setup['params']))
  g_router = np.asarray(g['router']['kernel'])
  assert np.all(np.isfinite(g_router))
  assert np.abs(g_router).max() > 1e-3


def _fixed_routing_moe():
  cfg = ModelConfig(vocab_size=8, d_model=4, num_layers=1, num_heads=1,
                    num_experts=4, top_k=2, d_ff=8, max_seq_len=4,
                    compute_dtype=jnp.float32, moe_impl='dense')
  moe = MoE(cfg, rngs=nnx.Rngs(0))
  moe.router.kernel[...] = jnp.eye(4)  # logits = x
  return moe


def test_aux_losses_on_fixed_routing():
  moe = _fixed_routing_moe()
  logits = np.array([[3., 2., 0., 0.],    # -> experts 0, 1
                     [3., 0., 2., 0.],    # -> 0, 2
                     [0., 0., 3., 2.],    # -> 2, 3
                     [2., 0., 0., 3.]],   # -> 3, 0
                    np.float32)
  _, aux = nnx.jit(lambda m, x: m(x))(moe, jnp.asarray(logits)[None])
  f = np.array([3, 1, 2, 2]) / 8.0
  p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  lb = 4 * np.sum(f * p.mean(0))
  lse = np.log(np.exp(logits).sum(-1))
  np.testing.assert_allclose(aux['expert_fraction'], f, rtol=1e-6)
  np.testing.assert_allclose(aux['lb_loss'], lb, rtol=1e-6)
  np.testing.assert_allclose(aux['z_loss'], np.mean(lse**2), rtol=1e-6)

  weights, experts, _ = route(jnp.asarray(logits), 2)
  np.testing.assert_array_equal(experts, [[0, 1], [0, 2], [2, 3], [3, 0]])
  np.testing.assert_allclose(
      weights[0], [np.exp(1) / (1 + np.exp(1)), 1 / (1 + np.exp(1))], rtol=1e-6)
  np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-6)


def test_aux_losses_uniform_router():
  """A uniform router gives lb = 1 whatever the tie-break, z = (log E)^2."""
  moe = _fixed_routing_moe()
  _, aux = nnx.jit(lambda m, x: m(x))(moe, jnp.full((1, 6, 4), 0.7, jnp.float32))
  np.testing.assert_allclose(aux['lb_loss'], 1.0, rtol=1e-6)
  np.testing.assert_allclose(aux['z_loss'], (0.7 + np.log(4.0))**2, rtol=1e-6)


def test_bf16_compute_close_to_f32(setup):
  """Default compute dtype: all impls run and stay near the f32 result."""
  apply = nnx.jit(lambda m, x: m(x))
  y32 = apply(MoE(_config('dense'), rngs=nnx.Rngs(0)), setup['x'])[0]
  for impl in ('dense', 'ragged', 'blocked'):
    cfg = dataclasses.replace(_config(impl), compute_dtype=jnp.bfloat16)
    y16, _ = apply(MoE(cfg, rngs=nnx.Rngs(0)), setup['x'])
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(y16, np.float32), y32,
                               rtol=0.05, atol=0.05, err_msg=impl)


@pytest.mark.parametrize('routing', ['skewed', 'exact_multiple', 'one_empty'])
def test_expert_impls_on_extreme_routings(routing):
  """Pure expert functions agree when groups are very uneven or empty."""
  from models import experts_blocked, experts_dense, experts_ragged
  T, K, E, D, F = 12, 2, 4, 8, 6
  experts = {
      'skewed': [[0, 1]] * 11 + [[2, 3]],          # 11 rows for experts 0, 1
      'exact_multiple': [[0, 1], [2, 3]] * 6,      # 6 per expert = 2 blocks of 3
      'one_empty': [[0, 3], [3, 1]] * 6,           # expert 2 gets nothing
  }[routing]
  experts_TK = jnp.asarray(experts, jnp.int32)
  ks = jax.random.split(jax.random.key(0), 5)
  x = jax.random.normal(ks[0], (T, D))
  w = jax.nn.softmax(jax.random.normal(ks[1], (T, K)), axis=-1)
  wg = jax.random.normal(ks[2], (E, D, F))
  wu = jax.random.normal(ks[3], (E, D, F))
  wd = jax.random.normal(ks[4], (E, F, D))
  args = (x, w, experts_TK, wg, wu, wd)
  ref = jax.jit(experts_dense)(*args)
  np.testing.assert_allclose(jax.jit(experts_ragged)(*args), ref, **TOL)
  blocked = jax.jit(experts_blocked, static_argnames='block_size')
  for bs in (1, 3, 5, 64):
    np.testing.assert_allclose(
        blocked(*args, block_size=bs), ref, **TOL, err_msg=f'bs={bs}')
