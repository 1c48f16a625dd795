"""Bounds on the update and bad gradients (issue 26, items 1, 5 and 6).

Every (momentum encoding, second-moment form) either has a bound on the
update, tested here on heavy-tailed gradients, or is refused when its
TierConfig is made; one bad gradient entry stays in its own entry.
"""

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import skewadam_jax as sa

B1, B2 = 0.9, 0.999
SHAPE = (2, 16, 24)  # a small expert bank: two 16 x 24 matrices


def _lognormal_grads(steps, seed=0):
  keys = jax.random.split(jax.random.PRNGKey(seed), 2 * steps)
  return [jnp.exp(3.0 * jax.random.normal(keys[2 * i], SHAPE))
          * jnp.sign(jax.random.normal(keys[2 * i + 1], SHAPE)) for i in range(steps)]


def _updates(tier, grads, **kwargs):
  tx = sa.scale_by_skewadam(b1=B1, b2=B2, param_labels="expert", expert=tier, **kwargs)
  state, out = tx.init(grads[0]), []
  step = jax.jit(tx.update)
  for g in grads:
    u, state = step(g, state)
    out.append(u)
  return out, state


def adam_bound(t, b1=B1, b2=B2):
  """max |m̂_t / √v̂_t| for Adam with b1² < b2 (Cauchy–Schwarz on the two EMAs)."""
  return ((1 - b1) / math.sqrt((1 - b2) * (1 - b1**2 / b2))
          * math.sqrt(1 - b2**t) / (1 - b1**t))


def test_sign_momentum_with_an_exact_second_moment_is_refused():
  with pytest.raises(ValueError, match="no bound on the update.*second_moment='factored'"):
    sa.TierConfig("sign", "exact")
  sa.TierConfig("sign", "exact", direction="orthogonal")  # no v in that direction


@pytest.mark.parametrize("momentum", ["fp32", "bf16"])
def test_dense_momentum_with_an_exact_v_keeps_adams_bound(momentum):
  grads = _lognormal_grads(60)
  updates, _ = _updates(sa.TierConfig(momentum, "exact"), grads)
  slack = 1.0 if momentum == "fp32" else 1.05  # bf16 rounds m by 2^-8 a step
  for t, u in enumerate(updates, start=1):
    assert float(jnp.max(jnp.abs(u))) <= slack * adam_bound(t), t


@pytest.mark.parametrize("momentum", ["fp32", "bf16", "int8", "sign", "none"])
def test_update_clipping_bounds_every_factored_form(momentum):
  grads = _lognormal_grads(20)
  tier = sa.TierConfig(momentum, "factored", int8_block_size=8)
  clipped, _ = _updates(tier, grads, clip_threshold=1.0)
  plain, _ = _updates(tier, grads)
  worst = 0.0
  for u, p in zip(clipped, plain):
    rms = jnp.sqrt(jnp.mean(u * u, axis=(1, 2)))
    assert float(jnp.max(rms)) <= 1.0 + 1e-5
    p_rms = jnp.sqrt(jnp.mean(p * p, axis=(1, 2), keepdims=True))
    # Clipping only rescales a matrix whose RMS is above the threshold.
    np.testing.assert_allclose(u, p / jnp.maximum(1.0, p_rms), rtol=1e-5, atol=1e-7)
    worst = max(worst, float(jnp.max(p_rms)))
  assert worst > 1.0  # the unclipped update does exceed it on these gradients


def _poisoned(bad_value):
  grads = _lognormal_grads(4, seed=1)
  bad = grads[1].at[0, 3, 5].set(bad_value)
  zero = grads[1].at[0, 3, 5].set(0.0)
  return [grads[0], bad, *grads[2:]], [grads[0], zero, *grads[2:]]


@pytest.mark.parametrize("bad_value", [jnp.nan, jnp.inf, 3e19])
@pytest.mark.parametrize("tier", [sa.DEFAULT_EXPERT, sa.DEFAULT_BACKBONE,
                                  sa.TierConfig("fp32", "exact")],
                         ids=["sign-factored", "bf16-factored", "fp32-exact"])
def test_one_bad_gradient_entry_counts_as_zero_and_poisons_nothing(bad_value, tier):
  # 3e19 is finite, but its square overflows float32: apply_if_finite lets it
  # through, and before, it poisoned the whole factored matrix for good.
  with_bad, with_zero = _poisoned(bad_value)
  got, state = _updates(tier, with_bad, contain_nonfinite=True)
  want, want_state = _updates(tier, with_zero, contain_nonfinite=True)
  for u, w in zip(got, want):
    np.testing.assert_array_equal(u, w)
  for x in jax.tree.leaves(state):
    if jnp.issubdtype(x.dtype, jnp.floating):
      assert bool(jnp.all(jnp.isfinite(x)))
  assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), state, want_state))
  if tier.second_moment == "factored":  # without containment the whole matrix is lost
    poisoned, _ = _updates(tier, with_bad)
    assert not bool(jnp.all(jnp.isfinite(poisoned[-1][0]) & (jnp.abs(poisoned[-1][0]) < 1e3)))


def test_ordinary_gradients_pass_the_bad_entry_filter_bit_for_bit():
  # The largest gradient that passes is √(max_float32 / size): far beyond any
  # real gradient, and below it nothing changes.
  from skewadam_jax import transform  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  grads = _lognormal_grads(5, seed=2)
  limit = math.sqrt(float(jnp.finfo(jnp.float32).max) / math.prod(SHAPE))
  edge = grads[0].at[0, 0, 0].set(limit * 0.999)
  for g in grads + [edge]:
    np.testing.assert_array_equal(transform._finite_entries(g), g)  # pylint: disable=protected-access
  got, _ = _updates(sa.TierConfig("fp32", "exact"), grads, contain_nonfinite=True)
  adam = optax.scale_by_adam(b1=B1, b2=B2)
  state = adam.init(grads[0])
  for g, u in zip(grads, got):
    want, state = adam.update(g, state)
    np.testing.assert_allclose(u, want, rtol=1e-4, atol=1e-6)  # optax rounds 1 - b2 differently


def test_bf16_momentum_warns_where_it_would_stall():
  with pytest.warns(UserWarning, match=r"backbone tier: bf16 momentum at b1=0.99 can stall"):
    sa.scale_by_skewadam(b1=0.99)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    sa.scale_by_skewadam(b1=0.9)
    sa.scale_by_skewadam(b1=0.99, backbone={"momentum": "fp32"})
  with pytest.raises(ValueError, match="clip_threshold must be > 0"):
    sa.scale_by_skewadam(clip_threshold=0.0)


def test_the_sign_encodings_update_is_about_half_of_fp32_momentums():
  # Documented (encodings.py, README "Momentum encodings"): the sign encoding
  # keeps each row's and column's mean |m| but not the per-entry spread, so
  # on a stationary noisy gradient the expert tier's update RMS is about half
  # of fp32 momentum's (same factored v): half the learning rate, in effect.
  key = jax.random.PRNGKey(0)
  signal = 0.3 * jax.random.normal(key, (64, 96))
  grads = [signal + jax.random.normal(jax.random.fold_in(key, t), (64, 96)) for t in range(150)]

  def rms_of_updates(momentum):
    tx = sa.scale_by_skewadam(param_labels="expert",
                              expert=sa.TierConfig(momentum, "factored"))
    state, out = tx.init(grads[0]), []
    step = jax.jit(tx.update)
    for g in grads:
      u, state = step(g, state)
      out.append(float(jnp.sqrt(jnp.mean(u * u))))
    return np.asarray(out[50:])

  ratio = float(np.mean(rms_of_updates("sign") / rms_of_updates("fp32")))
  print(f"sign / fp32 momentum update RMS: {ratio:.2f}")  # the README's figure (pytest -s)
  assert 0.4 <= ratio <= 0.65, ratio
