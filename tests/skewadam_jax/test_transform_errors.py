"""SkewAdam's answers to bad input: non-finite gradients under optax.apply_if_finite,
hyperparameters out of range, labels and trees that do not match.
"""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sa
from tests._steps import run


SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 12)


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def poison(tree, value):
  """``tree`` with one element of every leaf set to ``value`` (NaN or Inf)."""
  return jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(value), tree)


def run_steps(tx, params, grads_seq):
  """(params after the last step, state)."""
  trajectory, state = run(tx, params, grads_seq)
  return (trajectory[-1] if trajectory else params), state


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_apply_if_finite_nan_at_step_k_equals_skipping_that_batch(params, grad_seq, bad):
  k, n = 3, 8
  tx = optax.apply_if_finite(
      sa.skewadam(SCHEDULE, weight_decay=0.1,
                  expert=sa.TierConfig(momentum="int8", second_moment="factored")),
      max_consecutive_errors=2)
  seq = list(grad_seq[:n])
  seq[k] = poison(seq[k], bad)  # one element of one batch is enough
  got_params, got_state = run_steps(tx, params, seq)
  ref_params, ref_state = run_steps(tx, params, seq[:k] + seq[k + 1:])
  assert_trees_equal(got_params, ref_params)
  assert_trees_equal(got_state.inner_state, ref_state.inner_state)  # moments, counts, schedule
  assert (int(got_state.total_notfinite), int(ref_state.total_notfinite)) == (1, 0)
  assert int(got_state.notfinite_count) == 0
  # ...and the same as SkewAdam alone on the batches without batch k.
  plain = sa.skewadam(SCHEDULE, weight_decay=0.1,
                      expert=sa.TierConfig(momentum="int8", second_moment="factored"))
  plain_params, _ = run_steps(plain, params, seq[:k] + seq[k + 1:])
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7),
               got_params, plain_params)


def test_apply_if_finite_applies_the_update_after_k_consecutive_errors(params, grad_seq):
  # The documented caveat the training loop guards against: the (K+1)-th
  # consecutive non-finite update is applied.
  # Without containment it writes NaN into the parameters; with it (the
  # default) the NaN entries count as zero and the parameters stay finite.
  bad = [poison(g, jnp.nan) for g in grad_seq[:3]]
  for contain in (False, True):
    tx = optax.apply_if_finite(sa.skewadam(1e-2, contain_nonfinite=contain),
                               max_consecutive_errors=2)
    after_two, state = run_steps(tx, params, bad[:2])
    assert_trees_equal(after_two, params)
    assert int(state.notfinite_count) == 2
    after_three, _ = run_steps(tx, params, bad)
    finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(after_three))
    assert finite == contain


@pytest.mark.parametrize("make, message", [
    (lambda: sa.skewadam(-1e-3), r"learning_rate must be >= 0, got -0.001"),
    (lambda: sa.skewadam(float("nan")), r"learning_rate must be >= 0, got nan"),
    (lambda: sa.skewadam(1e-3, weight_decay=-0.1), r"weight_decay must be >= 0, got -0.1"),
    (lambda: sa.skewadam(1e-3, weight_decay=float("nan")), r"weight_decay must be >= 0, got nan"),
    (lambda: sa.skewadam(1e-3, b2=float("nan")), r"b2 must be in \[0, 1\), got nan"),
    (lambda: sa.scale_by_skewadam(eps_root=-1.0), r"eps_root must be >= 0, got -1.0"),
    (lambda: sa.scale_by_skewadam(factored_eps=-1e-30), r"factored_eps must be >= 0"),
    (lambda: sa.TierConfig(momentum="int8", int8_block_size=0),
     r"int8_block_size must be a positive int, got 0"),
    (lambda: sa.TierConfig(momentum="int8", int8_block_size=-8),
     r"int8_block_size must be a positive int, got -8"),
    (lambda: sa.TierConfig(momentum="int8", int8_block_size=2.5),
     r"int8_block_size must be a positive int, got 2.5"),
    (lambda: sa.TierConfig(int8_block_size=True), r"int8_block_size must be a positive int"),
    (lambda: sa.scale_by_skewadam(expert={"int8_block_size": 0}),
     r"int8_block_size must be a positive int, got 0"),
    (lambda: sa.TierConfig(nu_dtype=jnp.int8), r"nu_dtype must be a floating dtype"),
])
def test_hyperparameters_out_of_range_raise(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_schedules_are_not_rejected():
  sa.skewadam(SCHEDULE, weight_decay=0.0)  # callables are checked by optax, not here


PARAMS = {"embed": jnp.ones((6, 4)),
          "moe": {"router": jnp.ones((4, 2)), "experts": jnp.ones((2, 4, 3))}}


@pytest.mark.parametrize("labels, message", [
    ({"embed": "backbone", "moe": {"router": "router"}},
     r"no entry for \['moe/experts'\]"),
    ({"embed": "backbone", "moe": {"router": "router", "experts": "expert"}, "extra": "router"},
     r"entries for paths not in the parameters \['extra'\]"),
    ({"embed": "backbone", "moe": {"gate": "router"}},
     r"no entry for \['moe/experts', 'moe/router'\]"),
    ({"embed": "dense", "moe": {"router": "router", "experts": "expert"}},
     r"'embed' has label 'dense'"),
    ({"embed": 3, "moe": {"router": "router", "experts": "expert"}},
     r"'embed' has label 3, which is not a tier"),
])
def test_mismatched_labels_raise_naming_the_path(labels, message):
  with pytest.raises(ValueError, match=message):
    sa.skewadam(1e-3, param_labels=labels).init(PARAMS)


@pytest.mark.parametrize("path, shape", [
    ("embed", (6, 5)),                  # exact second moment
    ("moe/experts", (2, 5, 3)),         # factored second moment, sign momentum
    ("moe/experts", (3, 4, 3)),         # one more expert
    ("moe/router", (4, 2, 1)),          # rank change
])
def test_leaf_shape_changed_between_init_and_update_raises(path, shape):
  tx = sa.skewadam(1e-3)
  state = tx.init(PARAMS)
  grads = jax.tree.map(jnp.zeros_like, PARAMS)
  outer, name = (grads["moe"], path.split("/")[1]) if "/" in path else (grads, path)
  outer[name] = jnp.zeros(shape)
  with pytest.raises(ValueError, match=rf"SkewAdam state for '{path}' does not match .* "
                                       rf"update's shape {re.escape(str(shape))}"):
    tx.update(grads, state, grads)


def test_leaf_added_or_removed_between_init_and_update_raises():
  tx = sa.scale_by_skewadam()
  state = tx.init(PARAMS)
  grads = jax.tree.map(jnp.zeros_like, PARAMS)
  with pytest.raises(ValueError, match=r"updates' tree \(4 leaves\) differs .* \(3 leaves"):
    tx.update({**grads, "bias": jnp.zeros((4,))}, state)
  with pytest.raises(ValueError, match=r"updates' tree \(2 leaves\) differs .* \(3 leaves"):
    tx.update({"moe": grads["moe"]}, state)


@pytest.mark.parametrize("make", [sa.skewadam, sa.skewadam_orthogonal])
def test_an_integer_or_boolean_leaf_is_refused_at_init_by_path(make):
  params = {"w": jnp.ones((8, 8)), "counter": jnp.array(3), "mask": jnp.ones((4,), bool)}
  with pytest.raises(ValueError, match=r"2 are not: counter \(int32\), mask \(bool\)"):
    make(1e-2).init(params)
  # the remedy the message names: optax.partition keeps them out of SkewAdam's tree
  tx = optax.partition({"skew": make(1e-2), "frozen": optax.set_to_zero()},
                       {"w": "skew", "counter": "frozen", "mask": "frozen"})
  updates, _ = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  assert updates["w"].dtype == jnp.float32


def test_a_python_number_leaf_steps_as_a_0d_array_does():
  grads = {"w": jnp.full((4, 4), 0.5), "s": jnp.asarray(0.25)}
  as_number = sa.skewadam(1e-2).init({"w": jnp.ones((4, 4)), "s": 1.0})
  as_array = sa.skewadam(1e-2).init({"w": jnp.ones((4, 4)), "s": jnp.asarray(1.0)})
  assert_trees_equal(as_number, as_array)
  updates, _ = sa.skewadam(1e-2).update(grads, as_number, {"w": jnp.ones((4, 4)), "s": 1.0})
  want, _ = sa.skewadam(1e-2).update(grads, as_array, {"w": jnp.ones((4, 4)), "s": jnp.asarray(1.0)})
  assert_trees_equal(updates, want)


def test_a_state_restored_without_a_target_is_told_how_to_restore_it():
  # What orbax gives back without an abstract target: plain containers, not the NamedTuple.
  params = {"w": jnp.ones((4, 4))}
  tx = sa.scale_by_skewadam(param_labels="backbone")
  state = tx.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  for raw in (state._asdict(), list(state), tuple(state)):
    with pytest.raises(ValueError, match=r"plain (dict|list|tuple).*restored without a target.*"
                                         r"tx\.init\(params\)"):
      tx.update(grads, raw)
  with pytest.raises(ValueError, match="another optimizer"):
    tx.update(grads, optax.scale_by_adam().init(params))
