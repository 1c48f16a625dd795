"""Number formats: low-precision second moments, complex parameters, empty leaves."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sa

STEPS = 4000


def second_moments(nu_dtype, b2, second_moment):
  """v after STEPS steps of a gradient whose scale decays 100x over the run."""
  cfg = sa.TierConfig(momentum="fp32", second_moment=second_moment, nu_dtype=nu_dtype)
  tx = sa.scale_by_skewadam(b2=b2, backbone=cfg)
  params = {"w": jnp.zeros((8, 16))}
  noise = jax.random.normal(jax.random.PRNGKey(0), (64, 8, 16))

  def body(t, state):
    scale = 100.0 ** (-t / STEPS)
    g = {"w": scale * (1.0 + noise[t % 64])}
    return tx.update(g, state)[1]

  state = jax.jit(lambda s: jax.lax.fori_loop(0, STEPS, body, s))(tx.init(params))
  if second_moment == "exact":
    return state.nu["w"].astype(jnp.float32)
  return (state.nu_row["w"].astype(jnp.float32), state.nu_col["w"].astype(jnp.float32))


@pytest.mark.parametrize("second_moment", ["exact", "factored"])
def test_bf16_second_moment_tracks_fp32_where_allowed(second_moment):
  # b2 = 0.9: 1 - b2 = 0.1 >= 10 * eps(bf16), the rule TierConfig documents.
  ref = second_moments(jnp.float32, 0.9, second_moment)
  got = second_moments(jnp.bfloat16, 0.9, second_moment)
  for r, g in zip(jax.tree.leaves(ref), jax.tree.leaves(got)):
    assert float(jnp.max(jnp.abs(g / r - 1))) < 0.05


def test_bf16_second_moment_that_would_stall_is_refused():
  cfg = sa.TierConfig(nu_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match=r"backbone.nu_dtype=bfloat16 cannot hold .* b2=0.999"):
    sa.scale_by_skewadam(b2=0.999, backbone=cfg)
  with pytest.raises(ValueError, match=r"expert.nu_dtype=bfloat16 cannot hold"):
    sa.skewadam(1e-3, expert=cfg)
  with pytest.raises(ValueError, match=r"float16 is not supported"):
    sa.TierConfig(nu_dtype=jnp.float16)
  sa.scale_by_skewadam(b2=0.9, backbone=cfg)   # allowed


def test_complex_parameters_follow_optax_adam():
  params = {"w": jnp.zeros((3, 4), jnp.complex64), "b": jnp.zeros(4, jnp.complex64)}
  key_re, key_im = jax.random.split(jax.random.PRNGKey(1))
  grads = [jax.tree.map(lambda p, i=i: (jax.random.normal(jax.random.fold_in(key_re, i), p.shape)
                                        + 1j * jax.random.normal(jax.random.fold_in(key_im, i),
                                                                 p.shape)).astype(p.dtype),
                        params) for i in range(5)]
  adam = optax.scale_by_adam()
  exact = sa.TierConfig("fp32", "exact")
  for tx in (sa.scale_by_skewadam(backbone=exact),                       # Adam's form
             sa.scale_by_skewadam(backbone=sa.TierConfig("int8", "exact"))):  # complex64 m
    s, s_ref = tx.init(params), adam.init(params)
    for g in grads:
      u, s = tx.update(g, s)
      ref, s_ref = adam.update(g, s_ref)
      jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), u, ref)
  # The single-gradient case of the bug report: 1j gives ~1j, as optax.adam
  # gives it (-0.9999933j: float32 bias corrections of float32 decays).
  tx = sa.skewadam(1.0, weight_decay=0.0)
  u, _ = tx.update(jnp.array([1j]), tx.init(jnp.zeros(1, jnp.complex64)), jnp.zeros(1))
  reference = optax.adam(1.0)
  want, _ = reference.update(jnp.array([1j], jnp.complex64),
                             reference.init(jnp.zeros(1, jnp.complex64)))
  np.testing.assert_allclose(u, want, rtol=1e-6)
  np.testing.assert_allclose(u, [-1j], rtol=1e-5)
  # A factored v of |g|^2 is real; the momentum stays complex.
  state = sa.scale_by_skewadam().init(params)
  assert state.mu["w"].dtype == jnp.complex64 and state.nu_row["w"].dtype == jnp.float32


@pytest.mark.parametrize("momentum", sa.ENCODINGS)
def test_zero_size_leaves_leave_no_nan(momentum):
  params = {"e": jnp.zeros((0, 5)), "f": jnp.zeros((3, 0)), "g": jnp.zeros((0,)),
            "w": jnp.ones((3, 5))}
  cfg = sa.TierConfig(momentum=momentum, second_moment="factored", int8_block_size=2)
  tx = sa.skewadam(1e-2, backbone=cfg)
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  for _ in range(2):
    updates, state = jax.jit(tx.update)(grads, state, params)
  for x in jax.tree.leaves((updates, state)):
    assert not bool(jnp.any(jnp.isnan(x.astype(jnp.float32))))
