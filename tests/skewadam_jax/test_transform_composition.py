"""SkewAdam inside optax.partition / optax.masked, and declarations on trees from other frameworks.

A hybrid (SkewAdam on the MoE leaves, Muon or Adam elsewhere) must accept the
same tree-valued labels, axes and masks a user writes for the whole model;
callable pytree containers (Equinox modules) are declarations, not functions;
list-shaped parameters (Keras's stateless API) are labelled by their names.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sa
from tests import _xla

PARAMS = {"embed": jnp.linspace(-1.0, 1.0, 32).reshape(8, 4),
          "norm": jnp.linspace(0.5, 1.5, 4),
          "moe": {"router": jnp.linspace(-0.3, 0.3, 8).reshape(4, 2),
                  "experts": jnp.linspace(-2.0, 2.0, 48).reshape(2, 4, 6)}}
LABELS = {"embed": "backbone", "norm": "backbone",
          "moe": {"router": "router", "experts": "expert"}}
AXES = {"embed": sa.MatrixAxes(0, 1), "norm": None,
        "moe": {"router": (0, 1), "experts": sa.MatrixAxes(1, 2)}}
DECAY = {"embed": True, "norm": False, "moe": {"router": True, "experts": True}}


def _grads(step, tree=PARAMS):
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.PRNGKey(step), len(leaves))
  return treedef.unflatten([jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def _run(tx, params, steps=3, part=lambda g: g):
  """``steps`` updates; ``part`` picks the params' part of the whole model's gradients."""
  state = tx.init(params)
  for step in range(steps):
    updates, state = tx.update(part(_grads(step)), state, params)
    params = optax.apply_updates(params, updates)
  return params


def _skewadam(**kwargs):
  return sa.skewadam(1e-2, weight_decay=0.1, param_labels=LABELS, matrix_axes=AXES,
                     **kwargs)


def test_partition_with_tree_labels_axes_and_mask_runs_skewadam_on_its_part():
  # SkewAdam on the MoE leaves, optax.contrib.muon on the rest: SkewAdam is
  # given the declarations written for the whole model.
  part = {"embed": "muon", "norm": "muon", "moe": {"router": "skew", "experts": "skew"}}
  tx = optax.partition({"skew": _skewadam(mask=DECAY),
                        "muon": optax.contrib.muon(1e-2)}, part)
  hybrid = _run(tx, PARAMS)
  alone = _run(sa.skewadam(1e-2, weight_decay=0.1, param_labels=LABELS["moe"],
                           matrix_axes=AXES["moe"], mask=DECAY["moe"]), PARAMS["moe"],
                part=lambda g: g["moe"])
  for name in ("router", "experts"):
    np.testing.assert_allclose(hybrid["moe"][name], alone[name], rtol=1e-6)
  dense = lambda tree: {"embed": tree["embed"], "norm": tree["norm"]}
  muon_alone = _run(optax.contrib.muon(1e-2), dense(PARAMS), part=dense)
  assert not np.allclose(hybrid["embed"], PARAMS["embed"])
  np.testing.assert_allclose(hybrid["norm"], muon_alone["norm"], rtol=1e-6)


def test_masked_with_the_default_matrix_decay_and_tree_declarations():
  tx = optax.masked(_skewadam(), {"embed": False, "norm": False,
                                  "moe": {"router": True, "experts": True}})
  params = _run(tx, PARAMS)
  np.testing.assert_allclose(params["embed"], PARAMS["embed"] + sum(
      _grads(s)["embed"] for s in range(3)), rtol=1e-6)  # left alone: raw gradients applied
  alone = _run(sa.skewadam(1e-2, weight_decay=0.1, param_labels=LABELS["moe"],
                           matrix_axes=AXES["moe"]), PARAMS["moe"], part=lambda g: g["moe"])
  np.testing.assert_allclose(params["moe"]["experts"], alone["experts"], rtol=1e-6)


def test_a_spec_that_names_a_missing_leaf_is_still_refused():
  with pytest.raises(ValueError, match=r"entries for paths not in the parameters \['gone'\]"):
    sa.scale_by_skewadam(param_labels={**LABELS, "gone": "backbone"}).init(PARAMS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CallableBlock:
  """A pytree container with a forward pass, like an Equinox module."""
  kernel: object
  experts: object
  scale: object

  def __call__(self, x):
    raise AssertionError("a declaration tree was called as a function")


BLOCK = CallableBlock(kernel=jnp.ones((4, 6)), experts=jnp.ones((3, 4, 6)), scale=jnp.ones(6))


def test_callable_pytree_declarations_are_walked_not_called():
  labels = jax.tree.map(lambda _: "backbone", BLOCK)
  labels.experts = "expert"
  axes = CallableBlock(kernel=sa.MatrixAxes(0, 1), experts=sa.MatrixAxes(1, 2), scale=None)
  mask = CallableBlock(kernel=True, experts=True, scale=False)
  tx = sa.skewadam(1e-2, weight_decay=0.5, param_labels=labels, matrix_axes=axes, mask=mask)
  state = tx.init(BLOCK)
  updates, state = tx.update(jax.tree.map(jnp.ones_like, BLOCK), state, BLOCK)
  plans = sa.leaf_plans(BLOCK, param_labels=labels, matrix_axes=axes)
  assert [p.tier for p in plans] == ["backbone", "expert", "backbone"]
  assert plans[2].axes is None  # the None entry of the container is a vector
  assert state[0].nu_row.experts.shape == (3, 4, 1)
  # The mask container is a mask: the vector is not decayed.
  no_decay = sa.skewadam(1e-2, weight_decay=0.0, param_labels=labels, matrix_axes=axes)
  plain, _ = no_decay.update(jax.tree.map(jnp.ones_like, BLOCK), no_decay.init(BLOCK), BLOCK)
  np.testing.assert_array_equal(updates.scale, plain.scale)
  assert not np.allclose(updates.kernel, plain.kernel)


def test_functions_are_still_called():
  called = []

  def labels(tree):
    called.append(tree)
    return sa.moe_param_labels(tree)

  sa.scale_by_skewadam(param_labels=labels).init(PARAMS)
  sa.scale_by_skewadam(param_labels=functools.partial(sa.moe_param_labels)).init(PARAMS)
  sa.scale_by_skewadam(
      param_labels=jax.tree_util.Partial(sa.moe_param_labels)).init(PARAMS)
  assert called


def test_list_parameters_are_labelled_by_their_names():
  # Keras's stateless API passes trainable variables as a list (paths "0",
  # "1", ...): label them from the variables' own paths.
  names = ["decoder_block_0/attention/query/kernel",
           "decoder_block_0/sparse_moe/router/kernel",
           "decoder_block_0/sparse_moe/experts/gate_kernel"]
  params = [jnp.ones((4, 4)), jnp.ones((4, 2)), jnp.ones((2, 4, 6))]
  labels = sa.label_names(names)
  assert labels == ["backbone", "router", "expert"]
  state = sa.scale_by_skewadam(param_labels=labels).init(params)
  assert state.nu_row[2].shape == (2, 4, 1)
  with pytest.raises(ValueError, match=r"no entry for \['2'\]"):
    sa.scale_by_skewadam(param_labels=labels[:2]).init(params)


def test_state_bytes_by_tier_attributes_other_optimizers_states_by_the_labels():
  labels = {"embed": "backbone", "norm": "backbone",
            "moe": {"router": "router", "experts": "expert"}}
  renamed = {"embed": PARAMS["embed"], "norm": PARAMS["norm"],
             "moe": {"router": PARAMS["moe"]["router"], "experts": PARAMS["moe"]["experts"]}}
  gate_named = {"embed": renamed["embed"], "norm": renamed["norm"],
                "moe": {"gate": renamed["moe"]["router"], "experts": renamed["moe"]["experts"]}}
  gate_labels = {"embed": "backbone", "norm": "backbone",
                 "moe": {"gate": "router", "experts": "expert"}}
  state = optax.adamw(1e-3).init(gate_named)
  by_patterns = sa.state_bytes_by_tier(state)
  assert by_patterns["router"] == 0  # "gate" matches no default pattern
  by_labels = sa.state_bytes_by_tier(state, param_labels=gate_labels)
  assert by_labels["router"] == 8 * 8  # fp32 m and v of 8 entries
  assert by_labels["expert"] == 8 * 48
  by_callable = sa.state_bytes_by_tier(state, param_labels=lambda t: gate_labels,
                                       params=gate_named)
  assert by_callable == by_labels
  with pytest.raises(ValueError, match="needs params="):
    sa.state_bytes_by_tier(state, param_labels=lambda t: gate_labels)
  assert sa.state_bytes_by_tier(optax.adamw(1e-3).init(renamed), param_labels=labels) == (
      sa.state_bytes_by_tier(optax.adamw(1e-3).init(renamed)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FilteredBlock:
  """An Equinox-style module after eqx.filter(model, eqx.is_array): None where no array is."""
  kernel: object
  scale: object
  activation: object


def test_axes_declared_over_a_filtered_module_keep_its_absent_fields_absent():
  params = FilteredBlock(kernel=jnp.ones((3, 4, 6)), scale=jnp.ones((3, 6)), activation=None)
  # The obvious declaration: jax.tree.map over the parameters, None for vectors.
  axes = jax.tree.map(lambda x: sa.MatrixAxes(1, 2) if x.ndim == 3 else None, params)
  assert axes.activation is None and axes.scale is None
  plans = sa.leaf_plans(params, matrix_axes=axes, param_labels="backbone")
  assert [p.axes for p in plans] == [sa.MatrixAxes(1, 2), None]
  state = sa.scale_by_skewadam(matrix_axes=axes, param_labels="backbone").init(params)
  assert state.nu.scale.shape == (3, 6)  # a stacked vector: exact v


@pytest.mark.parametrize("direction", ["adam", "orthogonal", "normalized_orthogonal"])
@pytest.mark.parametrize("max_norm", [1e-2, 1e3])  # clipping, and a norm below the bound
def test_max_grad_norm_is_the_chained_global_norm_clip_bit_for_bit(direction, max_norm):
  # A [layers, experts, d, f] bank takes the orthogonal layer loop, which clips
  # one slice at a time; the other leaves are clipped whole.
  keys = jax.random.split(jax.random.PRNGKey(3), 4)
  params = {"embed": jax.random.normal(keys[0], (16, 8)),
            "layers": {"experts": jax.random.normal(keys[1], (3, 2, 8, 12)),
                       "router": jax.random.normal(keys[2], (3, 8, 2)),
                       "scale": jnp.ones((3, 8))}}
  tiers = {"backbone": {"direction": direction}, "expert": {"direction": direction}}
  axes = {"embed": sa.MatrixAxes(0, 1), "layers": {
      "experts": sa.MatrixAxes(2, 3, layer=0), "router": sa.MatrixAxes(1, 2), "scale": None}}
  built_in = sa.skewadam(1e-2, matrix_axes=axes, max_grad_norm=max_norm, **tiers)
  chained = optax.chain(optax.clip_by_global_norm(max_norm),
                        sa.skewadam(1e-2, matrix_axes=axes, **tiers))

  def steps(tx):
    state, p = tx.init(params), params
    # Bit for bit is the claim for the build users run: XLA:CPU's default (MLIR)
    # fusion emitters, which the suite otherwise turns off (tests/_xla.py).
    # (jaxlib 0.12 has only those, and no option to name them)
    options = {"xla_cpu_use_fusion_emitters": True} if _xla._jaxlib_version() < (0, 12) else {}
    step = jax.jit(tx.update, compiler_options=options)
    for k in jax.random.split(keys[3], 3):
      grads = jax.tree.map(lambda x, k=k: 5 * jax.random.normal(k, x.shape), p)
      updates, state = step(grads, state, p)
      p = optax.apply_updates(p, updates)
    return p

  ours, reference = steps(built_in), steps(chained)
  jax.tree.map(np.testing.assert_array_equal, ours, reference)
  assert not np.allclose(ours["embed"], params["embed"])


def test_max_grad_norm_must_be_positive():
  with pytest.raises(ValueError, match="max_grad_norm must be > 0"):
    sa.skewadam(1e-3, max_grad_norm=0.0)
