"""skewadam() called as optax.adamw is, and the errors a wrong call gets.

Each test fails on the release before it (issue 26, items 8, 11 and 12): a
weight-decay schedule, AdamW's positional order, ``mask=``, ``nesterov``,
``eps=0``, ``mu_dtype``, and the messages of bad configurations.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sa

ADAM_TIERS = dict(backbone=sa.TierConfig("fp32", "exact"), expert=sa.TierConfig("fp32", "exact"),
                  router=sa.TierConfig("fp32", "exact"))
PARAMS = {"embed": jnp.linspace(-1.0, 1.0, 24).reshape(6, 4),
          "norm": jnp.linspace(0.5, 1.5, 4),
          "moe": {"router": jnp.linspace(-0.3, 0.3, 8).reshape(4, 2),
                  "experts": jnp.linspace(-2.0, 2.0, 48).reshape(2, 4, 6)}}
MATRIX_MASK = {"embed": True, "norm": False, "moe": {"router": True, "experts": True}}


def _grads(step):
  keys = jax.random.split(jax.random.PRNGKey(step), 4)
  leaves, treedef = jax.tree.flatten(PARAMS)
  return treedef.unflatten([jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)])


def _run(tx, steps=3):
  params, state = PARAMS, tx.init(PARAMS)
  for step in range(steps):
    updates, state = tx.update(_grads(step), state, params)
    params = optax.apply_updates(params, updates)
  return params, state


def _assert_trees_close(a, b, rtol=2e-5, atol=1e-7):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_positional_arguments_are_adamws():
  ours = [n for n, p in inspect.signature(sa.skewadam).parameters.items()
          if p.kind == p.POSITIONAL_OR_KEYWORD]
  theirs = [n for n, p in inspect.signature(optax.adamw).parameters.items()
            if p.kind == p.POSITIONAL_OR_KEYWORD]
  assert ours == theirs
  keyword_only = inspect.signature(sa.skewadam).parameters
  assert keyword_only["nesterov"].kind == keyword_only["nesterov"].KEYWORD_ONLY


def test_an_adamw_call_with_every_argument_positional_runs_the_same_optimizer():
  # optax.adamw(lr, b1, b2, eps, eps_root, mu_dtype, weight_decay, mask)
  args = (1e-2, 0.8, 0.99, 1e-8, 0.0, jnp.float32, 0.1, MATRIX_MASK)
  params, _ = _run(sa.skewadam(*args, param_labels="backbone",
                               backbone={"second_moment": "exact"}))
  reference, _ = _run(optax.adamw(*args))
  _assert_trees_close(params, reference)


def _adamw_with_rate_per_step(schedule, mask, steps=3):
  """optax.adamw with the decay rate of step t given as a constant at step t.

  Independent of optax's own schedule support (optax 0.2.6 never advances
  add_decayed_weights' schedule count).
  """
  params = PARAMS
  state = optax.adamw(1e-2, weight_decay=0.0, mask=mask).init(params)
  for step in range(steps):
    tx = optax.adamw(1e-2, weight_decay=float(schedule(step)), mask=mask)
    updates, state = tx.update(_grads(step), state, params)
    params = optax.apply_updates(params, updates)
  return params


def test_a_weight_decay_schedule_decays_as_adamws():
  schedule = optax.linear_schedule(0.5, 0.0, 4)
  params, state = _run(sa.skewadam(1e-2, weight_decay=schedule, **ADAM_TIERS))
  _assert_trees_close(params, _adamw_with_rate_per_step(schedule, MATRIX_MASK))
  assert int(state[1].count) == 3  # the decay counts its own updates
  # Any mask with a schedule: the library's decay counts the steps (optax
  # 0.2.6's add_decayed_weights evaluates a schedule at step 0 only).
  for mask in (None, MATRIX_MASK, lambda tree: MATRIX_MASK):
    params, _ = _run(sa.skewadam(1e-2, weight_decay=schedule, mask=mask, **ADAM_TIERS))
    _assert_trees_close(params, _adamw_with_rate_per_step(
        schedule, None if mask is None else MATRIX_MASK))


def test_nesterov_is_adams_nesterov():
  params, _ = _run(sa.skewadam(1e-2, nesterov=True, **ADAM_TIERS))
  reference, _ = _run(optax.adamw(1e-2, nesterov=True, mask=MATRIX_MASK))
  _assert_trees_close(params, reference)
  plain, _ = _run(sa.skewadam(1e-2, **ADAM_TIERS))
  assert not np.allclose(plain["embed"], params["embed"])


def test_eps_zero_is_accepted_as_in_optax():
  params, _ = _run(sa.skewadam(1e-2, eps=0.0, eps_root=1e-12, **ADAM_TIERS))
  reference, _ = _run(optax.adamw(1e-2, eps=0.0, eps_root=1e-12, mask=MATRIX_MASK))
  _assert_trees_close(params, reference)
  with pytest.raises(ValueError, match="eps must be >= 0"):
    sa.skewadam(1e-2, eps=-1.0)


def test_mu_dtype_stores_every_tiers_momentum_densely():
  _, state = _run(sa.skewadam(1e-2, mu_dtype=jnp.bfloat16), steps=1)
  dtypes = {x.dtype for x in jax.tree.leaves(state[0].mu)}
  assert dtypes == {jnp.dtype(jnp.bfloat16)}
  with pytest.raises(ValueError, match="expert"):
    sa.skewadam(1e-2, mu_dtype=jnp.float32, expert=sa.TierConfig("sign", "factored"))
  with pytest.raises(ValueError, match="mu_dtype must be"):
    sa.skewadam(1e-2, mu_dtype=jnp.int8)


def test_mask_is_accepted_under_either_name_but_not_both():
  by_mask, _ = _run(sa.skewadam(1e-2, weight_decay=0.3, mask=MATRIX_MASK))
  by_old_name, _ = _run(sa.skewadam(1e-2, weight_decay=0.3, weight_decay_mask=MATRIX_MASK))
  _assert_trees_close(by_mask, by_old_name, rtol=0, atol=0)
  with pytest.raises(ValueError, match="not both"):
    sa.skewadam(1e-2, mask=None, weight_decay_mask=MATRIX_MASK)


def test_a_tier_dict_typo_names_the_tier_and_the_fields():
  with pytest.raises(ValueError, match=r"expert has unknown TierConfig fields \['momentun'\]"):
    sa.scale_by_skewadam(expert={"momentun": "fp32"})


def test_numpy_integer_block_sizes_are_ints():
  config = sa.TierConfig("int8", "factored", int8_block_size=np.int64(128))
  assert config == sa.TierConfig("int8", "factored", int8_block_size=128)
  assert type(config.int8_block_size) is int
  with pytest.raises(ValueError, match="positive int"):
    sa.TierConfig(int8_block_size=np.float32(128))


def test_float64_second_moment_needs_and_uses_64_bit_jax():
  if not jax.config.jax_enable_x64:
    with pytest.raises(ValueError, match="jax_enable_x64"):
      sa.TierConfig("fp32", "exact", nu_dtype=jnp.float64)
  with jax.enable_x64(True):
    tier = sa.TierConfig("fp32", "exact", nu_dtype=jnp.float64)
    tx = sa.scale_by_skewadam(b2=0.999, backbone=tier, param_labels="backbone")
    g = jnp.asarray([1e-3, 3.0], jnp.float32)
    state = tx.init(g)
    for _ in range(3):
      _, state = tx.update(g, state)
    g64 = np.asarray(g, np.float64)
    want, b2 = 0.0, 0.999  # a Python float b2 is used in float64 as given
    for _ in range(3):
      want = b2 * want + (1 - b2) * g64 * g64
    assert state.nu.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(state.nu), want, rtol=1e-12)


def test_a_changed_tree_names_the_paths_that_differ():
  tx = sa.scale_by_skewadam(param_labels="backbone")
  state = tx.init({"a": jnp.ones(2), "b": jnp.ones(2)})
  with pytest.raises(ValueError, match=r"only in the updates \['c'\], only in the state \['b'\]"):
    tx.update({"a": jnp.ones(2), "c": jnp.ones(2)}, state)


def test_another_optimizers_state_is_refused_by_name():
  tx = sa.scale_by_skewadam(param_labels="backbone")
  with pytest.raises(ValueError, match="ScaleByAdamState"):
    tx.update(PARAMS, optax.scale_by_adam().init(PARAMS))


def test_an_orthogonal_mask_without_an_orthogonal_tier_is_refused():
  with pytest.raises(ValueError, match="no tier has direction='orthogonal'"):
    sa.skewadam(1e-2, orthogonal_mask={"embed": False})
  sa.skewadam(1e-2, orthogonal_mask={"embed": False}, backbone={"direction": "orthogonal"})
