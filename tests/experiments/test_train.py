"""The training command on `tiny`: every optimizer learns, resume is exact, bad flags fail cleanly."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.training import config as config_lib
from experiments.training import optimizers
from experiments.training import steps
from experiments import train as train_lib
from experiments.training import run as training
from experiments.training.steps import abstract_axes, abstract_params

TINY = dict(preset="tiny", batch_size=4, seq_len=32, eval_batches=2, log_every=1,
            warmup_steps=2, sample_tokens=0)


def read_losses(out):
  return [r["loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
          if "loss" in r]


@pytest.mark.parametrize("optimizer", optimizers.OPTIMIZERS)
def test_a_few_steps_lower_the_loss(tmp_path, corpus, cache_dir, optimizer):
  config = train_lib.TrainConfig(optimizer=optimizer, steps=12, data=corpus, **TINY)
  summary = train_lib.train(config, tmp_path, cache_dir=cache_dir, progress=False)
  losses = read_losses(tmp_path)
  assert len(losses) == 12
  assert np.mean(losses[-3:]) < losses[0] - 0.3, losses
  saved = json.loads((tmp_path / "summary.json").read_text())
  for key in ("val_ppl", "unigram_ppl", "steps", "tokens_per_s", "opt_state_bytes_by_tier"):
    assert key in saved
  by_tier = saved["opt_state_bytes_by_tier"]
  assert by_tier["total"] == sum(by_tier[k] for k in ("backbone", "expert", "router", "other"))
  assert by_tier["expert"] > 0 and np.isfinite(saved["val_ppl"])


def test_resume_matches_uninterrupted_run(tmp_path, corpus, cache_dir):
  config = train_lib.TrainConfig(optimizer="skewadam", steps=8, data=corpus,
                                 ckpt_every=100, **TINY)
  run = training.Run(config, cache_dir=cache_dir)  # compiled once for the three runs
  full = train_lib.train(config, tmp_path / "full", progress=False, run=run)
  first = train_lib.train(config, tmp_path / "split", stop_after=4, progress=False, run=run)
  assert not first["completed"] and "val_ppl" not in first
  resumed = train_lib.train(config, tmp_path / "split", resume=True, progress=False, run=run)
  np.testing.assert_allclose(read_losses(tmp_path / "split"), read_losses(tmp_path / "full"),
                             rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
               resumed.params, full.params)
  assert resumed["val_ppl"] == pytest.approx(full["val_ppl"], rel=1e-6)
  # Resuming the finished run again changes nothing and keeps its figures.
  files = {name: (tmp_path / "split" / name).read_bytes()
           for name in ("summary.json", "metrics.jsonl")}
  again = train_lib.train(config, tmp_path / "split", resume=True, progress=False, run=run)
  assert again.already_finished and again["tokens_per_s"] == resumed["tokens_per_s"]
  assert {name: (tmp_path / "split" / name).read_bytes() for name in files} == files


def test_every_flag_has_help_and_the_structural_fields_come_from_the_config():
  parser = train_lib.build_parser()
  options = [a for a in parser._actions if a.option_strings]  # pylint: disable=protected-access
  assert len(options) > 30
  assert all(a.help and a.help.strip() for a in options), [
      a.option_strings for a in options if not a.help]
  help_text = parser.format_help()
  assert "{fp32,bf16,int8,sign,lowrank,none}" in help_text and "default 600" in help_text
  assert "backbone_momentum" in config_lib.STRUCTURAL_FIELDS
  assert not {"eval_every", "log_every", "ckpt_every", "mesh"} & set(config_lib.STRUCTURAL_FIELDS)


def test_resume_refuses_a_different_optimizer(tmp_path, corpus, cache_dir):
  config = train_lib.TrainConfig(optimizer="skewadam", steps=4, data=corpus, **TINY)
  train_lib.train(config, tmp_path, stop_after=2, cache_dir=cache_dir, progress=False)
  other = train_lib.TrainConfig(optimizer="adamw", steps=4, data=corpus, **TINY)
  with pytest.raises(ValueError, match="optimizer='skewadam' but this run has optimizer='adamw'"):
    train_lib.train(other, tmp_path, resume=True, cache_dir=cache_dir, progress=False)
  with pytest.raises(ValueError, match="already holds a checkpoint"):
    train_lib.train(config, tmp_path, cache_dir=cache_dir, progress=False)
  # A field the old hand-typed list had missed.
  bf16 = train_lib.TrainConfig(optimizer="skewadam", steps=4, data=corpus,
                               backbone_momentum="fp32", **TINY)
  with pytest.raises(ValueError, match="backbone_momentum"):
    train_lib.train(bf16, tmp_path, resume=True, cache_dir=cache_dir, progress=False)


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "sgd"], "unknown optimizer 'sgd'"),
    (["--preset", "huge"], "Unknown model preset 'huge'"),
    (["--lr", "-1"], "--lr must be > 0, got -1.0"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--data", "/nonexistent/corpus.txt"], "/nonexistent/corpus.txt"),
    (["--b1", "1"], "--b1 must be in [0, 1), got 1.0"),
])
def test_bad_flags_fail_with_one_line(capsys, flags, message):
  assert train_lib.main(["--preset", "tiny", "--no-progress", "--out", "/tmp/unused"] + flags) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and message in err and "\n" not in err


@pytest.mark.parametrize("optimizer, overrides", [
    ("adamw", {}),
    ("skewadam", {"backbone_momentum": "fp32", "expert_momentum": "fp32"}),
])
def test_b1_reaches_the_optimizer(optimizer, overrides):
  # From zero momentum one step stores (1 - b1)·g in every fp32 momentum leaf.
  config = train_lib.TrainConfig(optimizer=optimizer, b1=0.5, clip_norm=0.0, **overrides)
  tx = steps.make_tx(config, abstract_axes("tiny"), 1e-3)
  params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), abstract_params("tiny"))
  grads = jax.tree.map(lambda p: jnp.full_like(p, 0.25), params)
  _, state = tx.update(grads, tx.init(params), params)
  mus = [m for m in jax.tree.leaves(optax.tree.get(state, "mu"))
         if m.dtype == jnp.float32 and m.size > 1]
  assert mus
  for m in mus:
    np.testing.assert_allclose(np.asarray(m), 0.125, rtol=1e-6)
