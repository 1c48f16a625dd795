"""A named pattern set declares its trees' matrix axes; a guess on a stacked leaf warns."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import skewadam_jax as sa
from skewadam_jax import axes as axes_lib
from skewadam_jax import labels as labels_lib
from tests._steps import run

L, D, H, DH, E, F, V = 2, 8, 2, 4, 4, 16, 12
MA = sa.MatrixAxes

# MaxText's scanned Mixtral (param_scan_axis=1): 13 leaves, written out by hand
# with the axes each one means, as the reference the rule must reproduce.
MAXTEXT_SCANNED = {
    "params/token_embedder/embedding": ((V, D), MA(0, 1)),
    "params/decoder/decoder_norm/scale": ((D,), None),
    "params/decoder/logits_dense/kernel": ((D, V), MA(0, 1)),
    "params/decoder/layers/pre_self_attention_layer_norm/scale": ((D, L), None),
    "params/decoder/layers/post_self_attention_layer_norm/scale": ((D, L), None),
    "params/decoder/layers/self_attention/query/kernel": ((D, L, H, DH), MA(0, (2, 3), 1)),
    "params/decoder/layers/self_attention/key/kernel": ((D, L, 1, DH), MA(0, (2, 3), 1)),
    "params/decoder/layers/self_attention/value/kernel": ((D, L, 1, DH), MA(0, (2, 3), 1)),
    "params/decoder/layers/self_attention/out/kernel": ((H, L, DH, D), MA((0, 2), 3, 1)),
    "params/decoder/layers/MoeBlock_0/gate/kernel": ((D, L, E), MA(0, 2, 1)),
    "params/decoder/layers/MoeBlock_0/wi_0": ((E, L, D, F), MA(2, 3, 1)),
    "params/decoder/layers/MoeBlock_0/wi_1": ((E, L, D, F), MA(2, 3, 1)),
    "params/decoder/layers/MoeBlock_0/wo": ((E, L, F, D), MA(2, 3, 1)),
}
# Levanter stores a Linear's output axes first: q_proj [L, H, Dh, D], o_proj [L, D, H, Dh].
LEVANTER = {
    "transformer/layers/stacked/self_attn/q_proj/weight/0": ((L, H, DH, D), MA((1, 2), 3, 0)),
    "transformer/layers/stacked/self_attn/o_proj/weight/0": ((L, D, H, DH), MA(1, (2, 3), 0)),
    "transformer/layers/stacked/input_layernorm/weight/0": ((L, D), None),
    "transformer/layers/stacked/block_sparse_moe/gate/weight/0": ((L, E, D), MA(1, 2, 0)),
    "transformer/layers/stacked/block_sparse_moe/experts/w1/weight/0": ((L, E, F, D),
                                                                        MA(2, 3, 0)),
    "transformer/embeddings/token_embeddings/weight": ((V, D), MA(0, 1)),
}
# KerasHub (not scanned): EinsumDense attention kernels [D, H, Dh] and [H, Dh, D].
KERAS_HUB = {
    "transformer_layer_0/self_attention/query/kernel": ((D, H, DH), MA(0, (1, 2))),
    "transformer_layer_0/self_attention/attention_output/kernel": ((H, DH, D), MA((0, 1), 2)),
    "transformer_layer_0/sparse_moe_block/experts/gate_up_proj": ((E, D, 2 * F), MA(1, 2)),
    "transformer_layer_0/sparse_moe_block/experts/gate_up_proj_bias": ((E, 2 * F), None),
    "transformer_layer_0/sparse_moe_block/router/router_dense/kernel": ((D, E), MA(0, 1)),
}


def _nested(flat):
  """A nested dict of zeros from ``{"a/b": (shape, axes)}``."""
  tree = {}
  for path, (shape, _) in flat.items():
    *parents, name = path.split("/")
    node = tree
    for p in parents:
      node = node.setdefault(p, {})
    node[name] = jnp.zeros(shape)
  return tree


def _declared(flat):
  tree = _nested(flat)
  paths, _, treedef = labels_lib.flatten_with_paths(tree)
  return treedef.unflatten([flat[p][1] for p in paths])


@pytest.mark.parametrize("name, flat", [("maxtext", MAXTEXT_SCANNED), ("levanter", LEVANTER),
                                        ("keras_hub", KERAS_HUB)])
def test_named_sets_declare_the_axes_written_out_by_hand(name, flat):
  tree = _nested(flat)
  got = axes_lib.resolve_matrix_axes(sa.named_matrix_axes(name), tree)
  want = axes_lib.resolve_matrix_axes(_declared(flat), tree)
  paths, _, _ = labels_lib.flatten_with_paths(tree)
  assert dict(zip(paths, got)) == dict(zip(paths, want))


def test_label_fn_steps_as_the_hand_declaration_and_guessing_would_not():
  tree = _nested(MAXTEXT_SCANNED)
  grads = [jax.tree.map(lambda x, k=k: jax.random.normal(jax.random.PRNGKey(k), x.shape), tree)
           for k in range(2)]
  labels = sa.label_fn("maxtext")
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # declared axes: nothing to warn about
    named = run(sa.skewadam(1e-2, weight_decay=0.1, param_labels=labels), tree, grads)[0][-1]
    by_hand = run(sa.skewadam(1e-2, weight_decay=0.1, param_labels=labels,
                              matrix_axes=_declared(MAXTEXT_SCANNED)), tree, grads)[0][-1]
  for a, b in zip(jax.tree.leaves(named), jax.tree.leaves(by_hand)):
    np.testing.assert_array_equal(a, b)
  # The plan table says declared, not guessed; a stacked norm is a vector.
  table = sa.plan_table(tree, param_labels=labels)
  assert "(guessed)" not in table
  norm = next(r for r in table.splitlines() if "pre_self_attention_layer_norm" in r)
  assert "vector" in norm
  # An explicit declaration wins over the set's.
  everything_guessed = jax.tree.map(lambda x: MA() if x.ndim >= 2 else None, tree)
  explicit = run(sa.skewadam(1e-2, weight_decay=0.1, param_labels=labels,
                             matrix_axes=everything_guessed), tree, grads)[0][-1]
  scale = ("params", "decoder", "layers", "pre_self_attention_layer_norm", "scale")
  pick = lambda t: t[scale[0]][scale[1]][scale[2]][scale[3]][scale[4]]  # noqa: E731
  assert not np.allclose(pick(explicit), pick(named))


def test_guessed_axes_on_stacked_leaves_warn_naming_them():
  tree = _nested(MAXTEXT_SCANNED)
  own = lambda t: sa.moe_param_labels(  # noqa: E731  a user's patterns: no axes with them
      t, router=r"MoeBlock_0/gate", expert=r"MoeBlock_0/w(i_0|i_1|o)$")
  # 3-D router, 4-D banks and attention kernels; the [D, L] norms look like matrices.
  with pytest.warns(UserWarning, match=r"guessed the matrix axes of 8 stacked leaves.*"
                                       r"MoeBlock_0/gate/kernel \[8, 2, 4\]"):
    sa.skewadam(1e-3, param_labels=own).init(tree)
  # Expert banks [E, d, f] and 2-D leaves are what the guess gets right: silent.
  flat = {"experts": {"w": jnp.zeros((E, D, F))}, "router": {"w": jnp.zeros((D, E))},
          "embed": jnp.zeros((V, D))}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    sa.skewadam(1e-3).init(flat)


def test_a_set_without_axes_is_refused_by_name():
  with pytest.raises(ValueError, match=r"'default' declares no matrix axes.*'maxtext'"):
    sa.named_matrix_axes("default")
