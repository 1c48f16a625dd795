"""experiments/training/run.py's loop: the host reads a step's metrics only after
dispatching the next step (so it never waits on the device between steps),
with and without --skip-nonfinite, and the metrics log it writes."""

import json
import types

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.training import metrics_log
from experiments.training import run as training
from experiments.training.checkpoint import Checkpointer
from experiments.training.config import TrainConfig


class Scalar:
  """A device scalar stand-in that records when the host reads it."""

  def __init__(self, events, step, value):
    self.events, self.step, self.value = events, step, value

  def _read(self):
    self.events.append(("read", self.step))
    return self.value

  def __float__(self):
    return float(self._read())

  def __int__(self):
    return int(self._read())


class StubRun:
  """What ``training.train`` uses of a ``Run``, with no model and no device work."""

  def __init__(self, config, *, bad_steps=()):
    self.config = self.requested = config
    self.seq_len = 8
    self.events = []
    self.bad_steps = set(bad_steps)
    self.data_fingerprint = "stub"
    self.data = types.SimpleNamespace(
        info={"unigram_val_perplexity": 1.0, "val_names": []}, vocab_size=4,
        tokenizer=types.SimpleNamespace(save=lambda path: None))
    self.dataset = types.SimpleNamespace(batch_at=lambda step: (step, step))
    self.batch_at = self.dataset.batch_at
    self.rounding_key = None
    self.schedule = optax.constant_schedule(0.5)
    self.consecutive = 0

  def init_state(self):
    state = {"w": jnp.zeros((2,))}
    if self.config.skip_nonfinite:
      state = optax.ApplyIfFiniteState(jnp.int32(0), jnp.bool_(True), jnp.int32(0), state)
    return {"w": jnp.ones((2,))}, state

  def train_step(self, params, opt_state, inputs, targets):
    step = inputs + 1
    self.events.append(("dispatch", step))
    metrics = {"loss": Scalar(self.events, step, 1.0 / step)}
    if self.config.skip_nonfinite:
      self.consecutive = self.consecutive + 1 if inputs in self.bad_steps else 0
      metrics["notfinite_count"] = Scalar(self.events, step, self.consecutive)
      metrics["total_notfinite"] = Scalar(self.events, step, 0)
    return params, opt_state, metrics

  def evaluate(self, params):
    self.events.append(("evaluate", None))
    return 2.0

  def sample(self, params, step):
    self.events.append(("sample", step))
    return "stub text"


def reads_before_dispatch(events):
  """For each dispatch after the first: the steps whose metrics were read before it."""
  out, reads = {}, []
  for kind, step in events:
    if kind == "dispatch":
      out[step] = sorted(set(reads))
      reads = []
    elif kind == "read":
      reads.append(step)
  return out


@pytest.mark.parametrize("skip", [0, 3])
def test_metrics_are_read_one_step_late(tmp_path, skip):
  config = TrainConfig(steps=6, log_every=1, eval_every=100, ckpt_every=100,
                       skip_nonfinite=skip)
  run = StubRun(config)
  summary = training.train(config, tmp_path, progress=False, run=run)
  # Step k's metrics are read after step k+1 was dispatched, never before.
  before = reads_before_dispatch(run.events)
  assert before == {1: [], 2: [], 3: [1], 4: [2], 5: [3], 6: [4]}
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
  assert [r["loss"] for r in records if "loss" in r] == pytest.approx([1 / s for s in range(1, 7)])
  assert summary["completed"] and summary["val_ppl"] == 2.0
  assert summary["machine"]["cores"] >= 1 and summary["machine"]["jax"]


def test_checkpoint_and_eval_steps_read_first(tmp_path):
  config = TrainConfig(steps=4, log_every=1, eval_every=2, ckpt_every=100)
  run = StubRun(config)
  training.train(config, tmp_path, progress=False, run=run)
  # The evaluation after step 2 comes once step 2's metrics are checked.
  i = run.events.index(("evaluate", None))
  assert run.events[i - 1] == ("read", 2) and ("dispatch", 3) in run.events[i:]


def test_the_kth_nonfinite_step_stops_before_any_later_checkpoint(tmp_path):
  config = TrainConfig(steps=8, log_every=4, eval_every=100, ckpt_every=2, skip_nonfinite=2)
  run = StubRun(config, bad_steps={2, 3})  # steps 3 and 4 (1-based) are bad
  with pytest.raises(training.TrainingError, match="step 4: 2 consecutive"):
    training.train(config, tmp_path, progress=False, run=run)
  # Step 4 is a checkpoint step: it was checked first, so step 2's is the last.
  ckpt = Checkpointer(tmp_path / "ckpt")
  assert ckpt.latest_step() == 2
  ckpt.close()
  records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records if r.get("skipped_nonfinite")] == [3, 4]


def test_metrics_log_times_only_training(tmp_path):
  log = metrics_log.MetricsLog(tmp_path / "m.jsonl", tokens_per_step=10, progress=False,
                               total=4)
  assert log.tokens_per_s() is None
  log.record_step(1, 0.1, {"loss": 3.0})
  log.record_step(2, 0.1, {"loss": 2.0})
  assert log.tokens_per_s() > 0 and log.median_step_s() > 0
  log.pause_timer()
  log.record_step(3, 0.1, {"loss": 1.0})  # after a pause: no interval counted
  assert len(log._step_seconds) == 1  # pylint: disable=protected-access
  log.close()
  lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
  assert [r["tokens"] for r in lines] == [10, 20, 30]
  assert np.isfinite(lines[-1]["tokens_per_s"])
