"""State accounting: live states, abstract states, and the moe-6.78b tree."""

import math

import jax
import jax.numpy as jnp
import optax
import pytest

import skewadam_jax as sa

# DESIGN.md's moe-6.78b: vocab 32768, d_model 1024, 24 layers, 64 experts,
# expert SwiGLU d_ff 1400, untied embeddings. Built abstractly, without flax.
V, D, L, E, F = 32768, 1024, 24, 64, 1400


def moe_6p78b_abstract(dtype=jnp.bfloat16):
  s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)
  return {
      "embed": s(V, D), "unembed": s(D, V), "final_norm": s(D),
      "layers": {
          "attn": {"q": s(L, D, D), "k": s(L, D, D), "v": s(L, D, D), "o": s(L, D, D)},
          "attn_norm": s(L, D), "moe_norm": s(L, D),
          "moe": {"router": {"kernel": s(L, D, E)},
                  "experts": {"w_gate": s(L, E, D, F), "w_up": s(L, E, D, F),
                              "w_down": s(L, E, F, D)}},
      },
  }


def count(tree, tier=None):
  labels = sa.moe_param_labels(tree)
  return sum(math.prod(x.shape) for x, t in zip(jax.tree.leaves(tree), jax.tree.leaves(labels))
             if tier in (None, t))


def test_abstract_tree_matches_design_counts():
  tree = moe_6p78b_abstract()
  assert count(tree) == 6_775_424_000
  assert (count(tree, "backbone"), count(tree, "expert"), count(tree, "router")) == (
      167_822_336, 6_606_028_800, 1_572_864)


def test_6p78b_adamw_is_54_2_gb_and_skewadam_tiers_sum_to_total():
  live_before = sum(x.nbytes for x in jax.live_arrays())
  tree = moe_6p78b_abstract()
  adamw = sa.abstract_state_bytes_by_tier(optax.adamw(1e-3), tree)
  # fp32 m and v for every parameter (optax keeps them in the param dtype unless
  # told otherwise, so ask for fp32 params as the published baseline does).
  adamw32 = sa.abstract_state_bytes_by_tier(
      optax.adamw(1e-3, mu_dtype=jnp.float32),
      jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.float32), tree))
  assert adamw32["total"] == 8 * 6_775_424_000 + 4
  assert round(adamw32["total"] / 1e9, 1) == 54.2
  assert adamw["total"] == 4 * 6_775_424_000 + 4  # bf16 m and v

  skew = sa.abstract_state_bytes_by_tier(sa.skewadam(1e-3, group_leaves=False), tree)
  assert sum(skew[k] for k in ("backbone", "expert", "router", "other")) == skew["total"]
  # Independent hand count of the default configuration.
  per_matrix = {  # sign bits (packed along d_out) + |m| row/col + v row/col, fp32
      (D, F): D * math.ceil(F / 8) + 2 * 4 * (D + F),
      (F, D): F * math.ceil(D / 8) + 2 * 4 * (F + D),
  }
  # Backbone: bf16 m everywhere; v factored over the last two axes of every
  # leaf with 2+ dimensions (row and column fp32 statistics), exact for vectors.
  factored_v = 4 * (2 * (V + D) + 4 * L * 2 * D + 2 * (L + D))
  assert skew["backbone"] == 2 * 167_822_336 + factored_v + 4 * D
  assert skew["router"] == 8 * 1_572_864
  assert skew["expert"] == L * E * (2 * per_matrix[(D, F)] + per_matrix[(F, D)])
  # The step count, and one byte per placeholder (a field a leaf's form does not
  # use), leaf by leaf as on the CPU (off it one group's are MaskedNode: fewer).
  state = jax.eval_shape(sa.skewadam(1e-3, group_leaves=False).init, tree)[0]
  placeholders = sum(sa.transform.is_placeholder(x) for name in sa.transform.FIELDS
                     for x in jax.tree.leaves(getattr(state, name)))
  # 7 fields x 13 leaves, less the used ones: 3 expert banks (sign bits, |m| row
  # and col, v row and col), the router (m, v), 8 backbone matrices (m, v row
  # and col) and the final norm (m, v).
  assert len(jax.tree.leaves(tree)) == 13
  assert placeholders == 7 * 13 - (3 * 5 + 2 + 8 * 3 + 2)
  assert skew["other"] == 4 + placeholders
  assert round(skew["total"] / 1e9, 3) == 1.264  # within the published 1.29 GB
  # Adam's backbone (fp32 m, exact v): 8 bytes per backbone parameter.
  adam_backbone = sa.abstract_state_bytes_by_tier(
      sa.skewadam(1e-3, backbone={"momentum": "fp32", "second_moment": "exact"}), tree)
  assert adam_backbone["backbone"] == 8 * 167_822_336
  assert adam_backbone["expert"] == skew["expert"]
  assert skew["total"] < adam_backbone["total"] < adamw32["total"] / 20
  # Nothing of that size was allocated.
  assert sum(x.nbytes for x in jax.live_arrays()) - live_before < 1e6


@pytest.mark.parametrize("make_tx", [
    lambda: sa.skewadam(1e-3),
    lambda: sa.skewadam(1e-3, expert={"momentum": "int8"}),
    lambda: optax.adamw(1e-3),
    lambda: optax.adafactor(1e-3),
    lambda: optax.chain(optax.clip_by_global_norm(1.0), sa.skewadam(1e-3)),
])
def test_live_and_abstract_accounting_agree_with_nbytes(params, make_tx):
  tx = make_tx()
  state = tx.init(params)
  live = sa.state_bytes_by_tier(state)
  assert live["total"] == sum(x.nbytes for x in jax.tree.leaves(state))
  assert live == sa.abstract_state_bytes_by_tier(tx, params)


def test_optax_state_attributed_to_tiers_by_path(params):
  state = optax.adam(1e-3).init(params)
  got = sa.state_bytes_by_tier(state)
  labels = sa.moe_param_labels(params)
  for tier in sa.TIERS:
    n = sum(p.nbytes for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(labels)) if t == tier)
    assert got[tier] == 2 * n, tier


def test_a_custom_labelled_state_is_refused_without_its_labels():
  # #81: paths of the user's own (moe/wi) match no default pattern; counting them all as
  # backbone ("expert: 0") would be wrong in silence.
  import functools
  params = {"tok": jnp.ones((16, 4)), "moe": {"gate": jnp.ones((4, 2)),
                                              "wi": jnp.ones((2, 4, 8))}}
  labels = functools.partial(sa.moe_param_labels, router=r"moe/gate$", expert=r"moe/wi$")
  state = sa.skewadam(1e-3, param_labels=labels).init(params)
  with pytest.raises(ValueError, match=r"no path of this SkewAdam state matches the expert or "
                                       r"router patterns.*Pass the param_labels"):
    sa.state_bytes_by_tier(state)
  by_tier = sa.state_bytes_by_tier(state, param_labels=labels)
  assert by_tier["expert"] > 0 and by_tier["router"] > 0
  dense = sa.skewadam(1e-3, param_labels="backbone").init({"w": jnp.ones((4, 4))})
  assert sa.state_bytes_by_tier(dense, param_labels="backbone")["backbone"] > 0
