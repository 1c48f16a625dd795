"""Factored statistics: the grouped two-pass means against plain numpy means."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skewadam_jax import encodings
from skewadam_jax import factored


@pytest.mark.parametrize("shape", [(9, 5), (3, 13, 21), (2, 2, 16, 8), (1, 8, 1)])
@pytest.mark.parametrize("count", [1, 3])
def test_grouped_means_equal_numpy_means(shape, count):
  keys = jax.random.split(jax.random.PRNGKey(0), count)
  xs = [jax.random.normal(k, shape) ** 2 for k in keys]
  means, sums = factored.row_col_means_grouped(xs)
  assert sums == [] and len(means) == count
  for x, got in zip(xs, means):
    x = np.asarray(x, np.float64)
    np.testing.assert_allclose(got.row, x.mean(-1), rtol=1e-5)
    np.testing.assert_allclose(got.col, x.mean(-2), rtol=1e-5)
    assert got.row.shape == shape[:-1] and got.col.shape == shape[:-2] + shape[-1:]


@pytest.mark.parametrize("cols", [1, 8, 13, 704])
def test_group_sums_of_sign_bit_weights_are_packbits(cols):
  m = jax.random.normal(jax.random.PRNGKey(1), (2, 5, cols))
  m = m.at[0, 0, 0].set(0.0)  # zero is not negative: bit 0
  means, (bits,) = factored.row_col_means_grouped(
      [jnp.abs(m)], [encodings.SignEncoding.bit_weights(m)])
  assert bits.dtype == jnp.uint8
  np.testing.assert_array_equal(bits, np.packbits(np.asarray(m) < 0, axis=-1))
  np.testing.assert_allclose(means[0].row, np.abs(np.asarray(m)).mean(-1), rtol=1e-5)


def test_ema_factored_blends_means():
  state = factored.FactoredMoment(row=jnp.full((2, 3), 4.0), col=jnp.full((2, 5), 2.0))
  means = factored.FactoredMoment(row=jnp.ones((2, 3)), col=jnp.zeros((2, 5)))
  new = factored.ema_factored(state, means, 0.75)
  np.testing.assert_allclose(new.row, 0.75 * 4.0 + 0.25 * 1.0)
  np.testing.assert_allclose(new.col, 0.75 * 2.0)
