"""Faults in a training run (experiments/training/run.py) on `tiny`: non-finite gradients skipped
or stopped, bf16 stochastic rounding resumed exactly, a damaged latest checkpoint passed over, a
foreign configuration refused.
"""
import dataclasses
import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.training import checkpoint as ckpt_lib
from experiments import train as train_lib
from experiments.training import run as training


TINY = dict(preset="tiny", batch_size=4, seq_len=32, eval_batches=2, log_every=1,
            warmup_steps=2, sample_tokens=0)


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


RUN_CONFIG = dict(steps=8, ckpt_every=2, **TINY)


@pytest.fixture(scope="module")
def runs(corpus, cache_dir):
  """Runs shared by several tests, by --skip-nonfinite value: each compiles once.

  Without skipping, containment is off: the library's default would count the
  injected NaN gradients as zero and the run would not stop at all."""
  return {skip: training.Run(train_lib.TrainConfig(
      data=corpus, skip_nonfinite=skip, contain_nonfinite=None if skip else "off",
      **RUN_CONFIG), cache_dir=cache_dir) for skip in (0, 2)}


def test_training_skips_a_nan_step_exactly(tmp_path, runs):
  run = runs[2]
  summary = train_lib.train(run.config, tmp_path, progress=False, nan_grad_steps={2}, run=run)
  assert summary["nonfinite_skips"] == 1
  assert json.loads((tmp_path / "summary.json").read_text())["nonfinite_skips"] == 1
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert {"step": 3, "skipped_nonfinite": True, "consecutive_nonfinite": 1,
          "nonfinite_skips": 1} in records
  assert [r["nonfinite_skips"] for r in records if "loss" in r] == [0, 0] + [1] * 6

  # The reference: the same step function on every batch except batch 2.
  params, opt_state = run.init_state()
  for step in (0, 1, 3, 4, 5, 6, 7):
    params, opt_state, _ = run.train_step(params, opt_state, *run.dataset.batch_at(step),
                                          grad_scale=np.float32(1.0))
  assert_trees_equal(summary.params, params)
  assert_trees_equal(summary.opt_state.inner_state, opt_state.inner_state)


@pytest.mark.parametrize("skip, nan_steps, message, last_ckpt", [
    (2, {3, 4}, "error: step 5: 2 consecutive steps with non-finite gradients "
                "(--skip-nonfinite 2); stopped without applying or saving them; "
                "the last checkpoint is step 4", 4),
    (0, {2}, "error: step 4: the loss is nan, so the parameters are no longer finite; "
             "nothing more is saved and the last checkpoint is step 2", 2),
])
def test_non_finite_run_stops_with_one_line_and_keeps_good_checkpoints(
    tmp_path, corpus, runs, capsys, monkeypatch, skip, nan_steps, message, last_ckpt):
  monkeypatch.setattr(train_lib, "train", functools.partial(
      train_lib.train, nan_grad_steps=nan_steps, run=runs[skip]))
  flags = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--eval-batches", "2",
           "--log-every", "1", "--warmup-steps", "2", "--steps", "8", "--ckpt-every", "2",
           "--data", corpus, "--out", str(tmp_path), "--no-progress",
           "--skip-nonfinite", str(skip), "--sample-tokens", "0"]
  if not skip:
    flags += ["--contain-nonfinite", "off"]
  assert train_lib.main(flags) == 3
  err = capsys.readouterr().err.strip()
  assert err.startswith(message) and "\n" not in err, err
  checkpointer = ckpt_lib.Checkpointer(tmp_path / "ckpt")
  assert checkpointer.all_steps() == list(range(2, last_ckpt + 1, 2))
  step, (params, _), _ = checkpointer.restore_latest(runs[skip].init_state())
  checkpointer.close()
  assert step == last_ckpt
  assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))


SR_CONFIG = dict(steps=6, ckpt_every=2, param_dtype="bfloat16", stochastic_rounding=True,
                 **TINY)


@pytest.fixture(scope="module")
def sr_run(corpus, cache_dir):
  """One Run shared by the runs below: its steps compile once."""
  return training.Run(train_lib.TrainConfig(data=corpus, **SR_CONFIG), cache_dir=cache_dir)


@pytest.fixture(scope="module")
def full_sr_run(tmp_path_factory, sr_run):
  out = tmp_path_factory.mktemp("full_sr")
  return train_lib.train(sr_run.config, out, progress=False, run=sr_run)


def test_bf16_stochastic_rounding_run_resumes_exactly(tmp_path, sr_run, full_sr_run):
  assert {p.dtype for p in jax.tree.leaves(full_sr_run.params)} == {jnp.dtype(jnp.bfloat16)}
  assert np.isfinite(full_sr_run["val_ppl"])
  config = sr_run.config
  train_lib.train(config, tmp_path, stop_after=3, progress=False, run=sr_run)
  resumed = train_lib.train(config, tmp_path, resume=True, progress=False, run=sr_run)
  assert_trees_equal(resumed.params, full_sr_run.params)
  assert_trees_equal(resumed.opt_state, full_sr_run.opt_state)


def _largest_file(folder):
  return max((p for p in pathlib.Path(folder).rglob("*") if p.is_file()),
             key=lambda p: p.stat().st_size)


def test_damaged_latest_checkpoint_falls_back_to_the_previous_one(
    tmp_path, capsys, sr_run, full_sr_run):
  config = sr_run.config
  train_lib.train(config, tmp_path, stop_after=4, progress=False, run=sr_run)
  damaged = _largest_file(tmp_path / "ckpt" / "4" / "state" / "ocdbt.process_0" / "d")
  data = bytearray(damaged.read_bytes())
  data[len(data) // 2] ^= 0xFF  # one flipped byte: orbax alone restores it silently
  damaged.write_bytes(bytes(data))
  capsys.readouterr()
  resumed = train_lib.train(config, tmp_path, resume=True, progress=False, run=sr_run)
  err = capsys.readouterr().err
  # Where the flip lands decides which check sees it (the data is compressed).
  assert "warning: checkpoint at step 4" in err
  assert "does not match its checksum" in err or "cannot read its arrays" in err
  assert "falling back to the previous checkpoint" in err
  assert (tmp_path / "ckpt-corrupt" / "4").is_dir()
  assert_trees_equal(resumed.params, full_sr_run.params)
  steps = [r["step"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
           if "loss" in r]
  assert steps == [1, 2, 3, 4, 5, 6]  # the records after step 2 were replaced


def test_resume_refuses_another_configuration(tmp_path, cache_dir, runs):
  config = runs[0].config
  train_lib.train(config, tmp_path, stop_after=2, progress=False, run=runs[0])
  # (Other presets and dtypes: test_checkpoint_of_another_run_is_refused_...; a
  # model of another preset takes seconds to build, the refusal is the same code.)
  for change in ({"expert_momentum": "int8"}, {"skip_nonfinite": 3}, {"lr": 1e-3},
                 {"optimizer": "adamw"}):
    other = dataclasses.replace(config, **change)
    field, value = next(iter(change.items()))
    with pytest.raises(ckpt_lib.CheckpointError, match=f"this run has {field}={value!r}"):
      train_lib.train(other, tmp_path, resume=True, cache_dir=cache_dir, progress=False)
