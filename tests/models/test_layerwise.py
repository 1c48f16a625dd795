"""The update inside the backward pass on this project's model (models/layerwise.py,
experiments.training.steps.layerwise_step and --update-in-backward).

References: the standard train step (all gradients, then the update) with
optax's global-norm clipping and ``apply_if_finite``, on ``tiny`` in float32.
The engine itself on models that are not ours: tests/skewadam_jax/test_layerwise.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import models
from experiments.training import config as config_lib
from experiments.training import optimizers
from experiments.planning import planner
from experiments.training import steps
from experiments.training import run as training
from models import layerwise as model_layerwise
from skewadam_jax import layerwise

CLIP = 0.05  # below every step's gradient norm here, so clipping is active
SKIP = 3
STEPS = 5
ONES_PER_LAYER = jnp.ones(models.get_preset("tiny").num_layers)


@pytest.fixture(scope="module")
def tiny32():
  config = models.get_preset("tiny", compute_dtype=jnp.float32)
  graphdef, params, rest = nnx.split(models.Transformer(config, rngs=nnx.Rngs(0)),
                                     nnx.Param, ...)
  rng = np.random.default_rng(0)
  batches = [jnp.asarray(rng.integers(0, config.vocab_size, (4, 17)), jnp.int32)
             for _ in range(STEPS)]
  return graphdef, nnx.as_pure(params), rest, models.logical_axes(params), batches


def _per_layer(tiny32):
  """The tree the per-layer optimizer acts on: one layer's slice and the outer parameters."""
  graphdef, params, rest, _, _ = tiny32
  return model_layerwise.layerwise_step(nnx.merge(graphdef, params, rest),
                                        optax.identity()).per_layer_params(params)


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _pair(tiny32, name, tiers=None, clip=CLIP, skip=SKIP):
  """(standard step, its state, update-in-backward step, its state), both jitted."""
  graphdef, params, rest, axes, _ = tiny32
  schedule = optimizers.lr_schedule(1e-2, 10, 2)
  tx = optimizers.make_optimizer(name, learning_rate=schedule, axes=axes, clip_norm=clip,
                                 skewadam_tiers=tiers)
  if skip:
    tx = optax.apply_if_finite(tx, max_consecutive_errors=skip)
  slice_tx = optimizers.make_optimizer(name, learning_rate=schedule,
                                       axes=model_layerwise.slice_axes(axes), clip_norm=0,
                                       skewadam_tiers=tiers)
  standard = jax.jit(steps.make_step_fns(graphdef, rest, tx)[0])
  built = steps.layerwise_step(graphdef, rest, slice_tx, params, clip_norm=clip,
                               skip_nonfinite=skip)
  return standard, tx.init(_copy(params)), jax.jit(built.train_step), built.init(_copy(params))


@pytest.fixture(scope="module")
def pairs(tiny32):
  """:func:`_pair` by (optimizer, tiers), each compiled once for the module."""
  cache = {}

  def get(name, tiers=None):
    key = (name, repr(tiers))
    if key not in cache:
      cache[key] = _pair(tiny32, name, tiers)
    return cache[key]
  return get


def _run_both(tiny32, pair):
  standard, std_state, layerwise, lw_state = pair
  params = tiny32[1]
  std_params, lw_params = _copy(params), _copy(params)
  norms = []
  for tokens in tiny32[4]:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    std_params, std_state, std_m = standard(std_params, std_state, inputs, targets)
    # An all-ones per-layer scale: the NaN test then reuses this compiled step.
    lw_params, lw_state, lw_m = layerwise(lw_params, lw_state, inputs, targets,
                                          grad_scale=ONES_PER_LAYER)
    np.testing.assert_allclose(lw_m["loss"], std_m["loss"], rtol=1e-5)
    np.testing.assert_allclose(lw_m["grad_norm"], std_m["grad_norm"], rtol=1e-5)
    norms.append(float(std_m["grad_norm"]))
  return (std_params, std_state), (lw_params, lw_state), norms


def _by_path(tree):
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_states_close(standard, layerwise_state: layerwise.LayerwiseState, atol):
  """Every leaf of the standard state equals its layer-stack or outer counterpart."""
  parts = (_by_path(layerwise_state.layers), _by_path(layerwise_state.outer))
  for path, want in _by_path(standard).items():
    found = [part[path] for part in parts if path in part]
    assert found, f"no counterpart for state leaf {path}"
    for got in found:  # the step count is [L] in the layer stack's state
      np.testing.assert_allclose(np.asarray(got, np.float32),
                                 np.broadcast_to(np.asarray(want, np.float32), got.shape),
                                 atol=atol, rtol=0, err_msg=path)


# SkewAdam's default tiers quantise momentum (bf16 backbone, 1-bit sign experts):
# a float32 round-off difference in a gradient can move a value across a
# quantisation step, so its tolerance is that of the quantiser, not of fp32.
FP32_TIERS = {"backbone": {"momentum": "fp32"}, "expert": {"momentum": "fp32"}}


# With fp32 moments the two steps differ by float32 round-off only, which Adam's
# division amplifies where v is small: on one entry in 8,192 under XLA:CPU's
# legacy emitters (tests/_xla.py), up to 1e-5 on an Intel Xeon and 2.5e-5 on an
# AMD EPYC (which entry and how far depends on the CPU's kernels). A real
# difference between the two steps moves a parameter by about a step's update
# (lr 1e-2), 100x more than atol.
@pytest.mark.parametrize("name, tiers, atol", [
    ("adamw", None, 1e-4),
    ("skewadam", FP32_TIERS, 1e-4),
    # The default tiers round the bf16 momentum stochastically: a last-bit
    # difference between the two programs can send one entry to its other bf16
    # neighbour (one entry of 2048 moved 1.4e-4 here).
    ("skewadam", None, 3e-4),
])
def test_exact_mode_equals_the_standard_step_with_clipping(tiny32, pairs, name, tiers, atol):
  (std_params, std_state), (lw_params, lw_state), norms = _run_both(
      tiny32, pairs(name, tiers))
  assert min(norms) > CLIP  # clipping was active at every step
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=atol, rtol=0),
               lw_params, std_params)
  assert_states_close(std_state.inner_state[1], lw_state, atol)  # [1]: after the clip
  assert int(lw_state.total_notfinite) == int(std_state.total_notfinite) == 0


def test_muon_on_per_layer_matrices_runs_one_layer_at_a_time(tiny32):
  (std_params, _), (lw_params, _), _ = _run_both(tiny32, _pair(tiny32, "muon", clip=0, skip=0))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6, rtol=0),
               lw_params, std_params)


@pytest.mark.parametrize("name", ["lion", "adafactor", "muon", "skewadam", "adamw"])
def test_per_leaf_optimizers_pass_the_separability_check(tiny32, name):
  axes = model_layerwise.slice_axes(tiny32[3])
  tx = optimizers.make_optimizer(name, learning_rate=1e-3, axes=axes, clip_norm=0)
  layerwise.check_separable(tx, _per_layer(tiny32))


def test_nan_in_one_layer_skips_the_whole_step(tiny32, pairs):
  _, _, layerwise, state = pairs("skewadam")
  params = _copy(tiny32[1])
  tokens = tiny32[4][0]
  params, state, _ = layerwise(params, state, tokens[:, :-1], tokens[:, 1:],
                               grad_scale=ONES_PER_LAYER)
  before = jax.device_get((params, state))
  layer_nan = ONES_PER_LAYER.at[1].set(jnp.nan)
  params, state, metrics = layerwise(params, state, tokens[:, :-1], tokens[:, 1:],
                                     grad_scale=layer_nan)
  assert int(metrics["notfinite_count"]) == 1 and int(metrics["total_notfinite"]) == 1
  assert not bool(state.last_finite)
  # Nothing moved: no layer, not the outer parameters, not a step count.
  jax.tree.map(np.testing.assert_array_equal, params, before[0])
  jax.tree.map(np.testing.assert_array_equal, (state.layers, state.outer),
               (before[1].layers, before[1].outer))
  params, state, metrics = layerwise(params, state, tokens[:, :-1], tokens[:, 1:],
                                     grad_scale=ONES_PER_LAYER)
  assert int(metrics["notfinite_count"]) == 0 and int(metrics["total_notfinite"]) == 1
  assert not np.array_equal(params["unembed"]["kernel"], before[0]["unembed"]["kernel"])


def test_stale_mode_clips_by_the_previous_steps_norm(tiny32):
  graphdef, params, rest, axes, batches = tiny32
  schedule = optimizers.lr_schedule(1e-2, 10, 2)
  tx = optimizers.make_optimizer("adamw", learning_rate=schedule, axes=axes, clip_norm=0)
  slice_tx = optimizers.make_optimizer("adamw", learning_rate=schedule,
                                       axes=model_layerwise.slice_axes(axes), clip_norm=0)
  standard = jax.jit(steps.make_step_fns(graphdef, rest, tx)[0])
  built = steps.layerwise_step(graphdef, rest, slice_tx, params, clip_norm=CLIP,
                               clip_mode="stale")
  stale = jax.jit(built.train_step)
  ref_params, ref_state = _copy(params), tx.init(_copy(params))
  lw_params, lw_state = _copy(params), built.init(_copy(params))
  previous = 0.0  # no clipping at the first step
  for tokens in batches:
    factor = 1.0 if previous < CLIP else CLIP / previous
    ref_params, ref_state, ref_m = standard(ref_params, ref_state, tokens[:, :-1],
                                            tokens[:, 1:], grad_scale=np.float32(factor))
    lw_params, lw_state, lw_m = stale(lw_params, lw_state, tokens[:, :-1], tokens[:, 1:])
    previous = float(ref_m["grad_norm"]) / factor
    np.testing.assert_allclose(float(lw_m["grad_norm"]), previous, rtol=1e-5)
  # g·(c/n) here against (g/n)·c in the step: Adam's normalisation amplifies
  # that round-off for the few embedding entries whose gradient is near eps.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4, rtol=0),
               lw_params, ref_params)


@pytest.mark.parametrize("tx, what", [
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), "scaled by 1e4"),
    (optax.apply_if_finite(optax.adam(1e-3), 2), "set to NaN"),
])
def test_transformations_that_couple_parameters_are_refused(tiny32, tx, what):
  with pytest.raises(ValueError, match=f"update of 'embed/embedding' changed when the "
                                       f"other gradients were {what}"):
    layerwise.check_separable(tx, _per_layer(tiny32))


def test_bad_modes_are_refused():
  with pytest.raises(ValueError, match="needs --clip-mode exact"):
    config_lib.TrainConfig(update_in_backward=True, clip_mode="stale",
                           skip_nonfinite=2).validate()


def test_slice_axes_drop_only_the_layer_axis():
  axes = steps.abstract_axes("tiny")
  sliced = model_layerwise.slice_axes(axes)
  assert sliced["layers/moe/experts/w_up"] == ("experts", "embed", "mlp")
  assert sliced["layers/attn_norm/scale"] == ("embed",)
  assert sliced["unembed/kernel"] == axes["unembed/kernel"]


def test_planner_reports_less_gradient_memory_and_the_flops_of_each_mode():
  def flops(**mode):
    step, params, state = planner.abstract_train_step("tiny", "skewadam", **mode)
    tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    return planner.matmul_flops(step, params, state, tokens, tokens)

  standard = flops()
  # Exact mode recomputes and differentiates the stack twice (about 7 forward
  # passes' worth against the standard step's 4 with remat); stale mode once.
  assert 1.6 < flops(update_in_backward=True) / standard < 1.95
  assert 1.0 < flops(update_in_backward=True, clip_mode="stale") / standard < 1.12
  report = planner.plan("tiny", "skewadam", target="cpu", batch=2, seq=16,
                        update_in_backward=True, search_batch=False, device_memory_gb=24)
  assert report["update_in_backward"] and report["clip_mode"] == "exact"
  assert report["grad_bytes"] < report["param_bytes"] and report["fits"]
  assert report["device_bytes"] == 24e9 and report["matmul_flops"] > standard


def test_matmul_flops_counts_each_scan_iteration():
  w = jnp.ones((8, 8))
  one = planner.matmul_flops(lambda x: x @ w, jnp.ones((4, 8)))
  assert one == 2 * 4 * 8 * 8
  scanned = planner.matmul_flops(
      lambda x: jax.lax.scan(lambda c, _: (c @ w, None), x, None, length=5)[0], jnp.ones((4, 8)))
  assert scanned == 5 * one


def test_training_with_the_flag_resumes_exactly(tmp_path, corpus, cache_dir):
  config = config_lib.TrainConfig(preset="tiny", batch_size=4, seq_len=32, eval_batches=2,
                                  log_every=1, warmup_steps=2, steps=4, ckpt_every=2,
                                  data=corpus, update_in_backward=True, skip_nonfinite=2,
                                  sample_tokens=0)
  run = training.Run(config, cache_dir=cache_dir)
  full = training.train(config, tmp_path / "full", progress=False, run=run)
  training.train(config, tmp_path / "part", stop_after=2, progress=False, run=run)
  resumed = training.train(config, tmp_path / "part", resume=True, progress=False, run=run)
  jax.tree.map(np.testing.assert_array_equal, resumed.params, full.params)
  jax.tree.map(np.testing.assert_array_equal, resumed.opt_state, full.opt_state)
  assert np.isfinite(full["val_ppl"]) and full["opt_state_bytes_by_tier"]["expert"] > 0
