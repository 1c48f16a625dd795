"""The comparison harness on `tiny`: protocol, JSON rows, table and plots."""

import json

import pytest

from experiments import compare


def test_compare_on_tiny_writes_rows_table_and_plots(tmp_path, corpus, cache_dir, monkeypatch):
  argv = ["--preset", "tiny", "--optimizers", "adamw,skewadam", "--skewadam-configs",
          "expert=int8", "--steps", "6", "--sweep-steps", "3", "--seeds", "0,1",
          "--batch-size", "4", "--data", corpus, "--out", str(tmp_path / "cmp"), "--quick"]
  monkeypatch.setattr(compare.train_lib, "train", _with_cache(compare.train_lib.train, cache_dir))
  assert compare.main(argv) == 0
  rows = json.loads((tmp_path / "cmp" / "compare.json").read_text())
  assert [(r["optimizer"], r["config"]) for r in rows] == [
      ("adamw", "default"), ("skewadam", "default"), ("skewadam", {"expert_momentum": "int8"})]
  for r in rows:
    for key in ("optimizer", "config", "lr", "seeds", "val_ppl_mean", "val_ppl_std",
                "opt_state_bytes_small", "opt_state_bytes_6p78b", "step_time_ratio_to_adamw"):
      assert key in r, key
    assert len(r["sweep"]) == 3 and r["lr"] in [s["lr"] for s in r["sweep"]]
    assert r["lr"] == min(r["sweep"], key=lambda s: s["val_ppl"])["lr"]
    assert len(r["val_ppl_by_seed"]) == 2
  assert rows[0]["step_time_ratio_to_adamw"] == pytest.approx(1.0)
  # SkewAdam's state at moe-6.78b is a small fraction of AdamW's fp32 state.
  assert rows[1]["opt_state_bytes_6p78b"] < rows[0]["opt_state_bytes_6p78b"] / 20
  assert (tmp_path / "cmp" / "compare.md").read_text().count("\n") == 5
  for name in ("val_ppl.png", "state_bytes.png"):
    assert (tmp_path / "cmp" / name).stat().st_size > 1000


def _with_cache(train, cache_dir):
  def wrapped(config, out_dir, **kwargs):
    kwargs["cache_dir"] = cache_dir
    return train(config, out_dir, **kwargs)
  return wrapped


def test_bad_configuration_is_one_line(capsys):
  assert compare.main(["--optimizers", "sgd"]) == 2
  assert compare.main(["--skewadam-configs", "experts=int8"]) == 2
  err = capsys.readouterr().err
  assert "unknown optimizer 'sgd'" in err and "bad SkewAdam configuration 'experts=int8'" in err
