"""skewadam_orthogonal: the explicit skewadam call it stands for, and its embedding rule."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sa

# Hugging Face flat names: the embedding and lm_head must keep Adam's direction.
_HF = {
    "model.embed_tokens.weight": (32, 8),
    "model.layers.0.self_attn.q_proj.weight": (8, 8),
    "model.layers.0.block_sparse_moe.gate.weight": (8, 2),
    "model.layers.0.block_sparse_moe.experts.0.w1.weight": (8, 12),
    "model.layers.0.block_sparse_moe.experts.1.w1.weight": (8, 12),
    "model.layers.0.input_layernorm.weight": (8,),
    "lm_head.weight": (8, 32),
}


def _tree(shapes, seed=0):
  keys = jax.random.split(jax.random.key(seed), len(shapes))
  return {name: jax.random.normal(k, s) for k, (name, s) in zip(keys, shapes.items())}


def _plans(tx_kwargs, tree):
  return dict(zip(sorted(tree), sa.leaf_plans(tree, **tx_kwargs)))  # flattening order


def test_it_is_skewadam_with_both_matrix_tiers_orthogonal_and_embeddings_on_adam():
  params = _tree(_HF)
  labels = sa.label_fn("hf")
  explicit = sa.skewadam(
      1e-2, b1=0.9, b2=0.95, weight_decay=0.2, max_grad_norm=1.0, param_labels=labels,
      backbone={"direction": "orthogonal", "orthogonal_scale": "width"},
      expert={"direction": "orthogonal", "momentum": "lowrank", "lowrank_rank": 84,
              "lowrank_dtype": "int8", "orthogonal_scale": "width"},
      orthogonal_mask={k: k not in ("model.embed_tokens.weight", "lm_head.weight")
                       for k in params})
  alias = sa.skewadam_orthogonal(1e-2, param_labels=labels)
  s_explicit, s_alias = explicit.init(params), alias.init(params)
  # Jitted: one compile each, not one for each operation.
  update_explicit, update_alias = jax.jit(explicit.update), jax.jit(alias.update)
  for step in range(2):  # the second step reads the first's encoded momentum
    grads = _tree(_HF, seed=step + 1)
    u_explicit, s_explicit = update_explicit(grads, s_explicit, params)
    u_alias, s_alias = update_alias(grads, s_alias, params)
    for name in params:
      np.testing.assert_array_equal(u_alias[name], u_explicit[name], err_msg=name)
  assert jax.tree.structure(s_alias) == jax.tree.structure(s_explicit)
  # The expert tier stores int8 factors with a float32 step per row of Qᵀ, not
  # packed signs, unless told.
  w1 = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
  # rank min(84, 8, 12); off the CPU the state is stacked, with a group axis first
  factors = optax.tree.get(s_alias, "mu_row")[w1]
  assert factors.shape[-2:] == (8, 8) and factors.dtype == jnp.int8
  assert optax.tree.get(s_alias, "mu_scale")[w1].dtype == jnp.float32
  signs = sa.skewadam_orthogonal(1e-2, param_labels=labels, expert={"momentum": "sign"})
  assert optax.tree.get(signs.init(params), "mu")[w1].dtype == jnp.uint8


def test_the_embedding_patterns_pick_out_embeddings_of_every_named_framework():
  mask = sa.orthogonal_settings()["orthogonal_mask"]
  names = {
      "embed/embedding": False, "unembed/kernel": False,            # this project
      "model.embed_tokens.weight": False, "lm_head.weight": False,  # Hugging Face
      "transformer.wte.weight": False,
      "params/token_embedder/embedding": False,                     # MaxText
      "params/decoder/logits_dense/kernel": False,
      "token_embedding/embeddings": False,                          # KerasHub
      "embeddings/token_embeddings/weight": False,                  # Levanter
      "layers/attn/query/kernel": True, "model.layers.0.mlp.down_proj.weight": True,
      "decoder/layers/self_attention/out/kernel": True,
      "layers/moe/experts/w_up": True,
  }
  got = mask({name: jnp.zeros((2, 2)) for name in names})
  assert got == names


def test_plans_orthogonalise_matrices_and_leave_the_rest_to_adam():
  params = _tree(_HF)
  plans = _plans({"param_labels": sa.label_fn("hf"), **sa.orthogonal_settings()}, params)
  orthogonal = {name for name, plan in plans.items() if plan.orthogonal}
  assert orthogonal == {"model.layers.0.self_attn.q_proj.weight",
                        "model.layers.0.block_sparse_moe.experts.0.w1.weight",
                        "model.layers.0.block_sparse_moe.experts.1.w1.weight"}


def test_it_warns_when_no_path_looks_like_an_embedding_and_not_when_told_there_is_none():
  params = {"w": jnp.ones((4, 4)), "moe": {"router": jnp.ones((4, 2)),
                                          "experts": jnp.ones((2, 4, 6))}}
  with pytest.warns(UserWarning, match="no parameter path matched the embedding patterns"):
    sa.skewadam_orthogonal(1e-2).init(params)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tx = sa.skewadam_orthogonal(1e-2, embeddings=None)
    state = tx.init(params)
    plans = sa.leaf_plans(params, backbone={"direction": "orthogonal"},
                          expert={"direction": "orthogonal"})
    assert [p.orthogonal for p in plans] == [True, False, True]  # experts, router, w
    tx.update(jax.tree.map(jnp.ones_like, params), state, params)


def test_own_patterns_mask_and_tier_configs_are_used_as_given():
  params = {"wordemb": jnp.ones((16, 4)), "w": jnp.ones((4, 4))}
  tx = sa.skewadam_orthogonal(1e-2, embeddings=r"wordemb")
  grads = jax.tree.map(lambda x: jnp.arange(x.size, dtype=x.dtype).reshape(x.shape), params)
  updates, _ = tx.update(grads, tx.init(params), params)
  reference = sa.skewadam(1e-2, b2=0.95, weight_decay=0.2, max_grad_norm=1.0,
                          backbone={"direction": "orthogonal", "orthogonal_scale": "width"},
                          expert={"direction": "orthogonal"},
                          orthogonal_mask={"wordemb": False, "w": True})
  expected, _ = reference.update(grads, reference.init(params), params)
  for name in params:
    np.testing.assert_array_equal(updates[name], expected[name], err_msg=name)
  # A dict keeps its own direction; a TierConfig is used as it is.
  plans = sa.leaf_plans(params, backbone=sa.TierConfig(direction="adam"),
                        orthogonal_mask={"wordemb": False, "w": True})
  tx = sa.skewadam_orthogonal(1e-2, backbone=sa.TierConfig(direction="adam"),
                              orthogonal_mask={"wordemb": False, "w": True})
  tx.init(params)
  assert not any(p.orthogonal for p in plans)
  tx = sa.skewadam_orthogonal(1e-2, direction="normalized_orthogonal",
                              backbone={"momentum": "fp32"}, embeddings="wordemb")
  state = tx.init(params)
  assert state[0].mu["w"].dtype == jnp.float32  # the dict's momentum, the alias's direction
  assert state[0].nu_col["w"].shape == (1, 4)   # NorMuon's per-neuron statistic


def test_bad_arguments_are_refused_with_their_names():
  with pytest.raises(ValueError, match="direction must be one of"):
    sa.skewadam_orthogonal(1e-2, direction="adam")
  with pytest.raises(ValueError, match="direction must be one of"):
    sa.orthogonal_settings(direction="Orthogonal")
  with pytest.raises(ValueError, match="embeddings= or orthogonal_mask=, not both"):
    sa.skewadam_orthogonal(1e-2, embeddings="emb", orthogonal_mask={"w": True})


def test_it_chains_like_an_optax_alias():
  params = {"embed": jnp.ones((8, 4)), "w": jnp.linspace(-1, 1, 16).reshape(4, 4)}
  tx = optax.chain(optax.scale_by_schedule(lambda count: 1.0),
                   sa.skewadam_orthogonal(optax.linear_schedule(1e-2, 0.0, 10)))
  state = tx.init(params)
  updates, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
  assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))
  assert float(jnp.abs(updates["w"]).max()) > 0


# #81's tree: names of its own, a token table, a position table and a readout.
_OWN_NAMES = {"tok/embedding": (147, 64), "pos": (64, 64), "blocks/0/attn/qkv": (64, 192),
              "blocks/0/moe/gate": (64, 4), "blocks/0/moe/wi": (4, 64, 128),
              "readout/kernel": (64, 147), "readout/bias": (147,)}


def _nested(shapes):
  tree = {}
  for path, shape in shapes.items():
    *parents, name = path.split("/")
    node = tree
    for parent in parents:
      node = node.setdefault(parent, {})
    node[name] = jax.ShapeDtypeStruct(shape, jnp.float32)
  return tree


def test_the_output_side_is_found_by_its_vocabulary_and_position_tables_by_name():
  tree = _nested(_OWN_NAMES)
  labels = lambda t: sa.moe_param_labels(t, router=r"moe/gate$", expert=r"moe/w[io]$")  # noqa: E731
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # everything recognised: nothing to warn about
    plans = sa.leaf_plans(tree, param_labels=labels, **sa.orthogonal_settings())
  paths = sa.labels.flatten_with_paths(tree)[0]
  assert {p for p, plan in zip(paths, plans) if plan.orthogonal} == {
      "blocks/0/attn/qkv", "blocks/0/moe/wi"}
  table = sa.plan_table(tree, param_labels=labels, **sa.orthogonal_settings())
  rows = {line.split()[0]: line for line in table.splitlines()[1:]}
  assert "adam (embedding)" in rows["tok/embedding"]
  assert "adam (position embedding)" in rows["pos"]
  assert "adam (unembedding, vocabulary 147)" in rows["readout/kernel"]
  assert "(" not in rows["readout/bias"].split("adam")[-1]  # a vector: Adam's by its form
  # a mask of the user's own: named as such
  own = sa.plan_table(tree, param_labels=labels, backbone={"direction": "orthogonal"},
                      orthogonal_mask=lambda t: jax.tree.map(lambda _: False, t))
  own_rows = {line.split()[0]: line for line in own.splitlines()[1:]}
  assert "adam (orthogonal_mask)" in own_rows["blocks/0/attn/qkv"]


def test_an_embedding_without_an_output_side_is_announced():
  # No name like an unembedding and no other matrix with the vocabulary side: the
  # output layer, if any, would be orthogonalised; a tied model says so with embeddings=.
  tree = _nested({"tok/embedding": (147, 64), "out": (64, 100), "moe/router": (64, 4),
                  "moe/experts": (4, 64, 32)})
  with pytest.warns(UserWarning, match=r"found the embedding 'tok/embedding' but no unembedding"):
    sa.leaf_plans(tree, **sa.orthogonal_settings())
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    sa.leaf_plans(tree, **sa.orthogonal_settings(embeddings=r"(^|/)tok/"))
  # A vocabulary equal to the model width says nothing: every [D, D] matrix has it.
  square = _nested({"tok/embedding": (64, 64), "attn": (64, 64), "moe/router": (64, 4),
                    "moe/experts": (4, 64, 32)})
  with pytest.warns(UserWarning, match="but no unembedding"):
    plans = sa.leaf_plans(square, **sa.orthogonal_settings())
  assert plans[0].orthogonal  # attn


def test_structural_callables_under_inject_hyperparams_ask_for_static_args():
  params = {"embed": jnp.ones((16, 4)), "lm_head": jnp.ones((4, 16)),
            "l0": {"ffn": {"wi": jnp.ones((2, 4, 8))}, "gate": jnp.ones((4, 2))}}
  labels = lambda t: sa.moe_param_labels(t, router="gate", expert="ffn")  # noqa: E731
  message = r"param_labels was called with a step count.*static_args=\('param_labels',\)"
  for factory in (sa.skewadam, sa.skewadam_orthogonal):
    for init in (lambda tx: tx.init, lambda tx: jax.jit(tx.init)):
      for labeller in (labels, sa.label_fn("hf")):
        tx = optax.inject_hyperparams(factory)(learning_rate=1e-3, param_labels=labeller)
        with pytest.raises(ValueError, match=message):
          init(tx)(params)
    axes = optax.inject_hyperparams(factory)(learning_rate=1e-3,
                                             matrix_axes=sa.named_matrix_axes("hf"))
    with pytest.raises(ValueError, match=r"matrix_axes was called with a step count"):
      axes.init(params)
    # named static: the experts are the expert tier, jitted and stepped
    tx = optax.inject_hyperparams(factory, static_args=("param_labels",))(
        learning_rate=1e-3, param_labels=labels)
    state = jax.jit(tx.init)(params)
    by_tier = sa.state_bytes_by_tier(state, param_labels=labels)
    assert by_tier["expert"] > 0 and by_tier["router"] > 0
    jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), state, params)
  # a labeller written without the library's functions, returning an array: refused too
  with pytest.raises(ValueError, match="param_labels was called with a step count"):
    optax.inject_hyperparams(sa.skewadam)(
        learning_rate=1e-3, param_labels=lambda t: jnp.zeros(())).init(params)
