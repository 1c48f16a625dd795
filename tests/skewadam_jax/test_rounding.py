"""Stochastic rounding of updates to bf16 parameters (skewadam_jax/rounding.py): unbiased, a
neighbour, structure kept.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import skewadam_jax as sa


def bf16_neighbours(x32):
  """The bf16 values just below and above float32 ``x32`` (equal if x is bf16)."""
  bits = np.asarray(x32, np.float32).view(np.uint32)
  lo = (bits & np.uint32(0xFFFF0000)).view(np.float32)
  hi = np.where(bits & 0xFFFF, ((bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32),
                lo)
  lo, hi = np.where(lo <= hi, lo, hi), np.where(lo <= hi, hi, lo)  # negative numbers
  return lo, hi


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
  rng = np.random.default_rng(0)
  n, draws = 512, 4000
  p = jnp.asarray(rng.normal(size=n), jnp.bfloat16)
  # Updates from far below bf16 resolution to above it, both signs.
  u = jnp.asarray(rng.normal(size=n) * 10.0 ** rng.uniform(-6, -1, size=n), jnp.float32)
  exact = np.asarray(p, np.float32) + np.asarray(u)
  keys = jax.random.split(jax.random.key(0), draws)
  samples = jax.jit(jax.vmap(lambda k: sa.apply_updates_stochastic({"p": p}, {"p": u}, k)["p"]))(keys)
  samples = np.asarray(samples.astype(jnp.float32))
  lo, hi = bf16_neighbours(exact)
  assert np.all((samples == lo) | (samples == hi))
  # Hoeffding: each sample is lo or hi, so P(|mean - x| >= t·(hi - lo)) <= 2·exp(-2·draws·t²);
  # t = 0.07 gives < 2e-17 per element.
  spread = np.where(hi > lo, hi - lo, 1.0)
  deviation = np.abs(samples.mean(axis=0) - exact) / spread
  assert deviation.max() < 0.07, deviation.max()
  # Round to nearest is biased exactly where it matters: below half a unit it never moves.
  nearest = np.asarray(optax.apply_updates(p, u).astype(jnp.float32))
  tiny = np.abs(u) < 0.25 * spread
  assert tiny.sum() > 100 and np.all(nearest[tiny] == np.asarray(p, np.float32)[tiny])


def test_tiny_updates_vanish_with_round_to_nearest_but_not_on_average_with_sr():
  n, steps, u = 4096, 200, 1e-4  # bf16 spacing at 1.0 is 2**-7 = 0.0078: u is 1/78 of it
  params = {"w": jnp.ones((n,), jnp.bfloat16), "b": jnp.ones((n,), jnp.float32)}
  updates = {"w": jnp.full((n,), u), "b": jnp.full((n,), u)}

  @jax.jit
  def run(params, key):
    def body(i, p):
      return sa.apply_updates_stochastic(p, updates, jax.random.fold_in(key, i))
    return jax.lax.fori_loop(0, steps, body, params)

  nearest = params
  for _ in range(steps):
    nearest = optax.apply_updates(nearest, updates)
  got = run(params, jax.random.key(1))
  assert np.all(np.asarray(nearest["w"], np.float32) == 1.0)  # every update lost
  w = np.asarray(got["w"], np.float32)
  # Per element: a sum of 200 bounded steps, variance <= steps·u·2**-7; the
  # mean over 4096 elements has standard deviation ~2e-4: the bound is 5 of them.
  assert abs(w.mean() - (1.0 + steps * u)) < 1e-3, w.mean()
  np.testing.assert_allclose(got["b"], nearest["b"], rtol=0, atol=0)  # fp32: exact, as optax


def test_apply_updates_stochastic_keeps_structure_dtypes_and_specials():
  params = {"a": jnp.array([1.0, jnp.inf, jnp.nan, -2.0], jnp.bfloat16),
            "b": jnp.array([1.0, 2.0], jnp.float16), "c": None,
            "d": jnp.array([0.5, 0.25], jnp.bfloat16)}
  updates = {"a": jnp.array([0.0, 1.0, 1.0, 0.0]), "b": jnp.array([1e-4, 1.0], jnp.float32),
             "c": None, "d": jnp.array([0.0, 0.0])}
  new = sa.apply_updates_stochastic(params, updates, jax.random.key(3))
  assert jax.tree.structure(new, is_leaf=lambda x: x is None) == jax.tree.structure(
      params, is_leaf=lambda x: x is None)
  assert new["c"] is None
  assert (new["a"].dtype, new["b"].dtype, new["d"].dtype) == (jnp.bfloat16, jnp.float16,
                                                              jnp.bfloat16)
  a = np.asarray(new["a"], np.float32)
  assert a[0] == 1.0 and a[1] == np.inf and np.isnan(a[2]) and a[3] == -2.0
  np.testing.assert_array_equal(new["b"], optax.apply_updates(params["b"], updates["b"]))
  np.testing.assert_array_equal(new["d"], params["d"])  # representable: unchanged
  # Identical bf16 leaves draw independent bits.
  same = {"x": jnp.ones((256,), jnp.bfloat16), "y": jnp.ones((256,), jnp.bfloat16)}
  step = {"x": jnp.full((256,), 0.004), "y": jnp.full((256,), 0.004)}
  out = sa.apply_updates_stochastic(same, step, jax.random.key(0))
  assert not np.array_equal(np.asarray(out["x"]), np.asarray(out["y"]))


def test_hashed_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
  from skewadam_jax import rounding  # pylint: disable=import-outside-toplevel
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=2**20), jnp.float32)
  got = np.asarray(jax.jit(rounding.stochastic_round_to_bf16_hashed)(x, 3).astype(jnp.float32))
  lo, hi = bf16_neighbours(np.asarray(x))
  assert np.all((got == lo) | (got == hi))
  step = np.where(hi > lo, hi - lo, 1.0)
  # Each error in units of a bf16 step has spread <= 1/2: 2^20 draws put the
  # mean's standard error at 5e-4, so 0.003 is six of them.
  assert abs(np.mean((got - np.asarray(x)) / step)) < 0.003
  # One value everywhere: the draws still vary by position and by salt.
  quarter = jnp.full((2**16,), 1.0 + 2.0**-9)
  for salt in (0, 1, 2**31 + 5):
    up = float(jnp.mean(rounding.stochastic_round_to_bf16_hashed(quarter, salt) > 1.0))
    assert abs(up - 0.25) < 0.01, (salt, up)
  a, b = (rounding.stochastic_round_to_bf16_hashed(quarter, s) for s in (0, 1))
  assert not bool(jnp.array_equal(a, b))
  # A pure function of (x, position, salt): a resumed run rounds the same.
  np.testing.assert_array_equal(rounding.stochastic_round_to_bf16_hashed(quarter, 1), b)
  # A change below bf16's resolution keeps the draw, so it rarely changes the result.
  nudged = np.asarray(x).view(np.uint32) ^ np.uint32(1)
  other = rounding.stochastic_round_to_bf16_hashed(jnp.asarray(nudged.view(np.float32)), 3)
  assert float(jnp.mean(other.astype(jnp.float32) != got)) < 0.001


def test_hashed_uniform_numbers_are_uniform_and_stable_under_stacking():
  from skewadam_jax import rounding  # pylint: disable=import-outside-toplevel
  x = jnp.zeros((64, 64))
  draws = np.stack([np.asarray(rounding.uniform_hashed(x, salt)) for salt in range(16)])
  assert draws.min() >= 0.0 and draws.max() < 1.0
  # 65536 draws: mean and decile counts of a uniform, to a few standard errors
  assert abs(draws.mean() - 0.5) < 0.005
  counts = np.histogram(draws, bins=10, range=(0, 1))[0] / draws.size
  assert np.all(np.abs(counts - 0.1) < 0.005), counts
  # a new salt, or another stream of one salt, draws other numbers
  assert np.mean(draws[0] == draws[1]) < 0.01
  other = np.asarray(rounding.uniform_hashed(x, 0, stream=1))
  assert np.mean(other == draws[0]) < 0.01 and abs(np.corrcoef(other.ravel(), draws[0].ravel())[0, 1]) < 0.03
  # positions count within the last two axes: a matrix draws alike alone or stacked
  stacked = np.asarray(rounding.uniform_hashed(jnp.zeros((3, 64, 64)), 5))
  np.testing.assert_array_equal(stacked[2], draws[5])
  # floor(x + u) is unbiased: a quarter of the way up rounds up a quarter of the time
  up = np.mean(np.floor(2.25 + draws) == 3.0)
  assert abs(up - 0.25) < 0.01, up
