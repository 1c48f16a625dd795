"""The orthogonalised direction: Newton–Schulz against the SVD, and SkewAdam's orthogonal tiers
against a hand-written Muon-style loop."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sa
from skewadam_jax import encodings
from skewadam_jax import orthogonal


def _polar(m):
  u, _, vt = np.linalg.svd(m, full_matrices=False)
  return u @ vt


@pytest.mark.parametrize("shape", [(6, 6), (4, 9), (9, 4)])
def test_newton_schulz_has_the_polar_factors_singular_vectors(shape):
  x = np.asarray(jax.random.normal(jax.random.key(0), shape))
  q = np.asarray(sa.newton_schulz(jnp.asarray(x)))
  u, _, vt = np.linalg.svd(x, full_matrices=False)
  # In the SVD basis of x, q is diagonal: same singular vectors...
  inner = u.T @ q @ vt.T
  off = inner - np.diag(np.diag(inner))
  assert np.abs(off).max() < 1e-4
  # ...with singular values pushed into the quintic iteration's band around one.
  assert 0.6 < np.diag(inner).min() and np.diag(inner).max() < 1.25
  assert np.abs(q - _polar(x)).max() < 0.4


def test_newton_schulz_batches_over_every_other_axis():
  x = jax.random.normal(jax.random.key(1), (3, 5, 2, 7))  # matrices over axes 1 and 3
  q = sa.newton_schulz(x, sa.MatrixAxes(1, 3))
  for i in range(3):
    for j in range(2):
      np.testing.assert_allclose(q[i, :, j, :], sa.newton_schulz(x[i, :, j, :]), atol=1e-5)
  # Negative axes name the same matrix; the transposed declaration transposes the result.
  np.testing.assert_allclose(sa.newton_schulz(x, sa.MatrixAxes(-3, -1)), q, atol=0)
  np.testing.assert_allclose(sa.newton_schulz(x, sa.MatrixAxes(3, 1)), q, atol=1e-5)


def test_newton_schulz_of_zero_is_zero_and_scale_free():
  assert not np.any(np.asarray(sa.newton_schulz(jnp.zeros((3, 4)))))
  x = jax.random.normal(jax.random.key(2), (4, 6))
  np.testing.assert_allclose(sa.newton_schulz(1e3 * x), sa.newton_schulz(x), atol=1e-4)


def test_adam_rms_scale_gives_the_target_rms():
  x = jax.random.normal(jax.random.key(3), (2, 16, 48))
  axes = sa.MatrixAxes(1, 2)
  u = np.asarray(_polar(np.asarray(x[0])))  # exactly orthogonal
  scaled = u * orthogonal.adam_rms_scale(x.shape, axes)
  assert np.sqrt(np.mean(scaled ** 2)) == pytest.approx(orthogonal.ADAM_RMS, rel=1e-5)


def _params():
  keys = jax.random.split(jax.random.key(4), 4)
  return {"embed": jax.random.normal(keys[0], (10, 6)),
          "norm": jax.random.normal(keys[1], (6,)),
          "moe": {"router": jax.random.normal(keys[2], (6, 3)),
                  # a layer stack of banks [L, E, d, f]: the step maps over L
                  "experts": jax.random.normal(keys[3], (2, 3, 6, 8))}}


def _grads(step):
  return jax.tree.map(lambda p: jax.random.normal(jax.random.key(100 + step), p.shape),
                      _params())


@pytest.mark.parametrize("expert_momentum", ["fp32", "sign", "none"])
def test_orthogonal_tiers_follow_the_hand_written_loop(expert_momentum):
  b1 = 0.9
  tx = sa.scale_by_skewadam(
      b1=b1, backbone={"momentum": "fp32", "second_moment": "exact", "direction": "orthogonal"},
      expert={"momentum": expert_momentum, "direction": "orthogonal"},
      orthogonal_mask={"embed": False, "norm": True, "moe": True})
  adam = optax.scale_by_adam(b1=b1)  # for the leaves that keep Adam's direction
  params = _params()
  state, adam_state = tx.init(params), adam.init(params)
  update = jax.jit(tx.update)
  encoding = encodings.get_encoding(expert_momentum)
  axes = sa.MatrixAxes(2, 3)
  m = jnp.zeros((2, 3, 6, 8))
  for step in range(3):
    g = _grads(step)
    u, state = update(g, state)
    want_adam, adam_state = adam.update(g, adam_state)
    # embed (masked out), norm (a vector), router (an Adam tier): Adam's direction.
    for path in (("embed",), ("norm",), ("moe", "router")):
      got, want = u, want_adam
      for key in path:
        got, want = got[key], want[key]
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # The experts: Muon's direction of the momentum as the encoding stores it.
    ge = g["moe"]["experts"]
    if encoding is None:
      nesterov = ge
    else:
      m = b1 * m + (1 - b1) * ge
      nesterov = b1 * m + (1 - b1) * ge
    want = sa.newton_schulz(nesterov, axes) * 0.2 * np.sqrt(8)
    np.testing.assert_allclose(u["moe"]["experts"], want, rtol=2e-4, atol=2e-5)
    if encoding is not None:
      m = encoding.decode(encoding.encode(m, axes), axes)  # what the next step reads
  # Orthogonalised matrices store no second moment; the others keep theirs.
  assert sa.transform.is_placeholder(state.nu["moe"]["experts"])
  assert sa.transform.is_placeholder(state.nu_row["moe"]["experts"])
  assert state.nu["embed"].shape == (10, 6) and state.nu["norm"].shape == (6,)


def test_width_scaling_is_muons_aspect_ratio_rule():
  # Muon's width scaling, by hand: sqrt(max(1, fan_out / fan_in)), fan_in the rows.
  assert orthogonal.width_scale((6, 8), sa.MatrixAxes(0, 1)) == pytest.approx(np.sqrt(8 / 6))
  assert orthogonal.width_scale((8, 6), sa.MatrixAxes(0, 1)) == 1.0
  assert orthogonal.width_scale((2, 3, 4), sa.MatrixAxes(0, (1, 2))) == pytest.approx(np.sqrt(6))
  b1 = 0.9
  tier = {"momentum": "fp32", "direction": "orthogonal", "orthogonal_scale": "width"}
  tx = sa.scale_by_skewadam(b1=b1, expert=tier, orthogonal_mask={"embed": False, "norm": True,
                                                                 "moe": True})
  state, m = tx.init(_params()), jnp.zeros((2, 3, 6, 8))
  for step in range(2):
    g = _grads(step)
    u, state = jax.jit(tx.update)(g, state)
    m = b1 * m + (1 - b1) * g["moe"]["experts"]
    want = sa.newton_schulz(b1 * m + (1 - b1) * g["moe"]["experts"], sa.MatrixAxes(2, 3))
    np.testing.assert_allclose(u["moe"]["experts"], want * np.sqrt(8 / 6), rtol=2e-4, atol=2e-5)
  table = sa.plan_table(_params(), expert=tier, orthogonal_mask={"embed": False, "norm": True,
                                                                 "moe": True})
  assert "orthogonal, width-scaled" in table
  with pytest.raises(ValueError, match="orthogonal_scale 'muon'"):
    sa.TierConfig(orthogonal_scale="muon")


@pytest.mark.parametrize("shape", [(8, 24), (24, 8)])
def test_the_orthogonal_width_scaled_tier_is_optax_muon_once_bias_correction_fades(shape):
  # optax.contrib.muon is the reference: the same first step, and the same
  # steps once b1^t is negligible (muon bias-corrects the two Nesterov terms by
  # different factors, ours by none; the transient is ~10 % at step 2).
  from optax.contrib import MuonDimensionNumbers, muon  # pylint: disable=import-outside-toplevel
  params = {"w": jnp.zeros(shape)}
  tier = sa.TierConfig(momentum="fp32", direction="orthogonal", orthogonal_scale="width")
  ours = sa.skewadam(0.1, b1=0.9, weight_decay=0.0, max_grad_norm=None, backbone=tier,
                     param_labels={"w": "backbone"}, matrix_axes={"w": sa.MatrixAxes(0, 1)})
  ref = muon(0.1, beta=0.9, weight_decay=0.0,
             muon_weight_dimension_numbers={"w": MuonDimensionNumbers(0, 1)})
  step = jax.jit(lambda tx, g, s: tx.update(g, s, params), static_argnums=0)
  states = [ours.init(params), ref.init(params)]
  for t in range(80):
    g = {"w": jax.random.normal(jax.random.key(t), shape) + 0.5}  # a mean: momentum matters
    (u_ours, states[0]), (u_ref, states[1]) = (
        step(tx, g, s) for tx, s in zip((ours, ref), states))
    if t == 0 or t == 79:
      err = np.abs(np.asarray(u_ours["w"] - u_ref["w"])).max() / np.abs(u_ref["w"]).max()
      assert err < 1e-4, (t, err)
    if t == 1:  # the transient is there, so the test would see another scaling
      assert np.abs(np.asarray(u_ours["w"] - u_ref["w"])).max() > 1e-3 * np.abs(u_ref["w"]).max()


def test_orthogonal_direction_shrinks_the_state_and_plans_say_so():
  params = _params()
  plain = sa.scale_by_skewadam().init(params)
  ortho_tx = sa.scale_by_skewadam(expert={"direction": "orthogonal"})
  ortho = ortho_tx.init(params)
  assert sa.tree_bytes(ortho) < sa.tree_bytes(plain)
  plans = sa.leaf_plans(params, expert={"direction": "orthogonal"})
  assert [p.orthogonal for p in plans] == [False, True, False, False]  # embed, experts, ...


def test_bad_direction_and_mask_are_named():
  with pytest.raises(ValueError, match="direction 'muon'"):
    sa.TierConfig(direction="muon")
  tx = sa.scale_by_skewadam(expert={"direction": "orthogonal"},
                            orthogonal_mask={"embed": True, "norm": True, "moe": True,
                                             "typo": False})
  with pytest.raises(ValueError, match="orthogonal_mask.*typo"):
    tx.init(_params())


def _mapped_lengths(jaxpr) -> list[int]:
  """The lengths of every scan (``lax.map``) in a jaxpr, nested ones included."""
  lengths = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan":
      lengths.append(eqn.params["length"])
    for value in eqn.params.values():
      sub = getattr(value, "jaxpr", value)  # a ClosedJaxpr's jaxpr, or a Jaxpr
      if hasattr(sub, "eqns"):
        lengths += _mapped_lengths(sub)
  return lengths


def test_the_orthogonal_loop_runs_over_the_declared_layer_axis():
  # MaxText's scanned MoE bank [E, L, d, f] (param_scan_axis=1): 3 experts, 5 layers.
  g = {"wi": jax.random.normal(jax.random.PRNGKey(0), (3, 5, 6, 8))}
  orthogonal_tier = {"momentum": "fp32", "direction": "orthogonal"}
  results = {}
  for layer in (None, 1):
    tx = sa.scale_by_skewadam(param_labels="expert", expert=orthogonal_tier,
                              matrix_axes={"wi": sa.MatrixAxes(2, 3, layer=layer)})
    state = tx.init(g)
    results[layer] = tx.update(g, state)[0]["wi"]
    jaxpr = jax.make_jaxpr(tx.update)(g, state).jaxpr
    assert _mapped_lengths(jaxpr) == [3 if layer is None else 5]
  # Each matrix is orthogonalised on its own either way.
  want = sa.newton_schulz((1 - 0.9) * g["wi"] * (1 + 0.9), sa.MatrixAxes(2, 3))
  for got in results.values():
    np.testing.assert_allclose(got, want * 0.2 * np.sqrt(8), rtol=2e-4, atol=2e-5)
  with pytest.raises(ValueError, match=r"layer axis 2 for 'wi' is one of its matrix axes"):
    sa.scale_by_skewadam(matrix_axes={"wi": sa.MatrixAxes(2, 3, layer=2)}).init(g)
  with pytest.raises(ValueError, match=r"layer axis 7 for 'wi' is not an axis"):
    sa.scale_by_skewadam(matrix_axes={"wi": sa.MatrixAxes(2, 3, layer=7)}).init(g)


def test_the_layer_loop_writes_each_update_over_its_gradient_slice():
  # The update stack is the loop's carry (XLA updates it in place), not a new
  # stacked output: a bank-sized output per bank is what took the standard
  # orthogonal step at moe-6.78b from 30 GB to 46 GB.
  g = {"wi": jax.random.normal(jax.random.PRNGKey(0), (5, 3, 6, 8))}
  tx = sa.scale_by_skewadam(param_labels="expert", expert={"direction": "orthogonal"},
                            max_grad_norm=1.0)
  state = tx.init(g)
  [scan] = [e for e in jax.make_jaxpr(tx.update)(g, state).jaxpr.eqns
            if e.primitive.name == "scan"]
  # jax 0.12's scan describes its outputs in ft_out: (carries, stacked outputs), a
  # lone carry as None
  if "num_carry" in scan.params:
    num_carry = scan.params["num_carry"]
  else:
    carries = scan.params["ft_out"][0]
    num_carry = 1 if carries is None else len(carries)
  carried, stacked = scan.outvars[:num_carry], scan.outvars[num_carry:]
  assert [v.aval.shape for v in carried] == [(5, 3, 6, 8)]
  assert all(v.aval.size < g["wi"].size for v in stacked)  # the momentum's compact parts


def test_the_normalized_orthogonal_direction_follows_norMuons_hand_written_step():
  # NorMuon (Li et al., 2025), written out per output neuron with numpy.
  b1, neuron_b2 = 0.9, 0.95
  tier = {"momentum": "fp32", "direction": "normalized_orthogonal", "neuron_b2": neuron_b2}
  tx = sa.scale_by_skewadam(b1=b1, param_labels="expert", expert=tier)
  g0 = jax.random.normal(jax.random.PRNGKey(0), (3, 6, 8))
  state = tx.init(g0)
  assert state.nu_col.shape == (3, 1, 8)  # one value per output column of each matrix
  m, s = np.zeros((3, 6, 8)), np.zeros((3, 1, 8))
  for step in range(4):
    # Column scales that differ a lot between neurons: what the normalisation evens out.
    g = jax.random.normal(jax.random.PRNGKey(step), (3, 6, 8)) * jnp.arange(1.0, 9.0)
    u, state = jax.jit(tx.update)(g, state)
    m = b1 * m + (1 - b1) * np.asarray(g)
    o = np.asarray(sa.newton_schulz(b1 * m + (1 - b1) * np.asarray(g), sa.MatrixAxes(1, 2)),
                   np.float64)
    s = neuron_b2 * s + (1 - neuron_b2) * (o * o).mean(axis=1, keepdims=True)
    scaled = o / (np.sqrt(s) + 1e-10)
    frob = lambda x: np.sqrt((x * x).sum(axis=(1, 2), keepdims=True))  # noqa: E731
    want = scaled * frob(o) / frob(scaled) * 0.2 * np.sqrt(8)
    np.testing.assert_allclose(u, want, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(state.nu_col, s, rtol=1e-5)
  # The normalisation moves the norm between neurons, not the matrix's norm.
  plain = sa.scale_by_skewadam(b1=b1, param_labels="expert",
                               expert={"momentum": "fp32", "direction": "orthogonal"})
  u_plain, _ = plain.update(g0, plain.init(g0))
  u_norm, _ = tx.update(g0, tx.init(g0))
  np.testing.assert_allclose(jnp.linalg.norm(u_norm, axis=(1, 2)),
                             jnp.linalg.norm(u_plain, axis=(1, 2)), rtol=1e-4)
  # Its state is counted: 4 bytes per output column on top of the momentum.
  assert sa.tree_bytes(tx.init(g0)) == sa.tree_bytes(plain.init(g0)) + 3 * 8 * 4 - 1
  rows = sa.plans.plan_rows(g0, param_labels="expert", expert=tier)
  assert (rows[0]["direction"], rows[0]["second moment"]) == (
      "normalized orthogonal", "per-neuron float32")
  with pytest.raises(ValueError, match=r"neuron_b2 must be in \[0, 1\)"):
    sa.TierConfig(direction="normalized_orthogonal", neuron_b2=1.0)


def test_a_chunked_orthogonalisation_equals_the_unchunked_one_on_a_stacked_bank():
  # A layer stack of expert banks [L, E, d, f], every batch axis flattened and looped over.
  x = jax.random.normal(jax.random.key(11), (2, 6, 12, 20))
  axes = sa.MatrixAxes(2, 3)
  whole = np.asarray(sa.newton_schulz(x, axes, chunk="all"))
  for chunk in (1, 4, 5, "auto"):  # 4 and 5 are rounded down to divisors of 12: 4 and 4
    np.testing.assert_allclose(sa.newton_schulz(x, axes, chunk=chunk), whole, atol=2e-6)
  # bf16 iterates (float32 accumulation): chunked or not, the same result...
  half = np.asarray(sa.newton_schulz(x, axes, dtype="bfloat16", chunk=3))
  np.testing.assert_allclose(half, sa.newton_schulz(x, axes, dtype="bfloat16"), atol=2e-6)
  # ...and float32's direction to bf16 round-off compounded over the five
  # iterations (each rounds the iterate once more: about 5 · 2⁻⁸ relative).
  rms = lambda a: np.sqrt(np.mean(a ** 2))  # noqa: E731
  assert rms(half - whole) < 8 * 2.0 ** -8 * rms(whole)
  assert np.abs(half - whole).max() < 16 * 2.0 ** -8 * np.abs(whole).max()


def test_chunk_size_is_the_largest_divisor_within_the_bound():
  assert orthogonal.chunk_size(64, 1024 * 1400) == 8  # 11 fit in 64 MB; 8 divides 64
  assert orthogonal.chunk_size(8, 4096 * 14336) == 1  # one matrix is already over the bound
  assert orthogonal.chunk_size(12, 10, 5) == 4 and orthogonal.chunk_size(7, 10, 3) == 1
  assert orthogonal.chunk_size(6, 10, "all") == 6 and orthogonal.chunk_size(6, 10, 100) == 6
  for bad in (0, -2, 1.5, True, "some"):
    with pytest.raises(ValueError, match="orthogonal chunk must be"):
      orthogonal.chunk_size(6, 10, bad)
    with pytest.raises(ValueError, match="orthogonal chunk must be"):
      sa.TierConfig(direction="orthogonal", orthogonal_chunk=bad)
  with pytest.raises(ValueError, match="orthogonal_dtype must be one of"):
    sa.TierConfig(direction="orthogonal", orthogonal_dtype="float16")
  with pytest.raises(ValueError, match="Newton–Schulz dtype"):
    sa.newton_schulz(jnp.ones((2, 2)), dtype="float64")


def test_map_in_chunks_puts_strided_chunks_back_in_order():
  x = jnp.arange(2 * 6 * 3).reshape(2, 6, 3)
  seen = []

  def fn(chunk):
    seen.append(chunk.shape)
    return chunk * 10
  np.testing.assert_array_equal(orthogonal.map_in_chunks(fn, x, 1, 2), x * 10)
  assert seen == [(2, 2, 3)]  # traced once, as the loop's body
  # Chunk i holds entries i, i + 3, ... : a block-sharded axis stays sharded on them.
  firsts = orthogonal.map_in_chunks(lambda c: jnp.broadcast_to(c[:, :1], c.shape), x, 1, 2)
  np.testing.assert_array_equal(firsts[0, :, 0], [0, 3, 6, 0, 3, 6])
  with pytest.raises(ValueError, match="does not divide"):
    orthogonal.map_in_chunks(fn, x, 1, 4)


@pytest.mark.parametrize("expert_momentum", ["sign", "fp32"])
def test_the_update_steps_a_banks_experts_in_chunks_and_matches_the_whole_bank(expert_momentum):
  g = {"experts": jax.random.normal(jax.random.key(12), (2, 6, 6, 8))}  # [L, E, d, f]
  results = {}
  for chunk in ("all", 2, "auto"):
    tx = sa.scale_by_skewadam(param_labels="expert", expert={
        "momentum": expert_momentum, "direction": "orthogonal", "orthogonal_chunk": chunk})
    state = tx.init(g)
    update = jax.jit(tx.update)
    for step in range(3):
      u, state = update(jax.tree.map(lambda x, s=step: x * (1 + s), g), state)
    results[chunk] = (u, state)
    lengths = _mapped_lengths(jax.make_jaxpr(tx.update)(g, state).jaxpr)
    # The layer loop, then (chunk 2) a loop over 3 chunks of a layer's 6 experts.
    assert sorted(lengths) == ([2, 3] if chunk == 2 else [2])
    assert sa.leaf_plans(g, param_labels="expert", expert={
        "direction": "orthogonal", "orthogonal_chunk": chunk})[0].orthogonal_chunk == chunk
  for chunk in (2, "auto"):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6),
                 results[chunk], results["all"])


def test_owner_axes_are_mesh_axis_names_and_a_missing_one_is_named():
  assert sa.TierConfig(orthogonal_owner_axes="data").orthogonal_owner_axes == ("data",)
  assert sa.TierConfig(orthogonal_owner_axes=["data", "expert"]).orthogonal_owner_axes == (
      "data", "expert")
  for bad in (3, ("data", ""), (None,)):
    with pytest.raises(ValueError, match="orthogonal_owner_axes must be mesh axis names"):
      sa.TierConfig(orthogonal_owner_axes=bad)
  params = {"w": jnp.ones((4, 8, 8))}
  tx = sa.scale_by_skewadam(param_labels="backbone", matrix_axes=sa.MatrixAxes(1, 2),
                            backbone=sa.TierConfig(direction="orthogonal",
                                                   orthogonal_owner_axes="model"))
  state = tx.init(params)
  # Without a context mesh (one device) the setting changes nothing.
  plain = sa.scale_by_skewadam(param_labels="backbone", matrix_axes=sa.MatrixAxes(1, 2),
                               backbone=sa.TierConfig(direction="orthogonal"))
  np.testing.assert_array_equal(tx.update(params, state)[0]["w"],
                                plain.update(params, plain.init(params))[0]["w"])
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
    with pytest.raises(ValueError, match=r"names mesh axes \['model'\] that the context mesh "
                                         r"\(axes \('data',\)\) does not have"):
      tx.update(params, state)
