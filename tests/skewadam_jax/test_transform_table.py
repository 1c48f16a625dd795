"""Optax-style property tests over one table of SkewAdam configurations.

The table: every momentum encoding x second-moment form x parameter dtype,
with one ``TierConfig`` applied to all three tiers (``int8_block_size=4`` so
that int8 blocks matter on these tiny shapes), plus the library's three
default tiers (``skewadam_jax.skewadam(lr)`` with its default labels) for both
dtypes. Every property below runs over the whole table:

1. convergence on a parabola and on a Rosenbrock-like objective;
2. no recompilation on the second call of a jitted update;
3. ``optax.inject_hyperparams`` (no ``static_args``) gives the plain updates
   and state, and still applies weight decay (to matrices only);
4. the state keeps its structure, shapes and dtypes through an update, and an
   update inside ``lax.cond`` compiles;
5. ``optax.MultiSteps(every_k_schedule=2)``;
6. ``optax.tree.map_params`` with and without an extra params-shaped tree;
7. ``jax.eval_shape(tx.init, abstract_params)`` matches ``tx.init(params)``;
8. explicit-sharding stability on 8 simulated devices (in one subprocess,
   tests/_explicit_sharding_worker.py, started when this module's first test
   runs so that it overlaps with the others).

Compiled functions are shared between the tests of a configuration
(``functools.cache``), so each configuration compiles each function once.

Run alone: ``.venv/bin/python -m pytest tests/skewadam_jax/test_transform_table.py -q``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import subprocess
import sys
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import skewadam_jax as sa
from tests import _subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = ROOT / "tests" / "_explicit_sharding_worker.py"

# ---------------------------------------------------------------------------
# The table.


@dataclasses.dataclass(frozen=True)
class Config:
  """One row: a TierConfig for all three tiers (``momentum=None``: the defaults)."""
  momentum: Optional[str]
  second_moment: Optional[str]
  dtype: str
  int8_block_size: int = 4

  @property
  def id(self) -> str:
    form = "default-tiers" if self.momentum is None else f"{self.momentum}-{self.second_moment}"
    return f"{form}-{self.dtype}"

  @property
  def jdtype(self):
    return jnp.dtype(self.dtype)

  def tiers(self) -> dict:
    if self.momentum is None:
      return {}
    tier = sa.TierConfig(self.momentum, self.second_moment,
                         int8_block_size=self.int8_block_size)
    return {"backbone": tier, "expert": tier, "router": tier}

  def tx(self, learning_rate, **kwargs):
    return sa.skewadam(learning_rate, **kwargs, **self.tiers())

  def as_json(self) -> dict:
    return {"id": self.id, "momentum": self.momentum, "second_moment": self.second_moment,
            "int8_block_size": self.int8_block_size, "dtype": self.dtype}


DTYPES = ("float32", "bfloat16")
# lowrank is tested on its own (test_encodings.py): its factors are unique only up
# to a rotation, so two programs' states compare by their product; its explicit
# sharding is the orthogonal default's row of the sharding worker (ORTHOGONAL).
CONFIGS = [Config(m, s, d) for d in DTYPES for m in sa.ENCODINGS if m != "lowrank"
           for s in ("exact", "factored") if (m, s) != ("sign", "exact")] + [
    Config(None, None, d) for d in DTYPES]
table = pytest.mark.parametrize("cfg", CONFIGS, ids=[c.id for c in CONFIGS])
# skewadam_orthogonal's defaults (rank-84 int8 expert momentum: codes, and Qᵀ's row
# steps), for the sharding worker only.
ORTHOGONAL = {"id": "orthogonal-default", "alias": "orthogonal", "dtype": "float32"}
# the same with the expert momentum's factors in bfloat16 (the default before int8)
ORTHOGONAL_BF16 = {"id": "orthogonal-bf16-factors", "alias": "orthogonal", "dtype": "float32",
                   "expert": {"lowrank_dtype": "bfloat16", "lowrank_rank": 2}}

# A backbone matrix and vector, a router, and a 3-D expert bank under "experts"
# (labelled by the default labeller: moe/router -> router, moe/experts -> expert).
SHAPES = {"w": (6, 5), "norm": (5,), "moe": {"router": (5, 3), "experts": (3, 5, 6)}}
MATRICES = ("w", "moe/router", "moe/experts")   # declared matrices (ndim >= 2)
VECTORS = ("norm",)

LR, WD = 1e-2, 0.1  # the property tests' (non-convergence) hyperparameters

# The property tests (2-7) compile ~100 small programs and run each a few
# times: LLVM's optimisation level 0 saves a third of their compile time. It
# changes neither shapes, dtypes nor shardings (fixed before the backend
# runs) nor float results (XLA:CPU does not use fast-math); the convergence
# runs, which execute 2000 steps, keep the default.
jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _is_shape(x):
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def make_tree(seed: int, dtype, sample=None):
  sample = sample or (lambda k, s: jax.random.normal(k, s))
  leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=_is_shape)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(treedef, [sample(k, s).astype(dtype) for k, s in zip(keys, leaves)])


def by_path(tree) -> dict[str, Any]:
  return {sa.labels.path_to_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def tol(cfg: Config) -> dict:
  """Comparison tolerance for two computations that should agree to rounding."""
  # bf16 results are rounded to 8 significant bits: allow one ulp (2^-7 rel.).
  return dict(rtol=2.0**-7, atol=1e-6) if cfg.dtype == "bfloat16" else dict(rtol=1e-5, atol=1e-8)


def assert_trees_close(got, want, *, rtol, atol, what="", check_dtypes=True):
  assert jax.tree.structure(got) == jax.tree.structure(want), what
  bad = []
  for (path, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
    name = f"{what}{jax.tree_util.keystr(path)}"
    g, w = np.asarray(g), np.asarray(w)
    if (check_dtypes and g.dtype != w.dtype) or g.shape != w.shape:
      bad.append(f"{name}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}")
      continue
    if np.issubdtype(g.dtype, np.integer):
      if not np.array_equal(g, w):
        bad.append(f"{name}: integer arrays differ in {int((g != w).sum())} places")
      continue
    g32, w32 = g.astype(np.float32), w.astype(np.float32)
    if not np.allclose(g32, w32, rtol=rtol, atol=atol, equal_nan=False):
      err = np.abs(g32 - w32)
      finite = err[np.isfinite(err)]
      bad.append(f"{name}: max finite |diff| {finite.max() if finite.size else 0:.3g}, "
                 f"nan got/want {int(np.isnan(g32).sum())}/{int(np.isnan(w32).sum())}")
  assert not bad, "\n".join(bad)


def typeof_tree(tree):
  return jax.tree.map(jax.typeof, tree)


# ---------------------------------------------------------------------------
# Shared per-configuration computations (each compiles once per configuration).


@dataclasses.dataclass
class Plain:
  tx: Any
  step: Any              # jit(tx.update)
  params: Any
  grads: list
  state0: Any            # tx.init(params)
  updates1: Any          # step(grads[0], state0, params)
  state1: Any
  updates2: Any          # step(grads[1], state1, params)
  state2: Any
  second_call_compiles: int  # executables the second call added to the jit cache


@functools.cache
def plain(cfg: Config) -> Plain:
  tx = cfg.tx(LR, weight_decay=WD)
  params = make_tree(0, cfg.jdtype)
  grads = [make_tree(10 + i, cfg.jdtype) for i in range(2)]
  step = jit(tx.update)
  state0 = tx.init(params)
  updates1, state1 = jax.block_until_ready(step(grads[0], state0, params))
  compiled = step._cache_size()  # pylint: disable=protected-access
  updates2, state2 = jax.block_until_ready(step(grads[1], state1, params))
  return Plain(tx, step, params, grads, state0, updates1, state1, updates2, state2,
               step._cache_size() - compiled)  # pylint: disable=protected-access


# ---------------------------------------------------------------------------
# 1. Convergence.
#
# One schedule for every row: cosine decay from 0.05 to 0.005 over 2000 steps.
# At the end Adam's normalised step |lr·u| is at most ~lr = 5e-3 per
# coordinate, so a converged fp32 parameter sits within ~5e-3 of the optimum:
# that is the fp32 tolerance (observed worst, sign momentum with exact v on
# Rosenbrock: 5e-4). The sign encoding's rank-one |m| makes it the slowest
# row; 2000 steps are what it needs on the Rosenbrock valley (at 500 steps it
# is still ~0.9 away), the other rows are converged far earlier.
#
# bf16 parameters are updated with the library's unbiased stochastic rounding
# (skewadam_jax.apply_updates_stochastic): with round-to-nearest the steps
# along the Rosenbrock valley (|lr·u| < half an ulp, 2^-9 below 1) are rounded
# away and the runs stall ~0.15 from the optimum whatever the encoding, which
# is bf16's limit, not the optimizer's. With it, parameters settle within a
# few bf16 ulps of the optimum (ulp 2^-7 = 0.0078 just above 1), plus the
# encoding's noise: the bf16 tolerance is 0.08, ~10 ulps (observed worst 0.047,
# sign momentum). Both tolerances are far below the initial distances (up to
# ~4 for the parabola, 1 for Rosenbrock), and the loss must also fall by a
# large factor (fp32: 1e6, observed >= 4e8; bf16: 1e3, observed >= 1e4), so a
# wrong sign, a broken bias correction or a diverging encoding fails.

STEPS, PEAK_LR, FINAL_LR = 2000, 0.05, 0.005
ROSEN_B = 2.0
CONVERGE = {"float32": dict(tol=5e-3, factor=1e6), "bfloat16": dict(tol=0.08, factor=1e3)}


def parabola(params, target):
  return sum(jnp.sum(jnp.square(p.astype(jnp.float32) - t.astype(jnp.float32)))
             for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(target)))


def rosenbrock(params):
  """Rosenbrock on pairs (x_i, y_i) of each leaf's entries (first half, second half).

  Sum of (1 − x)² + B·(y − x²)², minimum 0 at all ones; an odd leftover entry
  z adds (1 − z)². B = 2 keeps the curved valley but lets Adam reach its end in
  2000 steps from U(0, 1.5).
  """
  total = 0.0
  for leaf in jax.tree.leaves(params):
    flat = leaf.astype(jnp.float32).reshape(-1)
    half = flat.size // 2
    x, y, rest = flat[:half], flat[half:2 * half], flat[2 * half:]
    total += (jnp.sum(jnp.square(1 - x) + ROSEN_B * jnp.square(y - x * x))
              + jnp.sum(jnp.square(1 - rest)))
  return total


def _max_err(params, target) -> float:
  return max(float(jnp.max(jnp.abs(p.astype(jnp.float32) - t.astype(jnp.float32))))
             for p, t in zip(jax.tree.leaves(params), jax.tree.leaves(target)))


@functools.cache
def converged(cfg: Config) -> dict:
  """Both objectives minimised from fixed starts, in one jitted function."""
  tx = cfg.tx(optax.cosine_decay_schedule(PEAK_LR, STEPS, alpha=FINAL_LR / PEAK_LR))
  dtype = cfg.jdtype
  start = make_tree(0, dtype)
  target = make_tree(1, dtype, lambda k, s: jax.random.uniform(k, s, minval=-1, maxval=1))
  rosen_start = make_tree(2, dtype, lambda k, s: jax.random.uniform(k, s, minval=0, maxval=1.5))
  ones = jax.tree.map(jnp.ones_like, start)
  stochastic = dtype == jnp.bfloat16

  @jax.jit
  def minimise(start, rosen_start, target):
    def run(loss, params):
      def body(i, carry):
        params, state = carry
        updates, state = tx.update(jax.grad(loss)(params), state, params)
        if stochastic:
          key = jax.random.fold_in(jax.random.key(0, impl="unsafe_rbg"), i)
          return sa.apply_updates_stochastic(params, updates, key), state
        return optax.apply_updates(params, updates), state
      return jax.lax.fori_loop(0, STEPS, body, (params, tx.init(params)))[0]
    return run(lambda p: parabola(p, target), start), run(rosenbrock, rosen_start)

  para_end, rosen_end = minimise(start, rosen_start, target)
  return {
      "parabola": dict(loss0=float(parabola(start, target)), loss=float(parabola(para_end, target)),
                       err=_max_err(para_end, target), dtypes=[x.dtype for x in jax.tree.leaves(para_end)]),
      "rosenbrock": dict(loss0=float(rosenbrock(rosen_start)), loss=float(rosenbrock(rosen_end)),
                         err=_max_err(rosen_end, ones), dtypes=[x.dtype for x in jax.tree.leaves(rosen_end)]),
  }


def _check_converged(cfg, result):
  bound = CONVERGE[cfg.dtype]
  assert all(d == cfg.jdtype for d in result["dtypes"]), result["dtypes"]
  assert np.isfinite(result["loss"]), result
  assert result["loss"] * bound["factor"] <= result["loss0"], (
      f"loss {result['loss0']:.3g} -> {result['loss']:.3g}, not down by {bound['factor']:g}")
  assert result["err"] <= bound["tol"], (
      f"max |param - optimum| {result['err']:.3g} > {bound['tol']:g} "
      f"(loss {result['loss0']:.3g} -> {result['loss']:.3g})")


@table
def test_converges_on_parabola(cfg):
  _check_converged(cfg, converged(cfg)["parabola"])


@table
def test_converges_on_rosenbrock(cfg):
  _check_converged(cfg, converged(cfg)["rosenbrock"])


# ---------------------------------------------------------------------------
# 2. No recompilation on the second call.


@table
def test_jitted_update_does_not_recompile(cfg):
  run = plain(cfg)
  assert run.second_call_compiles == 0, run.second_call_compiles
  assert run.step._cache_size() == 1  # pylint: disable=protected-access
  assert int(run.state2[0].count) == 2
  for u in jax.tree.leaves(run.updates2):
    assert u.dtype == cfg.jdtype
    assert bool(jnp.all(jnp.isfinite(u)))


# ---------------------------------------------------------------------------
# 3. inject_hyperparams without static_args.


# optax.inject_hyperparams stores the numeric hyperparameters in the params'
# highest dtype unless hyperparam_dtype is given: bfloat16 for bf16 params, where
# b2 = 0.999 rounds to 1.0 and the bias correction divides by zero, for
# optax.adam as for SkewAdam. The docs (guides/optax.md) say to inject with
# hyperparam_dtype=float32 for bf16 params, so that is what bf16 rows run;
# float32 rows run the plain default ("params").
inject_table = pytest.mark.parametrize(
    "cfg,hp_dtype",
    [(c, "params" if c.dtype == "float32" else "float32") for c in CONFIGS],
    ids=[f"{c.id}-hp_{'params' if c.dtype == 'float32' else 'float32'}" for c in CONFIGS])


@functools.cache
def injected(cfg: Config, hp_dtype: str) -> dict:
  factory = optax.inject_hyperparams(
      sa.skewadam, hyperparam_dtype=None if hp_dtype == "params" else jnp.dtype(hp_dtype))
  tx = factory(learning_rate=LR, weight_decay=WD, **cfg.tiers())
  tx_no_decay = factory(learning_rate=LR, weight_decay=0.0, **cfg.tiers())
  run = plain(cfg)
  step = jit(tx.update)
  state = tx.init(run.params)
  updates1, state1 = step(run.grads[0], state, run.params)
  updates2, state2 = step(run.grads[1], state1, run.params)
  # The hyperparameters live in the state: the same compiled step serves
  # tx_no_decay's state (weight_decay=0).
  no_decay1, _ = step(run.grads[0], tx_no_decay.init(run.params), run.params)
  return dict(updates=(updates1, updates2), states=(state1, state2), no_decay1=no_decay1,
              cache_size=step._cache_size(),  # pylint: disable=protected-access
              hyperparams={k: np.asarray(v, np.float32).item()
                           for k, v in state.hyperparams.items()})


def _finite(tree, what):
  bad = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
         if not bool(jnp.all(jnp.isfinite(x)))]
  assert not bad, f"{what}: non-finite values in {bad}"


@inject_table
def test_inject_hyperparams_matches_plain(cfg, hp_dtype):
  run, inj = plain(cfg), injected(cfg, hp_dtype)
  assert inj["cache_size"] == 1
  # The chain's last step multiplies by the injected lr, so the updates take
  # the promoted dtype of the params and the hyperparameters (as for
  # optax.inject_hyperparams(optax.adamw)): the params' dtype by default,
  # float32 for bf16 params with hyperparam_dtype=float32.
  hp = cfg.jdtype if hp_dtype == "params" else jnp.dtype(hp_dtype)
  updates_dtype = jnp.result_type(cfg.jdtype, hp)
  for i, (u, s, u_ref, s_ref) in enumerate(zip(
      inj["updates"], inj["states"], (run.updates1, run.updates2), (run.state1, run.state2))):
    _finite(u, f"step {i + 1} updates (injected hyperparams {inj['hyperparams']})")
    # With bf16 params and float32 hyperparameters the plain run rounds λ, λθ,
    # u + λθ and the product with lr to bf16, the injected one only u + λθ:
    # allow 2 bf16 ulps of the result, and of an update of size lr where u and
    # λθ nearly cancel.
    # An injected b2 is a float32 value, so its 1 − b2 is rounded twice
    # (4.7e-5 relative at 0.999), where the plain run's Python float is
    # rounded once; optax.inject_hyperparams(optax.adam) differs from
    # optax.adam the same way.
    injected_b = dict(rtol=1e-4, atol=1e-8) if cfg.dtype == "float32" else tol(cfg)
    loose = (dict(rtol=2.0**-6, atol=2 * LR * 2.0**-7) if updates_dtype != cfg.jdtype
             else injected_b)
    assert_trees_close(u, u_ref, **loose, what=f"step {i + 1} updates", check_dtypes=False)
    assert {x.dtype for x in jax.tree.leaves(u)} == {updates_dtype}
    assert_trees_close(s.inner_state, s_ref, **injected_b, what=f"step {i + 1} state")


@inject_table
def test_inject_hyperparams_applies_weight_decay_to_matrices_only(cfg, hp_dtype):
  run, inj = plain(cfg), injected(cfg, hp_dtype)
  _finite(inj["updates"][0], f"updates (injected hyperparams {inj['hyperparams']})")
  _finite(inj["no_decay1"], "updates with weight_decay=0")
  with_decay, no_decay = by_path(inj["updates"][0]), by_path(inj["no_decay1"])
  params = by_path(run.params)
  for name in VECTORS:
    np.testing.assert_array_equal(np.asarray(with_decay[name], np.float32),
                                  np.asarray(no_decay[name], np.float32), err_msg=name)
  for name in MATRICES:
    got = np.asarray(with_decay[name], np.float32) - np.asarray(no_decay[name], np.float32)
    want = -LR * WD * np.asarray(params[name], np.float32)
    # Δθ = −lr·(u + λθ): the two runs differ by −lr·λ·θ, up to rounding of
    # u + λθ and of the product with lr in the updates' dtype (and of the
    # injected lr and λ themselves for bf16 hyperparameters).
    rel = 2.0**-7 if cfg.dtype == "bfloat16" else 1e-5
    scale = np.abs(np.asarray(no_decay[name], np.float32)) + np.abs(want)
    assert np.any(got != 0), f"{name}: weight decay not applied"
    np.testing.assert_array_less(np.abs(got - want), 2 * rel * scale + 1e-9, err_msg=name)


# ---------------------------------------------------------------------------
# 4. State stability and lax.cond.


@table
def test_state_types_are_stable_and_update_compiles_in_cond(cfg):
  run = plain(cfg)
  assert jax.tree.structure(run.state0) == jax.tree.structure(run.state1)
  assert typeof_tree(run.state0) == typeof_tree(run.state1)
  assert typeof_tree(run.state0) == typeof_tree(run.state2)
  tx = run.tx

  @jit
  def maybe_step(pred, grads, state, params):
    return jax.lax.cond(pred, lambda: tx.update(grads, state, params),
                        lambda: (jax.tree.map(jnp.zeros_like, grads), state))

  updates, state = maybe_step(True, run.grads[0], run.state0, run.params)
  assert_trees_close(updates, run.updates1, **tol(cfg), what="cond updates")
  assert_trees_close(state, run.state1, **tol(cfg), what="cond state")
  updates, state = maybe_step(False, run.grads[0], run.state0, run.params)
  assert_trees_close(state, run.state0, rtol=0, atol=0, what="skipped state")
  assert int(state[0].count) == 0


# ---------------------------------------------------------------------------
# 5. MultiSteps.


@table
def test_multisteps_accumulates_then_steps(cfg):
  run = plain(cfg)
  multi = optax.MultiSteps(run.tx, every_k_schedule=2)
  step = jit(multi.update)
  state = multi.init(run.params)
  updates, state = step(run.grads[0], state, run.params)
  assert all(not bool(jnp.any(u)) for u in jax.tree.leaves(updates)), "first micro-step moved"
  updates, state = step(run.grads[1], state, run.params)
  assert all(bool(jnp.any(u)) for u in jax.tree.leaves(updates)), "second micro-step did not"
  assert int(state.gradient_step) == 1
  assert step._cache_size() == 1  # pylint: disable=protected-access
  # Equal to one plain step on the mean gradient (same compiled plain step).
  mean = jax.tree.map(lambda a, b: (a + (b - a) / 2).astype(a.dtype), *run.grads)
  ref, ref_state = run.step(mean, run.state0, run.params)
  loose = dict(rtol=5e-2, atol=1e-3) if cfg.dtype == "bfloat16" else tol(cfg)
  assert_trees_close(updates, ref, **loose, what="multisteps updates")
  assert typeof_tree(state.inner_opt_state) == typeof_tree(ref_state)


# ---------------------------------------------------------------------------
# 6. optax.tree.map_params.


@table
def test_map_params(cfg):
  run = plain(cfg)
  state = run.state1
  fields = [f for f in state[0]._fields if f != "count"]

  # f is applied to every leaf of every params-shaped field (placeholders too).
  abstract = optax.tree.map_params(run.tx, lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  assert jax.tree.structure(abstract) == jax.tree.structure(state)
  assert abstract[0].count is state[0].count                # not a param tree: untouched
  for f in fields:
    assert jax.tree.map(lambda x: (x.shape, x.dtype), getattr(abstract[0], f)) == jax.tree.map(
        lambda x: (x.shape, x.dtype), getattr(state[0], f)), f

  labels = sa.moe_param_labels(run.params)  # a params-shaped tree of strings
  out = optax.tree.map_params(run.tx, lambda _, label: label, state, labels,
                              transform_non_params=lambda _: "not-a-param")
  assert jax.tree.structure(out) == jax.tree.structure(state)
  for f in fields:
    assert getattr(out[0], f) == labels, f
  assert out[0].count == "not-a-param"

  specs = {"w": P(None, "x"), "norm": P("x"),
           "moe": {"router": P(), "experts": P("x", None, None)}}
  out = optax.tree.map_params(run.tx, lambda _, spec: spec, state, specs,
                              transform_non_params=lambda _: P())
  assert jax.tree.structure(out) == jax.tree.structure(state)
  for f in fields:
    assert getattr(out[0], f) == specs, f
  assert out[0].count == P()


# ---------------------------------------------------------------------------
# 7. Abstract init.


@table
def test_abstract_init_matches_init(cfg):
  run = plain(cfg)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), run.params)
  for tx in (run.tx, optax.MultiSteps(run.tx, every_k_schedule=2),
             optax.inject_hyperparams(sa.skewadam)(learning_rate=LR, **cfg.tiers())):
    shapes = jax.eval_shape(tx.init, abstract)
    concrete = tx.init(run.params)
    assert jax.tree.structure(shapes) == jax.tree.structure(concrete)
    assert jax.tree.map(lambda x: (x.shape, x.dtype, x.weak_type), shapes) == jax.tree.map(
        lambda x: (x.shape, x.dtype, jax.typeof(x).weak_type), concrete)


# ---------------------------------------------------------------------------
# 8. Explicit sharding on 8 simulated devices (one subprocess for the table).


def _wants_worker(session) -> bool:
  """Whether the session will run this module's sharding tests (not with -k deselecting them)."""
  return any(getattr(item, "module", None) is sys.modules[__name__]
             and item.name.startswith("test_explicit_sharding") for item in session.items)


@pytest.fixture(scope="module", autouse=True)
def _sharding_worker(request):
  """Starts the 8-device worker with the module's first test, to overlap with the rest."""
  if not _wants_worker(request.session):
    yield None
    return
  proc = subprocess.Popen(
      [sys.executable, str(WORKER), json.dumps([c.as_json() for c in CONFIGS] + [ORTHOGONAL, ORTHOGONAL_BF16])],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_subprocess.environment(devices=8), cwd=ROOT, text=True)
  yield proc
  if proc.poll() is None:
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def sharding_results(_sharding_worker):
  proc = _sharding_worker
  assert proc is not None
  try:
    stdout, stderr = proc.communicate(timeout=600)
  except subprocess.TimeoutExpired:
    proc.kill()
    stdout, stderr = proc.communicate()
  assert proc.returncode == 0, stderr[-4000:]
  return json.loads(stdout.strip().splitlines()[-1])


@table
def test_explicit_sharding_types_are_stable(cfg, sharding_results):
  _assert_stable_types(sharding_results[cfg.id])


def test_explicit_sharding_types_are_stable_for_the_orthogonal_default(sharding_results):
  # Newton-Schulz and the lowrank expert momentum's QR on an expert bank sharded on its
  # expert axis, a matrix sharded on its columns, a router on its rows; the int8 codes'
  # hashed rounding under explicit axes, and Qᵀ's row steps.
  _assert_stable_types(sharding_results[ORTHOGONAL["id"]])


def test_explicit_sharding_types_are_stable_for_bfloat16_expert_factors(sharding_results):
  # the bfloat16 factors' stochastic rounding under explicit axes
  _assert_stable_types(sharding_results[ORTHOGONAL_BF16["id"]])


def _assert_stable_types(result):
  errors = {k: v for k, v in result.items() if k.endswith("error")}
  assert not errors, "\n".join(f"{k}:\n{v}" for k, v in errors.items())
  stages = result["stages"]
  init = stages["init"]
  for stage in ("eval_shape_init", "eager_update", "jit_update", "jit_update_2"):
    diff = {k: (v, stages[stage].get(k)) for k, v in init.items() if stages[stage].get(k) != v}
    assert not diff, f"{stage} vs init (init, {stage}): {diff}"
  assert result["eager_updates"] == result["params"]
  assert result["jit_updates"] == result["params"]
  assert result["jit_cache_size"] == 1
