"""Declared matrix axes: stacked vectors are vectors, matrices on any two axes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

import skewadam_jax as sa
from skewadam_jax import axes as axes_lib
from tests._steps import run

L, D = 3, 5
# A scanned model's tree: a stacked norm scale [L, D] and a stacked matrix [L, D, 4].
PARAMS = {"layers": {"norm": {"scale": jnp.ones((L, D))},
                     "attn": {"wq": jnp.ones((L, D, 4)) * 0.5}},
          "embed": jnp.ones((6, D))}
DECLARED = {"layers": {"norm": {"scale": None}, "attn": {"wq": sa.MatrixAxes(1, 2)}},
            "embed": sa.MatrixAxes(0, 1)}


def scaled_grads(seed, steps):
  """Gradients whose scale differs 100x between layers, so mixing layers shows."""
  layer_scale = jnp.array([1.0, 0.01, 0.1])[:, None]
  out = []
  for k in jax.random.split(jax.random.PRNGKey(seed), steps):
    g = jax.tree.map(lambda p: jax.random.normal(k, p.shape), PARAMS)
    g["layers"]["norm"]["scale"] = g["layers"]["norm"]["scale"] * layer_scale
    out.append(g)
  return out


def test_stacked_vector_has_exact_second_moment_and_no_decay():
  tx = sa.skewadam(1e-2, weight_decay=0.5, matrix_axes=DECLARED)
  state = tx.init(PARAMS)[0]
  assert state.nu["layers"]["norm"]["scale"].shape == (L, D)          # exact [L, D]
  assert state.nu_row["layers"]["norm"]["scale"].shape == (1,)
  assert state.mu["layers"]["norm"]["scale"].shape == (L, D)
  # Zero gradients: only weight decay moves anything, and only the matrices.
  zeros = jax.tree.map(jnp.zeros_like, PARAMS)
  updates, _ = tx.update(zeros, tx.init(PARAMS), PARAMS)
  assert float(jnp.abs(updates["layers"]["norm"]["scale"]).max()) == 0.0
  assert float(jnp.abs(updates["layers"]["attn"]["wq"]).min()) > 0.0
  assert float(jnp.abs(updates["embed"]).min()) > 0.0
  assert sa.matrices_only(PARAMS, DECLARED) == {
      "layers": {"norm": {"scale": False}, "attn": {"wq": True}}, "embed": True}


@pytest.mark.parametrize("momentum", ["fp32", "sign", "int8"])
def test_stacked_vector_updates_equal_adam_on_each_layer_alone(momentum):
  # Every tier at its most compact, yet a declared vector is plain Adam per layer.
  cfg = sa.TierConfig(momentum=momentum, second_moment="factored")
  tx = sa.scale_by_skewadam(matrix_axes=DECLARED, backbone=cfg, expert=cfg, router=cfg)
  grads = scaled_grads(0, 6)
  state = tx.init(PARAMS)
  adam = [optax.scale_by_adam() for _ in range(L)]
  adam_states = [a.init(jnp.ones(D)) for a in adam]
  for g in grads:
    u, state = tx.update(g, state)
    for layer in range(L):
      ref, adam_states[layer] = adam[layer].update(
          g["layers"]["norm"]["scale"][layer], adam_states[layer])
      np.testing.assert_allclose(u["layers"]["norm"]["scale"][layer], ref, rtol=1e-5, atol=1e-7)


def test_default_axes_factor_a_stacked_vector_across_layers():
  # The reason to declare: undeclared, [L, D] is a matrix and layers mix (a name
  # that says nothing: "gamma"; a "scale" or "bias" is guessed a vector, below).
  # Layer 1's gradient is 100x smaller than the others on most dimensions;
  # factored across layers, its updates come out up to 100x off Adam's.
  g = jnp.array([[100.0, 1, 1, 1, 1], [0.01, 0.01, 0.01, 0.01, 1], [1, 1, 1, 1, 1]])
  params = {"layers": {"norm": {"gamma": jnp.ones((L, D))},
                       "attn": {"wq": jnp.ones((L, D, 4))}}, "embed": jnp.ones((6, D))}
  grads = {"layers": {"norm": {"gamma": g}, "attn": {"wq": jnp.ones((L, D, 4))}},
           "embed": jnp.ones((6, D))}
  declared = {"layers": {"norm": {"gamma": None}, "attn": {"wq": sa.MatrixAxes(1, 2)}},
              "embed": sa.MatrixAxes(0, 1)}
  ratios = {}
  for name, spec in (("default", None), ("declared", declared)):
    tx = sa.scale_by_skewadam(matrix_axes=spec)
    u, _ = tx.update(grads, tx.init(params))
    ref, _ = optax.scale_by_adam().update(g, optax.scale_by_adam().init(g))
    ratio = jnp.abs(ref / u["layers"]["norm"]["gamma"])
    ratios[name] = float(jnp.maximum(ratio, 1 / ratio).max())
  assert ratios["declared"] == pytest.approx(1.0, rel=1e-3)   # bf16 momentum rounding
  assert ratios["default"] > 50.0


def test_the_default_guess_makes_biases_and_scales_vectors_whatever_their_rank():
  # Flax attention biases [H, Dh], expert biases [E, F], stacked norm scales [L, D]:
  # vectors per output, as the named sets declare them (not factored, not decayed);
  # a kernel of the same shape stays a matrix.
  tree = {"attn": {"query": {"bias": jnp.ones((4, 8)), "kernel": jnp.ones((16, 4, 8))}},
          "moe": {"experts": {"wi_bias": jnp.ones((4, 32)), "wi": jnp.ones((4, 16, 32))}},
          "layers": {"norm": {"scale": jnp.ones((L, D))}}, "w": jnp.ones((4, 8))}
  axes = dict(zip(sa.labels.flatten_with_paths(tree)[0], axes_lib.resolve_matrix_axes(None, tree)))
  assert [p for p, a in axes.items() if a is None] == [
      "attn/query/bias", "layers/norm/scale", "moe/experts/wi_bias"]
  assert sa.matrices_only(tree)["attn"]["query"] == {"bias": False, "kernel": True}
  state = sa.scale_by_skewadam(group_leaves=False).init(tree)
  assert state.nu["moe"]["experts"]["wi_bias"].shape == (4, 32)     # exact, not factored
  assert state.nu_row["w"].shape == (4, 1)


def test_matrix_on_middle_axes_factors_per_batch_entry():
  # MaxText's scanned layout: [E, L, d, f] with the layer axis second.
  params = {"wi_0": jnp.zeros((2, 3, 4, 6))}
  cfg = sa.TierConfig(momentum="fp32", second_moment="factored")
  tx = sa.scale_by_skewadam(matrix_axes={"wi_0": sa.MatrixAxes(2, 3)}, backbone=cfg)
  state = tx.init(params)
  assert state.nu_row["wi_0"].shape == (2, 3, 4, 1)
  axes_first = sa.scale_by_skewadam(matrix_axes={"wi_0": (0, 2)}, backbone=cfg).init(params)
  assert axes_first.nu_row["wi_0"].shape == (2, 3, 1, 6)    # rows 0, cols 2 -> cols reduced
  assert axes_first.nu_col["wi_0"].shape == (1, 3, 4, 6)


def test_muon_dimension_numbers_and_callables_are_accepted():
  params = {"w": jnp.zeros((4, 3, 5))}
  dims = {"w": MuonDimensionNumbers(reduction_axis=0, output_axis=2)}
  for spec in (dims, lambda tree: dims):
    assert axes_lib.resolve_matrix_axes(spec, params) == [sa.MatrixAxes(0, 2)]


@pytest.mark.parametrize("spec, message", [
    ({"w": (0, 3)}, r"Matrix axes \(0, 3\) for 'w' are not axes of its shape \(4, 3\)"),
    ({"w": (1, -1)}, r"Matrix axes for 'w' name axis 1 twice"),
    ({"w": "rows"}, r"Matrix axes for 'w' must be a MatrixAxes"),
    ({"v": None}, r"matrix_axes does not match the parameter tree: no entry for \['w'\]"),
])
def test_bad_declarations_raise_naming_the_path(spec, message):
  with pytest.raises(ValueError, match=message):
    sa.scale_by_skewadam(matrix_axes=spec).init({"w": jnp.zeros((4, 3))})


def test_maxtext_tree_puts_its_expert_banks_in_the_expert_tier():
  tree = {"MoeBlock_0": {"gate": {"kernel": jnp.zeros((8, 4))},
                         "wi_0": jnp.zeros((4, 8, 16)), "wi_1": jnp.zeros((4, 8, 16)),
                         "wo": jnp.zeros((4, 16, 8))},
          "query": {"kernel": jnp.zeros((8, 8))}}
  plans = sa.leaf_plans(tree, param_labels=sa.label_fn("maxtext"))
  paths = ["/".join(str(k.key) for k in p) for p, _ in
           jax.tree_util.tree_flatten_with_path(tree)[0]]
  tiers = dict(zip(paths, (p.tier for p in plans)))
  assert tiers == {"MoeBlock_0/gate/kernel": "router", "MoeBlock_0/wi_0": "expert",
                   "MoeBlock_0/wi_1": "expert", "MoeBlock_0/wo": "expert",
                   "query/kernel": "backbone"}
  state = sa.scale_by_skewadam(param_labels=sa.label_fn("maxtext")).init(tree)
  assert state.mu["MoeBlock_0"]["wi_0"].dtype == jnp.uint8     # sign bits
  with pytest.warns(UserWarning, match="found no expert and no router leaf"):
    sa.scale_by_skewadam().init(tree)


# Several axes a side (issue 26, item 14): an attention kernel [QD, QH, QK] as the
# QD x (QH·QK) matrix Muon's dimension numbers describe; every result must be the
# 2-QD matrix's, reshaped back.
QD, QH, QK = 6, 2, 4


def test_several_axes_a_side_are_declared_as_muon_declares_them():
  params = {"q": jnp.zeros((QD, 3, QH, QK))}
  dims = {"q": MuonDimensionNumbers(reduction_axis=0, output_axis=(2, 3))}
  assert axes_lib.resolve_matrix_axes(dims, params) == [sa.MatrixAxes(0, (2, 3))]
  assert axes_lib.resolve_matrix_axes({"q": (0, (-2, -1))}, params) == [sa.MatrixAxes(0, (2, 3))]
  with pytest.raises(ValueError, match="name axis 2 twice"):
    axes_lib.resolve_matrix_axes({"q": ((0, 2), (2, 3))}, params)
  with pytest.raises(ValueError, match="are not axes of its shape"):
    axes_lib.resolve_matrix_axes({"q": (0, (2, 4))}, params)


@pytest.mark.parametrize("tier", [sa.TierConfig("fp32", "factored"),
                                  # nearest: stochastic rounding draws by position,
                                  # which the two layouts do not share
                                  sa.TierConfig("bf16", "factored", momentum_rounding="nearest"),
                                  sa.TierConfig("sign", "factored"),
                                  sa.TierConfig("fp32", "factored", direction="orthogonal"),
                                  sa.TierConfig("sign", "factored", direction="orthogonal")],
                         ids=["fp32", "bf16", "sign", "orthogonal", "orthogonal-sign"])
def test_a_multi_axis_matrix_steps_as_its_flattened_matrix(tier):
  # [QD, L, QH, QK] with the layer axis 1 a batch axis, against L separate
  # [QD, QH·QK] matrices stacked on a leading batch axis.
  layers = 3
  kernel = {"q": jnp.zeros((QD, layers, QH, QK))}
  flat = {"q": jnp.zeros((layers, QD, QH * QK))}
  to_flat = lambda x: jnp.moveaxis(x, 1, 0).reshape(layers, QD, QH * QK)  # noqa: E731
  kw = dict(param_labels="backbone", backbone=tier)
  tx = sa.scale_by_skewadam(matrix_axes={"q": sa.MatrixAxes(0, (2, 3))}, **kw)
  ref = sa.scale_by_skewadam(matrix_axes={"q": sa.MatrixAxes(1, 2)}, **kw)
  state, ref_state = tx.init(kernel), ref.init(flat)
  for step in range(3):
    g = jax.random.normal(jax.random.PRNGKey(step), (QD, layers, QH, QK))
    u, state = tx.update({"q": g}, state)
    want, ref_state = ref.update({"q": to_flat(g)}, ref_state)
    np.testing.assert_allclose(to_flat(u["q"]), want["q"], rtol=2e-5, atol=1e-6)
  if not tier.direction == "orthogonal":
    assert state.nu_row["q"].shape == (QD, layers, 1, 1)   # shaped like the parameter
    assert state.nu_col["q"].shape == (1, layers, QH, QK)
  plans = sa.leaf_plans(kernel, matrix_axes={"q": sa.MatrixAxes(0, (2, 3))}, **kw)
  assert plans[0].axes == sa.MatrixAxes(0, (2, 3))


def test_int8_blocks_run_along_the_last_column_axis_of_a_multi_axis_matrix():
  tier = sa.TierConfig("int8", "factored", int8_block_size=2)
  tx = sa.scale_by_skewadam(param_labels="backbone", backbone=tier,
                            matrix_axes={"q": sa.MatrixAxes(0, (1, 2))})
  state = tx.init({"q": jnp.zeros((QD, QH, QK))})
  assert state.mu_scale["q"].shape == (QD, QH, QK // 2)
  g = jax.random.normal(jax.random.PRNGKey(0), (QD, QH, QK))
  u, state = tx.update({"q": g}, state)
  assert bool(jnp.all(jnp.isfinite(u["q"])))
