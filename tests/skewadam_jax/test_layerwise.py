"""The update inside the backward pass as a library feature (skewadam_jax/layerwise.py).

References: the standard step of the same model (``jax.value_and_grad`` of the
whole scanned model, then ``optax.clip_by_global_norm`` and the optimizer),
on a plain-JAX MoE stack (examples/layerwise_plain_jax.py). The engine on
Flax linen and NNX models: tests/examples/test_layerwise_examples.py; on this
project's model, with the training command: tests/models/test_layerwise.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import skewadam_jax
from skewadam_jax import layerwise
from tests import _examples

example = _examples.load("layerwise_plain_jax")


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


@pytest.fixture(scope="module")
def compared():
  return example.compare(steps=5)


def test_the_plain_jax_example_equals_its_standard_step(compared):
  assert min(compared["grad_norms"]) > example.CLIP  # clipping was active at every step
  np.testing.assert_allclose(compared["layerwise_losses"], compared["standard_losses"],
                             rtol=1e-6)
  assert compared["max_param_diff"] < 2e-6


def test_the_example_prints_what_its_docstring_says(capsys):
  example.main()
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith("loss, standard step:") and lines[1].startswith("loss, inside")
  assert lines[0].split(":")[1].split() == lines[1].split(":")[1].split()
  assert float(lines[2].rsplit(":", 1)[1]) < 2e-6


def _engine(tx=None, **options):
  tx = optax.adamw(1e-2) if tx is None else tx
  return layerwise.layerwise_step(tx, example.embed, example.block, example.head,
                                  stack="blocks", **options)


BATCH = next(example.batches(1))


@pytest.fixture(scope="module")
def skipping():
  """An exact-clip engine with the non-finite skip, its jitted step (compiled once)."""
  engine = _engine(clip_norm=1.0, skip_nonfinite=2)
  return engine, jax.jit(engine.step)


def test_a_layer_axis_other_than_zero_gives_the_same_training(skipping):
  engine, step = skipping
  moved = _engine(clip_norm=1.0, skip_nonfinite=2, layer_axis=1)
  moved_step = jax.jit(moved.step)

  def to_axis_1(params):
    return {**params, "blocks": jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), params["blocks"])}

  params = example.init_params()
  a, state_a = _copy(params), engine.init(_copy(params))
  b = to_axis_1(params)
  state_b = moved.init(b)
  ones = jnp.ones(example.LAYERS)
  for batch in example.batches(3):
    a, state_a, m_a = step(a, state_a, batch, grad_scale=ones)
    b, state_b, m_b = moved_step(b, state_b, batch)
    np.testing.assert_allclose(m_b["loss"], m_a["loss"], rtol=1e-6)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), to_axis_1(a), b)
  # The state is stacked on a leading layer axis whatever axis the parameters use.
  mu = state_b.layers[0].mu["blocks"]["experts"]
  assert mu.shape == (example.LAYERS, example.EXPERTS, example.WIDTH, example.WIDTH)


def test_a_nan_in_one_layer_skips_the_whole_step(skipping):
  engine, step = skipping
  params = example.init_params()
  state = engine.init(params)
  ones = jnp.ones(example.LAYERS)
  params, state, _ = step(params, state, BATCH, grad_scale=ones)
  before = jax.device_get((params, state))
  params, state, metrics = step(params, state, BATCH, grad_scale=ones.at[1].set(jnp.nan))
  assert int(metrics["notfinite_count"]) == 1 and int(metrics["total_notfinite"]) == 1
  assert not bool(state.last_finite)
  jax.tree.map(np.testing.assert_array_equal, (params, state.layers, state.outer),
               (before[0], before[1].layers, before[1].outer))
  params, state, metrics = step(params, state, BATCH, grad_scale=ones)
  assert int(metrics["notfinite_count"]) == 0 and int(metrics["total_notfinite"]) == 1
  assert not np.array_equal(params["unembed"], before[0]["unembed"])


def test_stale_mode_clips_by_the_previous_steps_norm():
  params = example.init_params()
  clip = 0.05
  engine = _engine(optax.sgd(0.1), clip_norm=clip, clip_mode="stale")
  unclipped = _engine(optax.sgd(0.1))
  stale, free = jax.jit(engine.step), jax.jit(unclipped.step)
  p, state = _copy(params), engine.init(params)
  ref, ref_state = _copy(params), unclipped.init(params)
  previous = None
  for batch in example.batches(3):
    factor = 1.0 if previous is None else min(1.0, clip / previous)
    ref, ref_state, ref_m = free(ref, ref_state, batch, grad_scale=np.float32(factor))
    p, state, m = stale(p, state, batch)
    previous = float(m["grad_norm"])
    np.testing.assert_allclose(previous, float(ref_m["grad_norm"]) / factor, rtol=1e-5)
  assert previous > clip
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), p, ref)


def test_one_nan_layer_leaves_the_stale_norm_finite_and_the_other_layers_training():
  # Layer 1's gradient all NaN at the second step, against the same run with it 0.
  def train(contain, bad):
    engine = _engine(skewadam_jax.skewadam(1e-2), clip_norm=0.05, clip_mode="stale",
                     contain_nonfinite=contain)
    step = jax.jit(engine.step)
    params, ones = example.init_params(), jnp.ones(example.LAYERS)
    state, norms = engine.init(params), []
    for scale in (ones, ones.at[1].set(bad), ones):
      params, state, metrics = step(params, state, BATCH, grad_scale=scale)
      norms.append(float(metrics["grad_norm"]))
    return params, norms

  params, norms = train(True, jnp.nan)
  zeroed, zeroed_norms = train(True, 0.0)
  np.testing.assert_allclose(norms, zeroed_norms, rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), params, zeroed)
  assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))
  # The raw norm is NaN, and the stale clip carries it into every later step.
  _, raw_norms = train(False, jnp.nan)
  assert np.isnan(raw_norms[1])


def test_integer_block_outputs_get_no_gradient_and_pass_through():
  def block(params, x, batch, layer):
    y, load = example.block(params, x, batch, layer)
    return y, {"load": load, "layer": layer}  # an int32 output too

  def head(params, x, aux, batch):
    loss, metrics = example.head(params, x, aux["load"], batch)
    return loss, {**metrics, "layers_seen": jnp.sum(aux["layer"])}

  engine = layerwise.layerwise_step(optax.adam(1e-3), example.embed, block, head,
                                    stack="blocks")
  params = example.init_params()
  _, _, metrics = jax.jit(engine.step)(params, engine.init(params), BATCH)
  assert int(metrics["layers_seen"]) == sum(range(example.LAYERS))


def test_per_layer_params_are_one_slice_and_the_outer_leaves():
  tree = _engine().per_layer_params(example.init_params())
  assert tree["blocks"]["experts"].shape == (example.EXPERTS, example.WIDTH, example.WIDTH)
  assert tree["embed"].shape == (example.VOCAB, example.WIDTH)
  assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(tree))


def test_state_shardings_follow_each_slice_with_the_layer_axis_unsplit():
  mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "expert"))
  params = example.init_params()
  specs = {"embed": P(), "unembed": P(),
           "blocks": {"router": P(), "experts": P(None, "expert", None, "data")}}
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
  engine = _engine(skewadam_jax.skewadam(1e-3))
  state = engine.state_shardings(params, shardings)
  assert jax.tree.structure(state) == jax.tree.structure(
      jax.eval_shape(engine.init, params))
  mu = state.layers[0].mu["blocks"]["experts"]
  assert mu.spec == P(None, "expert", None, "data")  # the layer axis, then the slice's
  assert state.grad_norm.spec == P()
  split = {**specs, "blocks": {**specs["blocks"], "router": P("data")}}
  with pytest.raises(ValueError, match="'blocks/router': its layer axis 0 is split"):
    engine.state_shardings(params, jax.tree.map(lambda s: NamedSharding(mesh, s), split))


def test_stochastic_rounding_needs_a_key_and_rounds_bf16_parameters():
  params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), example.init_params())
  engine = _engine(optax.sgd(1e-4), stochastic_rounding=True)
  state = engine.init(params)
  with pytest.raises(ValueError, match="needs key="):
    engine.step(params, state, BATCH)
  new, _, _ = jax.jit(engine.step)(params, state, BATCH, key=jax.random.key(0))
  # sgd(1e-4) moves most weights by far less than half a bf16 step: nearest
  # rounding would keep them all; stochastic rounding moves some.
  nearest, _, _ = jax.jit(_engine(optax.sgd(1e-4)).step)(params, state, BATCH)
  moved = lambda tree: sum(int(jnp.sum(a != b)) for a, b in
                           zip(jax.tree.leaves(tree), jax.tree.leaves(params)))
  assert moved(new) > moved(nearest)


@pytest.mark.parametrize("stack, match", [
    ("layers", r"no parameter is in the stack 'layers'; the tree's paths look like \['blocks/"),
    (lambda path: True, "every parameter is in the stack"),
    (("blocks", "embed"), "disagree on the number of layers"),
])
def test_a_stack_that_does_not_match_the_tree_is_named(stack, match):
  engine = layerwise.layerwise_step(optax.adam(1e-3), example.embed, example.block,
                                    example.head, stack=stack)
  with pytest.raises(ValueError, match=match):
    engine.init(example.init_params())


def test_a_layer_axis_a_leaf_does_not_have_is_named():
  engine = _engine(layer_axis=3)
  with pytest.raises(ValueError, match=r"'blocks/router' of shape \(3, 16, 4\) has no layer axis 3"):
    engine.init(example.init_params())


@pytest.mark.parametrize("options, match", [
    (dict(clip_mode="late"), "clip_mode must be one of exact, stale, none"),
    (dict(clip_mode="stale", skip_nonfinite=2), "skip_nonfinite needs clip_mode='exact'"),
    (dict(clip_mode="none", skip_nonfinite=2), "skip_nonfinite needs clip_mode='exact'"),
    (dict(clip_norm=-1.0), "clip_norm must be positive"),
])
def test_bad_options_are_refused(options, match):
  with pytest.raises(ValueError, match=match):
    _engine(**options)


@pytest.mark.parametrize("tx, what", [
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "scaled by 1e4"),
    (optax.apply_if_finite(optax.adam(1e-3), 2), "set to NaN"),
])
def test_transformations_that_couple_parameters_are_refused_at_init(tx, what):
  with pytest.raises(ValueError, match=f"update of 'blocks/experts' changed when the other "
                                       f"gradients were {what}"):
    _engine(tx).init(example.init_params())


@pytest.mark.parametrize("accumulate_dtype", ["float32", "params"])
def test_micro_batches_update_with_the_mean_gradient(accumulate_dtype):
  """Against the standard step on the mean of each micro-batch's jax.grad (clip exact)."""
  K = 3
  params = example.init_params()
  micro = [next(example.batches(1, seed=s)) for s in range(K)]
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *micro)
  tx = optax.adamw(1e-2)
  engine = _engine(tx, clip_norm=0.5, micro_batches=K, accumulate_dtype=accumulate_dtype)
  new, _, metrics = jax.jit(engine.step)(params, engine.init(params), stacked)

  grads = [jax.grad(lambda p, b: example.loss_fn(p, b)[0])(params, b) for b in micro]
  mean = jax.tree.map(lambda *g: sum(g) / K, *grads)
  reference_tx = optax.chain(optax.clip_by_global_norm(0.5), tx)
  updates, _ = reference_tx.update(mean, reference_tx.init(params), params)
  expected = optax.apply_updates(params, updates)
  assert float(optax.tree.norm(mean)) > 0.5  # the clip acted
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
               new, expected)
  losses = [float(example.loss_fn(params, b)[0]) for b in micro]
  np.testing.assert_allclose(metrics["loss"], np.mean(losses), rtol=1e-6)
  np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(mean), rtol=1e-5)


@pytest.mark.parametrize("options, match", [
    (dict(micro_batches=0), "micro_batches must be an int >= 1, got 0"),
    (dict(micro_batches=2.0), "micro_batches must be an int >= 1, got 2.0"),
    (dict(accumulate_dtype="bf16"), "accumulate_dtype must be 'float32' or 'params'"),
])
def test_bad_accumulation_options_are_refused(options, match):
  with pytest.raises(ValueError, match=match):
    _engine(**options)


def test_gradient_accumulation_is_refused_with_the_reason():
  tx = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=2)
  with pytest.raises(ValueError, match="keeps a gradient of every parameter alive"):
    _engine(tx, check=False).init(example.init_params())


def test_a_head_that_does_not_return_a_scalar_loss_is_refused():
  def head(params, x, aux, batch):
    return x @ params["unembed"], {}
  engine = layerwise.layerwise_step(optax.adam(1e-3), example.embed, example.block, head,
                                    stack="blocks")
  params = example.init_params()
  with pytest.raises(ValueError, match="float scalar loss"):
    engine.step(params, engine.init(params), BATCH)


def test_scanned_matrix_axes_set_the_layer_axis_aside():
  params = example.init_params()
  spec = layerwise.scanned_matrix_axes("blocks")(params)
  assert spec["blocks"]["router"] == skewadam_jax.MatrixAxes(1, 2, layer=0)
  assert spec["blocks"]["experts"] == skewadam_jax.MatrixAxes(2, 3, layer=0)
  moved = layerwise.scanned_matrix_axes("blocks", layer_axis=1)({"blocks": jnp.ones((2, 3, 4)),
                                                                  "b": jnp.ones((3, 2))})
  assert moved == {"blocks": skewadam_jax.MatrixAxes(0, 2, layer=1),
                   "b": skewadam_jax.MatrixAxes(0, 1)}
  assert layerwise.scanned_matrix_axes("blocks")({"blocks": jnp.ones((2, 3)),
                                                  "b": jnp.ones(3)}) == {"blocks": None,
                                                                         "b": None}
