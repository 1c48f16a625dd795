"""Round-trip bounds, shapes and dtypes of the momentum encodings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import skewadam_jax as sa
from skewadam_jax import encodings
from skewadam_jax import factored
from skewadam_jax.axes import MatrixAxes

SHAPE = (2, 3, 16, 40)  # [L, E, R, C]; C=40 is not a multiple of 8 or of the block
AXES = MatrixAxes(2, 3)


@pytest.fixture(scope="module")
def momentum():
  return jax.random.normal(jax.random.PRNGKey(0), SHAPE) * jnp.logspace(-6, 1, SHAPE[-1])


def roundtrip(name, m, **kw):
  enc = encodings.get_encoding(name, **kw)
  axes = MatrixAxes(m.ndim - 2, m.ndim - 1)
  return enc.decode(jax.jit(lambda x: enc.encode(x, axes))(m), axes)


def test_fp32_is_exact(momentum):
  np.testing.assert_array_equal(roundtrip("fp32", momentum), momentum)


def test_bf16_relative_error_within_2_pow_minus_8(momentum):
  err = jnp.abs(roundtrip("bf16", momentum) - momentum)
  assert bool(jnp.all(err <= 2.0**-8 * jnp.abs(momentum)))


@pytest.mark.parametrize("block_size", [8, 256])
def test_int8_error_within_half_step_of_block_absmax(momentum, block_size):
  decoded = roundtrip("int8", momentum, block_size=block_size)
  # Independent per-block absmax, computed with numpy on the padded last axis.
  m = np.asarray(momentum)
  nblocks = -(-m.shape[-1] // block_size)
  padded = np.zeros(m.shape[:-1] + (nblocks * block_size,), np.float32)
  padded[..., :m.shape[-1]] = m
  absmax = np.abs(padded.reshape(m.shape[:-1] + (nblocks, block_size))).max(-1)
  bound = np.repeat(absmax, block_size, axis=-1)[..., :m.shape[-1]] / 254
  assert np.all(np.abs(np.asarray(decoded) - m) <= bound * (1 + 1e-6))


def test_sign_keeps_signs_and_each_row_and_columns_size(momentum):
  decoded = roundtrip("sign", momentum)
  np.testing.assert_array_equal(jnp.sign(decoded), jnp.sign(momentum))
  rms = lambda x, axis: jnp.sqrt(jnp.mean(jnp.square(x), axis=axis))  # noqa: E731
  np.testing.assert_allclose(rms(decoded, -1), rms(momentum, -1), rtol=1e-5)
  np.testing.assert_allclose(rms(decoded, -2), rms(momentum, -2), rtol=1e-5)


def test_sign_is_exact_for_rank_one_magnitude():
  key1, key2, key3 = jax.random.split(jax.random.PRNGKey(1), 3)
  rows = jax.random.uniform(key1, (3, 5, 1), minval=0.1, maxval=2.0)
  cols = jax.random.uniform(key2, (3, 1, 9), minval=0.1, maxval=2.0)
  signs = jnp.where(jax.random.bernoulli(key3, 0.5, (3, 5, 9)), 1.0, -1.0)
  m = signs * rows * cols
  np.testing.assert_allclose(roundtrip("sign", m), m, rtol=1e-5)


def test_zero_momentum_decodes_to_zero():
  for name in ("fp32", "bf16", "int8", "sign"):
    enc = encodings.get_encoding(name)
    parts = enc.encode(jnp.zeros(SHAPE), AXES)
    np.testing.assert_array_equal(enc.decode(parts, AXES), jnp.zeros(SHAPE))


def test_state_shapes_dtypes_and_bytes_per_param():
  R, C = SHAPE[-2:]
  lead = SHAPE[:-2]
  n = np.prod(SHAPE)
  expected = {
      "fp32": ({"mu": (SHAPE, jnp.float32)}, 4.0),
      "bf16": ({"mu": (SHAPE, jnp.bfloat16)}, 2.0),
      "int8": ({"mu": (SHAPE, jnp.int8), "mu_scale": (lead + (R, 1), jnp.float32)},
               1 + 4 / C),  # one block of 256 covers C=40
      "sign": ({"mu": (lead + (R, 5), jnp.uint8),
                "mu_row": (lead + (R, 1), jnp.float32),
                "mu_col": (lead + (1, C), jnp.float32)},
               (np.prod(lead) * R * 5 + 4 * np.prod(lead) * (R + C)) / n),
  }
  for name, (fields, bytes_per_param) in expected.items():
    enc = encodings.get_encoding(name)
    parts = jax.eval_shape(lambda: enc.encode(jnp.zeros(SHAPE), AXES))
    flat = {k: (x.shape, x.dtype) for k, x in parts.items()}
    assert flat == {k: (tuple(s), jnp.dtype(d)) for k, (s, d) in fields.items()}, name
    assert enc.bytes_per_param(SHAPE) == pytest.approx(bytes_per_param), name


def test_int8_last_short_block_gets_its_own_scale_without_padding():
  # [..., 384] with blocks of 256: one full block and one of 128, no padded copy.
  shape = (4, 8, 256, 384)
  enc = encodings.get_encoding("int8", block_size=256)
  axes = MatrixAxes(2, 3)
  m = jax.random.normal(jax.random.PRNGKey(3), shape)
  parts = enc.encode(m, axes)
  assert parts["mu_scale"].shape == (4, 8, 256, 2)
  np.testing.assert_allclose(parts["mu_scale"][..., 1], jnp.abs(m[..., 256:]).max(-1))
  assert "pad[" not in str(jax.make_jaxpr(lambda x: enc.encode(x, axes))(m))
  if _jaxlib_release() < (0, 10):
    return  # XLA:CPU before jaxlib 0.10 materialises the per-element scale (4 B/param)
  for fn in (lambda x: enc.encode(x, axes), lambda x: enc.decode(enc.encode(x, axes), axes)):
    compiled = jax.jit(fn).lower(m).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < m.size  # < 1 B/param


def _jaxlib_release() -> tuple[int, ...]:
  import jaxlib  # pylint: disable=import-outside-toplevel
  return tuple(int(p) for p in jaxlib.__version__.split(".")[:2])


@pytest.mark.parametrize("name", ["int8", "sign"])
def test_matrix_encodings_run_along_the_declared_columns(name):
  # Columns on axis 0 of a [C, L, R] leaf: the same as the [L, R, C] transpose.
  m = jax.random.normal(jax.random.PRNGKey(4), (12, 3, 5))
  enc = encodings.get_encoding(name, block_size=4)
  got = enc.decode(enc.encode(m, MatrixAxes(2, 0)), MatrixAxes(2, 0))
  moved = jnp.moveaxis(m, 0, -1)
  want = enc.decode(enc.encode(moved, MatrixAxes(1, 2)), MatrixAxes(1, 2))
  np.testing.assert_allclose(got, jnp.moveaxis(want, -1, 0), rtol=1e-6)


def test_sign_bytes_per_param_at_6p78b_expert_shape():
  # 1/8 bit-packed sign + fp32 row and column means of each 1024 x 1400 matrix.
  got = encodings.get_encoding("sign").bytes_per_param((64, 1024, 1400))
  assert got == pytest.approx(1 / 8 + 4 * (1024 + 1400) / (1024 * 1400))


def test_unknown_encoding_and_bad_block_size_raise():
  with pytest.raises(ValueError, match="Unknown momentum encoding 'int4'"):
    encodings.get_encoding("int4")
  with pytest.raises(ValueError, match="block_size must be a positive int, got 0"):
    encodings.get_encoding("int8", block_size=0)


def test_mulaw_int8_round_trip_bounds():
  enc = encodings.get_encoding("int8", block_size=64, int8_code="mulaw")
  assert enc.name == "int8-mulaw"
  axes = MatrixAxes(0, 1)
  x = jnp.exp(4.0 * jax.random.normal(jax.random.PRNGKey(5), (32, 128))) * jnp.sign(
      jax.random.normal(jax.random.PRNGKey(6), (32, 128)))
  back = enc.decode(enc.encode(x, axes), axes)
  absmax = jnp.repeat(jnp.abs(x).reshape(32, 2, 64).max(-1), 64, axis=1)
  half_step = (1 + encodings.MULAW_MU) ** (1 / 254) - 1  # 2.2 %
  bound = half_step * (jnp.abs(x) + absmax / encodings.MULAW_MU) + 1e-6 * absmax
  assert bool(jnp.all(jnp.abs(back - x) <= bound))
  linear = encodings.get_encoding("int8", block_size=64)
  small = jnp.abs(x) < absmax / 254
  assert bool(jnp.any(small)) and bool(jnp.all(
      jnp.where(small, linear.decode(linear.encode(x, axes), axes) == 0, True)))
  kept = small & (jnp.abs(x) >= 1e-4 * absmax)   # mu-law keeps them down to ~absmax/11600
  assert bool(jnp.any(kept)) and bool(jnp.all(jnp.where(kept, back != 0, True)))
  assert bool(jnp.all((jnp.sign(back) == jnp.sign(x)) | (back == 0)))
  with pytest.raises(ValueError, match="Unknown int8_code 'log'"):
    encodings.get_encoding("int8", int8_code="log")


@pytest.mark.parametrize("code, low, high", [("linear", 0.0, 0.2), ("mulaw", 0.95, 1.05)])
def test_ordinary_entries_beside_an_outlier_column_keep_their_momentum(code, low, high):
  # A 1000x outlier column in every block: with linear codes the ordinary
  # entries' momentum rounds to 0 (0.10x Adam's update), with mu-law it stays.
  import skewadam_jax as sa  # pylint: disable=import-outside-toplevel
  rows, cols = 16, 256
  key = jax.random.PRNGKey(0)
  base = 1.0 + 0.5 * jax.random.uniform(key, (rows, cols))
  grads = [(base * jnp.where(jnp.arange(cols) == 7, 1000.0, 1.0))
           * (1.0 + 0.1 * jax.random.normal(jax.random.fold_in(key, t), (rows, cols)))
           for t in range(30)]

  def run(tier):
    tx = sa.scale_by_skewadam(param_labels="expert", expert=tier)
    state = tx.init(grads[0])
    for g in grads:
      u, state = tx.update(g, state)
    return u

  want = run(sa.TierConfig("fp32", "factored"))
  got = run(sa.TierConfig("int8", "factored", int8_block_size=256, int8_code=code))
  ordinary = jnp.arange(cols) != 7
  ratio = float(jnp.median((got / want)[:, ordinary]))
  print(f"int8 {code}: ordinary entries' update x fp32 momentum's: {ratio:.2f}")  # pytest -s
  assert low <= ratio <= high, ratio


def test_lowrank_momentum_is_exact_for_a_low_rank_matrix_and_finds_the_top_subspace():
  enc = sa.get_encoding("lowrank", rank=3)
  axes = sa.MatrixAxes(1, 2)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  u = jax.random.normal(keys[0], (2, 12, 3))
  v = jax.random.normal(keys[1], (2, 3, 20))
  m = u @ v  # rank 3 in each of two matrices
  parts = enc.encode(m, axes)
  assert parts["mu_row"].shape == (2, 12, 3) and parts["mu_col"].shape == (2, 3, 20)
  np.testing.assert_allclose(enc.decode(parts, axes), m, rtol=1e-4, atol=1e-4)
  # A full-rank matrix: refined step after step, P·Qᵀ tends to its best rank-3
  # approximation (the truncated SVD), as a subspace iteration does.
  full = jax.random.normal(keys[2], (12, 20)) * jnp.linspace(3.0, 0.1, 20)
  parts = enc.encode(full, sa.MatrixAxes(0, 1))
  for _ in range(30):
    parts = enc.encode(full, sa.MatrixAxes(0, 1), previous=parts)
  s_u, s, s_vt = np.linalg.svd(np.asarray(full), full_matrices=False)
  best = (s_u[:, :3] * s[:3]) @ s_vt[:3]
  np.testing.assert_allclose(enc.decode(parts, sa.MatrixAxes(0, 1)), best, rtol=1e-3, atol=1e-3)
  # Columns first ([C, R] with rows on axis 1) is the same matrix transposed.
  t = enc.decode(enc.encode(m.transpose(0, 2, 1), sa.MatrixAxes(2, 1)), sa.MatrixAxes(2, 1))
  np.testing.assert_allclose(t, m.transpose(0, 2, 1), rtol=1e-4, atol=1e-4)
  assert enc.bytes_per_param((1024, 1400)) == pytest.approx(4 * 3 * (1024 + 1400) / (1024 * 1400))
  # Several row or column axes: the matrix of the flattened sides, reshaped by hand.
  heads = jax.random.normal(keys[2], (5, 2, 12, 3, 4))  # [L, H?, D, H, K], batch axes 0 and 1
  flat = heads.reshape(5, 2, 12, 12)
  split = sa.MatrixAxes(2, (3, 4))
  parts = enc.encode(heads, split)
  assert parts["mu_row"].shape == (5, 2, 12, 1, 3) and parts["mu_col"].shape == (5, 2, 3, 3, 4)
  for _ in range(3):
    parts = enc.encode(heads, split, previous=parts)
  by_hand = enc.encode(flat, sa.MatrixAxes(2, 3))
  for _ in range(3):
    by_hand = enc.encode(flat, sa.MatrixAxes(2, 3), previous=by_hand)
  np.testing.assert_allclose(enc.decode(parts, split).reshape(5, 2, 12, 12),
                             enc.decode(by_hand, sa.MatrixAxes(2, 3)), rtol=1e-5, atol=1e-5)
  with pytest.raises(ValueError, match="rank must be a positive int"):
    sa.TierConfig("lowrank", "factored", lowrank_rank=0)


def test_lowrank_bf16_factors_halve_the_bytes_and_keep_the_product():
  axes = sa.MatrixAxes(1, 2)
  wide = encodings.get_encoding("lowrank", rank=3)
  half = encodings.get_encoding("lowrank", rank=3, lowrank_dtype="bfloat16")
  # By hand: r·(R + C) values a matrix, 2 bytes each.
  assert half.bytes_per_param((1024, 1400)) == pytest.approx(2 * 3 * (1024 + 1400) / (1024 * 1400))
  assert half.bytes_per_param((1024, 1400)) == pytest.approx(wide.bytes_per_param((1024, 1400)) / 2)
  m = jax.random.normal(jax.random.PRNGKey(3), (2, 12, 20))
  got, want = half.encode(m, axes), wide.encode(m, axes)
  assert {k: v.dtype for k, v in got.items()} == {"mu_row": jnp.bfloat16, "mu_col": jnp.bfloat16}
  # The same subspace iteration, each factor rounded once: the product within a
  # few bf16 steps of the float32 factors' (|P| <= 1, so the error is relative to m).
  np.testing.assert_allclose(half.decode(got, axes), wide.decode(want, axes),
                             atol=4 * 2.0**-8 * float(jnp.max(jnp.abs(m))))
  got = half.encode(m, axes, previous=got)  # refined from stored bf16 factors
  assert got["mu_col"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match="lowrank_dtype must be one of"):
    sa.TierConfig("lowrank", "factored", lowrank_dtype="float16")
  assert sa.TierConfig("lowrank", lowrank_dtype=jnp.bfloat16).lowrank_dtype == "bfloat16"
  # The tier's encoding is the one get_encoding builds from its fields (the default
  # momentum_rounding, stochastic, reaches the bf16 factors; float32 ones ignore it).
  tier = sa.TierConfig("lowrank", lowrank_rank=3, lowrank_dtype="bfloat16")
  assert tier.momentum_encoding() == encodings.get_encoding(
      "lowrank", rank=3, lowrank_dtype="bfloat16", rounding="stochastic")
  assert tier.momentum_encoding().stochastic
  assert not sa.TierConfig("lowrank").momentum_encoding().stochastic
  assert sa.TierConfig("none").momentum_encoding() is None


@pytest.mark.parametrize("dtype, nearest_below", [("bfloat16", 0.9), ("int8", None)])
def test_lowrank_factors_rounded_stochastically_carry_an_unbiased_ema(dtype, nearest_below):
  # The EMA m ← b1·m̃ + (1 − b1)·g of a constant rank-2 gradient, carried in
  # rank-2 bf16 or int8 factors, must reach g. Rounded stochastically, it
  # follows g to the noise of the rounding (the ratio wanders by about 0.3 %
  # over the steps in bf16). Rounded to nearest, bf16 drops every increment below
  # half a step of the factors and the EMA stalls short of g (at 0.79 of it
  # here); int8's step is a float32 fraction of each row's absmax, whose entry
  # is coded exactly, so a row that only grows in size does not stall (0.997).
  axes = sa.MatrixAxes(0, 1)
  keys = jax.random.split(jax.random.PRNGKey(5), 2)
  g = jax.random.normal(keys[0], (16, 2)) @ jax.random.normal(keys[1], (2, 24))
  b1 = 0.99

  def carried(rounding):
    enc = encodings.get_encoding("lowrank", rank=2, lowrank_dtype=dtype, rounding=rounding)

    def step(count, parts):
      m = b1 * enc.decode(parts, axes) + (1 - b1) * g
      return enc.encode(m, axes, salt=count, previous=parts)

    parts = jax.jit(lambda: jax.lax.fori_loop(0, 1500, step, enc.encode(jnp.zeros_like(g), axes)))()
    m = enc.decode(parts, axes)
    return m, float(jnp.sum(m * g) / jnp.sum(g * g))  # (1 − 0.99^1500) = 1 − 3e-7: g's is 1

  m, ratio = carried("stochastic")
  assert abs(ratio - 1.0) < 0.02, ratio
  np.testing.assert_allclose(m, g, atol=0.2 * float(jnp.std(g)))
  if nearest_below is not None:
    assert carried("nearest")[1] < nearest_below


def test_lowrank_int8_factors_quarter_the_bytes_and_keep_the_product():
  axes = sa.MatrixAxes(1, 2)
  wide = encodings.get_encoding("lowrank", rank=3)
  int8 = encodings.get_encoding("lowrank", rank=3, lowrank_dtype="int8", rounding="stochastic")
  assert int8.stochastic and sa.TierConfig("lowrank", lowrank_rank=3, lowrank_dtype="int8").momentum_encoding() == int8
  # By hand: r·(R + C) one-byte codes and a float32 step per row of Qᵀ, a matrix.
  assert int8.bytes_per_param((1024, 1400)) == pytest.approx(
      (3 * (1024 + 1400) + 4 * 3) / (1024 * 1400))
  m = jax.random.normal(jax.random.PRNGKey(3), (2, 12, 20))
  got, want = int8.encode(m, axes, salt=1), wide.encode(m, axes)
  assert {k: (v.dtype, v.shape) for k, v in got.items()} == {
      "mu_row": (jnp.int8, (2, 12, 3)), "mu_col": (jnp.int8, (2, 3, 20)),
      "mu_scale": (jnp.float32, (2, 3, 1))}
  # By hand from the float32 factors: P's columns coded against their absmax a,
  # a moved into Qᵀ, Qᵀ's rows coded against theirs; each code within one step.
  p, q_t = want["mu_row"], want["mu_col"]
  a = jnp.max(jnp.abs(p), axis=1, keepdims=True) / 127
  assert bool(jnp.all(jnp.abs(got["mu_row"] * a - p) < a))
  scaled = q_t * jnp.swapaxes(a, 1, 2)
  np.testing.assert_allclose(got["mu_scale"], jnp.max(jnp.abs(scaled), axis=2, keepdims=True) / 127,
                             rtol=1e-6)
  assert bool(jnp.all(jnp.abs(got["mu_col"] * got["mu_scale"] - scaled) < got["mu_scale"]))
  product = np.asarray(wide.decode(want, axes))
  draws = [np.asarray(int8.decode(int8.encode(m, axes, salt=s), axes)) for s in range(1, 65)]
  error = np.linalg.norm(draws[0] - product) / np.linalg.norm(product)
  assert 0 < error < 0.03, error
  # unbiased: the mean over salts is nearer the float32 factors' product than one draw
  mean_error = np.linalg.norm(np.mean(draws, axis=0) - product) / np.linalg.norm(product)
  assert mean_error < error / 4, (mean_error, error)
  # Refined from the stored codes: the subspace iteration goes on as from float32 factors.
  full = jax.random.normal(jax.random.PRNGKey(4), (12, 20)) * jnp.linspace(3.0, 0.1, 20)
  parts = int8.encode(full, sa.MatrixAxes(0, 1), salt=0)
  for salt in range(1, 31):
    parts = int8.encode(full, sa.MatrixAxes(0, 1), salt=salt, previous=parts)
  s_u, s, s_vt = np.linalg.svd(np.asarray(full), full_matrices=False)
  best = (s_u[:, :3] * s[:3]) @ s_vt[:3]
  back = int8.decode(parts, sa.MatrixAxes(0, 1))
  assert float(np.linalg.norm(back - best) / np.linalg.norm(best)) < 0.03
  # project: the orthogonal projection on the codes' subspace, which holds the momentum
  x = jax.random.normal(jax.random.PRNGKey(5), (12, 20))
  once = int8.project(parts, x, sa.MatrixAxes(0, 1))
  np.testing.assert_allclose(int8.project(parts, once, sa.MatrixAxes(0, 1)), once, atol=1e-5)
  np.testing.assert_allclose(int8.project(parts, back, sa.MatrixAxes(0, 1)), back, atol=1e-4)
  np.testing.assert_allclose(np.sum(np.asarray(x - once) * np.asarray(once)), 0.0, atol=1e-4)
  # Several row or column axes store the flattened matrix's codes, drawn alike.
  heads = jax.random.normal(jax.random.PRNGKey(6), (5, 2, 12, 3, 4))
  split = sa.MatrixAxes(2, (3, 4))
  parts = int8.encode(heads, split, salt=7)
  assert parts["mu_scale"].shape == (5, 2, 3, 1, 1)
  by_hand = int8.encode(heads.reshape(5, 2, 12, 12), sa.MatrixAxes(2, 3), salt=7)
  np.testing.assert_allclose(int8.decode(parts, split).reshape(5, 2, 12, 12),
                             int8.decode(by_hand, sa.MatrixAxes(2, 3)), rtol=1e-5, atol=1e-5)


def test_lowrank_expert_momentum_steps_in_both_directions():
  params = {"layers": {"moe": {"experts": {"w_up": jnp.zeros((2, 4, 16, 24))}}}}
  for direction in ("adam", "orthogonal"):
    tx = sa.scale_by_skewadam(param_labels="expert", expert=sa.TierConfig(
        "lowrank", "factored", lowrank_rank=4, direction=direction))
    state = tx.init(params)
    for step in range(3):
      g = jax.tree.map(lambda p, s=step: jax.random.normal(jax.random.PRNGKey(s), p.shape), params)
      u, state = jax.jit(tx.update)(g, state)
      assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(u))
    assert state.mu_row["layers"]["moe"]["experts"]["w_up"].shape == (2, 4, 16, 4)


def test_lowrank_complement_weights_the_update_outside_the_momentum_subspace():
  # A stack of layers x experts (the layer loop and the expert chunks both run).
  params = {"experts": jnp.zeros((2, 3, 16, 24))}

  def run(complement, direction="orthogonal"):
    tx = sa.scale_by_skewadam(
        param_labels="expert", matrix_axes=sa.MatrixAxes(2, 3, layer=0),
        expert=sa.TierConfig("lowrank", "factored", lowrank_rank=4, direction=direction,
                             lowrank_complement=complement))
    state, updates = tx.init(params), []
    for step in range(3):
      g = {"experts": jax.random.normal(jax.random.PRNGKey(step), (2, 3, 16, 24))}
      u, state = jax.jit(tx.update)(g, state)
      updates.append(np.asarray(u["experts"]))
    return updates, state

  whole, state = run(1.0)
  damped = {complement: run(complement) for complement in (0.25, 0.0)}
  for _, damped_state in damped.values():
    # The weight changes the update only: the momentum is the same.
    for field in ("mu_row", "mu_col"):
      np.testing.assert_allclose(getattr(damped_state, field)["experts"],
                                 getattr(state, field)["experts"], rtol=1e-5, atol=1e-6)
  # By hand on the last step: P = the stored left factor (orthonormal columns).
  p = np.asarray(state.mu_row["experts"])  # [2, 3, 16, 4]
  kept = p @ (np.swapaxes(p, -1, -2) @ whole[-1])
  np.testing.assert_allclose(np.swapaxes(p, -1, -2) @ p, np.broadcast_to(np.eye(4), (2, 3, 4, 4)),
                             atol=1e-5)
  quarter, nothing_outside = damped[0.25][0], damped[0.0][0]
  np.testing.assert_allclose(quarter[-1], kept + 0.25 * (whole[-1] - kept), rtol=1e-4, atol=1e-5)
  assert max(np.linalg.matrix_rank(x, tol=1e-4) for x in nothing_outside[-1].reshape(6, 16, 24)) == 4
  # Adam's direction has no orthogonalised update to weigh: the setting is not read.
  np.testing.assert_array_equal(run(0.25, "adam")[0][-1], run(1.0, "adam")[0][-1])
  for bad in (1.5, -0.1, True, "half"):
    with pytest.raises(ValueError, match="lowrank_complement must be in"):
      sa.TierConfig("lowrank", "factored", lowrank_complement=bad)


def test_lowrank_factors_orthogonalise_the_momentum_subspace_of_the_nesterov_mix():
  # Layers x experts (layer loop and expert chunks), rows 16 and columns 24 at rank 4.
  params = {"experts": jnp.zeros((2, 3, 16, 24))}
  b1 = 0.9

  def run(orthogonalise):
    tx = sa.scale_by_skewadam(
        b1=b1, param_labels="expert", matrix_axes=sa.MatrixAxes(2, 3, layer=0),
        expert=sa.TierConfig("lowrank", "factored", lowrank_rank=4, direction="orthogonal",
                             lowrank_orthogonalise=orthogonalise))
    state, steps = tx.init(params), []
    for step in range(3):
      g = {"experts": jax.random.normal(jax.random.PRNGKey(step), (2, 3, 16, 24))}
      before = state
      u, state = jax.jit(tx.update)(g, state)
      steps.append((np.asarray(g["experts"]), before, np.asarray(u["experts"]), state))
    return steps

  full, factors, rms = run("full"), run("factors"), run("factors_rms")
  # factors_rms: the same rank-4 update at the whole matrix's norm (16 singular
  # values of about 1 against 4): sqrt(16 / 4) times the factors' update.
  np.testing.assert_allclose(rms[-1][2], 2.0 * factors[-1][2], rtol=1e-5, atol=1e-7)
  norm = lambda u: np.linalg.norm(u.reshape(6, -1), axis=-1)  # noqa: E731
  np.testing.assert_allclose(norm(rms[-1][2]), norm(full[-1][2]), rtol=0.2)
  # The momentum is stored alike: only the update's input differs.
  for (_, _, _, a), (_, _, _, b) in zip(full, factors):
    np.testing.assert_allclose(a.mu_row["experts"] @ a.mu_col["experts"],
                               b.mu_row["experts"] @ b.mu_col["experts"], rtol=1e-4, atol=1e-6)
  # By hand on the last step: m = (1 − b1)·g + b1·P₋Q₋ᵀ, n = b1·m + (1 − b1)·g, and the
  # update is Newton–Schulz of P·Pᵀ·n (the whole 16 x 24 matrix) at Adam's RMS.
  g, before, update, after = factors[-1]
  m = (1 - b1) * g + b1 * (np.asarray(before.mu_row["experts"]) @ np.asarray(before.mu_col["experts"]))
  n = b1 * m + (1 - b1) * g
  p = np.asarray(after.mu_row["experts"])
  projected = p @ (np.swapaxes(p, -1, -2) @ n)
  expected = np.asarray(sa.newton_schulz(jnp.asarray(projected))) * 0.2 * np.sqrt(24)
  np.testing.assert_allclose(update, expected, rtol=1e-3, atol=2e-5)
  # A rank-4 update whose singular values are Newton–Schulz's band, and not the full update.
  singular = np.linalg.svd(update.reshape(6, 16, 24) / (0.2 * np.sqrt(24)), compute_uv=False)
  assert np.all(singular[:, 4:] < 1e-4) and np.all((singular[:, :4] > 0.6) & (singular[:, :4] < 1.3))
  assert np.max(np.abs(update - full[-1][2])) > 0.1 * np.max(np.abs(update))
  # int8 factors run the same way (their codes re-orthonormalised first).
  tx = sa.scale_by_skewadam(
      param_labels="expert", matrix_axes=sa.MatrixAxes(2, 3, layer=0),
      expert=sa.TierConfig("lowrank", "factored", lowrank_rank=4, lowrank_dtype="int8",
                           direction="orthogonal", lowrank_orthogonalise="factors"))
  u, _ = jax.jit(tx.update)({"experts": jnp.asarray(g)}, tx.init(params))
  assert max(np.linalg.matrix_rank(x, tol=1e-4) for x in np.asarray(u["experts"]).reshape(6, 16, 24)) == 4


def test_lowrank_orthogonalise_refuses_what_it_cannot_read():
  with pytest.raises(ValueError, match="Unknown lowrank_orthogonalise 'half'"):
    sa.TierConfig("lowrank", "factored", lowrank_orthogonalise="half")
  for form in ("factors", "factors_rms"):
    with pytest.raises(ValueError, match=f"'{form}' orthogonalises.*momentum='sign' has none"):
      sa.TierConfig("sign", "factored", lowrank_orthogonalise=form)
  with pytest.raises(ValueError, match="leave lowrank_complement at 1"):
    sa.TierConfig("lowrank", "factored", lowrank_orthogonalise="factors", lowrank_complement=0.5)
