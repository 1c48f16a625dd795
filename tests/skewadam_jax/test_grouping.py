"""Leaves of one plan, shape and dtype stepped together (transform.leaf_groups, issue 44):
the same update and state as each leaf alone, and a program that grows with plans, not leaves.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sa
from skewadam_jax import transform


def _per_expert_tree(experts, d=8, f=16):
  """A Hugging Face-shaped layer: one 2-D leaf per expert weight, a router, a norm, an embedding."""
  tree = {"embed_tokens": jnp.zeros((32, d)), "norm": {"weight": jnp.zeros((d,))},
          "block_sparse_moe": {"gate": {"kernel": jnp.zeros((d, experts))},
                               "experts": {str(e): {"w1": jnp.zeros((d, f)),
                                                    "w2": jnp.zeros((f, d))}
                                           for e in range(experts)}}}
  return tree


def _grads(tree, step):
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(jax.random.PRNGKey(step), len(leaves))
  return treedef.unflatten([jnp.exp(2.0 * jax.random.normal(k, x.shape))
                            * jnp.sign(jax.random.normal(jax.random.fold_in(k, 1), x.shape))
                            for k, x in zip(keys, leaves)])


SETTINGS = {
    "default": {},
    "orthogonal": sa.orthogonal_settings(),
    "orthogonal-int8-factors": sa.orthogonal_settings(
        expert={"lowrank_rank": 84, "lowrank_dtype": "int8"}),
    "int8-bf16": {"expert": {"momentum": "int8", "int8_block_size": 8},
                  "backbone": {"momentum": "bf16", "second_moment": "exact"}},
}


@pytest.mark.parametrize("name", SETTINGS)
def test_grouped_steps_equal_each_leaf_stepped_alone_and_the_stacked_state_holds_them(name):
  # group_leaves=True: the update and state of each leaf stepped alone, to round-off;
  # "stacked": the grouped update, with each group's state stacked at its first leaf
  # (the grouped per-leaf states stacked) and optax.MaskedNode at its other leaves.
  tree = _per_expert_tree(4)
  kw = dict(param_labels=sa.label_fn("hf"), max_grad_norm=1.0, **SETTINGS[name])
  txs = [sa.scale_by_skewadam(group_leaves=g, **kw) for g in (False, True, "stacked")]
  states = [tx.init(tree) for tx in txs]
  groups = transform.leaf_groups(sa.leaf_plans(tree, **{k: v for k, v in kw.items()
                                                        if k != "max_grad_norm"}),
                                 jax.tree.leaves(tree))
  assert max(map(len, groups)) == 4  # each expert weight's group: the 4 experts

  def close(a, b):
    # Batched matmuls round differently, and Newton-Schulz's polynomial and the
    # factors' QR amplify that round-off along a matrix's small singular directions
    # (how much depends on the CPU's matmul kernels), which can move a stored bfloat16
    # entry by an ulp: a float leaf is held to its own scale, 1e-3 of its largest entry
    # or an ulp of it, where a wrong group, step or state is off by O(1). Integer codes
    # are held exactly.
    bound = 0.0
    if jnp.issubdtype(jnp.asarray(b).dtype, jnp.floating):
      step = max(1e-3, float(jnp.finfo(jnp.asarray(b).dtype).eps))
      bound = step * float(np.abs(np.asarray(b, np.float32)).max(initial=0.0))
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-4, atol=1e-5 + bound)
  for step in range(3):
    g = _grads(tree, step)
    (u_alone, s_alone), (u_grouped, s_grouped), (u_stacked, s_stacked) = (
        jax.jit(tx.update)(g, s) for tx, s in zip(txs, states))
    states = [s_alone, s_grouped, s_stacked]
    jax.tree.map(close, (u_alone, s_alone), (u_grouped, s_grouped))
    jax.tree.map(close, u_grouped, u_stacked)
    for field in transform.FIELDS:
      per_leaf = jax.tree.leaves(getattr(s_grouped, field))
      held = jax.tree.leaves(getattr(s_stacked, field),
                             is_leaf=lambda x: isinstance(x, optax.MaskedNode))
      for indices in groups:
        if len(indices) == 1 or transform.is_placeholder(per_leaf[indices[0]]):
          close(held[indices[0]], per_leaf[indices[0]])
        else:
          close(held[indices[0]], jnp.stack([per_leaf[i] for i in indices]))
        assert all(isinstance(held[i], optax.MaskedNode) for i in indices[1:])


def test_leaf_groups_share_plan_shape_and_dtype_within_the_bound():
  tree = {"a": jnp.zeros((4, 4)), "b": jnp.zeros((4, 4)), "c": jnp.zeros((4, 4), jnp.bfloat16),
          "d": jnp.zeros((4, 8)), "e": jnp.zeros((4, 4)), "v": jnp.zeros((4,))}
  leaves = jax.tree.leaves(tree)
  plans = sa.leaf_plans(tree, param_labels="expert")
  assert transform.leaf_groups(plans, leaves) == [[0, 1, 4], [2], [3], [5]]
  # At most max_elements entries a group; a leaf over half of it alone.
  assert transform.leaf_groups(plans, leaves, max_elements=32) == [[0, 1], [2], [3], [4], [5]]
  assert transform.leaf_groups(plans, leaves, max_elements=None) == [[i] for i in range(6)]
  labels = {"a": "expert", "b": "backbone", "c": "expert", "d": "expert", "e": "expert",
            "v": "expert"}
  plans = sa.leaf_plans(tree, param_labels=labels)
  assert transform.leaf_groups(plans, leaves)[0] == [0, 4]  # another tier: another plan


def _hlo_lines(experts, group):
  tree = _per_expert_tree(experts)
  tx = sa.scale_by_skewadam(param_labels=sa.label_fn("hf"), group_leaves=group)
  return jax.jit(tx.update).trace(tree, tx.init(tree)).lower().as_text().count("\n")


def test_the_program_grows_with_plans_not_leaves():
  small, large = _hlo_lines(4, True), _hlo_lines(16, True)
  alone_small, alone_large = _hlo_lines(4, False), _hlo_lines(16, False)
  assert alone_large > 2.5 * alone_small  # each leaf its own ops
  # Grouped: only the stack and the slices grow (a few lines a leaf).
  assert large - small < 0.25 * (alone_large - alone_small)


@pytest.mark.parametrize("anchor", [0, 7, -1, np.iinfo(np.int32).min, np.iinfo(np.int32).max])
def test_unstack_takes_every_slice_in_order_whatever_the_anchor(anchor):
  n = 70  # three sorts of offsets: 32, 32 and 6
  stacked = {"a": jnp.arange(float(n)), "b": jnp.arange(2 * n).reshape(n, 2)}
  out = jax.jit(lambda a: transform._unstack(stacked, n, a))(jnp.int32(anchor))
  assert len(out) == n
  for j, tree in enumerate(out):
    assert float(tree["a"]) == j and tree["b"].tolist() == [2 * j, 2 * j + 1]


def test_a_group_s_outputs_are_sliced_at_runtime_offsets_on_the_cpu():
  # Constant offsets would make every slice a kernel of its own for XLA:CPU
  # (transform._unstack): the compiled program must slice at offsets
  # it reads at run time, and have no static slice of a stacked result left.
  tree = _per_expert_tree(4)
  tx = sa.scale_by_skewadam(param_labels=sa.label_fn("hf"), group_leaves=True)
  compiled = jax.jit(tx.update).trace(tree, tx.init(tree)).lower().compile().as_text()
  assert " dynamic-slice(" in compiled
  static = [line for line in compiled.splitlines() if " slice(" in line]
  assert all("= s32[1]" in line for line in static), static[:3]  # the offsets' own


def test_a_stacked_state_does_not_grow_with_a_group_s_leaves():
  count = lambda experts, group: len(jax.tree.leaves(  # noqa: E731
      sa.scale_by_skewadam(param_labels=sa.label_fn("hf"), group_leaves=group).init(
          _per_expert_tree(experts))))
  assert count(16, "stacked") == count(4, "stacked")
  assert count(16, True) > 3 * count(4, True) - 40  # the per-leaf layout: 7 arrays a leaf


def test_a_state_is_continued_with_the_layout_it_was_made_with():
  tree = _per_expert_tree(2)
  kw = dict(param_labels=sa.label_fn("hf"))
  stacked, per_leaf = (sa.scale_by_skewadam(group_leaves=g, **kw) for g in ("stacked", True))
  grads = _grads(tree, 0)
  with pytest.raises(ValueError, match=r"experts/0/w1.*stacked with the 1 leaves after it"):
    stacked.update(grads, per_leaf.init(tree))
  with pytest.raises(ValueError, match=r"experts/0/w1.*uint8\[2, 8, 2\].*group_leaves"):
    per_leaf.update(grads, stacked.init(tree))
  with pytest.raises(ValueError, match="group_leaves must be"):
    sa.scale_by_skewadam(group_leaves="stack")


def test_a_stacked_state_shards_and_counts_as_its_parameters():
  # (Its orbax round trip: tests/experiments/training/test_checkpoint.py.)
  from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P
  tree = _per_expert_tree(2)
  kw = dict(param_labels=sa.label_fn("hf"))
  stacked, per_leaf = (sa.skewadam(1e-3, group_leaves=g, **kw) for g in ("stacked", False))
  # The group's bytes are its leaves' bytes, all counted at its first leaf.
  assert (sum(sa.state_bytes_per_param(stacked, tree))
          == sum(sa.state_bytes_per_param(per_leaf, tree)))
  mesh = AbstractMesh((2,), ("data",))
  shardings = jax.tree.map(lambda x: NamedSharding(mesh, P("data") if x.ndim == 2 else P()),
                           tree)
  experts = sa.state_shardings(stacked, tree, shardings)[0].nu_row["block_sparse_moe"]["experts"]
  assert tuple(experts["0"]["w1"].spec) == (None, "data", None)  # [2, 8, 1]: the group axis first
  assert isinstance(experts["1"]["w1"], optax.MaskedNode)


def test_a_stacked_state_under_optax_masked_steps_as_the_grouped_one():
  tree = _per_expert_tree(3)
  mask = jax.tree.map(lambda x: x.ndim == 2, tree)  # the norm's vector left out
  txs = [optax.masked(sa.scale_by_skewadam(param_labels=sa.label_fn("hf"), group_leaves=g),
                      mask) for g in (True, "stacked")]
  states = [tx.init(tree) for tx in txs]
  for step in range(2):
    g = _grads(tree, step)
    (u1, states[0]), (u2, states[1]) = (jax.jit(tx.update)(g, s)
                                        for tx, s in zip(txs, states))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), u1, u2)


def _layout(state):
  """Each state leaf's shape and dtype, or "masked" for an optax.MaskedNode."""
  return jax.tree.leaves(jax.tree.map(
      lambda x: "masked" if isinstance(x, optax.MaskedNode) else (x.shape, str(x.dtype)),
      state, is_leaf=lambda x: isinstance(x, optax.MaskedNode)))


def test_auto_stacks_the_state_on_every_backend_and_continues_either_layout(monkeypatch):
  # One layout for every backend (#81): the CPU stepped each leaf alone before 0.3.0.
  tree = _per_expert_tree(2)
  kw = dict(param_labels=sa.label_fn("hf"))
  auto = sa.scale_by_skewadam(**kw)
  stacked, alone = (sa.scale_by_skewadam(group_leaves=g, **kw) for g in ("stacked", False))
  for backend in ("cpu", "gpu", "tpu"):
    with monkeypatch.context() as patch:
      patch.setattr(jax, "default_backend", lambda backend=backend: backend)
      assert _layout(auto.init(tree)) == _layout(stacked.init(tree))
      assert _layout(auto.init(tree)) != _layout(alone.init(tree))
  # A state made on either backend is stepped in its own layout, as its own setting steps it.
  for tx in (stacked, alone):
    state, grads = tx.init(tree), _grads(tree, 0)
    (u_auto, s_auto), (u, state) = auto.update(grads, state), tx.update(grads, state)
    assert _layout(s_auto) == _layout(state)
    jax.tree.map(np.testing.assert_array_equal, (u_auto, s_auto), (u, state))


def test_a_changed_tree_names_a_stacked_group_s_later_leaves_too():
  # A stacked group's later leaves hold optax.MaskedNode: still paths of the state.
  tx = sa.scale_by_skewadam(param_labels="backbone", group_leaves="stacked")
  state = tx.init({"a": jnp.ones((4, 4)), "b": jnp.ones((4, 4))})
  assert isinstance(state.mu["b"], optax.MaskedNode)
  with pytest.raises(ValueError, match=r"\(2 leaves\).*\(2 leaves in its 'mu' field\): paths "
                                       r"only in the updates \['c'\], only in the state \['b'\]"):
    tx.update({"a": jnp.ones((4, 4)), "c": jnp.ones((4, 4))}, state)
