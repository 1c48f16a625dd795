"""Factored statistics: plain and grouped means against numpy, over declared axes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skewadam_jax import encodings
from skewadam_jax import factored
from skewadam_jax.axes import MatrixAxes


def last_two(shape):
  return MatrixAxes(len(shape) - 2, len(shape) - 1)


@pytest.mark.parametrize("shape", [(9, 5), (3, 13, 21), (2, 2, 16, 8), (1, 8, 1)])
@pytest.mark.parametrize("count", [1, 3])
def test_grouped_means_equal_numpy_means(shape, count):
  keys = jax.random.split(jax.random.PRNGKey(0), count)
  xs = [jax.random.normal(k, shape) ** 2 for k in keys]
  means, sums = factored.row_col_means_grouped(xs)
  assert sums == [] and len(means) == count
  for x, (row, col) in zip(xs, means):
    x = np.asarray(x, np.float64)
    np.testing.assert_allclose(row, x.mean(-1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(col, x.mean(-2, keepdims=True), rtol=1e-5)
    assert (row.shape, col.shape) == factored.factored_shapes(shape, last_two(shape))


@pytest.mark.parametrize("cols", [1, 8, 13, 704])
def test_group_sums_of_sign_bit_weights_are_packbits(cols):
  m = jax.random.normal(jax.random.PRNGKey(1), (2, 5, cols))
  m = m.at[0, 0, 0].set(0.0)  # zero is not negative: bit 0
  means, (bits,) = factored.row_col_means_grouped(
      [jnp.abs(m)], [encodings.SignEncoding.bit_weights(m)])
  assert bits.dtype == jnp.uint8
  np.testing.assert_array_equal(bits, np.packbits(np.asarray(m) < 0, axis=-1))
  np.testing.assert_allclose(means[0][0], np.abs(np.asarray(m)).mean(-1, keepdims=True),
                             rtol=1e-5)


@pytest.mark.parametrize("axes", [MatrixAxes(0, 2), MatrixAxes(2, 0), MatrixAxes(1, 3)])
def test_means_over_declared_axes_treat_the_others_as_batch(axes):
  x = jax.random.uniform(jax.random.PRNGKey(2), (3, 4, 5, 6))
  row, col = factored.row_col_means(x, axes)
  xn = np.asarray(x, np.float64)
  np.testing.assert_allclose(row, xn.mean(axes.cols, keepdims=True), rtol=1e-5)
  np.testing.assert_allclose(col, xn.mean(axes.rows, keepdims=True), rtol=1e-5)
  # The reconstruction keeps both means, matrix by matrix.
  recon = factored.rank_one(row, col, axes)
  assert recon.shape == x.shape
  np.testing.assert_allclose(recon.mean(axes.cols, keepdims=True), row, rtol=1e-5)
  np.testing.assert_allclose(recon.mean(axes.rows, keepdims=True), col, rtol=1e-5)
  # root=True takes the square root on the factors: the same numbers.
  np.testing.assert_allclose(factored.rank_one(row, col, axes, root=True), jnp.sqrt(recon),
                             rtol=1e-6)


def test_rank_one_is_exact_for_a_rank_one_matrix():
  r = jnp.array([1.0, 2.0, 4.0])[:, None]
  c = jnp.array([0.5, 1.0, 3.0, 2.0])[None, :]
  x = r * c
  row, col = factored.row_col_means(x, MatrixAxes(0, 1))
  np.testing.assert_allclose(factored.rank_one(row, col, MatrixAxes(0, 1)), x, rtol=1e-6)


def test_zero_size_axes_give_zero_not_nan():
  for shape in [(0, 5), (4, 0), (2, 0, 3)]:
    x = jnp.ones(shape)
    row, col = factored.row_col_means(x, last_two(shape))
    assert not bool(jnp.any(jnp.isnan(row))) and not bool(jnp.any(jnp.isnan(col)))


def test_ema_blends_means_in_the_states_dtype():
  old = jnp.full((2, 3, 1), 4.0)
  new = factored.ema(old, jnp.ones((2, 3, 1)), 0.75)
  np.testing.assert_allclose(new, 0.75 * 4.0 + 0.25 * 1.0)
  assert factored.ema(old.astype(jnp.bfloat16), jnp.ones((2, 3, 1)), 0.5).dtype == jnp.bfloat16
