"""Faults and what they do: non-finite gradients, damaged or foreign checkpoints,
crashes mid-save, bad data and flags, bad optimizer input, bf16 rounding.

Training-level tests use the `tiny` preset on a small generated corpus (as
tests/test_train.py does); everything else runs without a model.
"""

import dataclasses
import functools
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import skewadam_jax as sa
from experiments.training import checkpoint as ckpt_lib
from experiments.training import config as config_lib
from experiments import train as train_lib
from experiments.training import run as training
from tests._steps import run

REPO = pathlib.Path(__file__).resolve().parent.parent
TINY = dict(preset="tiny", batch_size=4, seq_len=32, eval_batches=2, log_every=1,
            warmup_steps=2, sample_tokens=0)
SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 3, 12)


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def poison(tree, value):
  """``tree`` with one element of every leaf set to ``value`` (NaN or Inf)."""
  return jax.tree.map(lambda g: g.at[(0,) * g.ndim].set(value), tree)


def run_steps(tx, params, grads_seq):
  """(params after the last step, state)."""
  trajectory, state = run(tx, params, grads_seq)
  return (trajectory[-1] if trajectory else params), state


# ------------------------------------------------ non-finite gradients: library


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_apply_if_finite_nan_at_step_k_equals_skipping_that_batch(params, grad_seq, bad):
  k, n = 3, 8
  tx = optax.apply_if_finite(
      sa.skewadam(SCHEDULE, weight_decay=0.1,
                  expert=sa.TierConfig(momentum="int8", second_moment="factored")),
      max_consecutive_errors=2)
  seq = list(grad_seq[:n])
  seq[k] = poison(seq[k], bad)  # one element of one batch is enough
  got_params, got_state = run_steps(tx, params, seq)
  ref_params, ref_state = run_steps(tx, params, seq[:k] + seq[k + 1:])
  assert_trees_equal(got_params, ref_params)
  assert_trees_equal(got_state.inner_state, ref_state.inner_state)  # moments, counts, schedule
  assert (int(got_state.total_notfinite), int(ref_state.total_notfinite)) == (1, 0)
  assert int(got_state.notfinite_count) == 0
  # ...and the same as SkewAdam alone on the batches without batch k.
  plain = sa.skewadam(SCHEDULE, weight_decay=0.1,
                      expert=sa.TierConfig(momentum="int8", second_moment="factored"))
  plain_params, _ = run_steps(plain, params, seq[:k] + seq[k + 1:])
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-7),
               got_params, plain_params)


def test_apply_if_finite_applies_the_update_after_k_consecutive_errors(params, grad_seq):
  # The documented caveat the training loop guards against: the (K+1)-th
  # consecutive non-finite update is applied.
  tx = optax.apply_if_finite(sa.skewadam(1e-2), max_consecutive_errors=2)
  bad = [poison(g, jnp.nan) for g in grad_seq[:3]]
  after_two, state = run_steps(tx, params, bad[:2])
  assert_trees_equal(after_two, params)
  assert int(state.notfinite_count) == 2
  after_three, _ = run_steps(tx, params, bad)
  assert not all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(after_three))


# ------------------------------------------------ non-finite gradients: training


RUN_CONFIG = dict(steps=8, ckpt_every=2, **TINY)


@pytest.fixture(scope="module")
def runs(corpus, cache_dir):
  """Runs shared by several tests, by --skip-nonfinite value: each compiles once."""
  return {skip: training.Run(train_lib.TrainConfig(data=corpus, skip_nonfinite=skip,
                                                    **RUN_CONFIG), cache_dir=cache_dir)
          for skip in (0, 2)}


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
  assert train_lib.main(flags) == 3
  err = capsys.readouterr().err.strip()
  assert err.startswith(message) and "\n" not in err, err
  checkpointer = ckpt_lib.Checkpointer(tmp_path / "ckpt")
  assert checkpointer.all_steps() == list(range(2, last_ckpt + 1, 2))
  step, (params, _), _ = checkpointer.restore_latest(runs[skip].init_state())
  checkpointer.close()
  assert step == last_ckpt
  assert all(bool(jnp.all(jnp.isfinite(p))) for p in jax.tree.leaves(params))


# --------------------------------------------- bf16 + stochastic rounding, resume


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


# ------------------------------------------------------------ checkpoints alone


def small_state(value=1.0):
  return {"w": jnp.full((3, 5), value), "count": jnp.asarray(7, jnp.int32),
          "h": jnp.full((4,), value, jnp.bfloat16)}


def test_truncated_or_missing_files_fall_back_and_all_damaged_is_an_error(tmp_path):
  checkpointer = ckpt_lib.Checkpointer(tmp_path / "ckpt", max_to_keep=3)
  for step in (1, 2, 3):
    checkpointer.save(step, small_state(float(step)), {"config": {}})
  for file in (tmp_path / "ckpt" / "3" / "state").rglob("*"):  # a partial copy
    if file.is_file():
      file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
  (tmp_path / "ckpt" / "2" / "meta" / "metadata").unlink()
  messages = []
  step, state, _ = checkpointer.restore_latest(small_state(), warn=messages.append)
  assert step == 1
  assert_trees_equal(state, small_state(1.0))
  assert "step 3" in messages[0] and "cannot read its arrays" in messages[0]
  assert "step 2" in messages[1] and "cannot read its metadata" in messages[1]
  assert all("\n" not in m for m in messages)
  assert checkpointer.all_steps() == [1]  # the damaged ones were moved aside...
  checkpointer.save(2, small_state(2.0), {"config": {}})  # ...so step 2 can be saved again
  checkpointer.close()

  other = ckpt_lib.Checkpointer(tmp_path / "other")
  other.save(5, small_state(), {})
  for file in (tmp_path / "other" / "5" / "state").rglob("*"):
    if file.is_file():
      file.write_bytes(b"")
  with pytest.raises(ckpt_lib.CheckpointError,
                     match=r"no usable checkpoint in .*other: step 5 is damaged"):
    other.restore_latest(small_state(), warn=lambda m: None)
  assert other.all_steps() == [5]  # nothing moved when there is nothing to fall back to
  other.close()


def test_flipped_byte_is_caught_by_the_checksum(tmp_path):
  checkpointer = ckpt_lib.Checkpointer(tmp_path)
  state = {"w": jax.random.normal(jax.random.key(0), (1 << 16,))}  # incompressible
  checkpointer.save(1, state, {})
  data_file = _largest_file(tmp_path / "1" / "state" / "ocdbt.process_0" / "d")
  data = bytearray(data_file.read_bytes())
  data[len(data) // 2] ^= 0x01
  data_file.write_bytes(bytes(data))
  with pytest.raises(ckpt_lib.CorruptCheckpointError,
                     match=r"step 1 .*: leaf \['w'\] does not match its checksum"):
    checkpointer.restore(1, state)
  checkpointer.close()


@pytest.mark.parametrize("change, message", [
    ({"expect": {"preset": "small"}}, "has preset='tiny' but this run has preset='small'"),
    ({"expect": {"expert_momentum": "int8"}},
     "has expert_momentum=None but this run has expert_momentum='int8'"),
    ({"expect_meta": {"data_fingerprint": "bbbb"}},
     "has data_fingerprint='aaaa' but this run has data_fingerprint='bbbb'"),
    ({"like": {"w": jnp.zeros((3, 6)), "count": jnp.zeros((), jnp.int32),
               "h": jnp.zeros((4,), jnp.bfloat16)}},
     r"leaf \['w'\] is float32\[3, 5\] there and \['w'\] is float32\[3, 6\] here"),
    ({"like": {"w": jnp.zeros((3, 5)), "count": jnp.zeros((), jnp.int32),
               "h": jnp.zeros((4,), jnp.float32)}},
     r"leaf \['h'\] is bfloat16\[4\] there and \['h'\] is float32\[4\] here"),
    ({"like": {"w": jnp.zeros((3, 5))}}, "holds 3 arrays; this run's state has 1"),
])
def test_checkpoint_of_another_run_is_refused_naming_the_difference(tmp_path, change, message):
  checkpointer = ckpt_lib.Checkpointer(tmp_path)
  config = {"preset": "tiny", "optimizer": "skewadam", "expert_momentum": None}
  checkpointer.save(1, small_state(), {"config": config, "data_fingerprint": "aaaa"})
  check = config_lib.resume_check({**config, **change.get("expect", {})},
                                  change.get("expect_meta", {}).get("data_fingerprint", "aaaa"))
  with pytest.raises(ckpt_lib.CheckpointError, match=message) as info:
    checkpointer.restore_latest(change.get("like", small_state()), check=check)
  assert not isinstance(info.value, ckpt_lib.CorruptCheckpointError)
  assert checkpointer.all_steps() == [1]
  checkpointer.close()


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


def _crash(directory, mode):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  return subprocess.Popen([sys.executable, str(REPO / "tests" / "crash_during_save.py"),
                           str(directory), mode], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, env=env, text=True)


@pytest.mark.parametrize("mode", ["finalize", "external"])
def test_save_killed_midway_leaves_the_previous_checkpoint(tmp_path, mode):
  directory = tmp_path / "ckpt"
  proc = _crash(directory, mode)
  assert proc.stdout.readline().strip() == "saved 1"
  if mode == "external":  # SIGKILL as soon as the second save has started writing
    deadline = time.monotonic() + 60
    while not (directory / "2.orbax-checkpoint-tmp").exists():
      assert proc.poll() is None and time.monotonic() < deadline
      time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
  assert proc.wait(timeout=60) == -signal.SIGKILL
  assert (directory / "2.orbax-checkpoint-tmp").exists() and not (directory / "2").exists()

  checkpointer = ckpt_lib.Checkpointer(directory)
  like = {"big": jnp.zeros((4,)), "w": jnp.zeros((8,))}
  step, state, meta = checkpointer.restore_latest(like)
  assert (step, meta["note"]) == (1, "good")
  assert_trees_equal(state, {"big": jnp.zeros((4,)), "w": jnp.full((8,), 1.0)})
  checkpointer.save(2, {"big": jnp.zeros((4,)), "w": jnp.full((8,), 2.0)}, {"note": "redo"})
  assert checkpointer.all_steps() == [1, 2]
  assert not (directory / "2.orbax-checkpoint-tmp").exists()
  checkpointer.close()


# ------------------------------------------------------------- bad data, flags


@pytest.fixture(scope="module")
def bad_corpora(tmp_path_factory):
  root = tmp_path_factory.mktemp("bad")
  (root / "empty.txt").write_bytes(b"")
  (root / "latin1.txt").write_bytes("café au lait, the king and the queen".encode("latin-1"))
  (root / "short.txt").write_text("Too short. For one sequence.")
  (root / "no_text").mkdir()
  (root / "no_text" / "blank.txt").write_text("  \n")
  return root


@pytest.mark.parametrize("flags, message", [
    (["--data", "{bad}/empty.txt"], "{bad}/empty.txt: corpus is empty"),
    (["--data", "{bad}/latin1.txt"], "{bad}/latin1.txt: not valid UTF-8: byte 0xe9 at byte offset 3"),
    (["--data", "{bad}/short.txt"], "{bad}/short.txt: training split too short: only"),
    (["--data", "{bad}/no_text"], "{bad}/no_text: folder contains no text files"),
    (["--data", "{bad}/missing.txt"], "{bad}/missing.txt: corpus path does not exist"),
    (["--preset", "huge"], "Unknown model preset 'huge'"),
    (["--optimizer", "sgd"], "unknown optimizer 'sgd'"),
    (["--lr", "-0.1"], "--lr must be > 0, got -0.1"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
    (["--lr", "inf"], "--lr must be finite, got inf"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--batch-size", "two"], "argument --batch-size: invalid int value: 'two'"),
    (["--steps", "-5"], "--steps must be >= 1, got -5"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0 and finite, got -1.0"),
    (["--val-fraction", "0"], "--val-fraction must be in (0, 1), got 0.0"),
    (["--seq-len", "4096"], "--seq-len 4096 exceeds the preset's max_seq_len 32"),
    (["--param-dtype", "fp8"], "--param-dtype must be one of float32, bfloat16, got 'fp8'"),
    (["--stochastic-rounding"], "--stochastic-rounding needs bfloat16 parameters"),
    (["--skip-nonfinite", "-1"], "--skip-nonfinite must be >= 0, got -1"),
    (["--expert-momentum", "int4"], "Unknown momentum encoding 'int4'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_data_and_flags_fail_with_one_line(capsys, tmp_path, cache_dir, bad_corpora,
                                               monkeypatch, flags, message):
  monkeypatch.setattr(train_lib, "train", functools.partial(train_lib.train, cache_dir=cache_dir))
  flags = [f.format(bad=bad_corpora) for f in flags]
  argv = ["--preset", "tiny", "--no-progress", "--out", str(tmp_path)] + flags
  assert train_lib.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and message.format(bad=bad_corpora) in err, err
  assert "\n" not in err and "Traceback" not in err


def test_command_line_reports_bad_input_without_traceback(tmp_path, bad_corpora):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--preset", "tiny", "--no-progress",
       "--data", str(bad_corpora / "latin1.txt"), "--out", str(tmp_path)],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      f"error: {bad_corpora / 'latin1.txt'}: not valid UTF-8: byte 0xe9 at byte offset 3 "
      "(invalid continuation byte)")
  assert proc.stdout == ""


# ------------------------------------------------------- optimizer input


@pytest.mark.parametrize("make, message", [
    (lambda: sa.skewadam(-1e-3), r"learning_rate must be >= 0, got -0.001"),
    (lambda: sa.skewadam(float("nan")), r"learning_rate must be >= 0, got nan"),
    (lambda: sa.skewadam(1e-3, weight_decay=-0.1), r"weight_decay must be >= 0, got -0.1"),
    (lambda: sa.skewadam(1e-3, weight_decay=float("nan")), r"weight_decay must be >= 0, got nan"),
    (lambda: sa.skewadam(1e-3, b2=float("nan")), r"b2 must be in \[0, 1\), got nan"),
    (lambda: sa.scale_by_skewadam(eps_root=-1.0), r"eps_root must be >= 0, got -1.0"),
    (lambda: sa.scale_by_skewadam(factored_eps=-1e-30), r"factored_eps must be >= 0"),
    (lambda: sa.TierConfig(momentum="int8", int8_block_size=0),
     r"int8_block_size must be a positive int, got 0"),
    (lambda: sa.TierConfig(momentum="int8", int8_block_size=-8),
     r"int8_block_size must be a positive int, got -8"),
    (lambda: sa.TierConfig(momentum="int8", int8_block_size=2.5),
     r"int8_block_size must be a positive int, got 2.5"),
    (lambda: sa.TierConfig(int8_block_size=True), r"int8_block_size must be a positive int"),
    (lambda: sa.scale_by_skewadam(expert={"int8_block_size": 0}),
     r"int8_block_size must be a positive int, got 0"),
    (lambda: sa.TierConfig(nu_dtype=jnp.int8), r"nu_dtype must be a floating dtype"),
])
def test_hyperparameters_out_of_range_raise(make, message):
  with pytest.raises(ValueError, match=message):
    make()


def test_schedules_are_not_rejected():
  sa.skewadam(SCHEDULE, weight_decay=0.0)  # callables are checked by optax, not here


PARAMS = {"embed": jnp.ones((6, 4)),
          "moe": {"router": jnp.ones((4, 2)), "experts": jnp.ones((2, 4, 3))}}


@pytest.mark.parametrize("labels, message", [
    ({"embed": "backbone", "moe": {"router": "router"}},
     r"no entry for \['moe/experts'\]"),
    ({"embed": "backbone", "moe": {"router": "router", "experts": "expert"}, "extra": "router"},
     r"entries for paths not in the parameters \['extra'\]"),
    ({"embed": "backbone", "moe": {"gate": "router"}},
     r"no entry for \['moe/experts', 'moe/router'\]"),
    ({"embed": "dense", "moe": {"router": "router", "experts": "expert"}},
     r"'embed' has label 'dense'"),
    ({"embed": 3, "moe": {"router": "router", "experts": "expert"}},
     r"'embed' has label 3, which is not a tier"),
])
def test_mismatched_labels_raise_naming_the_path(labels, message):
  with pytest.raises(ValueError, match=message):
    sa.skewadam(1e-3, param_labels=labels).init(PARAMS)


@pytest.mark.parametrize("path, shape", [
    ("embed", (6, 5)),                  # exact second moment
    ("moe/experts", (2, 5, 3)),         # factored second moment, sign momentum
    ("moe/experts", (3, 4, 3)),         # one more expert
    ("moe/router", (4, 2, 1)),          # rank change
])
def test_leaf_shape_changed_between_init_and_update_raises(path, shape):
  tx = sa.skewadam(1e-3)
  state = tx.init(PARAMS)
  grads = jax.tree.map(jnp.zeros_like, PARAMS)
  outer, name = (grads["moe"], path.split("/")[1]) if "/" in path else (grads, path)
  outer[name] = jnp.zeros(shape)
  with pytest.raises(ValueError, match=rf"SkewAdam state for '{path}' does not match .* "
                                       rf"update's shape {re.escape(str(shape))}"):
    tx.update(grads, state, grads)


def test_leaf_added_or_removed_between_init_and_update_raises():
  tx = sa.scale_by_skewadam()
  state = tx.init(PARAMS)
  grads = jax.tree.map(jnp.zeros_like, PARAMS)
  with pytest.raises(ValueError, match=r"updates' tree \(4 leaves\) differs .* \(3 leaves"):
    tx.update({**grads, "bias": jnp.zeros((4,))}, state)
  with pytest.raises(ValueError, match=r"updates' tree \(2 leaves\) differs .* \(3 leaves"):
    tx.update({"moe": grads["moe"]}, state)


# ------------------------------------------------------- stochastic rounding


def bf16_neighbours(x32):
  """The bf16 values just below and above float32 ``x32`` (equal if x is bf16)."""
  bits = np.asarray(x32, np.float32).view(np.uint32)
  lo = (bits & np.uint32(0xFFFF0000)).view(np.float32)
  hi = np.where(bits & 0xFFFF, ((bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32),
                lo)
  lo, hi = np.where(lo <= hi, lo, hi), np.where(lo <= hi, hi, lo)  # negative numbers
  return lo, hi


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
  rng = np.random.default_rng(0)
  n, draws = 512, 4000
  p = jnp.asarray(rng.normal(size=n), jnp.bfloat16)
  # Updates from far below bf16 resolution to above it, both signs.
  u = jnp.asarray(rng.normal(size=n) * 10.0 ** rng.uniform(-6, -1, size=n), jnp.float32)
  exact = np.asarray(p, np.float32) + np.asarray(u)
  keys = jax.random.split(jax.random.key(0), draws)
  samples = jax.jit(jax.vmap(lambda k: sa.apply_updates_stochastic({"p": p}, {"p": u}, k)["p"]))(keys)
  samples = np.asarray(samples.astype(jnp.float32))
  lo, hi = bf16_neighbours(exact)
  assert np.all((samples == lo) | (samples == hi))
  # Hoeffding: each sample is lo or hi, so P(|mean - x| >= t·(hi - lo)) <= 2·exp(-2·draws·t²);
  # t = 0.07 gives < 2e-17 per element.
  spread = np.where(hi > lo, hi - lo, 1.0)
  deviation = np.abs(samples.mean(axis=0) - exact) / spread
  assert deviation.max() < 0.07, deviation.max()
  # Round to nearest is biased exactly where it matters: below half a unit it never moves.
  nearest = np.asarray(optax.apply_updates(p, u).astype(jnp.float32))
  tiny = np.abs(u) < 0.25 * spread
  assert tiny.sum() > 100 and np.all(nearest[tiny] == np.asarray(p, np.float32)[tiny])


def test_tiny_updates_vanish_with_round_to_nearest_but_not_on_average_with_sr():
  n, steps, u = 4096, 200, 1e-4  # bf16 spacing at 1.0 is 2**-7 = 0.0078: u is 1/78 of it
  params = {"w": jnp.ones((n,), jnp.bfloat16), "b": jnp.ones((n,), jnp.float32)}
  updates = {"w": jnp.full((n,), u), "b": jnp.full((n,), u)}

  @jax.jit
  def run(params, key):
    def body(i, p):
      return sa.apply_updates_stochastic(p, updates, jax.random.fold_in(key, i))
    return jax.lax.fori_loop(0, steps, body, params)

  nearest = params
  for _ in range(steps):
    nearest = optax.apply_updates(nearest, updates)
  got = run(params, jax.random.key(1))
  assert np.all(np.asarray(nearest["w"], np.float32) == 1.0)  # every update lost
  w = np.asarray(got["w"], np.float32)
  # Per element: a sum of 200 bounded steps, variance <= steps·u·2**-7; the
  # mean over 4096 elements has standard deviation ~2e-4: the bound is 5 of them.
  assert abs(w.mean() - (1.0 + steps * u)) < 1e-3, w.mean()
  np.testing.assert_allclose(got["b"], nearest["b"], rtol=0, atol=0)  # fp32: exact, as optax


def test_apply_updates_stochastic_keeps_structure_dtypes_and_specials():
  params = {"a": jnp.array([1.0, jnp.inf, jnp.nan, -2.0], jnp.bfloat16),
            "b": jnp.array([1.0, 2.0], jnp.float16), "c": None,
            "d": jnp.array([0.5, 0.25], jnp.bfloat16)}
  updates = {"a": jnp.array([0.0, 1.0, 1.0, 0.0]), "b": jnp.array([1e-4, 1.0], jnp.float32),
             "c": None, "d": jnp.array([0.0, 0.0])}
  new = sa.apply_updates_stochastic(params, updates, jax.random.key(3))
  assert jax.tree.structure(new, is_leaf=lambda x: x is None) == jax.tree.structure(
      params, is_leaf=lambda x: x is None)
  assert new["c"] is None
  assert (new["a"].dtype, new["b"].dtype, new["d"].dtype) == (jnp.bfloat16, jnp.float16,
                                                              jnp.bfloat16)
  a = np.asarray(new["a"], np.float32)
  assert a[0] == 1.0 and a[1] == np.inf and np.isnan(a[2]) and a[3] == -2.0
  np.testing.assert_array_equal(new["b"], optax.apply_updates(params["b"], updates["b"]))
  np.testing.assert_array_equal(new["d"], params["d"])  # representable: unchanged
  # Identical bf16 leaves draw independent bits.
  same = {"x": jnp.ones((256,), jnp.bfloat16), "y": jnp.ones((256,), jnp.bfloat16)}
  step = {"x": jnp.full((256,), 0.004), "y": jnp.full((256,), 0.004)}
  out = sa.apply_updates_stochastic(same, step, jax.random.key(0))
  assert not np.array_equal(np.asarray(out["x"]), np.asarray(out["y"]))
