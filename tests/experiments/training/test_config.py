"""The training configuration as a file (experiments/training/config.py): a user's own MoE shape.

A TOML file sets any TrainConfig field in its table; the command line
overrides it; ``experiments.train --config FILE`` trains it and
``experiments.memory --config FILE`` plans the same run.
"""

import dataclasses
import json

import pytest

import models
import skewadam_jax

from experiments.training import config as config_lib
from experiments import memory
from experiments.planning import planner
from experiments import train as train_lib

# A shape no preset has: 6 layers, width 64, 8 experts, top-2, expert width 96 (the
# shipped examples/my-moe.toml, 6 x 256 with 16 experts of width 512, is checked below;
# this smaller one trains and plans in the time a test has).
MY_MOE = """
[model]
preset = "tiny"
num_layers = 6
d_model = 64
num_heads = 4
num_experts = 8
top_k = 2
d_ff = 96
param_dtype = "bfloat16"

[optimizer]
optimizer = "skewadam"
lr = 3e-3

[optimizer.tiers.expert]
momentum = "int8"

[data]
batch_size = 2
seq_len = 16

[run]
steps = 2
warmup_steps = 1
"""


@pytest.fixture
def my_moe(tmp_path):
  path = tmp_path / "my-moe.toml"
  path.write_text(MY_MOE.replace("warmup_steps = 1\n", "") + "eval_batches = 1\n"
                  "sample_tokens = 0\n" + "\n[optimizer.tiers.backbone]\nmomentum = \"bf16\"\n")
  return path


def test_every_field_has_one_table():
  placed = [name for names in config_lib.SECTIONS.values() for name in names]
  assert sorted(placed) == sorted(f.name for f in dataclasses.fields(config_lib.TrainConfig))
  assert len(placed) == len(set(placed))


def test_a_file_sets_the_fields_and_the_command_line_overrides_it(my_moe):
  values = config_lib.load_config_file(my_moe)
  assert values["num_experts"] == 8 and values["expert_momentum"] == "int8"
  assert values["backbone_momentum"] == "bf16" and values["lr"] == 3e-3
  config, _ = train_lib.parse_args(["--config", str(my_moe), "--num-layers", "3"])
  model = config.model_config()
  assert (model.num_layers, model.d_model, model.num_experts, model.top_k, model.d_ff) == (
      3, 64, 8, 2, 96)
  # A file's tiers amend the training command's defaults (orthogonal directions,
  # width-scaled; no low-rank settings beside another momentum).
  width = {"direction": "orthogonal", "orthogonal_scale": "width"}
  assert config.skewadam_tiers() == {"expert": {"momentum": "int8", **width},
                                     "backbone": {"momentum": "bf16", **width}}


@pytest.mark.parametrize("text, message", [
    ("[modle]\nnum_layers = 2\n", r"unknown table \[modle\]"),
    ("[model]\nnum_layer = 2\n", r"\[model\]: unknown key 'num_layer'"),
    ("[run]\nnum_layers = 2\n", r"\[run\]: 'num_layers' belongs in \[model\]"),
    ("[model]\nnum_layers = \"two\"\n", r"\[model\]: num_layers must be int, got 'two'"),
    ("[optimizer]\nlr = true\n", r"lr must be float, got True"),
    ("[optimizer.tiers.expert]\nmoment = \"int8\"\n", r"expert.moment has no training flag"),
    ("[model\n", "not valid TOML"),
])
def test_a_bad_file_is_one_line_naming_the_key(tmp_path, text, message):
  path = tmp_path / "bad.toml"
  path.write_text(text)
  with pytest.raises(ValueError, match=message):
    config_lib.load_config_file(path)


def test_a_shape_the_model_refuses_is_one_line(tmp_path, capsys):
  path = tmp_path / "odd.toml"
  path.write_text('[model]\npreset = "tiny"\nd_model = 30\nnum_heads = 4\n')
  assert train_lib.main(["--config", str(path), "--out", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err
  assert "d_model=30 is not divisible by num_heads=4" in err and "\n" == err[-1:]
  assert train_lib.main(["--config", str(tmp_path / "none.toml")]) == 2
  assert "no such configuration file" in capsys.readouterr().err


def test_my_own_moe_trains_from_its_file_and_the_planner_plans_the_same_file(
    my_moe, corpus, tmp_path, capsys):
  out = tmp_path / "run"
  assert train_lib.main(["--config", str(my_moe), "--data", corpus, "--out", str(out),
                         "--no-progress"]) == 0
  summary = json.loads((out / "summary.json").read_text())
  saved = summary["config"]
  assert (saved["num_layers"], saved["d_model"], saved["num_experts"], saved["d_ff"]) == (
      6, 64, 8, 96)
  capsys.readouterr()
  # The CPU target: what is checked is which model and state the file gives the
  # planner, not a GPU's analysis (test_memory.py compiles for the GPU targets).
  assert memory.main(["--config", str(my_moe), "--target", "cpu", "--no-search", "--json"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["num_params"] == summary["num_params"]
  assert report["opt_state_bytes_by_tier"] == summary["opt_state_bytes_by_tier"]
  width = {"direction": "orthogonal", "orthogonal_scale": "width"}
  assert report["skewadam_tiers"] == {"expert": {"momentum": "int8", **width},
                                      "backbone": {"momentum": "bf16", **width}}


def test_the_shipped_example_file_is_a_valid_configuration():
  values = config_lib.load_config_file(config_lib.ROOT / "examples" / "my-moe.toml")
  config = config_lib.TrainConfig(**values)
  config.validate()
  width = {"direction": "orthogonal", "orthogonal_scale": "width"}
  assert config.model_config().num_experts == 16 and config.skewadam_tiers() == {
      "expert": {"momentum": "sign", **width}, "backbone": width}


@pytest.mark.parametrize("name", sorted(models.PRESETS))
def test_every_preset_is_a_shipped_configuration_file(name):
  # The file alone (no `preset` key) gives the preset field for field, whatever
  # TrainConfig's default preset is: every ModelConfig field is a [model] key.
  path = models.PRESETS_DIR / f"{name}.toml"
  values = config_lib.load_config_file(path)
  assert "preset" not in values
  for base in models.PRESETS:
    assert config_lib.TrainConfig(preset=base, **values).model_config() == models.PRESETS[name]
  spelled = set(values) | {"attention_impl"}  # None (JAX chooses) has no TOML spelling
  assert spelled == {f.name for f in dataclasses.fields(models.ModelConfig)}


def test_every_model_setting_has_a_flag_and_a_key():
  fields = {f.name for f in dataclasses.fields(models.ModelConfig)}
  assert set(config_lib.SECTIONS["model"]) - {"preset"} == fields
  config, _ = train_lib.parse_args(["--preset", "tiny", "--no-remat", "--loss-chunk-size", "8",
                                    "--compute-dtype", "float32", "--z-loss-coef", "0"])
  model = config.model_config()
  assert (model.remat, model.loss_chunk_size, model.compute_dtype.name, model.z_loss_coef) == (
      False, 8, "float32", 0.0)
  assert train_lib.parse_args(["--preset", "tiny"])[0].model_config() == models.PRESETS["tiny"]
  with pytest.raises(ValueError, match="--norm-eps must be > 0"):
    config_lib.TrainConfig(preset="tiny", norm_eps=0.0).validate()


def test_a_preset_file_names_its_bad_key(tmp_path):
  path = tmp_path / "bad.toml"
  path.write_text("[model]\nvocab_size = 8\nwidth = 4\n")
  with pytest.raises(ValueError, match=r"bad.toml: unknown \[model\] keys \['width'\]"):
    models.load_preset_file(path)
  path.write_text("[run]\nsteps = 1\n")
  with pytest.raises(ValueError, match="no \\[model\\] table"):
    models.load_preset_file(path)


def test_the_default_expert_momentum_follows_the_direction_and_old_runs_keep_signs():
  default = config_lib.TrainConfig()
  assert default.expert_momentum is None and default.resolved_expert_momentum == "lowrank"
  adam = config_lib.TrainConfig(backbone_direction="adam", expert_direction="adam")
  # Adam's direction is the library's skewadam(): its packed signs, no expert setting.
  assert adam.resolved_expert_momentum is None and "expert" not in adam.skewadam_tiers()
  assert adam.as_dict()["expert_momentum"] == "sign"
  assert default.as_dict()["expert_momentum"] == "lowrank"
  # A run saved before rank 16 (None: the library's signs, whatever the direction)
  # is not the default's run; with signs named it is.
  saved = default.as_dict() | {"expert_momentum": None}
  assert "expert_momentum='sign'" in config_lib.resume_check(default.as_dict())({"config": saved})
  signs = dataclasses.replace(default, expert_momentum="sign")
  assert config_lib.resume_check(signs.as_dict())({"config": saved}) is None
  assert config_lib.resume_check(adam.as_dict())(
      {"config": adam.as_dict() | {"expert_momentum": None}}) is None


def test_the_orthogonal_tiers_defaults_are_the_alias_settings():
  default = config_lib.TrainConfig()
  alias = skewadam_jax.orthogonal_settings()
  tiers = default.skewadam_tiers()
  assert tiers["expert"] == alias["expert"] and tiers["backbone"] == alias["backbone"]
  saved = default.as_dict()  # a run saves what its None resolved to
  assert (saved["expert_lowrank_rank"], saved["expert_lowrank_dtype"],
          saved["backbone_orthogonal_scale"], saved["expert_orthogonal_scale"]) == (
              84, "int8", "width", "width")
  assert config_lib.resume_check(saved)({"config": saved}) is None
  # Adam's direction is the library's skewadam(): none of the alias's settings.
  adam = config_lib.TrainConfig(backbone_direction="adam", expert_direction="adam")
  assert adam.skewadam_tiers() == {} and adam.as_dict()["expert_lowrank_rank"] is None


def test_a_run_saved_before_the_alias_set_a_tier_key_keeps_the_librarys_value():
  # Saved unset (None) or before the field existed (absent): the library's rank 16,
  # float32 factors and Adam-RMS scale, not the alias's new values.
  old = {"optimizer": "skewadam", "backbone_direction": "orthogonal",
         "expert_direction": "orthogonal", "expert_momentum": "lowrank",
         "expert_lowrank_rank": None, "backbone_orthogonal_scale": None,
         "expert_orthogonal_scale": None}
  filled = config_lib.with_defaults(old)
  assert (filled["expert_lowrank_rank"], filled["expert_lowrank_dtype"],
          filled["backbone_orthogonal_scale"], filled["expert_orthogonal_scale"]) == (
              16, "float32", "adam_rms", "adam_rms")
  assert "expert_lowrank_rank=16" in config_lib.resume_check(
      config_lib.TrainConfig(weight_decay=0.1).as_dict())({"config": old})
  rebuilt = config_lib.TrainConfig(**filled).skewadam_tiers()["expert"]
  expert = dataclasses.replace(skewadam_jax.DEFAULT_EXPERT, **rebuilt)
  assert (expert.lowrank_rank, expert.lowrank_dtype, expert.orthogonal_scale) == (
      16, "float32", "adam_rms")
  # A planner report's tiers are the library's arguments: what they leave out is the library's.
  fields = config_lib.tier_fields({"expert": {"direction": "orthogonal", "momentum": "lowrank"}})
  assert (fields["expert_lowrank_rank"], fields["expert_lowrank_dtype"]) == (16, "float32")
  # The library's signs read no low-rank setting: none is filled in.
  fields = config_lib.tier_fields({"expert": {"direction": "orthogonal"}})
  assert fields["expert_momentum"] == "sign" and "expert_lowrank_rank" not in fields
  assert "expert_lowrank_rank" not in config_lib.tier_fields({})  # Adam's direction: unset


def test_the_weight_decay_default_is_the_optimizers_and_the_alias_for_orthogonal_tiers(
    monkeypatch):
  assert config_lib.TrainConfig().as_dict()["weight_decay"] == 0.2  # saved resolved

  def moved(learning_rate, weight_decay=0.3, **kwargs):  # the alias with another default
    raise AssertionError("only its signature is read")

  monkeypatch.setattr(skewadam_jax, "skewadam_orthogonal", moved)
  assert config_lib.TrainConfig().resolved_weight_decay == 0.3
  for other in (config_lib.TrainConfig(optimizer="adamw"),
                config_lib.TrainConfig(backbone_direction="adam", expert_direction="adam")):
    assert other.as_dict()["weight_decay"] == 0.1
  assert config_lib.TrainConfig(weight_decay=0.0).resolved_weight_decay == 0.0  # 0 is a value
  # A run saved before the default moved ran at what it saved; an unset one at 0.1.
  saved = config_lib.TrainConfig().as_dict() | {"weight_decay": None}
  assert "weight_decay=0.1" in config_lib.resume_check(config_lib.TrainConfig().as_dict())(
      {"config": saved})


def test_runs_saved_before_the_orthogonal_default_keep_adams_direction():
  # A saved None was the library's direction (adam); the default is now orthogonal.
  saved = {"optimizer": "skewadam", "backbone_direction": None, "expert_direction": None}
  check = config_lib.resume_check(dataclasses.asdict(config_lib.TrainConfig()))
  assert "backbone_direction='adam'" in check({"config": saved})
  adam = config_lib.TrainConfig(backbone_direction="adam", expert_direction="adam")
  # ... and ran with the safety settings of before 0.3.0: a resume names them too.
  assert "momentum_rounding='nearest'" in config_lib.resume_check(dataclasses.asdict(adam))(
      {"config": saved})
  old = dataclasses.replace(adam, momentum_rounding="nearest", update_clip="off",
                            contain_nonfinite="off")
  assert config_lib.resume_check(dataclasses.asdict(old))({"config": saved}) is None
  assert old.skewadam_tiers()["clip_threshold"] is None
  assert adam.skewadam_tiers() == {} and config_lib.TrainConfig().skewadam_tiers() == {
      "backbone": {"direction": "orthogonal", "orthogonal_scale": "width"},
      "expert": {"direction": "orthogonal", "momentum": "lowrank", "lowrank_rank": 84,
                 "lowrank_dtype": "int8", "orthogonal_scale": "width"}}
  # Another optimizer does not read the tier fields: its old runs are the same runs.
  adamw = dataclasses.asdict(config_lib.TrainConfig(optimizer="adamw"))
  assert config_lib.resume_check(adamw)({"config": {**saved, "optimizer": "adamw"}}) is None
  # A planner report's tiers are the library's arguments: no direction is adam.
  assert config_lib.tier_fields({})["expert_direction"] == "adam"
