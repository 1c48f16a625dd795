"""The momentum probe's measures against hand computations and the library's own step."""

import doctest

import jax.numpy as jnp
import numpy as np
import pytest

import skewadam_jax
from experiments.studies import momentum_probe as probe

RNG = np.random.default_rng(0)


def test_the_experts_mean_keeps_everything_of_equal_momenta_and_a_share_of_one_over_e_of_independent_ones():
  same = np.broadcast_to(RNG.normal(size=(1, 16, 24)), (8, 16, 24))
  assert probe.energy_share_of_mean(same, 0) == pytest.approx(1.0)
  independent = RNG.normal(size=(3, 8, 64, 96))
  assert probe.energy_share_of_mean(independent, 1) == pytest.approx(1 / 8, abs=0.01)


def test_the_experts_mean_share_by_hand():
  a, b = np.array([[3.0, 0.0]]), np.array([[1.0, 2.0]])
  # E·‖(a + b)/2‖² / (‖a‖² + ‖b‖²) = 2·(4 + 1) / (9 + 5)
  assert probe.energy_share_of_mean(np.stack([a, b]), 0) == pytest.approx(10 / 14)


def test_mean_abs_cosine_by_hand():
  a, b, c = np.array([[1.0, 0.0]]), np.array([[1.0, 1.0]]), np.array([[0.0, -2.0]])
  # pairs: (a, b) 1/√2, (a, c) 0, (b, c) −1/√2
  assert probe.mean_abs_cosine(np.stack([a, b, c]), 0) == pytest.approx(np.sqrt(2) / 3)


def test_top_rank_share_is_the_top_singular_values_share():
  u = np.linalg.qr(RNG.normal(size=(5, 3)))[0]
  v = np.linalg.qr(RNG.normal(size=(7, 3)))[0]
  m = u @ np.diag([3.0, 2.0, 1.0]) @ v.T
  assert probe.top_rank_share(m, 1) == pytest.approx(9 / 14)
  assert probe.top_rank_share(m[None], 2) == pytest.approx(13 / 14)


def test_a_shared_subspace_keeps_all_of_experts_that_share_one_and_is_the_own_subspace_for_one_expert():
  basis = np.linalg.qr(RNG.normal(size=(12, 3)))[0]
  experts = basis @ RNG.normal(size=(4, 3, 10))  # [E, d, o], one 3-dim row space
  assert probe.shared_subspace_share(experts, 3) == pytest.approx(1.0)
  assert probe.shared_subspace_share(experts, 2) < 1.0
  one = RNG.normal(size=(2, 1, 12, 10))
  for rank in (1, 4):
    assert probe.shared_subspace_share(one, rank) == pytest.approx(probe.top_rank_share(one, rank))


def test_spectrum_split_of_an_orthogonal_matrix_and_of_one_scaled_inside():
  q = np.linalg.qr(RNG.normal(size=(6, 6)))[0]
  basis = q[:, :2]
  assert probe.spectrum_split(q, basis) == pytest.approx((1.0, 1.0))
  inside_twice = 2 * basis @ q[:, :2].T
  assert probe.spectrum_split(inside_twice, basis) == pytest.approx((4.0, 0.0))


def test_the_probes_step_input_is_the_librarys_orthogonal_step():
  b1 = 0.9
  params = {"experts": {"w": jnp.zeros((2, 4, 6))}}
  tx = skewadam_jax.skewadam_orthogonal(1.0, b1=b1, weight_decay=0.0, max_grad_norm=None,
                                        expert={"momentum": "fp32"})
  g1, g2 = (jnp.asarray(RNG.normal(size=(2, 4, 6)), jnp.float32) for _ in range(2))
  state = tx.init(params)
  _, state = tx.update({"experts": {"w": g1}}, state, params)
  update, _ = tx.update({"experts": {"w": g2}}, state, params)
  _, nest = probe.nesterov_input((1 - b1) * np.asarray(g1), np.asarray(g2), b1)
  expected = skewadam_jax.newton_schulz(jnp.asarray(nest, jnp.float32),
                                        skewadam_jax.MatrixAxes(-2, -1))
  scale = skewadam_jax.orthogonal.width_scale((4, 6), skewadam_jax.MatrixAxes(-2, -1))
  np.testing.assert_allclose(-np.asarray(update["experts"]["w"]), scale * np.asarray(expected),
                             rtol=1e-5, atol=1e-6)


def test_equal_bytes_shared_rank_costs_no_more_than_the_per_expert_factors():
  for rank, d, o, experts in [(6, 128, 256, 8), (42, 1024, 1400, 64)]:
    shared = probe.equal_bytes_shared_rank(rank, d, o, experts)
    assert shared * (d / experts + o) <= rank * (d + o) < (shared + 1) * (d / experts + o)


def test_the_docstring_examples_run():
  result = doctest.testmod(probe)
  assert result.attempted >= 2 and result.failed == 0


def _gradients(steps, shape=(2, 6, 10)):
  return [RNG.normal(size=shape).astype(np.float32) for _ in range(steps)]


def test_float32_and_full_rank_factors_follow_float32_exactly():
  grads = _gradients(12)
  assert probe.follow(grads, skewadam_jax.encodings.get_encoding("fp32")) == pytest.approx(1.0, abs=1e-5)
  full_rank = skewadam_jax.encodings.get_encoding("lowrank", rank=6)  # every row of 6 x 10
  assert probe.follow(grads, full_rank, burn_in=2) == pytest.approx(1.0, abs=1e-4)


def test_no_momentum_follows_a_constant_gradient_but_not_a_noisy_one():
  constant = [np.ones((6, 10), np.float32) + np.eye(6, 10, dtype=np.float32)] * 8
  assert probe.follow(constant, None) == pytest.approx(1.0, abs=1e-5)
  noisy = probe.follow(_gradients(30), None, burn_in=10)
  rank_two = probe.follow(_gradients(30), skewadam_jax.encodings.get_encoding("lowrank", rank=2),
                          burn_in=10)
  assert noisy < 0.9 and rank_two < 0.95


def test_fidelity_names_every_form_and_leaf():
  grads = {"a/experts/w": np.stack(_gradients(4))}
  result = probe.fidelity(grads, forms=("fp32", "none"), burn_in=1)
  assert set(result) == {"fp32", "none"} and set(result["fp32"]) == {"a/experts/w"}
  assert result["fp32"]["a/experts/w"] == pytest.approx(1.0, abs=1e-5)
