"""skewadam_jax.state_shardings: specs per encoding, optax states, errors.

Shardings here live on an 8-device ``AbstractMesh``: the rules are about
PartitionSpecs and shapes, so no devices are needed (tests/experiments/test_parallel.py
checks them on 8 simulated devices).
"""

import doctest

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import skewadam_jax
from skewadam_jax import sharding as sharding_lib
from skewadam_jax.transform import is_placeholder

MESH = AbstractMesh((2, 4), ("data", "expert"))
F32 = jnp.float32

# A backbone matrix and vector, a router, and 4-D and 3-D expert banks, with
# the expert axis (−3) on "expert" and some matrix axes on "data".
PARAMS = {
    "embed": jax.ShapeDtypeStruct((16, 8), F32),
    "final_norm": jax.ShapeDtypeStruct((8,), F32),
    "layers": {"moe": {
        "router": {"kernel": jax.ShapeDtypeStruct((2, 8, 4), F32)},
        "experts": {"w_up": jax.ShapeDtypeStruct((2, 4, 8, 16), F32),
                    "w_down": jax.ShapeDtypeStruct((2, 4, 16, 8), F32)}}},
    "bank": {"experts": jax.ShapeDtypeStruct((4, 8, 6), F32)},
}
SPECS = {
    "embed": P("data"),
    "final_norm": P(),
    "layers": {"moe": {
        "router": {"kernel": P()},
        "experts": {"w_up": P(None, "expert", None, "data"),
                    "w_down": P(None, "expert", "data")}}},  # trailing None implied
    "bank": {"experts": P("expert")},
}
SHARDINGS = jax.tree.map(lambda s: NamedSharding(MESH, s), SPECS)


def spec_of(x):
  """The spec as a tuple without trailing Nones (P("a") and P("a", None) agree)."""
  spec = list(x.spec if isinstance(x, NamedSharding) else x)
  while spec and spec[-1] is None:
    spec.pop()
  return tuple(spec)


def assert_valid(state, shardings):
  """Every sharding splits its array evenly (``shard_shape`` raises otherwise)."""
  for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings)):
    assert len(s.spec) <= len(x.shape), (x.shape, s.spec)
    s.shard_shape(x.shape)


def skew_parts(tx, params=PARAMS, shardings=SHARDINGS, **kw):
  out = skewadam_jax.state_shardings(tx, params, shardings, **kw)
  state = jax.eval_shape(tx.init, params)
  assert jax.tree.structure(out) == jax.tree.structure(state)
  assert_valid(state, out)
  return out, state


W_UP, W_DOWN = "layers/moe/experts/w_up", "layers/moe/experts/w_down"


def at(tree, path):
  for part in path.split("/"):
    tree = tree[part]
  return tree


@pytest.mark.parametrize("momentum, second_moment", [
    (m, v) for v in ("factored", "exact") for m in ("fp32", "bf16", "int8", "sign", "none")
    if (m, v) != ("sign", "exact")])  # refused: no bound on the update
def test_expert_tier_specs_follow_the_encoding(momentum, second_moment):
  tx = skewadam_jax.scale_by_skewadam(
      expert=skewadam_jax.TierConfig(momentum, second_moment, int8_block_size=4))
  out, state = skew_parts(tx)
  up, down = (None, "expert", None, "data"), (None, "expert", "data")
  if second_moment == "factored":
    # Statistics keep the parameter's rank; the reduced axis is replicated.
    assert at(state.nu_row, W_UP).shape == (2, 4, 8, 1)
    assert spec_of(at(out.nu_row, W_UP)) == (None, "expert")
    assert spec_of(at(out.nu_col, W_UP)) == (None, "expert", None, "data")
    assert spec_of(at(out.nu_row, W_DOWN)) == (None, "expert", "data")
    assert spec_of(at(out.nu_col, W_DOWN)) == (None, "expert")
    assert spec_of(at(out.nu, W_UP)) == ()   # placeholder
  else:
    assert spec_of(at(out.nu, W_UP)) == up and spec_of(at(out.nu, W_DOWN)) == down
  if momentum in ("fp32", "bf16"):
    assert spec_of(at(out.mu, W_UP)) == up
  elif momentum == "int8":
    assert spec_of(at(out.mu, W_UP)) == up
    # scale [2, 4, 8, 16/4=4]: 4 blocks split evenly over data=2.
    assert at(state.mu_scale, W_UP).shape == (2, 4, 8, 4)
    assert spec_of(at(out.mu_scale, W_UP)) == up
  elif momentum == "sign":
    assert spec_of(at(out.mu_row, W_UP)) == (None, "expert")
    assert spec_of(at(out.mu_col, W_UP)) == (None, "expert", None, "data")
    # Packed 8 to a byte along the columns: 16 -> 2 still splits evenly over
    # data=2, so the bits keep the parameter's spec.
    assert spec_of(at(out.mu, W_UP)) == up and spec_of(at(out.mu, W_DOWN)) == down
  else:
    assert is_placeholder(at(state.mu, W_UP)) and spec_of(at(out.mu, W_UP)) == ()
  # The 3-D bank without a layer axis follows the same rules on axis 0.
  for name in ("mu", "nu", "nu_row", "nu_col"):
    if not is_placeholder(at(getattr(state, name), "bank/experts")):
      assert spec_of(at(getattr(out, name), "bank/experts"))[0] == "expert"


def test_shortened_axis_is_replicated_unless_it_divides():
  params = {"experts": jax.ShapeDtypeStruct((4, 8, 6), F32)}
  shardings = {"experts": NamedSharding(MESH, P("expert", None, "data"))}
  tx = skewadam_jax.scale_by_skewadam(
      expert=skewadam_jax.TierConfig("int8", "factored", int8_block_size=2))
  out, state = skew_parts(tx, params, shardings)
  assert state.mu_scale["experts"].shape == (4, 8, 3)  # 3 blocks: odd
  assert spec_of(out.mu_scale["experts"]) == ("expert",)
  assert spec_of(out.mu["experts"]) == ("expert", None, "data")


def test_backbone_router_and_count():
  tx = skewadam_jax.skewadam(1e-3, backbone={"second_moment": "factored"})
  out, _ = skew_parts(tx)
  skew = out[0]
  assert spec_of(skew.count) == ()
  assert spec_of(skew.mu["embed"]) == ("data",)
  assert spec_of(skew.nu_row["embed"]) == ("data",)
  assert spec_of(skew.nu_col["embed"]) == ()
  assert spec_of(skew.nu["final_norm"]) == ()  # vectors stay exact
  assert spec_of(at(skew.nu, "layers/moe/router/kernel")) == ()
  # Every sharding is on the parameters' mesh.
  assert all(s.mesh == MESH for s in jax.tree.leaves(out))


def test_expert_state_is_never_replicated_over_experts():
  for momentum in skewadam_jax.ENCODINGS:
    tx = skewadam_jax.scale_by_skewadam(expert={"momentum": momentum})
    out, state = skew_parts(tx)
    for path in (W_UP, W_DOWN):
      for name in ("mu", "nu", "nu_row", "nu_col", "mu_scale", "mu_row", "mu_col"):
        if not is_placeholder(at(getattr(state, name), path)):
          assert "expert" in spec_of(at(getattr(out, name), path)), (momentum, path, name)


def test_optax_states_follow_params_by_path_and_shape():
  tx = optax.MultiSteps(optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3)), every_k_schedule=2)
  out = skewadam_jax.state_shardings(tx, PARAMS, SHARDINGS)
  state = jax.eval_shape(tx.init, PARAMS)
  assert_valid(state, out)
  adam = out.inner_opt_state[1].inner_state[0]
  for moments in (adam.mu, adam.nu, out.acc_grads):
    assert jax.tree.map(spec_of, moments) == jax.tree.map(spec_of, SHARDINGS)
  assert spec_of(adam.count) == () and spec_of(out.mini_step) == ()
  hyper = out.inner_opt_state[1].hyperparams
  assert all(spec_of(s) == () for s in jax.tree.leaves(hyper))


def test_other_shapes_are_replicated():
  # Adafactor factors the two largest axes; its statistics have other shapes
  # than the parameter (optax.tree_map_params would give them its spec).
  tx = optax.adafactor(1e-3, min_dim_size_to_factor=4)
  out = skewadam_jax.state_shardings(tx, PARAMS, SHARDINGS)
  assert_valid(jax.eval_shape(tx.init, PARAMS), out)
  factored = out[0]
  for s in jax.tree.leaves((factored.v_row, factored.v_col)):
    assert spec_of(s) == ()


def test_partition_specs_in_partition_specs_out():
  tx = skewadam_jax.skewadam(1e-3)
  out = skewadam_jax.state_shardings(tx, PARAMS, SPECS, mesh=MESH)
  named = skewadam_jax.state_shardings(tx, PARAMS, SHARDINGS)
  assert all(isinstance(s, P) for s in jax.tree.leaves(out))
  assert jax.tree.map(spec_of, out) == jax.tree.map(spec_of, named)
  with pytest.raises(ValueError, match="need mesh="):
    skewadam_jax.state_shardings(tx, PARAMS, SPECS)


def test_memory_kind_is_kept():
  shardings = jax.tree.map(
      lambda s: NamedSharding(MESH, s, memory_kind="pinned_host"), SPECS)
  out = skewadam_jax.state_shardings(skewadam_jax.skewadam(1e-3), PARAMS, shardings)
  assert at(out[0].nu_row, W_UP).memory_kind == "pinned_host"


def test_mismatched_shardings_name_the_path():
  tx = skewadam_jax.skewadam(1e-3)
  missing = {**SHARDINGS, "bank": {}}
  with pytest.raises(ValueError, match="no sharding for.*bank/experts"):
    skewadam_jax.state_shardings(tx, PARAMS, missing)
  too_long = {**SHARDINGS, "final_norm": NamedSharding(MESH, P(None, "data"))}
  with pytest.raises(ValueError, match="'final_norm' has shape \\(8,\\).*2 entries"):
    skewadam_jax.state_shardings(tx, PARAMS, too_long)
  not_sharding = {**SHARDINGS, "embed": "data"}
  with pytest.raises(ValueError, match="'embed' has sharding 'data'"):
    skewadam_jax.state_shardings(tx, PARAMS, not_sharding)
  mixed = {**SHARDINGS, "embed": P("data")}
  with pytest.raises(ValueError, match="mixes NamedSharding and PartitionSpec"):
    skewadam_jax.state_shardings(tx, PARAMS, mixed)


def test_state_array_longer_than_its_parameter_names_the_path():
  param = sharding_lib._Param((4, 6), ("expert", None), NamedSharding(MESH, P("expert")))
  with pytest.raises(ValueError, match=r"for parameter 'w' \(4, 6\) has an axis longer"):
    sharding_lib._follow(jax.ShapeDtypeStruct((6, 4), F32), param, dict(MESH.shape), "w")


def test_stacked_vector_declared_as_such_keeps_an_exact_replicated_free_state():
  params = {"norm": jax.ShapeDtypeStruct((2, 8), F32)}
  shardings = {"norm": NamedSharding(MESH, P(None, "data"))}
  tx = skewadam_jax.scale_by_skewadam(matrix_axes={"norm": None})
  out, state = skew_parts(tx, params, shardings)
  assert state.nu["norm"].shape == (2, 8) and spec_of(out.nu["norm"]) == (None, "data")


def test_docstring_examples_run():
  result = doctest.testmod(sharding_lib)
  assert result.attempted > 0 and result.failed == 0


def test_partitioned_states_with_masked_nodes():
  # optax.partition (as optax.contrib.muon) leaves MaskedNodes in each part's state.
  labels = jax.tree.map(lambda _: "skew", PARAMS)
  labels["embed"] = "adam"
  tx = optax.partition({"adam": optax.adam(1e-3), "skew": skewadam_jax.skewadam(1e-3)}, labels)
  out = skewadam_jax.state_shardings(tx, PARAMS, SHARDINGS)
  adam = out.inner_states["adam"].inner_state[0]
  assert spec_of(adam.mu["embed"]) == ("data",)
  assert isinstance(adam.mu["final_norm"], optax.MaskedNode)
  skew = out.inner_states["skew"].inner_state[0]
  assert spec_of(at(skew.nu_row, W_UP)) == (None, "expert")


def test_the_per_neuron_second_moment_is_sharded_like_its_columns():
  tx = skewadam_jax.scale_by_skewadam(
      expert=skewadam_jax.TierConfig("sign", direction="normalized_orthogonal"))
  out, state = skew_parts(tx)
  assert at(state.nu_col, W_UP).shape == (2, 4, 1, 16)  # rows reduced: one per output column
  assert spec_of(at(out.nu_col, W_UP)) == (None, "expert", None, "data")
  assert spec_of(at(out.nu_col, W_DOWN)) == (None, "expert")
  assert is_placeholder(at(state.nu_row, W_UP)) and is_placeholder(at(state.nu, W_UP))
