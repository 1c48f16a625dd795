"""Tests for the tier labeller."""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import skewadam_jax as sa
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
    labels.resolve_labels(labels.label_fn("maxtext"), MAXTEXT, warn=True)  # it matches: silent
    labels.resolve_labels(None, {"router": jnp.zeros(2), "experts": jnp.zeros((2, 2, 2))},
                          warn=True)


def test_unknown_pattern_set_raises():
  with pytest.raises(ValueError, match=r"Unknown pattern set 'mixtral'"):
    labels.label_fn("mixtral")


# Real trees' paths (issue 26, item 13), as their frameworks flatten them:
# KerasHub 0.32 (variables' .path, list-shaped parameters), Levanter's
# Equinox/Haliax modules (scanned; NamedArray adds a trailing /0), MaxText's
# Linen trees (layer axis at position 1), Hugging Face checkpoint names.
def _tree(paths_and_shapes):
  return {p: jnp.zeros(s) for p, s in paths_and_shapes}


REAL_TREES = {
    "keras_hub mixtral": ("keras_hub", [
        ("transformer_layer_0/self_attention/query/kernel", (8, 2, 4)),
        ("transformer_layer_0/mixtral_sparse_moe_block/sparse_feedforward_gate_dense/kernel", (8, 4)),
        ("transformer_layer_0/mixtral_sparse_moe_block/experts/expert_feedforward_gate_dense", (4, 8, 16)),
        ("transformer_layer_0/mixtral_sparse_moe_block/experts/expert_feedforward_intermediate_dense", (4, 8, 16)),
        ("transformer_layer_0/mixtral_sparse_moe_block/experts/expert_feedforward_output_dense", (4, 16, 8)),
        ("transformer_layer_1/mixtral_sparse_moe_block_1/sparse_feedforward_gate_dense/kernel", (8, 4)),
        ("transformer_layer_1/mixtral_sparse_moe_block_1/experts/expert_feedforward_output_dense", (4, 16, 8)),
    ], 4, 2),
    "keras_hub qwen_moe": ("keras_hub", [
        ("transformer_layer_0/qwen_sparse_moe_block/sparse_feedforward_gate_dense/kernel", (8, 4)),
        ("transformer_layer_0/qwen_sparse_moe_block/experts/expert_feedforward_gate_dense", (4, 8, 32)),
        ("transformer_layer_0/qwen_sparse_moe_block/experts/expert_feedforward_output_dense", (4, 16, 8)),
        ("transformer_layer_0/qwen_sparse_moe_block/shared_expert_dense/feedforward_gate_dense/kernel", (8, 16)),
        ("transformer_layer_0/qwen_sparse_moe_block/shared_expert_gate_dense/kernel", (8, 1)),
    ], 2, 1),
    "keras_hub gpt_oss": ("keras_hub", [
        ("transformer_layer_0/sparse_moe_block/router/router_dense/kernel", (8, 4)),
        ("transformer_layer_0/sparse_moe_block/router/router_dense/bias", (4,)),
        ("transformer_layer_0/sparse_moe_block/experts/gate_up_proj", (4, 8, 32)),
        ("transformer_layer_0/sparse_moe_block/experts/gate_up_proj_bias", (4, 32)),
        ("transformer_layer_0/sparse_moe_block/experts/down_proj", (4, 16, 8)),
    ], 3, 2),
    "levanter mixtral": ("levanter", [
        ("transformer/layers/stacked/self_attn/q_proj/weight/0", (2, 8, 8)),
        ("transformer/layers/stacked/block_sparse_moe/gate/weight/0", (2, 4, 8)),
        ("transformer/layers/stacked/block_sparse_moe/experts/w1/weight/0", (2, 4, 8, 16)),
        ("transformer/layers/stacked/block_sparse_moe/experts/w2/weight/0", (2, 4, 16, 8)),
        ("transformer/layers/stacked/block_sparse_moe/experts/w3/weight/0", (2, 4, 8, 16)),
        ("transformer/layers/stacked/block_sparse_moe/shared_mlp/gate_proj/weight/0", (2, 16, 8)),
    ], 3, 1),
    "levanter qwen3_moe": ("levanter", [
        ("transformer/layers/stacked/mlp/gate/weight/0", (2, 4, 8)),
        ("transformer/layers/stacked/mlp/experts/gate_proj/weight/0", (2, 4, 8, 16)),
        ("transformer/layers/stacked/mlp/experts/down_proj/weight/0", (2, 4, 16, 8)),
        ("transformer/layers/stacked/input_layernorm/weight/0", (2, 8)),
    ], 2, 1),
    "maxtext mixtral": ("maxtext", [
        ("params/decoder/layers/MoeBlock_0/gate/kernel", (8, 2, 4)),
        ("params/decoder/layers/MoeBlock_0/wi_0", (4, 2, 8, 16)),
        ("params/decoder/layers/MoeBlock_0/wi_1", (4, 2, 8, 16)),
        ("params/decoder/layers/MoeBlock_0/wo", (4, 2, 16, 8)),
        ("params/decoder/layers/self_attention/query/kernel", (8, 2, 2, 4)),
    ], 3, 1),
    "maxtext qwen3_moe": ("maxtext", [
        ("params/decoder/layers/moe_block/gate/kernel", (8, 2, 4)),
        ("params/decoder/layers/moe_block/wi_0", (4, 2, 8, 16)),
        ("params/decoder/layers/moe_block/wo", (4, 2, 16, 8)),
    ], 2, 1),
    "maxtext deepseek": ("maxtext", [
        ("params/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate/kernel", (8, 2, 4)),
        ("params/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/gate/bias", (2, 4)),
        ("params/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/wi_0", (4, 2, 8, 16)),
        ("params/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/wo", (4, 2, 16, 8)),
        ("params/decoder/moe_layers/DeepSeekMoeBlock_0/shared_experts/wi_0/kernel", (8, 2, 16)),
        ("params/decoder/dense_layers/mlp/wi_0/kernel", (8, 1, 16)),
    ], 2, 2),
    "maxtext gpt_oss fused": ("maxtext", [
        ("params/decoder/layers/layers_0/GptOssMlp/gate/kernel", (8, 2, 4)),
        ("params/decoder/layers/layers_0/GptOssMlp/wi", (4, 2, 8, 32)),
        ("params/decoder/layers/layers_0/GptOssMlp/wi_0_bias", (4, 2, 16)),
        ("params/decoder/layers/layers_0/GptOssMlp/wo", (4, 2, 16, 8)),
        ("params/decoder/layers/layers_0/GptOssMlp/wo_bias", (4, 2, 8)),
    ], 4, 1),
    "hf mixtral": ("hf", [
        ("model.layers.0.self_attn.q_proj.weight", (8, 8)),
        ("model.layers.0.block_sparse_moe.gate.weight", (4, 8)),
        ("model.layers.0.block_sparse_moe.experts.0.w1.weight", (16, 8)),
        ("model.layers.0.block_sparse_moe.experts.1.w2.weight", (8, 16)),
    ], 2, 1),
    # EasyDeL's modules keep Hugging Face's names, kernels stored [in, out]
    # and expert banks stacked [E, in, out].
    "easydel mixtral": ("easydel", [
        ("model/layers/0/self_attn/q_proj/weight", (8, 8)),
        ("model/layers/0/block_sparse_moe/gate/weight", (8, 4)),
        ("model/layers/0/block_sparse_moe/experts/w1/weight", (4, 8, 16)),
        ("model/layers/0/block_sparse_moe/experts/w2/weight", (4, 16, 8)),
        ("model/layers/0/block_sparse_moe/experts/w3/weight", (4, 8, 16)),
        ("model/layers/0/input_layernorm/weight", (8,)),
    ], 3, 1),
    "easydel qwen3_moe": ("easydel", [
        ("model/layers/0/mlp/gate/weight", (8, 4)),
        ("model/layers/0/mlp/experts/gate_proj/weight", (4, 8, 16)),
        ("model/layers/0/mlp/experts/down_proj/weight", (4, 16, 8)),
        ("model/layers/0/self_attn/q_norm/weight", (4,)),
    ], 2, 1),
    "easydel deepseek_v3": ("easydel", [
        ("model/layers/0/mlp/gate_proj/weight", (8, 16)),
        ("model/layers/3/mlp/gate/weight", (8, 4)),
        ("model/layers/3/mlp/gate/e_score_correction_bias", (4,)),
        ("model/layers/3/mlp/experts/up_proj/weight", (4, 8, 16)),
        ("model/layers/3/mlp/shared_experts/up_proj/weight", (8, 16)),
        ("model/layers/3/self_attn/q_a_proj/weight", (8, 6)),
    ], 1, 2),
    "hf qwen2_moe": ("hf", [
        ("model.layers.0.mlp.gate.weight", (4, 8)),
        ("model.layers.0.mlp.experts.0.gate_proj.weight", (16, 8)),
        ("model.layers.0.mlp.experts.0.down_proj.weight", (8, 16)),
        ("model.layers.0.mlp.shared_expert.gate_proj.weight", (16, 8)),
        ("model.layers.0.mlp.shared_expert_gate.weight", (1, 8)),
    ], 2, 1),
    "hf deepseek_v3": ("hf", [
        ("model.layers.0.mlp.gate_proj.weight", (16, 8)),
        ("model.layers.3.mlp.gate.weight", (4, 8)),
        ("model.layers.3.mlp.gate.e_score_correction_bias", (4,)),
        ("model.layers.3.mlp.experts.7.up_proj.weight", (16, 8)),
        ("model.layers.3.mlp.shared_experts.up_proj.weight", (16, 8)),
    ], 1, 2),
    "hf gpt_oss": ("hf", [
        ("model.layers.0.mlp.router.weight", (4, 8)),
        ("model.layers.0.mlp.router.bias", (4,)),
        ("model.layers.0.mlp.experts.gate_up_proj", (4, 8, 32)),
        ("model.layers.0.mlp.experts.down_proj_bias", (4, 8)),
    ], 2, 2),
}


@pytest.mark.parametrize("model", sorted(REAL_TREES))
def test_named_pattern_sets_route_real_trees(model):
  name, paths_and_shapes, experts, routers = REAL_TREES[model]
  paths = [p for p, _ in paths_and_shapes]
  got = labels.label_names(paths, **labels.PATTERNS[name])
  in_tree = labels.resolve_labels(labels.label_fn(name), _tree(paths_and_shapes))
  assert dict(zip(sorted(paths), in_tree)) == dict(zip(paths, got))  # jax sorts dict keys
  by_tier = {t: [p for p, g in zip(paths, got) if g == t] for t in labels.TIERS}
  assert len(by_tier["expert"]) == experts, by_tier
  assert len(by_tier["router"]) == routers, by_tier
  assert not any("shared" in p for p in by_tier["expert"] + by_tier["router"])
  assert not any(re.search(r"attn|attention|norm|proj\.weight$", p) and "experts" not in p
                 for p in by_tier["expert"] + by_tier["router"]), by_tier


def test_named_pattern_sets_warn_naming_the_set_and_example_paths():
  tree = _tree(REAL_TREES["keras_hub mixtral"][1])
  with pytest.warns(UserWarning, match=r"labeller 'maxtext' found no expert and no router.*"
                                       r"mixtral_sparse_moe_block/experts/.*"
                                       r"label_fn\('keras_hub'\) finds 4 expert and 2 router"):
    labels.resolve_labels(labels.label_fn("maxtext"), tree, warn=True)
  with pytest.warns(UserWarning, match=r"default labeller found no router leaf.*"
                                       r"sparse_feedforward_gate_dense"):
    labels.resolve_labels(None, tree, warn=True)
  import warnings  # pylint: disable=import-outside-toplevel
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    labels.resolve_labels(labels.label_fn("keras_hub"), tree, warn=True)


def test_a_users_own_patterns_warn_when_a_typo_leaves_a_tier_empty():
  typo = functools.partial(labels.moe_param_labels, router=r"(^|/)gate(/|$)",
                           expert=r"(^|/)MoeBlock_0/w(i|o)_?[01]?$x")  # the trailing x: a typo
  with pytest.warns(UserWarning, match=r"own param_labels function found no expert leaf"):
    got = labels.resolve_labels(typo, MAXTEXT, warn=True)
  assert "expert" not in got and got.count("router") == 1
  # Through the optimizer: init warns, before a single step.
  with pytest.warns(UserWarning, match=r"found no expert leaf"):
    sa.scale_by_skewadam(param_labels=typo).init(MAXTEXT)
  right = functools.partial(labels.moe_param_labels, router=r"(^|/)gate(/|$)",
                            expert=r"(^|/)MoeBlock_0/w(i_0|i_1|o)$")
  import warnings  # pylint: disable=import-outside-toplevel
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert labels.resolve_labels(right, MAXTEXT, warn=True).count("expert") == 3
    # Labels given as a tree (or one tier for every leaf) are taken as meant.
    labels.resolve_labels("backbone", MAXTEXT, warn=True)
    labels.resolve_labels(jax.tree.map(lambda _: "backbone", MAXTEXT), MAXTEXT, warn=True)


def test_the_hint_never_offers_a_router_as_an_expert():
  # MaxText's scanned router kernel is 3-D [embed, layers, experts], like a bank.
  scanned = {"params": {"decoder": {"layers": {"MoeBlock_0": {
      "gate": {"kernel": jnp.zeros((8, 2, 4))},
      "wi_0": jnp.zeros((4, 2, 8, 16)), "wo": jnp.zeros((4, 2, 16, 8))}}}}}
  with pytest.warns(UserWarning) as caught:
    labels.resolve_labels(None, scanned, warn=True)
  text = str(caught[0].message)
  expert_hint = text.split("expert: ")[1].split("; router:")[0]
  assert "MoeBlock_0/wi_0" in expert_hint and "gate" not in expert_hint
  assert "router: ['params/decoder/layers/MoeBlock_0/gate/kernel']" in text


def test_the_hint_offers_no_path_that_does_not_look_like_the_missing_tier():
  # Every leaf an expert, no router anywhere: the hint names no expert as a router.
  tree = {"experts": {str(e): {"kernel": jnp.zeros((8, 16)), "bias": jnp.zeros((16,))}
                      for e in range(2)}}
  with pytest.warns(UserWarning, match=r"found no router leaf.*router: none of the paths "
                                       r"looks like one\.") as caught:
    labels.resolve_labels(lambda t: jax.tree.map(lambda _: "expert", t), tree, warn=True)
  assert "experts/0" not in str(caught[0].message)
