"""SkewAdam against independent references: optax's Adam/AdamW and numpy loops."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sa
from skewadam_jax import transform
from tests._steps import run

EXACT = sa.TierConfig(momentum="fp32", second_moment="exact")
ALL_EXACT = dict(backbone=EXACT, expert=EXACT, router=EXACT)
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 5, 25)


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=rtol, atol=atol), a, b)


def leaf(tree, path):
  for part in path.split("/"):
    tree = tree[part]
  return tree


def test_all_exact_fp32_equals_adamw(params, grad_seq):
  kw = dict(learning_rate=SCHEDULE, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.1,
            mask=sa.matrices_only)
  ref, _ = run(optax.adamw(**kw), params, grad_seq)
  kw["weight_decay_mask"] = kw.pop("mask")
  got, _ = run(sa.skewadam(**kw, **ALL_EXACT), params, grad_seq)
  assert len(got) >= 20
  for step, (r, g) in enumerate(zip(ref, got)):
    assert_trees_close(g, r), step


def test_default_router_follows_adam_exactly(params, grad_seq):
  ref, _ = run(optax.adam(1e-2), params, grad_seq)
  got, state = run(sa.skewadam(1e-2, weight_decay=0.0), params, grad_seq)
  skew = state[0]
  assert leaf(skew.nu, "layers/moe/router/kernel").shape == (2, 8, 4)   # exact v
  assert leaf(skew.nu_row, "layers/moe/router/kernel").shape == (1,)    # not factored
  assert leaf(skew.mu, "layers/moe/router/kernel").dtype == jnp.float32
  for r, g in zip(ref, got):
    np.testing.assert_allclose(leaf(g, "layers/moe/router/kernel"),
                               leaf(r, "layers/moe/router/kernel"), rtol=1e-5, atol=1e-6)


def numpy_factored_reference(grads_seq, b1, b2, eps, factored_eps):
  """Per-expert loop: row/col EMAs of g² and Adam's update for each matrix alone."""
  lead = grads_seq[0].shape[:-2]
  R, C = grads_seq[0].shape[-2:]
  rows = np.zeros(lead + (R,)); cols = np.zeros(lead + (C,)); m = np.zeros(lead + (R, C))
  out = []
  for t, g in enumerate(grads_seq, start=1):
    g = np.asarray(g, np.float64)
    u = np.zeros_like(g)
    for idx in np.ndindex(*lead):
      g2 = g[idx] ** 2 + factored_eps
      rows[idx] = b2 * rows[idx] + (1 - b2) * g2.mean(axis=1)
      cols[idx] = b2 * cols[idx] + (1 - b2) * g2.mean(axis=0)
      v = np.outer(rows[idx], cols[idx]) / rows[idx].mean()
      m[idx] = b1 * m[idx] + (1 - b1) * g[idx]
      u[idx] = (m[idx] / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    out.append((rows.copy(), cols.copy(), u))
  return out


@pytest.mark.parametrize("shape", [(3, 5, 7), (2, 3, 5, 7)])
def test_expert_factored_second_moment_matches_per_expert_loop(shape):
  keys = jax.random.split(jax.random.PRNGKey(7), 6)
  # Different scales per expert so a mixed-up axis would show.
  scales = jnp.arange(1, shape[-3] + 1, dtype=jnp.float32)[:, None, None]
  grads_seq = [jax.random.normal(k, shape) * scales for k in keys]
  params = {"experts": jnp.zeros(shape)}
  tx = sa.scale_by_skewadam(b1=0.9, b2=0.95, eps=1e-8, clip_threshold=None,
                            expert=sa.TierConfig(momentum="fp32", second_moment="factored"))
  update = jax.jit(tx.update)
  state = tx.init(params)
  ref = numpy_factored_reference(grads_seq, 0.9, 0.95, 1e-8, 1e-30)
  for g, (rows, cols, u_ref) in zip(grads_seq, ref):
    u, state = update({"experts": g}, state)
    row, col = state.nu_row["experts"], state.nu_col["experts"]
    assert row.shape == shape[:-1] + (1,) and col.shape == shape[:-2] + (1,) + shape[-1:]
    np.testing.assert_allclose(row[..., 0], rows, rtol=1e-5)
    np.testing.assert_allclose(col[..., 0, :], cols, rtol=1e-5)
    np.testing.assert_allclose(u["experts"], u_ref, rtol=1e-4, atol=1e-6)


def test_one_experts_state_ignores_another_experts_gradient(params, grad_seq):
  tx = sa.scale_by_skewadam()  # default: sign momentum, factored v
  update = jax.jit(tx.update)
  path = "layers/moe/experts/w_up"

  def run_with(perturb):
    state = tx.init(params)
    for g in grad_seq[:4]:
      if perturb:
        w_up = g["layers"]["moe"]["experts"]["w_up"]
        g = jax.tree.map(lambda x: x, g)
        g["layers"]["moe"]["experts"]["w_up"] = w_up.at[:, 1].mul(100.0).at[:, 1, 0].set(-3.0)
      u, state = update(g, state)
    return leaf(u, path), [leaf(getattr(state, f), path) for f in transform.FIELDS]

  u_a, fields_a = run_with(False)
  u_b, fields_b = run_with(True)
  others = np.array([0, 2, 3])
  np.testing.assert_array_equal(u_a[:, others], u_b[:, others])
  compared = 0
  for a, b in zip(fields_a, fields_b):
    if not transform.is_placeholder(a):
      np.testing.assert_array_equal(a[:, others], b[:, others])
      compared += 1
  assert compared == 5  # sign bits, |m| rows and columns, v rows and columns
  assert not np.allclose(u_a[:, 1], u_b[:, 1])


@pytest.mark.parametrize("momentum", sa.ENCODINGS)
def test_every_encoding_trains_and_keeps_state_avals(params, grad_seq, momentum):
  tx = sa.skewadam(1e-2, expert=sa.TierConfig(momentum=momentum, second_moment="factored"))
  state0 = tx.init(params)
  _, state = run(tx, params, grad_seq[:3])
  assert jax.tree.structure(state) == jax.tree.structure(state0)
  for a, b in zip(jax.tree.leaves(state0), jax.tree.leaves(state)):
    assert (a.shape, a.dtype) == (b.shape, b.dtype)
    assert bool(jnp.all(jnp.isfinite(b.astype(jnp.float32))))


def test_init_from_shape_dtype_structs(params):
  tx = sa.skewadam(1e-3)
  abstract = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
  concrete = tx.init(params)
  for state in (tx.init(abstract), jax.eval_shape(tx.init, abstract)):
    assert jax.tree.structure(state) == jax.tree.structure(concrete)
    assert [(x.shape, x.dtype) for x in jax.tree.leaves(state)] == [
        (x.shape, x.dtype) for x in jax.tree.leaves(concrete)]


def test_state_avals_identical_after_init_and_update_under_cond(params, grad_seq):
  tx = sa.skewadam(1e-3, expert=sa.TierConfig(momentum="int8", second_moment="factored"))
  state = tx.init(params)

  @jax.jit
  def maybe_step(pred, state):
    return jax.lax.cond(pred, lambda s: tx.update(grad_seq[0], s, params)[1],
                        lambda s: s, state)

  for pred in (True, False):
    new = maybe_step(pred, state)
    assert jax.tree.structure(new) == jax.tree.structure(state)
    assert jax.tree.map(lambda x: (x.shape, x.dtype), new) == jax.tree.map(
        lambda x: (x.shape, x.dtype), state)
  assert int(maybe_step(True, state)[0].count) == 1
  assert int(maybe_step(False, state)[0].count) == 0


def test_chain_with_clipping_equals_clipped_adamw(params, grad_seq):
  ref, _ = run(optax.chain(optax.clip_by_global_norm(0.5),
                           optax.adamw(1e-2, weight_decay=0.1, mask=sa.matrices_only)),
               params, grad_seq[:10])
  got, _ = run(optax.chain(optax.clip_by_global_norm(0.5),
                           sa.skewadam(1e-2, weight_decay=0.1, **ALL_EXACT)),
               params, grad_seq[:10])
  assert_trees_close(got[-1], ref[-1])


def test_an_injected_learning_rate_can_change_between_steps(params, grad_seq):
  # That injected hyperparameters match the plain optimizer, per configuration
  # and dtype, is test_transform_table.py's test_inject_hyperparams_matches_plain.
  factory = optax.inject_hyperparams(
      sa.skewadam, static_args=("weight_decay_mask", "param_labels"),
      hyperparam_dtype=jnp.float32)
  tx = factory(learning_rate=1e-2, weight_decay=0.1, param_labels=sa.moe_param_labels,
               expert=sa.TierConfig(momentum="int8", second_moment="factored"))
  got, state = run(tx, params, grad_seq[:5])
  assert not np.allclose(got[-1]["embed"], params["embed"])
  state.hyperparams["learning_rate"] = jnp.asarray(0.0)
  # Jitted: op by op, the update would compile each of its operations on its own.
  updates, _ = jax.jit(tx.update)(grad_seq[5], state, got[-1])
  assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))


def test_apply_if_finite_skips_non_finite_step(params, grad_seq):
  tx = optax.apply_if_finite(sa.skewadam(1e-2), max_consecutive_errors=3)
  state = tx.init(params)
  bad = jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(jnp.nan), grad_seq[0])
  updates, new_state = jax.jit(tx.update)(bad, state, params)
  assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))
  assert_trees_close(new_state.inner_state, state.inner_state, rtol=0, atol=0)
  assert int(new_state.notfinite_count) == 1
  got, _ = run(tx, params, grad_seq[:3])
  ref, _ = run(sa.skewadam(1e-2), params, grad_seq[:3])
  assert_trees_close(got[-1], ref[-1])


def test_bf16_params_get_bf16_updates_from_fp32_state(params, grad_seq):
  tx = sa.skewadam(1e-2)
  p16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  g16 = jax.tree.map(lambda g: g.astype(jnp.bfloat16), grad_seq[0])
  state = tx.init(p16)
  # The state's dtypes are the tiers' (bf16 backbone momentum by default), not the params'.
  assert [x.dtype for x in jax.tree.leaves(state)] == [
      x.dtype for x in jax.tree.leaves(tx.init(params))]
  u16, _ = jax.jit(tx.update)(g16, state, p16)
  u32, _ = jax.jit(tx.update)(jax.tree.map(lambda g: g.astype(jnp.float32), g16), tx.init(params),
                              jax.tree.map(lambda p: p.astype(jnp.float32), p16))
  assert {u.dtype for u in jax.tree.leaves(u16)} == {jnp.dtype(jnp.bfloat16)}
  assert_trees_close(jax.tree.map(lambda u: u.astype(jnp.float32), u16), u32, rtol=1e-2, atol=1e-6)
  new = optax.apply_updates(p16, u16)
  assert {p.dtype for p in jax.tree.leaves(new)} == {jnp.dtype(jnp.bfloat16)}


@pytest.mark.parametrize("kwargs, message", [
    (dict(b1=1.0), r"b1 must be in \[0, 1\), got 1.0"),
    (dict(b1=-0.1), r"b1 must be in \[0, 1\), got -0.1"),
    (dict(b2=1.5), r"b2 must be in \[0, 1\), got 1.5"),
    (dict(eps=-1e-8), r"eps must be >= 0, got -1e-08"),
    (dict(eps=float("nan")), r"eps must be >= 0"),
    (dict(expert={"momentum": "int4"}), r"Unknown momentum encoding 'int4'"),
    (dict(backbone={"second_moment": "low-rank"}), r"Unknown second_moment 'low-rank'"),
    (dict(router="fp32"), r"router must be a TierConfig"),
])
def test_bad_hyperparameters_raise(kwargs, message):
  with pytest.raises(ValueError, match=message):
    sa.scale_by_skewadam(**kwargs)


def test_unknown_encoding_in_tier_config_raises():
  with pytest.raises(ValueError, match="Unknown momentum encoding 'fp8'"):
    sa.TierConfig(momentum="fp8")


def test_bad_labels_raise_naming_the_path(params):
  labels = sa.moe_param_labels(params)
  labels["embed"] = "dense"
  with pytest.raises(ValueError, match=r"'embed' has label 'dense'"):
    sa.scale_by_skewadam(param_labels=labels).init(params)
  with pytest.raises(ValueError, match=r"param_labels does not match .* no entry for \['final_norm'\]"):
    sa.scale_by_skewadam(param_labels={"embed": "backbone"}).init(
        {"embed": params["embed"], "final_norm": params["final_norm"]})


def test_per_expert_2d_leaves_get_the_expert_tiers_forms():
  # Hugging Face Mixtral style: one 2-D matrix per expert.
  tree = {"moe": {"experts": {"0": {"w1": jnp.zeros((8, 6))}, "1": {"w1": jnp.zeros((8, 6))}},
                  "router": jnp.zeros((8, 2))}}
  # Leaf by leaf, the default on the CPU (off it the two experts' state is stacked).
  state = sa.scale_by_skewadam(group_leaves=False).init(tree)
  w1 = lambda field: getattr(state, field)["moe"]["experts"]["0"]["w1"]
  assert (w1("mu").dtype, w1("mu").shape) == (jnp.uint8, (8, 1))     # sign bits
  assert w1("nu_row").shape == (8, 1) and w1("nu_col").shape == (1, 6)
  assert w1("nu").shape == (1,)


def test_update_with_changed_shape_labels_or_tree_raises():
  tx = sa.scale_by_skewadam()
  small = {"a": jnp.zeros((4, 3)), "b": {"experts": jnp.zeros((2, 4, 3))}}
  state = tx.init(small)
  with pytest.raises(ValueError, match=r"for 'a' does not match .* shape \(5, 3\)"):
    tx.update({"a": jnp.zeros((5, 3)), "b": {"experts": jnp.zeros((2, 4, 3))}}, state)
  # Relabelled as router: fp32 momentum and exact v, where init made bf16 and factored.
  relabel = sa.scale_by_skewadam(param_labels={"a": "router", "b": "expert"})
  with pytest.raises(ValueError, match=r"for 'a' does not match its configuration \(momentum fp32"):
    relabel.update(small, state)
  with pytest.raises(ValueError, match=r"updates' tree \(1 leaves\) differs .* \(2 leaves"):
    tx.update({"a": jnp.zeros((4, 3))}, state)


def test_state_made_with_other_encodings_raises_naming_the_path():
  tree = {"moe": {"experts": jnp.zeros((2, 4, 3))}}
  state = sa.scale_by_skewadam(expert={"momentum": "int8"}).init(tree)
  with pytest.raises(ValueError, match=r"'moe/experts' does not match .*momentum sign"):
    sa.scale_by_skewadam().update(tree, state)
  # A dtype change alone (bf16 vs fp32 momentum) is caught too.
  state = sa.scale_by_skewadam(backbone={"momentum": "fp32"}).init({"w": jnp.zeros((4, 3))})
  with pytest.raises(ValueError, match=r"field 'mu' is float32\[4, 3\], expected bfloat16"):
    sa.scale_by_skewadam().update({"w": jnp.zeros((4, 3))}, state)


@pytest.mark.parametrize("shape", [(2, 4, 6), (3, 16, 24)])
def test_cpu_and_accelerator_reductions_agree(shape):
  """The grouped reductions (XLA:CPU) equal the plain ones (XLA:GPU/TPU)."""
  g = jax.random.normal(jax.random.PRNGKey(3), shape)
  m = jax.random.normal(jax.random.PRNGKey(4), shape)
  axes = sa.MatrixAxes(len(shape) - 2, len(shape) - 1)
  plan = transform.LeafPlan("expert", sa.get_encoding("sign"), axes, True, jnp.float32)
  for g_sq, m_ in ((g * g, m), (g * g, None), (None, m)):
    grouped = transform._reductions(plan, g_sq, m_, grouped=True)
    plain = transform._reductions(plan, g_sq, m_, grouped=False)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5), grouped, plain)
