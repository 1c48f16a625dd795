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
  _, _, got, _ = labels.resolve_labels({"moe": {"router": "router"}}, boxed)
  assert got == ["router"]


def test_resolve_rejects_mismatched_tree_naming_paths():
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
  with pytest.raises(ValueError, match=r"no label for \['b'\]"):
    labels.resolve_labels({"a": "backbone"}, params)
  with pytest.raises(ValueError, match=r"not in the parameters \['c'\]"):
    labels.resolve_labels({"a": "backbone", "b": "router", "c": "expert"}, params)


def test_resolve_rejects_unknown_label_naming_path():
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2)}
  with pytest.raises(ValueError, match=r"'b' has label 'experts'"):
    labels.resolve_labels({"a": "backbone", "b": "experts"}, params)


def test_resolve_accepts_callable_and_shape_structs():
  params = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
  paths, _, got, _ = labels.resolve_labels(lambda t: jax.tree.map(lambda _: "router", t), params)
  assert (paths, got) == (["w"], ["router"])
