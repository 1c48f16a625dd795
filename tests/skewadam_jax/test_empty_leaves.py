"""Leaves with no entries (a zero-size axis anywhere: an empty expert bank, a matrix
with no rows or columns, an empty vector), as other frameworks' trees can hold: they
step to empty updates, and every other leaf steps exactly as in the tree without them.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import skewadam_jax as sa
from skewadam_jax import orthogonal
from skewadam_jax import plans

EMPTY_SHAPES = {"no_experts": (0, 8, 8), "no_rows": (4, 0, 8), "no_cols": (4, 8, 0),
                "no_rows_stacked": (2, 0, 8, 8), "vector": (0,), "matrix": (0, 3)}


def base_params():
  return {"moe": {"experts": {"w": jnp.linspace(-1.0, 1.0, 4 * 8 * 8).reshape(4, 8, 8)},
                  "router": {"kernel": jnp.linspace(0.0, 1.0, 32).reshape(8, 4)}},
          "mlp": {"w": jnp.linspace(0.0, 1.0, 64).reshape(8, 8)}}


def with_empties(params):
  params = jax.tree.map(lambda x: x, params)
  params["moe"]["experts"].update({k: jnp.ones(s) for k, s in EMPTY_SHAPES.items()})
  params["mlp"].update({k: jnp.ones(s) for k, s in EMPTY_SHAPES.items()})
  return params


def two_steps(tx, params):
  grads = jax.tree.map(lambda x: 0.1 * x + 0.01, params)
  state = tx.init(params)
  update = jax.jit(tx.update)  # one compile, not one for each operation
  for _ in range(2):
    updates, state = update(grads, state, params)
  return updates


LOWRANK_DTYPES = {f"lowrank-{d}": {"momentum": "lowrank", "lowrank_dtype": d}
                  for d in sa.encodings.LOWRANK_DTYPES}
EXPERT_MOMENTA = {**{m: {"momentum": m} for m in ("fp32", "bf16", "int8", "sign", "none")},
                  **LOWRANK_DTYPES}


@pytest.mark.parametrize("direction", ["adam", "orthogonal"])
@pytest.mark.parametrize("momentum", list(EXPERT_MOMENTA))
def test_empty_leaves_step_to_empty_updates_and_leave_the_rest_as_without_them(
    direction, momentum):
  tiers = {"expert": {**EXPERT_MOMENTA[momentum], "direction": direction},
           "backbone": {"direction": direction}}
  reference = two_steps(sa.skewadam(1e-2, **tiers), base_params())
  updates = two_steps(sa.skewadam(1e-2, **tiers), with_empties(base_params()))
  for tier in ("moe", "mlp"):
    for name, shape in EMPTY_SHAPES.items():
      leaf = updates[tier]["experts"][name] if tier == "moe" else updates[tier][name]
      assert leaf.shape == shape
  for path in (("moe", "experts", "w"), ("moe", "router", "kernel"), ("mlp", "w")):
    got, want = updates, reference
    for key in path:
      got, want = got[key], want[key]
    np.testing.assert_array_equal(got, want)


def test_the_orthogonal_default_steps_a_tree_with_empty_leaves_under_jit():
  params = with_empties(base_params())
  tx = sa.skewadam_orthogonal(1e-2, embeddings=None)
  grads = jax.tree.map(lambda x: 0.1 * x + 0.01, params)
  updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
  assert jax.tree.map(jnp.shape, updates) == jax.tree.map(jnp.shape, params)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_an_empty_stack_is_one_empty_chunk():
  assert orthogonal.chunk_size(0, 64) == 0
  assert orthogonal.width_scale((0, 8), sa.MatrixAxes(0, 1)) == 1.0
  assert orthogonal.newton_schulz(jnp.ones((0, 8, 8))).shape == (0, 8, 8)
  with pytest.raises(ValueError, match="A chunk of 3 does not divide the axis of 8"):
    orthogonal.map_in_chunks(lambda t: t, jnp.ones((8, 2)), 0, 3)


def test_the_plan_table_gives_an_empty_leaf_no_bytes_a_parameter():
  rows = {row["path"]: row for row in plans.plan_rows(with_empties(base_params()))}
  assert rows["mlp/no_cols"]["state B/param"] is None and rows["mlp/vector"]["state B/param"] is None
  assert rows["mlp/w"]["state B/param"] > 0
  line = next(r for r in sa.plan_table(with_empties(base_params())).splitlines()
              if r.startswith("moe/experts/no_rows "))
  assert line.split()[-1] == "-"
