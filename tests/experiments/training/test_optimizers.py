"""Learning-rate schedules against hand-computed values, and their settings' checks."""

import math

import pytest

from experiments.training import config as config_lib
from experiments.training import optimizers
from experiments.training.config import TrainConfig, with_defaults


def _at(schedule, step):
  return float(schedule(step))


def test_cosine_warms_up_then_decays_to_a_tenth():
  s = optimizers.lr_schedule(2.0, 100, 10)
  assert _at(s, 5) == pytest.approx(1.0)
  assert _at(s, 10) == pytest.approx(2.0)
  mid = 10 + 45
  assert _at(s, mid) == pytest.approx(0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * 0.5)), rel=1e-5)
  assert _at(s, 100) == pytest.approx(0.2)


@pytest.mark.parametrize("kind, shape", [("wsd", lambda f: 1 - math.sqrt(f)),
                                          ("cooldown", lambda f: 1 - f)])
def test_constant_phase_then_the_decay_over_the_last_fraction(kind, shape):
  s = optimizers.lr_schedule(2.0, 100, 10, kind=kind, decay_fraction=0.2)
  assert _at(s, 5) == pytest.approx(1.0)
  for step in (10, 50, 80):  # stable until the decay starts at 100 - 20
    assert _at(s, step) == pytest.approx(2.0)
  for step in (85, 90, 99):
    assert _at(s, step) == pytest.approx(2.0 * shape((step - 80) / 20), rel=1e-5, abs=1e-6)
  assert _at(s, 100) == pytest.approx(0.0, abs=1e-7)


def test_bad_schedules_are_refused_with_the_reason():
  with pytest.raises(ValueError, match="unknown schedule 'linear'"):
    optimizers.lr_schedule(1.0, 100, 10, kind="linear")
  with pytest.raises(ValueError, match="overlap the 10 warmup steps"):
    optimizers.lr_schedule(1.0, 100, 10, kind="wsd", decay_fraction=0.95)
  with pytest.raises(ValueError, match="--schedule must be one of"):
    TrainConfig(schedule="step").validate()
  with pytest.raises(ValueError, match="--decay-fraction must be in"):
    TrainConfig(schedule="wsd", decay_fraction=0.0).validate()
  with pytest.raises(ValueError, match="overlap"):
    TrainConfig(schedule="cooldown", steps=100, warmup_steps=60, decay_fraction=0.5).validate()


def test_saved_configs_take_the_defaults_of_fields_they_predate():
  saved = {"preset": "tiny", "lr": 0.1}
  full = with_defaults(saved)
  assert full["schedule"] == "cosine" and full["decay_fraction"] == 0.2
  assert full["lr"] == 0.1 and full["preset"] == "tiny"
  assert full["sample_tokens"] == 0  # what runs did before the flag, not its default


ORTHOGONAL = {"backbone": {"direction": "orthogonal"}, "expert": {"direction": "orthogonal"}}


def test_the_rest_tier_gives_muons_adamw_leaves_adamws_moments():
  from experiments.planning import accounting  # pylint: disable=import-outside-toplevel
  plain = {r["path"]: r for r in accounting.per_leaf("tiny", "skewadam", skewadam_tiers=ORTHOGONAL)}
  rest = {r["path"]: r for r in accounting.per_leaf(
      "tiny", "skewadam", skewadam_tiers={**ORTHOGONAL, optimizers.REST_TIER: "router"})}
  moved = sorted(p for p, r in rest.items() if r["tier"] != plain[p]["tier"])
  # Exactly what Muon leaves to its AdamW part: the backbone leaves it does not orthogonalise.
  muon = {r["path"]: r for r in accounting.per_leaf("tiny", "muon")}
  assert moved == sorted(p for p, r in muon.items()
                         if not r["orthogonalized"] and plain[p]["tier"] == "backbone")
  assert any("embed" in p for p in moved) and any("norm" in p for p in moved)
  for path in moved:  # AdamW's moments: fp32 m, exact v, 8 bytes a parameter
    assert (rest[path]["tier"], rest[path]["momentum"], rest[path]["second_moment"]) == (
        "router", "fp32", "exact"), path
    assert rest[path]["state_bytes"] == 8 * math.prod(rest[path]["shape"]), path
  for path in set(rest) - set(moved):  # nothing else changes
    assert rest[path] == plain[path], path


def test_orthogonal_scale_and_rest_tier_are_training_settings():
  config = TrainConfig(backbone_direction="orthogonal", expert_direction="orthogonal",
                       expert_orthogonal_scale="adam_rms", orthogonal_rest_tier="router")
  config.validate()
  tiers = config.skewadam_tiers()
  assert tiers["expert"] == {"direction": "orthogonal", "orthogonal_scale": "adam_rms",
                            "momentum": "lowrank", "lowrank_rank": 84, "lowrank_dtype": "int8"}
  assert tiers["backbone"]["orthogonal_scale"] == "width"  # the default, the alias's
  assert tiers[optimizers.REST_TIER] == "router"
  assert optimizers.REST_TIER not in optimizers.tier_configs(tiers)
  from experiments.training import config as config_lib  # pylint: disable=import-outside-toplevel
  assert TrainConfig(**config_lib.tier_fields(tiers)).skewadam_tiers() == tiers


def test_skewadam_orthogonal_is_the_training_commands_orthogonal_row():
  # The library's one-call form of the measured configuration must be the
  # optimizer `train --backbone-direction orthogonal --expert-direction
  # orthogonal` builds, update for update, on the real model's tree (its
  # labels and stacked matrix axes passed as a user passes theirs).
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import models  # pylint: disable=import-outside-toplevel
  import skewadam_jax  # pylint: disable=import-outside-toplevel
  model = models.Transformer(models.get_preset("tiny"), rngs=nnx.Rngs(0))
  params = nnx.as_pure(nnx.split(model, nnx.Param, ...)[1])
  axes = models.logical_axes(nnx.split(model, nnx.Param, ...)[1])
  lr = 1e-2
  command = TrainConfig(backbone_direction="orthogonal", expert_direction="orthogonal")
  train = optimizers.make_optimizer("skewadam", learning_rate=lr, axes=axes,
                                    skewadam_tiers=command.skewadam_tiers())
  declared = optimizers.skewadam_axes(axes)
  alias = skewadam_jax.skewadam_orthogonal(  # its default decay mask: the declared matrices
      lr, param_labels=declared["param_labels"], matrix_axes=declared["matrix_axes"])
  states = [train.init(params), alias.init(params)]
  update = jax.jit(lambda tx, g, s, p: tx.update(g, s, p), static_argnums=0)
  for step in range(2):
    grads = jax.tree.map(lambda x, k: jax.random.normal(k, x.shape, x.dtype), params,
                         jax.tree.unflatten(jax.tree.structure(params), list(
                             jax.random.split(jax.random.key(step), len(jax.tree.leaves(params))))))
    (u_train, states[0]), (u_alias, states[1]) = (
        update(tx, grads, s, params) for tx, s in zip((train, alias), states))
    for a, b in zip(jax.tree.leaves(u_train), jax.tree.leaves(u_alias)):
      np.testing.assert_array_equal(a, b)


def test_muon_momentum_is_muons_own_beta():
  # --muon-momentum reaches optax.contrib.muon's beta: Muon's part of the tree
  # equals optax's muon built with that beta by hand; 0.95 is optax's default.
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from optax.contrib import muon  # pylint: disable=import-outside-toplevel
  axes = {"w": ("embed", "mlp")}
  params = {"w": jnp.ones((4, 6))}
  dims = optimizers.muon_dimension_numbers(axes)
  grads = [{"w": jax.random.normal(jax.random.key(s), (4, 6))} for s in range(2)]
  for beta in (0.95, 0.5):
    ours = optimizers.make_optimizer("muon", learning_rate=0.1, axes=axes, weight_decay=0.0,
                                     clip_norm=0, muon_momentum=beta)
    reference = muon(0.1, beta=beta, muon_weight_dimension_numbers=dims)
    states = [ours.init(params), reference.init(params)]
    for g in grads:
      (u, states[0]), (want, states[1]) = (tx.update(g, s, params)
                                           for tx, s in zip((ours, reference), states))
    assert jnp.allclose(u["w"], want["w"], rtol=1e-5, atol=1e-6), beta
  with pytest.raises(ValueError, match="--muon-momentum must be in"):
    TrainConfig(muon_momentum=1.0).validate()


def test_nesterov_gives_adams_direction_optax_nesterov():
  # --nesterov on reaches the library: a backbone leaf with AdamW's moments
  # (fp32 m, exact v) steps as optax.adamw(nesterov=True) does, clip included,
  # and differs from the plain step.
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from experiments.training import config as config_lib  # pylint: disable=import-outside-toplevel
  config = TrainConfig(backbone_direction="adam", expert_direction="adam",
                       backbone_momentum="fp32", backbone_second_moment="exact", nesterov="on")
  config.validate()
  tiers = config.skewadam_tiers()
  assert tiers["nesterov"] is True and "nesterov" not in optimizers.tier_configs(tiers)
  assert TrainConfig(**config_lib.tier_fields(tiers)).skewadam_tiers() == tiers
  axes = {"w": ("embed", "mlp")}
  params = {"w": jnp.ones((4, 6))}
  grads = [{"w": jax.random.normal(jax.random.key(s), (4, 6))} for s in range(3)]

  def updates(tx):
    state, out = tx.init(params), []
    for g in grads:
      u, state = tx.update(g, state, params)
      out.append(u["w"])
    return out

  kwargs = dict(learning_rate=0.1, axes=axes, weight_decay=0.1)
  ours = updates(optimizers.make_optimizer("skewadam", skewadam_tiers=tiers, **kwargs))
  plain = updates(optimizers.make_optimizer(
      "skewadam", skewadam_tiers={**tiers, "nesterov": False}, **kwargs))
  want = updates(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(
      0.1, b1=0.9, b2=0.95, weight_decay=0.1, nesterov=True)))
  for got, ref, other in zip(ours, want, plain):
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
    assert np.abs(np.asarray(got - other)).max() > 1e-3


def test_expert_lowrank_complement_reaches_the_expert_tier():
  import argparse  # pylint: disable=import-outside-toplevel
  import skewadam_jax as sa  # pylint: disable=import-outside-toplevel
  from experiments.training import config as config_lib  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser()
  config_lib.add_flags(parser, config_lib.TIER_FIELDS)
  args = parser.parse_args(["--expert-lowrank-complement", "0"])
  tiers = config_lib.tiers_from_args(args)
  assert tiers["expert"]["lowrank_complement"] == 0.0  # 0 is kept, not dropped as unset
  assert TrainConfig(**config_lib.tier_fields(tiers)).skewadam_tiers() == tiers
  assert sa.TierConfig(**optimizers.tier_configs(tiers)["expert"]).lowrank_complement == 0.0
  assert "expert" not in TrainConfig().skewadam_tiers() or (
      "lowrank_complement" not in TrainConfig().skewadam_tiers()["expert"])
  with pytest.raises(ValueError, match="lowrank_complement must be in"):
    TrainConfig(expert_lowrank_complement=2.0).validate()


def test_expert_lowrank_orthogonalise_reaches_the_expert_tier():
  import argparse  # pylint: disable=import-outside-toplevel
  import skewadam_jax as sa  # pylint: disable=import-outside-toplevel
  from experiments.training import config as config_lib  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser()
  config_lib.add_flags(parser, config_lib.TIER_FIELDS)
  tiers = config_lib.tiers_from_args(parser.parse_args(["--expert-lowrank-orthogonalise",
                                                        "factors"]))
  assert tiers["expert"]["lowrank_orthogonalise"] == "factors"
  assert TrainConfig(**config_lib.tier_fields(tiers)).skewadam_tiers() == tiers
  expert = sa.TierConfig(**optimizers.tier_configs(tiers)["expert"])
  assert (expert.lowrank_orthogonalise, expert.momentum) == ("factors", "lowrank")
  assert "lowrank_orthogonalise" not in TrainConfig().skewadam_tiers()["expert"]
  with pytest.raises(ValueError, match="leave lowrank_complement at 1"):
    TrainConfig(expert_lowrank_orthogonalise="factors", expert_lowrank_complement=0.5).validate()
  with pytest.raises(ValueError, match="lowrank_orthogonalise .half."):
    TrainConfig(expert_lowrank_orthogonalise="half").validate()


def test_owner_axes_reach_each_orthogonal_tier_iterated_whole():
  owned = TrainConfig(orthogonal_owner_axes="data").skewadam_tiers()
  assert owned["backbone"]["orthogonal_owner_axes"] == ("data",)
  assert owned["expert"]["orthogonal_owner_axes"] == ("data",)
  # Through the factors the expert iterate is small: its products stay all-reduced.
  factors = TrainConfig(orthogonal_owner_axes="data",
                        expert_lowrank_orthogonalise="factors").skewadam_tiers()
  assert factors["backbone"]["orthogonal_owner_axes"] == ("data",)
  assert "orthogonal_owner_axes" not in factors["expert"]
  assert TrainConfig(**config_lib.tier_fields(owned)).skewadam_tiers() == owned
  assert "orthogonal_owner_axes" not in TrainConfig().skewadam_tiers()["expert"]

@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_expert_lowrank_dtype_reaches_the_expert_tier(dtype):
  import argparse  # pylint: disable=import-outside-toplevel
  import skewadam_jax as sa  # pylint: disable=import-outside-toplevel
  from experiments.training import config as config_lib  # pylint: disable=import-outside-toplevel
  parser = argparse.ArgumentParser()
  config_lib.add_flags(parser, config_lib.TIER_FIELDS)
  args = parser.parse_args(["--expert-lowrank-rank", "32", "--expert-lowrank-dtype", dtype])
  tiers = config_lib.tiers_from_args(args)
  assert tiers["expert"]["lowrank_dtype"] == dtype
  assert TrainConfig(**config_lib.tier_fields(tiers)).skewadam_tiers() == tiers
  expert = sa.TierConfig(**optimizers.tier_configs(tiers)["expert"])
  assert (expert.lowrank_rank, expert.lowrank_dtype) == (32, dtype)
  assert expert.momentum_encoding().stochastic  # the default rounding reaches the factors
  with pytest.raises(ValueError, match="lowrank_dtype must be one of"):
    TrainConfig(expert_lowrank_dtype="float16").validate()


def test_the_default_rate_follows_the_expert_tiers_direction_and_scale():
  rate = lambda config: optimizers.default_lr(config.optimizer, config.skewadam_tiers())  # noqa: E731
  # The default (Muon's width scaling) at the tuning's rate; Adam's update RMS at the
  # 1600-step sweep's, so a run that names it, or one saved before the default moved
  # (its scale unset: the library's), keeps the rate it had.
  assert rate(TrainConfig()) == 1.5e-2
  assert rate(TrainConfig(expert_orthogonal_scale="adam_rms")) == 1.35e-2
  saved = TrainConfig().as_dict() | {"expert_orthogonal_scale": None, "lr": None}
  assert rate(TrainConfig(**with_defaults(saved))) == 1.35e-2
  assert rate(TrainConfig(backbone_direction="adam", expert_direction="adam")) == 3e-3
  assert rate(TrainConfig(optimizer="muon")) == optimizers.DEFAULT_LR["muon"]
