"""The checkpoint store (experiments/training/checkpoint.py): damaged checkpoints fall back,
foreign ones are refused, a save killed midway loses nothing.
"""
import os
import pathlib
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


REPO = pathlib.Path(__file__).resolve().parents[3]


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def _largest_file(folder):
  return max((p for p in pathlib.Path(folder).rglob("*") if p.is_file()),
             key=lambda p: p.stat().st_size)


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
     "has expert_momentum='sign' but this run has expert_momentum='int8'"),
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


def test_a_skewadam_state_stacked_by_group_round_trips(tmp_path):
  # group_leaves="stacked": a group's arrays at its first leaf, optax.MaskedNode at the others.
  tree = {"experts": {str(e): {"w1": jnp.full((8, 16), 0.1 * e)} for e in range(3)},
          "norm": jnp.ones((8,))}
  tx = sa.skewadam(1e-3, param_labels=sa.label_fn("hf"), group_leaves="stacked")
  _, opt_state = jax.jit(tx.update)(jax.tree.map(jnp.sin, tree), tx.init(tree), tree)
  assert isinstance(opt_state[0].mu["experts"]["1"]["w1"], optax.MaskedNode)
  assert opt_state[0].nu_row["experts"]["0"]["w1"].shape == (3, 8, 1)
  checkpointer = ckpt_lib.Checkpointer(tmp_path / "ckpt")
  checkpointer.save(1, (tree, opt_state), {"config": {}})
  like = jax.eval_shape(lambda: (tree, tx.init(tree)))
  (params, restored), _ = checkpointer.restore(1, like)
  assert jax.tree.structure(restored) == jax.tree.structure(opt_state)
  assert_trees_equal((params, restored), (tree, opt_state))
