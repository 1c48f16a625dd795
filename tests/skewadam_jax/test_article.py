"""The article's optimizer (skewadam_jax/article.py) against a NumPy transcription of its code.

The reference is written here, in float64, from the article's public PyTorch
code (github.com/nuemaan/skewadam at 50f3da6: ``skewadam.py``'s ``step`` and
the tier groups of ``train.py: build_optimizer``), one tensor at a time:
decoupled decay first, the EMA of g² floored at 1e-8 inside the root before
bias correction (two separate floors when factored), momentum only in the
dense tier, the RMS clip over the whole tensor. Runs are 110 steps, so the
bias correction decays and the clip acts on vectors too; at gradient scale
1e-5 the floor binds on every entry.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax
from skewadam_jax import article

STEPS, LR, WD = 110, 1e-2, 0.05
TIERS = {"dense": (True, True, WD), "experts": (False, True, WD), "router": (False, False, 0.0)}


def reference_step(p, g, state, tier, t, clip_axes=None):
  """One step of the reference for one float64 tensor; returns (p, state)."""
  momentum, factored, wd = TIERS[tier]
  factored = factored and p.ndim >= 2
  p = p * (1 - LR * wd)
  bc1, bc2 = 1 - 0.9 ** t, 1 - 0.999 ** t
  g2 = g * g
  if factored:
    state["row"] = 0.999 * state["row"] + 0.001 * g2.mean(-1, keepdims=True)
    state["col"] = 0.999 * state["col"] + 0.001 * g2.mean(-2, keepdims=True)
    mean = np.maximum(state["row"].mean(-2, keepdims=True), 1e-15)
    denominator = (np.sqrt(np.maximum(state["row"] / mean, 1e-8))
                   * np.sqrt(np.maximum(state["col"], 1e-8)))
  else:
    state["v"] = 0.999 * state["v"] + 0.001 * g2
    denominator = np.sqrt(np.maximum(state["v"], 1e-8))
  if momentum:
    state["m"] = 0.9 * state["m"] + 0.1 * g
    u = state["m"] * math.sqrt(bc2) / bc1 / denominator
  else:
    u = g * math.sqrt(bc2) / denominator
  rms = np.sqrt(np.mean(u * u, axis=clip_axes, keepdims=True))
  u = u / np.maximum(rms, 1.0)
  return p - LR * u, state


def reference_init(p, tier):
  momentum, factored, _ = TIERS[tier]
  state = {"m": np.zeros_like(p)} if momentum else {}
  if factored and p.ndim >= 2:
    state["row"] = np.zeros(p.shape[:-1] + (1,))
    state["col"] = np.zeros(p.shape[:-2] + (1,) + p.shape[-1:])
  else:
    state["v"] = np.zeros_like(p)
  return state


def _tree(seed=0):
  ks = iter(jax.random.split(jax.random.key(seed), 8))
  n = lambda *shape: np.asarray(jax.random.normal(next(ks), shape), np.float64)
  # The vectors of the tiers without momentum (an expert bias, a router bias)
  # are where the RMS clip acts on vectors: their u is about g / sqrt(v).
  return {"dense": {"kernel": n(6, 5), "scale": n(5)},
          "experts": {"e0": n(4, 3), "e1": n(4, 3), "bias": n(3)},
          "router": {"kernel": n(5, 2), "bias": n(2)}}


def _run_both(params, scale, clip_scope="tensor", seed=1):
  """(JAX params, reference params) after STEPS steps on the same random gradients."""
  rng = np.random.default_rng(seed)
  tx = skewadam_jax.skewadam_article(LR, clip_scope=clip_scope)
  jax_params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  state = tx.init(jax_params)
  step = jax.jit(tx.update)
  paths, leaves, treedef = skewadam_jax.labels.flatten_with_paths(params)
  tiers = [path.split("/")[0] for path in paths]
  ref = [np.array(x) for x in leaves]
  ref_state = [reference_init(x, tier) for x, tier in zip(ref, tiers)]
  for t in range(1, STEPS + 1):
    grads = [scale * rng.standard_normal(x.shape) * (1 + (t % 7)) for x in leaves]
    updates, state = step(treedef.unflatten([jnp.asarray(g, jnp.float32) for g in grads]),
                          state, jax_params)
    jax_params = optax.apply_updates(jax_params, updates)
    for i, (g, tier) in enumerate(zip(grads, tiers)):
      axes = (ref[i].ndim - 2, ref[i].ndim - 1) if (clip_scope == "matrix"
                                                     and ref[i].ndim >= 2) else None
      ref[i], ref_state[i] = reference_step(ref[i], g, ref_state[i], tier, t, axes)
  return jax.tree.leaves(jax_params), ref


@pytest.mark.parametrize("scale", [1.0, 1e-5], ids=["unit", "floor-binds"])
def test_each_expert_matrix_its_own_leaf(scale):
  got, want = _run_both(_tree(), scale)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("scale", [1.0, 1e-5], ids=["unit", "floor-binds"])
def test_a_stacked_bank(scale):
  """[E, R, C] bank: factored per expert; the clip over the whole tensor, as the code does."""
  params = {"dense": {"scale": _tree()["dense"]["scale"]},
            "experts": {"w": np.stack([_tree()["experts"]["e0"], _tree()["experts"]["e1"]])}}
  got, want = _run_both(params, scale)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_a_matrix_clip_of_a_stacked_bank_equals_one_leaf_per_expert():
  """clip_scope="matrix": the article's run, whose experts were separate 2-D tensors."""
  tree = _tree()
  bank = {"experts": {"w": np.stack([tree["experts"]["e0"], tree["experts"]["e1"]])}}
  per_expert = {"experts": {"e0": tree["experts"]["e0"], "e1": tree["experts"]["e1"]}}
  tx = skewadam_jax.skewadam_article(LR, clip_scope="matrix")
  grads = np.random.default_rng(3).standard_normal((2, 4, 3)) * 5.0
  stacked = tx.update({"experts": {"w": jnp.asarray(grads, jnp.float32)}},
                      tx.init(jax.tree.map(jnp.asarray, bank)),
                      jax.tree.map(jnp.asarray, bank))[0]["experts"]["w"]
  split = tx.update({"experts": {"e0": jnp.asarray(grads[0], jnp.float32),
                                 "e1": jnp.asarray(grads[1], jnp.float32)}},
                    tx.init(jax.tree.map(jnp.asarray, per_expert)),
                    jax.tree.map(jnp.asarray, per_expert))[0]["experts"]
  np.testing.assert_allclose(stacked, np.stack([split["e0"], split["e1"]]), rtol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 1e-5], ids=["unit", "floor-binds"])
def test_declared_matrix_axes_step_a_scanned_tree_as_per_layer_tensors(scale):
  """A scanned model's leaves, with matrix_axes declared and clip_scope="matrix",
  step as the reference's per-layer tensors: a stacked norm scale [L, D]
  keeps an exact v and one clip a layer; a kernel [D, L, F] with its layer
  axis in the middle is factored over (D, F) a layer at a time."""
  layers, rng = 3, np.random.default_rng(5)
  params = {"dense": {"scale": rng.standard_normal((layers, 5)),
                      "kernel": rng.standard_normal((6, layers, 4))},
            "experts": {"w": rng.standard_normal((layers, 2, 4, 3))}}
  declared = {"dense": {"scale": None, "kernel": skewadam_jax.MatrixAxes(0, 2)},
              "experts": {"w": skewadam_jax.MatrixAxes(2, 3)}}
  tx = skewadam_jax.skewadam_article(LR, clip_scope="matrix", matrix_axes=declared)
  jax_params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  state, step = tx.init(jax_params), jax.jit(tx.update)
  # The reference's tensors: one per layer (and per expert), as separate modules.
  slices = {"scale": lambda x, l: x[l], "kernel": lambda x, l: x[:, l, :],
            "w": lambda x, l: x[l]}
  ref = {(name, l): np.array(slices[name](params[tier][name], l))
         for tier, name in (("dense", "scale"), ("dense", "kernel"), ("experts", "w"))
         for l in range(layers)}
  tier_of = {"scale": "dense", "kernel": "dense", "w": "experts"}
  ref_state = {}
  for (name, l), x in ref.items():
    ref_state[name, l] = (reference_init(x, tier_of[name]) if name != "w"
                          else [reference_init(e, "experts") for e in x])
  for t in range(1, 13):
    grads = jax.tree.map(lambda x: scale * rng.standard_normal(x.shape), params)
    updates, state = step(jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads),
                          state, jax_params)
    jax_params = optax.apply_updates(jax_params, updates)
    for (name, l), x in ref.items():
      g = slices[name](grads[tier_of[name]][name], l)
      if name == "w":  # each expert its own 2-D tensor
        stepped = [reference_step(e, ge, s, "experts", t)
                   for e, ge, s in zip(x, g, ref_state[name, l])]
        ref[name, l] = np.stack([p for p, _ in stepped])
        ref_state[name, l] = [s for _, s in stepped]
      else:
        ref[name, l], ref_state[name, l] = reference_step(x, g, ref_state[name, l],
                                                          tier_of[name], t)
  for name, tier in tier_of.items():
    want = np.stack([ref[name, l] for l in range(layers)], axis=1 if name == "kernel" else 0)
    np.testing.assert_allclose(jax_params[tier][name], want, rtol=2e-5, atol=2e-6,
                               err_msg=name)
  assert state[0].nu["dense"]["scale"].shape == (layers, 5)  # exact v
  assert isinstance(state[0].nu_row["dense"]["scale"], optax.MaskedNode)
  assert state[0].nu_row["dense"]["kernel"].shape == (6, layers, 1)

def test_the_floor_makes_the_step_depend_on_the_gradient_scale():
  """Adam's step is scale-free; the reference's grows with the gradient where the floor binds."""
  params = {"router": {"kernel": jnp.ones((3, 2))}}
  tx = skewadam_jax.skewadam_article(1.0)
  size = lambda s: float(jnp.abs(tx.update({"router": {"kernel": jnp.full((3, 2), s)}},
                                           tx.init(params), params)[0]["router"]["kernel"]).max())
  assert size(1e-4) == pytest.approx(10 * size(1e-5), rel=1e-4)
  assert size(1.0) == pytest.approx(size(10.0), rel=1e-4)  # floor far below: Adam's sign-like


def test_state_per_tier():
  state = skewadam_jax.skewadam_article(LR).init(jax.tree.map(jnp.asarray, _tree()))[0]
  assert state.mu["dense"]["kernel"].shape == (6, 5)
  assert isinstance(state.mu["experts"]["e0"], optax.MaskedNode)
  assert isinstance(state.mu["router"]["kernel"], optax.MaskedNode)
  assert (state.nu_row["experts"]["e0"].shape, state.nu_col["experts"]["e0"].shape) == (
      (4, 1), (1, 3))
  assert isinstance(state.nu["experts"]["e0"], optax.MaskedNode)
  assert state.nu["dense"]["scale"].shape == (5,)
  assert state.nu["router"]["kernel"].shape == (5, 2)
  assert isinstance(state.nu_row["router"]["kernel"], optax.MaskedNode)


def test_the_decay_mask_spares_only_the_router():
  mask = article.article_decay_mask(_tree())
  assert mask == {"dense": {"kernel": True, "scale": True},
                  "experts": {"e0": True, "e1": True, "bias": True},
                  "router": {"kernel": False, "bias": False}}


def test_hyperparameters_can_be_injected():
  params = jax.tree.map(jnp.asarray, _tree())
  grads = jax.tree.map(jnp.ones_like, params)
  plain = skewadam_jax.skewadam_article(LR)
  injected = optax.inject_hyperparams(skewadam_jax.skewadam_article)(learning_rate=LR)
  want, _ = plain.update(grads, plain.init(params), params)
  got, _ = jax.jit(injected.update)(grads, injected.init(params), params)
  # Injected, b2 is a float32 array: 1 - b2 is 1.3e-5 off the Python float's.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5), got, want)


@pytest.mark.parametrize("kwargs, match", [
    (dict(b1=1.0), "b1 must be in"), (dict(floor=0.0), "floor must be > 0"),
    (dict(clip_threshold=-1.0), "clip_threshold must be > 0"),
    (dict(clip_scope="expert"), "clip_scope must be one of tensor, matrix"),
])
def test_bad_settings_are_refused(kwargs, match):
  with pytest.raises(ValueError, match=match):
    skewadam_jax.skewadam_article(LR, **kwargs)


def test_floor_share_counts_the_entries_whose_denominator_the_floor_sets():
  """Against the denominator formed entry by entry: floored where max(., φ) picks φ."""
  rng = np.random.default_rng(7)
  params = {"dense": {"kernel": jnp.zeros((3, 6, 5)), "scale": jnp.zeros(5)},
            "router": {"kernel": jnp.zeros((5, 4))}}
  tx = optax.chain(optax.clip_by_global_norm(1e9), skewadam_jax.skewadam_article(LR))
  state = tx.init(params)
  for _ in range(3):
    # Entries spread over 12 decades so that some rows, columns and entries bind.
    grads = jax.tree.map(lambda p: jnp.asarray(
        rng.standard_normal(p.shape) * 10.0 ** rng.uniform(-9, 3, p.shape), jnp.float32), params)
    _, state = tx.update(grads, state, params)
  inner = state[1][0]
  bound = [np.asarray(inner.nu["dense"]["scale"]) < 1e-8,
           np.asarray(inner.nu["router"]["kernel"]) < 1e-8]
  v_row, v_col = (np.asarray(x["dense"]["kernel"]) for x in (inner.nu_row, inner.nu_col))
  normalised = v_row / np.maximum(v_row.mean(axis=-2, keepdims=True), 1e-15)
  bound.append((normalised < 1e-8) | (v_col < 1e-8))  # broadcast to [3, 6, 5]
  want = sum(b.sum() for b in bound) / sum(b.size for b in bound)
  assert 0 < want < 1
  np.testing.assert_allclose(float(article.floor_share(state)), want, rtol=1e-6)
  assert float(article.floor_share(optax.adam(1e-3).init(params))) == 0.0
