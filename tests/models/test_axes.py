"""The model's parameter paths meet the optimizer's default labeller (the contract)."""

import json
import math
import re

import jax
import jax.numpy as jnp
import pytest

import models
import skewadam_jax
from experiments import state_bytes
from experiments.planning import accounting
from experiments.training import optimizers
from experiments.training import steps
from skewadam_jax import labels as labels_lib


@pytest.mark.parametrize("preset", ["tiny", "moe-6.78b"])
def test_default_labeller_routes_every_model_parameter(preset):
  params = steps.abstract_params(preset)
  paths, leaves, _ = labels_lib.flatten_with_paths(params)
  tiers = labels_lib.resolve_labels(None, params)
  config = models.get_preset(preset)
  L, D, E, F = config.num_layers, config.d_model, config.num_experts, config.d_ff
  got = {path: (tier, leaf.shape) for path, tier, leaf in zip(paths, tiers, leaves)}
  assert {p: t for p, (t, _) in got.items() if t != "backbone"} == {
      "layers/moe/router/kernel": "router",
      "layers/moe/experts/w_gate": "expert",
      "layers/moe/experts/w_up": "expert",
      "layers/moe/experts/w_down": "expert",
  }
  assert got["layers/moe/router/kernel"][1] == (L, D, E)
  assert got["layers/moe/experts/w_down"][1] == (L, E, F, D)
  # The model's declared axes give the same tiers, leaf for leaf.
  declared = models.logical_axes(models.abstract_params(config))
  assert {p: models.axes.tier(declared[p]) for p in got} == {p: t for p, (t, _) in got.items()}


def test_6p78b_split_and_state_bytes_from_the_real_model():
  params = steps.abstract_params("moe-6.78b")
  labels = jax.tree.leaves(skewadam_jax.moe_param_labels(params))
  counts = {t: 0 for t in skewadam_jax.TIERS}
  for leaf, tier in zip(jax.tree.leaves(params), labels):
    counts[tier] += leaf.size
  assert counts == {"backbone": 167_822_336, "expert": 6_606_028_800, "router": 1_572_864}
  adamw = accounting.state_bytes("moe-6.78b", "adamw")
  assert round(adamw["total"] / 1e9, 1) == 54.2
  skew = accounting.state_bytes("moe-6.78b", "skewadam")
  assert skew["total"] == sum(skew[t] for t in ("backbone", "expert", "router", "other"))
  # Default backbone: bf16 m (2 B/param) plus row and column statistics of v.
  assert 2 * counts["backbone"] < skew["backbone"] < 2 * counts["backbone"] + 2e6
  adam_backbone = accounting.state_bytes(
      "moe-6.78b", "skewadam", skewadam_tiers={"backbone": {"momentum": "fp32",
                                                            "second_moment": "exact"}})
  assert adam_backbone["backbone"] == 8 * counts["backbone"]


@pytest.fixture(scope="module")
def tiny_params():
  return jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), steps.abstract_params("tiny"))


@pytest.mark.parametrize("optimizer", ["adamw", "skewadam", "muon", "lion", "adafactor"])
def test_per_leaf_plan_matches_what_the_optimizer_does(tiny_params, optimizer):
  from experiments.training import optimizers  # pylint: disable=import-outside-toplevel
  rows = accounting.per_leaf("tiny", optimizer)
  paths, leaves, _ = labels_lib.flatten_with_paths(tiny_params)
  assert [r["path"] for r in rows] == paths
  # Zero gradients: only weight decay moves a parameter, and only where "decayed".
  tx = optimizers.make_optimizer(optimizer, learning_rate=1.0, weight_decay=0.1,
                                 axes=steps.abstract_axes("tiny"))
  zeros = jax.tree.map(jnp.zeros_like, tiny_params)
  updates, _ = jax.jit(tx.update)(zeros, tx.init(tiny_params), tiny_params)
  moved = [bool(jnp.any(u != 0)) for u in jax.tree.leaves(updates)]
  assert [r["decayed"] for r in rows] == moved
  total = skewadam_jax.abstract_state_bytes_by_tier(
      tx, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tiny_params))["total"]
  assert 0 < total - sum(r["state_bytes"] for r in rows) <= 200  # counts and placeholders
  if optimizer == "skewadam":
    # each leaf's own state (the default stacks a group's at its first leaf)
    leafwise = optimizers.make_optimizer(optimizer, learning_rate=1.0, weight_decay=0.1,
                                         axes=steps.abstract_axes("tiny"),
                                         skewadam_tiers={"group_leaves": False})
    state = leafwise.init(tiny_params)[0]  # skewadam clips inside its own step: no clip state
    for row, nu in zip(rows, jax.tree.leaves(state.nu)):
      assert (row["second_moment"] == "exact") == (tuple(nu.shape) == tuple(row["shape"]))
  else:
    assert {r["tier"] for r in rows} == {None}
  assert ({r["orthogonalized"] for r in rows} == {None}) == (optimizer not in ("muon",
                                                                           "skewadam"))


def test_orthogonal_tiers_orthogonalise_what_muon_does():
  tiers = {"backbone": {"direction": "orthogonal"}, "expert": {"direction": "orthogonal"}}
  rows = accounting.per_leaf("tiny", "skewadam", skewadam_tiers=tiers)
  muon = accounting.per_leaf("tiny", "muon")
  assert ([r["orthogonalized"] for r in rows] == [r["orthogonalized"] for r in muon]
          and any(r["orthogonalized"] for r in rows))
  assert all((r["second_moment"] == "none") == r["orthogonalized"] for r in rows)


def test_per_leaf_command_writes_json(capsys):
  assert state_bytes.main(["--preset", "tiny", "--per-leaf", "--optimizer", "skewadam",
                           "--json"]) == 0

  report = json.loads(capsys.readouterr().out)
  keys = {"path", "shape", "axes", "tier", "momentum", "second_moment", "decayed",
          "orthogonalized", "state_bytes"}
  assert report["leaves"] and all(set(r) == keys for r in report["leaves"])


def test_per_leaf_command_takes_the_tier_flags(capsys):
  flags = ["--expert-momentum", "fp32", "--expert-direction", "orthogonal",
           "--param-dtype", "bfloat16"]
  assert state_bytes.main(["--preset", "tiny", "--per-leaf", "--optimizer", "skewadam",
                           "--json"] + flags) == 0
  leaves = json.loads(capsys.readouterr().out)["leaves"]
  experts = [r for r in leaves if r["tier"] == "expert"]
  assert experts and all(r["momentum"] == "fp32" and r["orthogonalized"] for r in experts)
  # Against a real state of the same configuration: fp32 momentum, no second moment.
  tiers = {"expert": {"momentum": "fp32", "direction": "orthogonal"}}
  tx = optimizers.make_optimizer("skewadam", learning_rate=1e-3, axes=steps.abstract_axes("tiny"),
                                 skewadam_tiers=tiers)
  params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype),
                        steps.abstract_params("tiny", jnp.bfloat16))
  real = skewadam_jax.state_bytes_by_tier(tx.init(params))
  assert sum(r["state_bytes"] for r in experts) == real["expert"]
  assert real["expert"] == 4 * sum(math.prod(r["shape"]) for r in experts)


# Paths by name, independently of the declared axes: what each must be.
NORM_SCALE = re.compile(r"(^|/)\w*norm/scale$")
MATRIX = re.compile(r"(/kernel|/embedding|/w_(gate|up|down))$")


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("optimizer", ["adamw", "skewadam", "muon", "lion", "adafactor"])
def test_command_plan_never_decays_or_orthogonalises_a_norm_scale(capsys, preset, optimizer):
  # The command a user runs; its "decayed" column is one real update with zero
  # gradients and weight decay 0.1 on the preset itself.
  assert state_bytes.main(["--preset", preset, "--optimizer", optimizer, "--per-leaf",
                           "--json"]) == 0
  leaves = json.loads(capsys.readouterr().out)["leaves"]
  norms = [r for r in leaves if NORM_SCALE.search(r["path"])]
  matrices = [r for r in leaves if MATRIX.search(r["path"])]
  assert len(norms) == 3 and len(norms) + len(matrices) == len(leaves)
  assert {len(r["shape"]) for r in norms} == {1, 2}  # [D] and stacked [L, D]
  assert [r["path"] for r in norms if r["decayed"]] == []
  assert all(r["decayed"] for r in matrices)
  if optimizer == "muon":
    orthogonal = {r["path"] for r in leaves if r["orthogonalized"]}
    assert orthogonal == {r["path"] for r in matrices
                          if not re.search(r"embed|router", r["path"])}
  if optimizer == "skewadam":
    assert {r["second_moment"] for r in norms} == {"exact"}
    assert {r["momentum"] for r in norms} == {"bf16"}  # the backbone's, dense
    stacked = [r for r in norms if len(r["shape"]) == 2]
    assert all(r["tier"] == "backbone" for r in stacked)
