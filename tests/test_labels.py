"""Tests for the tier labeller."""

import jax
import jax.numpy as jnp
import pytest

from skewadam_jax import labels


def test_default_patterns_route_router_expert_backbone():
  params = {
      "embed": jnp.zeros((8, 4)),
      "layers": {"attn": {"q": jnp.zeros((2, 4, 4))},
                 "moe": {"router": {"kernel": jnp.zeros((2, 4, 3))},
                         "experts": {"w_up": jnp.zeros((2, 3, 4, 5))}}},
      "routerless": jnp.zeros(3),   # a substring is not a path component
  }
  got = labels.moe_param_labels(params)
  assert got == {
      "embed": "backbone",
      "layers": {"attn": {"q": "backbone"},
                 "moe": {"router": {"kernel": "router"},
                         "experts": {"w_up": "expert"}}},
      "routerless": "backbone",
  }


def test_bare_array_is_backbone():
  assert labels.moe_param_labels(jnp.zeros(3)) == "backbone"


def test_custom_patterns_and_router_precedence():
  params = {"gate": jnp.zeros((4, 2)), "bank": jnp.zeros((2, 4, 4)),
            "bank_router": jnp.zeros((4, 2))}
  got = labels.moe_param_labels(params, router=[r"gate$", r"_router$"], expert=r"bank")
  assert got == {"gate": "router", "bank": "expert", "bank_router": "router"}


def test_trailing_value_is_dropped_from_paths():
  class Box:  # stands in for a Flax Variable: a node with a `value` child
    def __init__(self, value):
      self.value = value

  jax.tree_util.register_pytree_with_keys(
      Box, lambda b: (((jax.tree_util.GetAttrKey("value"), b.value),), None),
      lambda _, c: Box(c[0]))
  boxed = {"moe": {"router": Box(jnp.zeros((4, 2)))}}
  plain = {"moe": {"router": jnp.zeros((4, 2))}}
  boxed_paths, _, _ = labels.flatten_with_paths(boxed)
  plain_paths, _, _ = labels.flatten_with_paths(plain)
  assert boxed_paths == plain_paths == ["moe/router"]
  # A labels tree written for plain params resolves against boxed params.
  got = labels.resolve_labels({"moe": {"router": "router"}}, boxed)
  assert got == ["router"]


def test_resolve_rejects_mismatched_tree_naming_paths():
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
  with pytest.raises(ValueError, match=r"no entry for \['b'\]"):
    labels.resolve_labels({"a": "backbone"}, params)
  with pytest.raises(ValueError, match=r"not in the parameters \['c'\]"):
    labels.resolve_labels({"a": "backbone", "b": "router", "c": "expert"}, params)


def test_resolve_rejects_unknown_label_naming_path():
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
  with pytest.raises(ValueError, match=r"'b' has label 'experts'"):
    labels.resolve_labels({"a": "backbone", "b": "experts"}, params)


def test_resolve_accepts_callable_and_shape_structs():
  params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
  got = labels.resolve_labels(lambda t: jax.tree.map(lambda _: "router", t), params)
  assert got == ["router"]


def test_a_tier_name_or_a_prefix_tree_labels_whole_subtrees():
  params = {"a": jnp.zeros(2), "moe": {"w1": jnp.zeros((2, 3)), "w2": jnp.zeros((3, 2))}}
  assert labels.resolve_labels("expert", params) == ["expert"] * 3
  assert labels.resolve_labels({"a": "backbone", "moe": "expert"}, params) == [
      "backbone", "expert", "expert"]


# Hugging Face Mixtral (Flax): one 2-D leaf per expert; router called `gate`.
HF_MIXTRAL = {"model": {"layers": {"0": {
    "self_attn": {"q_proj": {"kernel": jnp.zeros((8, 8))}},
    "block_sparse_moe": {
        "gate": {"kernel": jnp.zeros((8, 4))},
        "experts": {str(e): {w: {"kernel": jnp.zeros((8, 16) if w != "w2" else (16, 8))}
                             for w in ("w1", "w2", "w3")} for e in range(4)}},
    "input_layernorm": {"weight": jnp.zeros(8)}}}}}

# MaxText: stacked [E, d, f] banks directly in the MoE block; router `gate`.
MAXTEXT = {"params": {"decoder": {"layers_0": {
    "MoeBlock_0": {"gate": {"kernel": jnp.zeros((8, 4))},
                   "wi_0": jnp.zeros((4, 8, 16)), "wi_1": jnp.zeros((4, 8, 16)),
                   "wo": jnp.zeros((4, 16, 8))},
    "self_attention": {"query": {"kernel": jnp.zeros((8, 2, 4))}},
    "pre_self_attention_layer_norm": {"scale": jnp.zeros(8)}}}}}


@pytest.mark.parametrize("tree, name, experts, routers", [
    (HF_MIXTRAL, "hf_mixtral", 12, 1),
    (MAXTEXT, "maxtext", 3, 1),
])
def test_documented_pattern_sets_route_third_party_trees(tree, name, experts, routers):
  got = labels.resolve_labels(labels.label_fn(name), tree)
  paths, _, _ = labels.flatten_with_paths(tree)
  by_tier = {t: [p for p, g in zip(paths, got) if g == t] for t in labels.TIERS}
  assert len(by_tier["expert"]) == experts and len(by_tier["router"]) == routers
  assert all("gate" in p for p in by_tier["router"])
  assert not any("attn" in p or "attention" in p or "norm" in p
                 for p in by_tier["expert"] + by_tier["router"])


def test_default_patterns_warn_when_nothing_is_an_expert_or_router():
  with pytest.warns(UserWarning, match=r"found no expert and no router leaf"):
    labels.resolve_labels(None, MAXTEXT, warn=True)
  with pytest.warns(UserWarning, match=r"found no router leaf"):
    labels.resolve_labels(None, HF_MIXTRAL, warn=True)   # experts/ matches, gate does not
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    labels.resolve_labels(labels.label_fn("maxtext"), MAXTEXT, warn=True)  # explicit: silent
    labels.resolve_labels(None, {"router": jnp.zeros(2), "experts": jnp.zeros((2, 2, 2))},
                          warn=True)


def test_unknown_pattern_set_raises():
  with pytest.raises(ValueError, match=r"Unknown pattern set 'mixtral'"):
    labels.label_fn("mixtral")
