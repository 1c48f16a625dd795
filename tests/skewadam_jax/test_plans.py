"""plan_table: every leaf's tier, axes, encodings, decay and state bytes, before a run."""

import jax
import jax.numpy as jnp
import pytest

import skewadam_jax as sa
from skewadam_jax import plans as plan_table_lib

S = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
PARAMS = {"embed": S(64, 8), "layers": {"norm": S(2, 8), "moe": {
    "router": S(2, 8, 4), "experts": S(2, 4, 8, 16)}}}
AXES = {"embed": (0, 1), "layers": {"norm": None, "moe": {"router": (1, 2),
                                                          "experts": (2, 3)}}}


def test_rows_are_the_plans_init_makes_and_the_bytes_its_state_holds():
  rows = plan_table_lib.plan_rows(PARAMS, matrix_axes=AXES)
  plans = sa.leaf_plans(PARAMS, matrix_axes=AXES)
  per_param = sa.state_bytes_per_param(sa.scale_by_skewadam(matrix_axes=AXES), PARAMS)
  assert [r["path"] for r in rows] == ["embed", "layers/moe/experts", "layers/moe/router",
                                       "layers/norm"]
  assert [r["tier"] for r in rows] == [p.tier for p in plans]
  assert [r["matrix axes"] for r in rows] == ["(0, 1)", "(2, 3)", "(1, 2)", "vector"]
  assert [r["momentum"] for r in rows] == ["bf16", "sign", "fp32", "bf16"]
  assert [r["second moment"] for r in rows] == ["factored float32"] * 2 + ["exact float32"] * 2
  assert [r["decay"] for r in rows] == ["yes", "yes", "yes", "no"]  # vectors are not decayed
  sizes = [64 * 8, 2 * 4 * 8 * 16, 2 * 8 * 4, 2 * 8]
  assert [r["state B/param"] for r in rows] == [round(b / n, 3) for b, n in zip(per_param, sizes)]


def test_the_table_follows_the_mask_and_the_tiers_given():
  table = sa.plan_table(PARAMS, matrix_axes=AXES, mask=None,
                        expert=sa.TierConfig("int8", "factored", direction="orthogonal"))
  lines = table.splitlines()
  assert lines[0].split() == ["path", "shape", "tier", "matrix", "axes", "momentum", "second",
                              "moment", "direction", "decay", "state", "B/param"]
  assert "guessed" not in table  # the axes were declared
  assert "(2, 3) (guessed)" in sa.plan_table(PARAMS)  # the last two, not declared
  experts = next(line for line in lines if line.startswith("layers/moe/experts"))
  assert experts.split()[:10] == ["layers/moe/experts", "[2,", "4,", "8,", "16]", "expert",
                                  "(2,", "3)", "int8", "none"]
  assert "orthogonal" in experts
  norm = next(line for line in lines if line.startswith("layers/norm"))
  assert " yes " in norm  # mask=None decays every leaf


def test_a_misrouted_tree_warns_once_and_shows_it():
  with pytest.warns(UserWarning, match="found no expert and no router") as caught:
    table = sa.plan_table({"w": S(4, 8, 16)})
  assert len(caught) == 1
  assert "backbone" in table.splitlines()[1]
