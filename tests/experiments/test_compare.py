"""The comparison harness on `tiny`: protocol, JSON rows, table and plots; the defaults rule."""

import json
import os
import pathlib
import statistics

import pytest

import models
import skewadam_jax

from experiments import compare
from experiments.studies import comparison
from experiments.studies import sweeps
from experiments.training import optimizers
from experiments.training.config import TrainConfig


def test_compare_on_tiny_writes_rows_table_and_plots(tmp_path, corpus, cache_dir, monkeypatch):
  # The SkewAdam configuration is the default, spelt out: it must run once.
  argv = ["--preset", "tiny", "--optimizers", "adamw,skewadam", "--skewadam-configs",
          ",".join(f"{k}={v}" for k, v in sweeps.default_config().items()),
          "--steps", "4", "--sweep-steps", "4", "--lr-factors", "1,3", "--seeds", "0,1",
          "--batch-size", "4", "--data", corpus, "--out", str(tmp_path / "cmp"), "--quick"]
  monkeypatch.setattr(sweeps.training, "train", _with_cache(sweeps.training.train, cache_dir))
  assert compare.main(argv) == 0
  rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())
  assert [(r["optimizer"], r["config"], comparison.is_default(r)) for r in rows] == [
      ("adamw", "default", True), ("skewadam", sweeps.default_config(), True)]
  assert not comparison.is_default({"optimizer": "skewadam",
                                 "config": sweeps.resolve_config({"expert_m": "int8"})})
  for r in rows:
    for key in ("optimizer", "config", "lr", "seeds", "val_ppl_mean", "val_ppl_std",
                "opt_state_bytes_small", "opt_state_bytes_6p78b", "step_time_ratio_to_adamw"):
      assert key in r, key
    assert len(r["sweep"]) == 2 and r["lr"] in [s["lr"] for s in r["sweep"]]
    assert r["lr"] == min(r["sweep"], key=lambda s: s["val_ppl"])["lr"]
    assert len(r["val_ppl_by_seed"]) == 2
  assert rows[0]["step_time_ratio_to_adamw"] == pytest.approx(1.0)
  # SkewAdam's state at moe-6.78b (1.3 GB) is a fraction of AdamW's 54.2 GB.
  assert rows[1]["opt_state_bytes_6p78b"] < rows[0]["opt_state_bytes_6p78b"] / 40
  table = (tmp_path / "cmp" / "compare.md").read_text()
  assert table.count("\n| skewadam") == 1 and "(default)" in table
  for name in ("val_ppl.png", "state_bytes.png", "frontier.png"):
    assert (tmp_path / "cmp" / name).stat().st_size > 1000
  # Each run keeps its metrics and summary, not its checkpoints; the sweep's
  # best run (as long as the final runs) is seed 0's, so 2 + 1 runs a row.
  runs = list((tmp_path / "cmp" / "runs").iterdir())
  assert len(runs) == 2 * (2 + 1)
  assert all((r / "summary.json").exists() and not (r / "ckpt").exists() for r in runs)
  # --render redraws the same table from the JSON alone.
  assert compare.main(["--render", str(tmp_path / "cmp" / "compare.json"),
                       "--out", str(tmp_path / "again"), "--quick"]) == 0
  assert (tmp_path / "again" / "compare.md").read_text() == table
  # --reuse-runs reads every finished run instead of training it again.
  def no_training(*args, **kwargs):
    raise AssertionError("a finished run was trained again")
  monkeypatch.setattr(sweeps.training, "train", no_training)
  assert compare.main(argv + ["--reuse-runs"]) == 0
  assert (tmp_path / "cmp" / "compare.md").read_text() == table
  # A run of another configuration in the same folder is not reused.
  some_run = sorted(runs)[0]
  summary = json.loads((some_run / "summary.json").read_text())
  summary["config"]["seed"] += 100
  (some_run / "summary.json").write_text(json.dumps(summary))
  with pytest.raises(AssertionError, match="trained again"):
    compare.main(argv + ["--reuse-runs"])


def _with_cache(train, cache_dir):
  def wrapped(config, out_dir, **kwargs):
    kwargs["cache_dir"] = cache_dir
    return train(config, out_dir, **kwargs)
  return wrapped


def test_bad_configuration_is_one_line(capsys):
  assert compare.main(["--optimizers", "sgd"]) == 2
  assert compare.main(["--skewadam-configs", "experts=int8"]) == 2
  assert compare.main(["--skewadam-configs", "expert_m=int4"]) == 2
  err = capsys.readouterr().err
  assert "unknown optimizer 'sgd'" in err and "bad SkewAdam configuration 'experts=int8'" in err
  assert "int4" in err


def test_sweep_extends_past_an_edge_optimum(monkeypatch, tmp_path):
  # Validation perplexity falls with the learning rate up to 9x the default:
  # the grid {1/3, 1, 3} must grow upwards until the optimum is inside it.
  def fake_run(base, out, cache_dir, *, lr, steps, seed, **overrides):
    del base, out, cache_dir, steps, seed, overrides
    x = lr / comparison.optimizers.DEFAULT_LR["adamw"]
    return {"val_ppl": 100 + (x - 9) ** 2, "tokens_per_s": 1.0, "median_step_s": 1.0,
            "opt_state_bytes": 1,
            "curve": []}
  monkeypatch.setattr(comparison, "run_or_reuse", fake_run)
  monkeypatch.setattr(comparison.accounting, "state_bytes", lambda *a, **k: {"total": 1})
  [row] = comparison.compare([("adamw", {})], base=comparison.TrainConfig(),
                          out_dir=tmp_path, steps=2, sweep_steps=1, seeds=(0,), log=lambda m: None)
  factors = [round(s["lr"] / comparison.optimizers.DEFAULT_LR["adamw"], 6) for s in row["sweep"]]
  assert factors == [round(1 / 3, 6), 1, 3, 9, 27]
  assert row["lr"] == pytest.approx(9 * comparison.optimizers.DEFAULT_LR["adamw"])


def _row(optimizer, ppl, std, state, **config):
  return {"optimizer": optimizer, "config": config or "default", "val_ppl_mean": ppl,
          "val_ppl_std": std, "opt_state_bytes_6p78b": state}


def test_choose_default_follows_the_stated_rule():
  adamw = _row("adamw", 100.0, 1.0, 54e9)
  big_good = _row("skewadam", 95.0, 1.0, 2.3e9, name="big")
  small_ok = _row("skewadam", 100.8, 0.5, 1.26e9, name="small-ok")   # within AdamW's spread
  small_better = _row("skewadam", 99.0, 0.5, 1.28e9, name="small-better")
  tiny_bad = _row("skewadam", 130.0, 1.0, 0.5e9, name="tiny-bad")
  # Within the budget, the best perplexity among those that match AdamW.
  assert comparison.choose_default([adamw, big_good, small_ok, small_better, tiny_bad]) is small_better
  assert comparison.choose_default([adamw, big_good, small_ok, tiny_bad]) is small_ok
  # Nothing within the budget matches: the smallest state that does.
  mid = _row("skewadam", 99.5, 1.0, 1.6e9, name="mid")
  assert comparison.choose_default([adamw, big_good, mid, tiny_bad]) is mid
  assert comparison.choose_default([adamw, tiny_bad]) is None
  assert comparison.choose_default([big_good]) is None


def test_choose_default_with_a_compute_term_orders_by_the_equal_time_rows():
  adamw = _row("adamw", 100.0, 1.0, 54e9)
  fast = _row("skewadam", 99.0, 0.5, 1.2e9, name="fast")
  slow = _row("skewadam", 97.0, 0.5, 1.2e9, name="slow")      # best at equal steps
  untimed = _row("skewadam", 96.0, 0.5, 1.2e9, name="untimed")
  rows = [adamw, fast, slow, untimed]
  assert comparison.choose_default(rows) is untimed
  # At AdamW's wall-clock the slow one trained fewer steps and fell behind.
  timed = [_row("skewadam", 99.5, 0.5, 1.2e9, name="fast"),
           _row("skewadam", 101.0, 0.5, 1.2e9, name="slow"), _row("adamw", 100.0, 1.0, 54e9)]
  assert comparison.choose_default(rows, equal_time=timed) is fast
  # A configuration must still match AdamW at equal steps to be chosen.
  assert comparison.choose_default([adamw, _row("skewadam", 130.0, 1.0, 1e9, name="fast")],
                                   equal_time=timed) is None


def _seeded(optimizer, seeds, **config):
  row = _row(optimizer, statistics.mean(seeds), statistics.stdev(seeds), 1e9, **config)
  return {**row, "val_ppl_by_seed": seeds}


def test_the_verdict_orders_a_pair_only_outside_twice_the_seed_spread():
  default = _seeded("skewadam", [100.0, 102.0, 104.0], **sweeps.default_config())
  adamw = _seeded("adamw", [101.0, 104.0, 107.0])     # 4 apart, spread 3: a tie
  muon = _seeded("muon", [80.0, 81.0, 82.0])         # 21 apart, spread 2
  text = comparison.verdict_text([adamw, default, muon])
  assert text.startswith("Verdict for SkewAdam's default (3 seeds): ")
  assert "against adamw: within noise (difference -2.00, 0.7x the larger seed spread" in text
  assert "against muon: higher perplexity by 21.00 (10.5x the larger seed spread)" in text
  assert comparison.ordering(muon, default) == ("lower", 10.5)
  assert comparison.verdict_text([default]).startswith("No AdamW or Muon row")  # alone: no order
  # choose_default's choice matches AdamW only by the spread rule here: it says so.
  adamw_row = {**adamw, "opt_state_bytes_6p78b": 54e9}
  assert "matches AdamW only by the spread rule (a tie, not a win)" in comparison.choice_text(
      [adamw_row, {**default, "opt_state_bytes_6p78b": 1.2e9}])
  clear = _seeded("skewadam", [90.0, 90.5, 91.0], **sweeps.default_config())
  assert "tie" not in comparison.choice_text([adamw_row, {**clear, "opt_state_bytes_6p78b": 1.2e9}])


def test_rows_of_one_seed_get_differences_and_no_ordering():
  default = {**_row("skewadam", 76.67, 0.0, 1.2e9, **sweeps.default_config()),
             "val_ppl_by_seed": [76.67]}
  adamw = {**_row("adamw", 129.48, 0.0, 54e9), "val_ppl_by_seed": [129.48]}
  muon = _seeded("muon", [74.0, 74.5, 75.0])  # one side of one seed is enough
  text = comparison.verdict_text([adamw, default, muon])
  assert text == ("No verdict for SkewAdam's default: a row of one seed has no seed spread to "
                  "order a pair by; against adamw: difference -52.81; against muon: "
                  "difference +2.17.")


def test_the_quick_table_has_no_timing_and_names_the_machine():
  row = {**_seeded("adamw", [101.0, 104.0]), "lr": 9e-3, "opt_state_bytes_small": 3e7,
         "step_time_ratio_to_adamw": 1.0}
  assert "step time" not in comparison.markdown_table([row], step_time=False)
  assert "| 101.00, 104.00 |" in comparison.markdown_table([row], step_time=False)
  assert "step time" in comparison.markdown_table([row])
  machine = comparison.machine_text()
  assert machine.endswith(f", {os.cpu_count()} cores") and len(machine) > len(" cores") + 3


RESULTS = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "results" / "compare.json"


@pytest.mark.skipif(not RESULTS.exists(), reason="no committed comparison yet")
def test_library_defaults_are_the_committed_comparisons_choice():
  rows = json.loads(RESULTS.read_text())
  choice = comparison.choose_default(rows)
  assert choice is not None
  # the library's skewadam()'s tiers (its safety settings: test_safe_defaults_rerun_*)
  assert choice["config"] == sweeps.without_safety(sweeps.resolve_config({}))


LONG = RESULTS.with_name("compare-long.json")
PLANS = RESULTS.with_name("memory")


def test_the_training_commands_default_is_the_long_comparisons_choice():
  # The stated rule: the best perplexity at the long horizon within 1.29 GB at
  # moe-6.78b whose standard train step fits the A100-40GB target. On the long
  # comparison's rows it chose the orthogonal tiers with packed-sign expert momentum ...
  long = json.loads(LONG.read_text())
  reports = comparison.load_reports(PLANS)
  signs = comparison.choose_default(long, reports=reports)
  assert signs is not None and signs["config"]["expert_m"] == "sign"
  assert signs["config"] == sweeps.without_safety(sweeps.resolve_entry("skewadam", {
      "expert_m": "sign", "backbone_scale": "adam_rms", "expert_scale": "adam_rms", "wd": 0.1}))
  # ... on the 1600-step rows as they stand on 0.3.0's defaults (that row re-run on
  # them, the expert momentum's rows beside it) it chooses rank 16 ...
  safe_signs = json.loads(RESULTS.with_name("safe-defaults-1600.json").read_text())
  expert_rows = json.loads(RESULTS.with_name("expert-momentum.json").read_text())
  rows = [r for r in long if r is not signs] + safe_signs + expert_rows
  rank16 = comparison.choose_default(rows, reports=reports)
  assert rank16 is not None and rank16["name"] == "lowrank-16"
  assert rank16["val_ppl_mean"] + rank16["val_ppl_std"] < safe_signs[0]["val_ppl_mean"]
  # ... with #42's first tuned candidate beside them, that one (rank 42 in bfloat16) ...
  rank42, rank84 = json.loads(RESULTS.with_name("muon-gap.json").read_text())
  assert (rank42["name"], rank84["name"]) == ("rank42-bf16", "rank84-int8")
  first = comparison.choose_default(rows + [rank42], reports=reports)
  assert first is rank42 and first["val_ppl_mean"] + first["val_ppl_std"] < rank16["val_ppl_mean"]
  # ... and with its second, rank 84 in int8 at the same bytes: the default.
  choice = comparison.choose_default(rows + [rank42, rank84], reports=reports)
  assert choice is rank84 and choice["config"] == sweeps.default_config()
  assert choice["val_ppl_mean"] + choice["val_ppl_std"] < rank42["val_ppl_mean"]
  assert optimizers.default_lr("skewadam", comparison.row_tiers(choice)) == pytest.approx(choice["lr"])
  assert optimizers.default_lr("skewadam", comparison.row_tiers(rank16)) == pytest.approx(rank16["lr"])


def test_merge_rows_replaces_rerun_rows_and_recomputes_step_time_ratios(tmp_path):
  kept = [dict(_row("adamw", 100.0, 1.0, 54e9), median_step_s=0.2),
          dict(_row("skewadam", 99.0, 1.0, 1.3e9, name="a"), median_step_s=0.3),
          dict(_row("lion", 120.0, 1.0, 27e9), median_step_s=0.1)]
  rerun = [dict(_row("skewadam", 98.0, 1.0, 1.3e9, name="a"), median_step_s=0.25),
           dict(_row("skewadam", 97.0, 1.0, 1.2e9, name="b"), median_step_s=0.4)]
  rows = comparison.merge_rows(kept, rerun)
  assert [(r["optimizer"], r["val_ppl_mean"]) for r in rows] == [
      ("adamw", 100.0), ("skewadam", 98.0), ("lion", 120.0), ("skewadam", 97.0)]
  assert [r["step_time_ratio_to_adamw"] for r in rows] == pytest.approx([1.0, 1.25, 0.5, 2.0])


@pytest.mark.skipif(not RESULTS.exists(), reason="no committed comparison yet")
def test_render_with_kept_rows_writes_the_merged_comparison(tmp_path):
  kept = json.loads(RESULTS.read_text())
  rerun = [dict(kept[-1], val_ppl_mean=1.0)]
  (tmp_path / "new.json").write_text(json.dumps(rerun))
  assert compare.main(["--render", str(tmp_path / "new.json"), "--keep-rows-from", str(RESULTS),
                       "--out", str(tmp_path / "out")]) == 0
  merged = json.loads((tmp_path / "out" / "compare.json").read_text())
  assert [r["val_ppl_mean"] for r in merged] == [r["val_ppl_mean"] for r in kept[:-1]] + [1.0]
  assert (tmp_path / "out" / "compare.md").exists()


def test_fixed_learning_rates_skip_the_sweep(monkeypatch, tmp_path):
  trained = []

  def fake_run(base, out, cache_dir, *, lr, steps, seed, **overrides):
    del base, out, cache_dir, overrides
    trained.append((lr, steps, seed))
    return {"val_ppl": 50.0 + seed, "tokens_per_s": 1.0, "median_step_s": 1.0,
            "opt_state_bytes": 1, "curve": []}
  monkeypatch.setattr(comparison, "run_or_reuse", fake_run)
  monkeypatch.setattr(comparison.accounting, "state_bytes", lambda *a, **k: {"total": 1})
  orthogonal = {"expert_dir": "orthogonal"}
  saved = [{"optimizer": "muon", "config": "default", "lr": 0.03},
           {"optimizer": "skewadam", "config": sweeps.resolve_entry("skewadam", orthogonal),
            "lr": 0.01}]
  rows = comparison.compare([("muon", None), ("skewadam", orthogonal)],
                         base=comparison.TrainConfig(), out_dir=tmp_path, steps=8, sweep_steps=2,
                         seeds=(0, 1, 2), log=lambda m: None, fixed_lrs=saved)
  assert trained == [(0.03, 8, s) for s in (0, 1, 2)] + [(0.01, 8, s) for s in (0, 1, 2)]
  assert [r["lr"] for r in rows] == [0.03, 0.01] and all(r["sweep"] == [] for r in rows)
  with pytest.raises(ValueError, match="no learning rate for adamw"):
    comparison.compare([("adamw", None)], base=comparison.TrainConfig(), out_dir=tmp_path, steps=8,
                    sweep_steps=2, seeds=(0,), log=lambda m: None, fixed_lrs=saved)


def test_update_directions_appear_in_a_row_only_when_not_adam():
  # Rows saved before the direction keys existed keep their identity.
  assert "expert_dir" not in sweeps.resolve_config({})
  assert sweeps.resolve_config({"expert_dir": "adam"}) == sweeps.resolve_config({})
  ortho = sweeps.resolve_config({"backbone_dir": "orthogonal", "expert_dir": "orthogonal"})
  assert ortho["backbone_dir"] == ortho["expert_dir"] == "orthogonal"
  tiers = comparison.TrainConfig(**comparison.train_overrides(ortho)).skewadam_tiers()
  assert tiers["expert"]["direction"] == tiers["backbone"]["direction"] == "orthogonal"


def test_the_attribution_keys_appear_only_when_set_and_reach_the_tiers():
  # The orthogonal row's identity (and its runs' folders) is unchanged by the new keys.
  ortho = {"backbone_dir": "orthogonal", "expert_dir": "orthogonal"}
  assert sweeps.resolve_config(ortho) == sweeps.resolve_config(
      {**ortho, "backbone_scale": "adam_rms", "expert_scale": "adam_rms", "rest": "backbone"})
  row = sweeps.resolve_config({**ortho, "expert_scale": "width", "rest": "router"})
  assert row["expert_scale"] == "width" and row["rest"] == "router"
  assert "backbone_scale" not in row
  tiers = comparison.TrainConfig(**comparison.train_overrides(row)).skewadam_tiers()
  assert tiers["expert"]["orthogonal_scale"] == "width"
  assert tiers[optimizers.REST_TIER] == "router"
  assert sweeps.parse_entries("", "backbone_dir=orthogonal,rest=router")[0][0] == "skewadam"


def test_the_expert_factors_dtype_names_a_row_only_when_not_float32():
  # muon_gap.sh's rank-42 bfloat16 candidate as a comparison's row; rows saved
  # before the key existed (float32 factors) keep their identity.
  lowrank = {"expert_m": "lowrank", "expert_rank": "42"}
  assert sweeps.resolve_config(lowrank) == sweeps.resolve_config({**lowrank,
                                                                   "expert_dtype": "float32"})
  row = sweeps.resolve_config(sweeps.parse_skewadam_config(
      "expert_m=lowrank,expert_rank=42,expert_dtype=bfloat16"))
  assert row["expert_dtype"] == "bfloat16"
  tiers = comparison.TrainConfig(**comparison.train_overrides(row)).skewadam_tiers()
  assert tiers["expert"]["lowrank_dtype"] == "bfloat16"
  with pytest.raises(ValueError, match="lowrank_dtype must be one of"):
    sweeps.parse_entries("", "expert_m=lowrank,expert_dtype=float16")


def test_a_comparison_row_keeps_the_library_tiers_it_names_after_the_alias_moved():
  # The default row follows the alias, and trains what the training command's default does.
  default = sweeps.default_config()
  assert (default["expert_rank"], default["expert_dtype"], default["backbone_scale"],
          default["expert_scale"], default["wd"]) == (84, "int8", "width", "width", 0.2)
  assert comparison._full_tiers(comparison.row_tiers({"config": default})) == (
      comparison._full_tiers(TrainConfig().skewadam_tiers()))
  assert TrainConfig(**sweeps.train_overrides(default)).resolved_weight_decay == 0.2
  # A saved row leaves out the keys at IMPLICIT's value (rank 16, Adam-RMS, weight
  # decay 0.1): it still trains those, not the alias's.
  old = sweeps.resolve_config({"backbone_dir": "orthogonal", "expert_dir": "orthogonal",
                               "expert_m": "lowrank"})
  assert "expert_rank" not in old and "wd" not in old
  expert = comparison.row_tiers({"config": old})["expert"]
  assert (expert["lowrank_rank"], expert["orthogonal_scale"]) == (16, "adam_rms")
  assert TrainConfig(**sweeps.train_overrides(old)).resolved_weight_decay == 0.1


def test_a_spelled_number_names_the_same_row_as_the_training_commands():
  spelled = sweeps.parse_skewadam_config("expert_m=lowrank,expert_rank=16,wd=0.1")
  assert spelled == {"expert_m": "lowrank", "expert_rank": 16, "wd": 0.1}
  assert sweeps.resolve_config(spelled) == sweeps.resolve_config({"expert_m": "lowrank"})
  with pytest.raises(ValueError, match="expert_rank must be int, got 'four'"):
    sweeps.parse_skewadam_config("expert_m=lowrank,expert_rank=four")


def test_a_run_saved_before_a_config_field_existed_is_reused(tmp_path):
  config = comparison.TrainConfig(preset="tiny", steps=3)
  saved = json.loads(json.dumps(config.as_dict()))  # as a run saves it
  del saved["schedule"], saved["decay_fraction"]  # fields added later, at their defaults
  (tmp_path / "summary.json").write_text(json.dumps(
      {"config": saved, "completed": True, "val_ppl": 10.0}))
  assert sweeps.finished_summary(tmp_path, config)["val_ppl"] == 10.0
  assert sweeps.finished_summary(tmp_path, comparison.dataclasses.replace(
      config, schedule="wsd")) is None
  # A run saved before rank 16 (expert momentum None: the signs) is not the default's.
  (tmp_path / "summary.json").write_text(json.dumps(
      {"config": {**saved, "expert_momentum": None}, "completed": True, "val_ppl": 10.0}))
  assert sweeps.finished_summary(tmp_path, config) is None
  assert sweeps.finished_summary(tmp_path, comparison.dataclasses.replace(
      config, expert_momentum="sign"))["val_ppl"] == 10.0


def test_longer_horizon_is_set_beside_the_shorter_one(tmp_path):
  def row(optimizer, ppl, tokens, **config):
    return dict(_row(optimizer, ppl, 0.5, 54e9 if optimizer != "skewadam" else 1.2e9, **config),
                lr=1e-3, opt_state_bytes_small=1e6, step_time_ratio_to_adamw=1.0, median_step_s=0.1,
                curve_seed0=[(tokens // 2, ppl * 2), (tokens, ppl)])
  shorter = [row("adamw", 120.0, 800_000), row("muon", 80.0, 800_000),
             row("skewadam", 78.0, 800_000, expert_dir="orthogonal")]
  longer = [row("adamw", 70.0, 3_200_000), row("muon", 58.0, 3_200_000),
            row("skewadam", 59.5, 3_200_000, expert_dir="orthogonal"),
            row("lion", 90.0, 3_200_000)]  # not in the shorter one: left out of the table
  table = comparison.horizon_table(shorter, longer)
  lines = table.splitlines()
  assert "0.80M tokens" in lines[0] and "3.20M tokens" in lines[0] and len(lines) == 2 + 3
  # SkewAdam leads at the shorter horizon and is second at the longer one.
  assert "78.00 ± 0.50 (1) | 59.50 ± 0.50 (2) | 0.763 |" in lines[4]
  assert "80.00 ± 0.50 (2) | 58.00 ± 0.50 (1) | 0.725 |" in lines[3]
  assert comparison.horizon_table(shorter, [row("lion", 90.0, 1)]) == "No row is in both comparisons."
  (tmp_path / "short.json").write_text(json.dumps(shorter))
  (tmp_path / "long.json").write_text(json.dumps(longer))
  assert compare.main(["--render", str(tmp_path / "long.json"), "--keep-rows-from",
                       str(tmp_path / "long.json"), "--out", str(tmp_path / "out"),
                       "--name", "compare-long", "--shorter", str(tmp_path / "short.json")]) == 0
  out = tmp_path / "out"
  assert [(r["optimizer"], r["val_ppl_mean"]) for r in
          json.loads((out / "compare-long.json").read_text())] == [
              (r["optimizer"], r["val_ppl_mean"]) for r in longer]
  assert table in (out / "compare-long.md").read_text()
  for name in ("horizons", "val_ppl", "state_bytes", "frontier"):
    assert (out / f"compare-long-{name}.png").stat().st_size > 1000
  assert not (out / "compare.json").exists() and not (out / "val_ppl.png").exists()


def test_a_sweep_around_saved_rates_at_the_final_budget_trains_each_run_once(monkeypatch,
                                                                             tmp_path):
  # Validation perplexity is best at half the saved rate; the sweep run at the
  # best rate is seed 0's final run, so only seeds 1 and 2 train after it.
  trained = []

  def fake_run(base, out, cache_dir, *, lr, steps, seed, **overrides):
    del base, cache_dir, overrides
    trained.append((round(lr, 6), steps, seed, out.name))
    return {"val_ppl": 50.0 + abs(lr - 0.015) * 100 + seed, "tokens_per_s": 1.0,
            "median_step_s": 1.0, "opt_state_bytes": 1, "curve": []}
  monkeypatch.setattr(comparison, "run_or_reuse", fake_run)
  monkeypatch.setattr(comparison.accounting, "state_bytes", lambda *a, **k: {"total": 1})
  saved = [{"optimizer": "muon", "config": "default", "lr": 0.03}]
  [row] = comparison.compare([("muon", None)], base=comparison.TrainConfig(), out_dir=tmp_path,
                          steps=8, sweep_steps=8, seeds=(0, 1, 2), lr_factors=(0.5, 1),
                          max_extensions=1, log=lambda m: None, sweep_around=saved)
  assert [t[:3] for t in trained] == [(0.015, 8, 0), (0.03, 8, 0), (0.0075, 8, 0),
                                      (0.015, 8, 1), (0.015, 8, 2)]
  assert row["lr"] == pytest.approx(0.015)
  assert row["val_ppl_by_seed"] == [50.0, 51.0, 52.0]


@pytest.fixture
def seen(monkeypatch):
  """What the command passes to the protocol (which does not run), by keyword."""
  arguments = {}

  def fake_compare(entries, **kwargs):
    del entries
    arguments.update(kwargs)
    return []
  monkeypatch.setattr(comparison, "compare", fake_compare)
  monkeypatch.setattr(compare, "_write", lambda *a, **k: 0)
  return arguments


def test_the_first_rates_file_that_has_a_row_wins(seen, tmp_path):
  first, second = tmp_path / "a.json", tmp_path / "b.json"
  first.write_text(json.dumps([{"optimizer": "muon", "config": "default", "lr": 0.02}]))
  second.write_text(json.dumps([{"optimizer": "muon", "config": "default", "lr": 0.05},
                                {"optimizer": "adamw", "config": "default", "lr": 0.001}]))
  argv = ["--optimizers", "muon,adamw", "--lr-from", f"{first},{second}"]
  assert compare.main(argv) == 0
  assert seen["sweep_around"] is None
  assert comparison.tuned_rates([("muon", None), ("adamw", None)], seen["fixed_lrs"]) == {
      sweeps.entry_key("muon", None): 0.02, sweeps.entry_key("adamw", None): 0.001}
  assert compare.main(argv + ["--lr-factors", "0.5,1"]) == 0
  assert seen["fixed_lrs"] is None and seen["lr_factors"] == (0.5, 1.0)
  assert seen["sweep_around"] is not None


def test_a_config_files_model_is_the_comparisons_model(seen, tmp_path):
  shipped = RESULTS.parents[1] / "configs" / "small-x5.toml"
  assert compare.main(["--optimizers", "adamw", "--config", str(shipped)]) == 0
  model = seen["base"].model_config()
  assert (model.num_layers, model.d_model, model.d_ff, model.num_experts) == (6, 256, 512, 8)
  assert models.count_params(model)["total"] == 22_560_000  # 5.06x small's
  other = tmp_path / "other.toml"
  other.write_text('[model]\npreset = "tiny"\nnum_layers = 3\n[run]\nsteps = 7\n')
  assert compare.main(["--optimizers", "adamw", "--config", str(other)]) == 0
  assert seen["base"].preset == "tiny" and seen["base"].model_config().num_layers == 3
  assert seen["base"].steps != 7  # the protocol, not the file, sets the rest


def test_runs_table_says_what_each_run_changes_from_the_baseline(tmp_path, capsys):
  from experiments.training.config import TrainConfig  # pylint: disable=import-outside-toplevel
  import dataclasses  # pylint: disable=import-outside-toplevel
  base_config = dataclasses.asdict(TrainConfig(
      optimizer="skewadam", lr=0.5 * 0.027, backbone_direction="orthogonal",
      expert_direction="orthogonal"))

  def run(name, ppl, completed=True, predates=(), **changes):
    folder = tmp_path / name
    folder.mkdir()
    config = {key: value for key, value in {**base_config, "seed": 0, **changes}.items()
              if key not in predates}
    (folder / "summary.json").write_text(json.dumps(
        {"completed": completed, "val_ppl": ppl, "config": config}))
    return str(folder)

  # Saved before --muon-momentum existed: it ran with the default, 0.95.
  baseline = run("base", 59.87, predates=("muon_momentum",))
  rows = [run("rest", 59.0, lr=0.0135, orthogonal_rest_tier="router"),  # the same rate
          run("b1", 61.0, b1=0.95, eval_every=7),                      # logging is no change
          run("muon-momentum", 60.0, muon_momentum=0.9)]
  assert compare.main(["--runs-table", ",".join(rows), "--baseline", baseline]) == 0
  out = capsys.readouterr().out
  assert "| `rest` | orthogonal_rest_tier=router | 59.00 | -0.87 | 1.622 GB |" in out
  assert "| `b1` | b1=0.95 | 61.00 | +1.13 | 1.219 GB |" in out
  assert "| `muon-momentum` | muon_momentum=0.9 | 60.00 | +0.13 | 1.219 GB |" in out
  assert "(validation perplexity 59.87, state at moe-6.78b 1.219 GB)" in out
  unfinished = run("unfinished", 70.0, completed=False)
  assert compare.main(["--runs-table", unfinished, "--baseline", baseline]) == 2
  assert "unfinished: the run did not finish" in capsys.readouterr().err
  assert compare.main(["--runs-table", unfinished]) == 2


def test_the_rule_takes_only_configurations_whose_standard_step_fits():
  ortho = {"backbone_dir": "orthogonal", "expert_dir": "orthogonal"}
  adamw = _row("adamw", 100.0, 1.0, 54e9)
  default = {**_row("skewadam", 90.0, 1.0, 1.265e9), "config": "default"}
  orthogonal = {**_row("skewadam", 80.0, 1.0, 1.219e9), "config": {"expert_m": "sign", **ortho}}
  rows = [adamw, default, orthogonal]

  def report(tiers, fits, **extra):
    return {"preset": "moe-6.78b", "optimizer": "skewadam", "target": "a100-40gb", "batch": 1,
            "seq": 2048, "devices": 1, "update_in_backward": False, "skewadam_tiers": tiers,
            "fits": fits, "peak_bytes": 1, **extra}
  ortho_tiers = {"expert": {"direction": "orthogonal"}, "backbone": {"direction": "orthogonal"}}
  # The same configuration spelled two ways (the row names the default sign encoding).
  assert comparison.standard_step_fits(orthogonal, [report(ortho_tiers, True)]) is True
  assert comparison.standard_step_fits(orthogonal, [report({}, True)]) is None
  # The standard step that does not fit is no candidate, whatever its perplexity...
  assert comparison.choose_default(rows, reports=[report({}, True),
                                                  report(ortho_tiers, False)]) is default
  # ...and neither is a report of another step, batch or mesh.
  others = [report(ortho_tiers, True, update_in_backward=True), report(ortho_tiers, True, batch=8),
            report(ortho_tiers, True, devices=8), report({}, True)]
  assert comparison.choose_default(rows, reports=others) is default
  assert comparison.choose_default(rows, reports=[report(ortho_tiers, True), report({}, True)]) \
      is orthogonal
  assert comparison.choose_default(rows) is orthogonal  # no reports: no fit condition
  text = comparison.choice_text(rows, [report(ortho_tiers, True)])
  assert "whose standard train step fits the A100-40GB target" in text


def test_the_committed_plans_say_which_measured_configurations_fit():
  reports = comparison.load_reports(pathlib.Path(__file__).parents[2] / "experiments" / "results"
                                    / "memory")
  long = json.loads((pathlib.Path(__file__).parents[2] / "experiments" / "results"
                     / "compare-long.json").read_text())
  skewadam = [r for r in long if r["optimizer"] == "skewadam"]
  # Adam's direction (skewadam-adam.json), the orthogonal default (skewadam.json) and the
  # normalised rows: all planned, all fit.
  assert len(skewadam) == 3 and all(comparison.standard_step_fits(r, reports) for r in skewadam)
  assert sorted(r["config"].get("backbone_dir", "adam") for r in skewadam) == [
      "adam", "normalized_orthogonal", "orthogonal"]
  unplanned = {**skewadam[0], "config": {"expert_m": "int8"}}
  assert comparison.standard_step_fits(unplanned, reports) is None


def test_the_time_left_is_priced_by_each_optimizers_own_runs():
  now = [0.0]
  lines = []
  clock = comparison.RunClock(["adamw"] * 2 + ["skewadam"] * 2, log=lines.append,
                              clock=lambda: now[0])

  def run(optimizer, seconds):
    def train():
      now[0] += seconds
      return optimizer
    return clock.run(optimizer, train)
  assert clock.left_s() is None  # nothing timed yet
  assert run("adamw", 60) == "adamw"
  assert clock.left_s() == 3 * 60  # skewadam not seen yet: priced as adamw
  assert lines[-1] == "compare: 3 runs to go after 1.0 min (1 trained); about 3.0 min left"
  run("adamw", 120)
  run("skewadam", 300)
  assert clock.left_s() == 300  # the last run at skewadam's own time
  run("skewadam", 0.1)  # read back, not trained: done, and not timed
  assert clock.left_s() == 0 and lines[-1].startswith("compare: 0 runs to go")
  clock.drop("adamw", 0)
  with pytest.raises(ValueError):
    clock.drop("muon", 1)


def test_one_rate_for_every_row_runs_no_sweep(seen):
  argv = ["--optimizers", "muon", "--skewadam-configs", "ns_chunk=1", "--lr", "0.01"]
  assert compare.main(argv) == 0
  entries = [("muon", None), ("skewadam", {"ns_chunk": "1"})]
  assert set(comparison.tuned_rates(entries, seen["fixed_lrs"]).values()) == {0.01}
  assert seen["sweep_around"] is None
  assert compare.main(argv + ["--lr-factors", "0.5,1"]) == 2
  assert compare.main(["--optimizers", "muon", "--lr", "0"]) == 2


def test_the_newton_schulz_schedule_keys_name_a_row_only_when_not_the_default():
  ortho = {"backbone_dir": "orthogonal", "expert_dir": "orthogonal"}
  assert sweeps.resolve_config(ortho) == sweeps.resolve_config(
      {**ortho, "ns_chunk": "auto", "ns_dtype": "float32"})
  row = sweeps.resolve_config({**ortho, "ns_chunk": "2", "ns_dtype": "bfloat16"})
  tiers = comparison.TrainConfig(**comparison.train_overrides(row)).skewadam_tiers()
  for tier in ("expert", "backbone"):
    assert tiers[tier]["orthogonal_chunk"] == 2 and tiers[tier]["orthogonal_dtype"] == "bfloat16"
