"""One training run as a library: set-up and resume, the loop, the non-finite guard.

:class:`Run` builds the model, the optimizer, the data and the compiled steps
of a :class:`~experiments.training.config.TrainConfig`; :func:`train` runs its loop
with checkpoints (:mod:`experiments.training.checkpoint`) and a metrics log with a
progress bar (:mod:`experiments.training.metrics_log`). ``python -m experiments.train``
is the command around it. The loop reads a step's metrics only after the next
step has been dispatched, so the host never waits for the device between
steps (it waits at evaluations and checkpoints, which need the parameters).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import json
import math
import os
import pathlib
from typing import Collection

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import models
import skewadam_jax
from experiments import data as data_lib
from experiments.training import config as config_lib
from experiments.training import mesh as mesh_lib
from experiments.training import monitoring
from experiments.training import sampling
from experiments.training import steps as steps_lib
from experiments.training.checkpoint import Checkpointer
from experiments.training.config import TrainConfig
from experiments.training.metrics_log import MetricsLog, machine, read_metrics, write_atomically


SAMPLE_PROMPT_TOKENS = 16  # the evaluation samples continue the validation text's start
SAMPLE_LOG_CHARS = 200  # of each sample, in metrics.jsonl
TRAIN_SCALARS = ("loss", "ce_loss", "lb_loss", "z_loss", "grad_norm", "update_rms",
                 "floor_share")  # to TensorBoard


@dataclasses.dataclass(frozen=True, eq=False)
class TrainResult(collections.abc.Mapping):
  """What :func:`train` returns: the run's summary, and its final state.

  It reads as the summary (``result["val_ppl"]``, ``json.dumps(dict(result))``:
  what ``summary.json`` holds), so the device state never travels inside a
  JSON dictionary. ``already_finished`` is true when a resumed run had
  nothing left to do (its summary is the saved one).
  """

  summary: dict
  params: object
  opt_state: object
  already_finished: bool = False

  def __getitem__(self, key):
    return self.summary[key]

  def __iter__(self):
    return iter(self.summary)

  def __len__(self):
    return len(self.summary)


class TrainingError(RuntimeError):
  """The run cannot go on: its gradients or parameters stopped being finite.

  Raised before any checkpoint of the bad state is written; the command
  prints it as one line and exits with status 3.
  """




class Run:
  """A model, its optimizer, the data and the compiled step functions."""

  def __init__(self, config: TrainConfig, *, cache_dir: str | os.PathLike | None = None):
    config.validate()
    self.requested = config
    if config.vocab_size is None and data_lib.is_prepared_dir(config.data):
      # The model's vocabulary follows the prepared corpus's tokenizer; the
      # resolved value is the run's (saved with its checkpoints and summary).
      config = dataclasses.replace(config,
                                   vocab_size=data_lib.open_prepared(config.data).vocab_size)
    self.config = config
    self.model_config = config.model_config()
    seq_len = config.seq_len or self.model_config.max_seq_len
    if seq_len > self.model_config.max_seq_len:
      raise ValueError(f"--seq-len {seq_len} exceeds the preset's max_seq_len "
                       f"{self.model_config.max_seq_len}")
    self.seq_len = seq_len
    if data_lib.is_prepared_dir(config.data):
      # Memory-mapped shards; the split is the manifest's (not val_fraction).
      self.data = data_lib.open_prepared(config.data,
                                         max_vocab_size=self.model_config.vocab_size)
    else:
      self.data = data_lib.prepare_data(
          config.data, vocab_size=self.model_config.vocab_size, cache_dir=cache_dir,
          val_fraction=config.val_fraction)
    corpus = self.data.info["path"]
    try:
      self.dataset = data_lib.TokenDataset(
          self.data.train_tokens, seq_len=seq_len,
          batch_size=config.batch_size * config.accumulate,
          seed=config.seed)
    except data_lib.DataError as err:
      raise data_lib.DataError(f"{corpus}: training split too short: {err}") from None
    try:
      self.eval_set = data_lib.eval_batches(
          self.data.val_tokens, seq_len, config.batch_size, max_batches=config.eval_batches)
    except data_lib.DataError as err:
      raise data_lib.DataError(f"{corpus}: validation split too short: {err}") from None
    # Checked on resume: the same path with other text would silently give
    # other batches than the checkpointed run saw. A prepared corpus's comes
    # from its manifest (its shards' hashes), not from reading every token.
    if isinstance(self.data, data_lib.PreparedCorpus):
      self.data_fingerprint = self.data.fingerprint
    else:
      self.data_fingerprint = hashlib.sha256(
          self.data.train_tokens.tobytes() + b"|" + self.data.val_tokens.tobytes()
      ).hexdigest()[:16]

    model = models.Transformer(self.model_config, rngs=nnx.Rngs(config.seed))
    self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
    self.axes = models.logical_axes(params)
    self.initial_params = nnx.as_pure(params)
    self.schedule = steps_lib.learning_rate_schedule(config)
    # Stochastic-rounding bits are a pure function of (seed, step), like the
    # batches, so a resumed run rounds exactly as an uninterrupted one.
    self.rounding_key = jax.random.fold_in(jax.random.key(config.seed), 0x5352)
    self.spmd = None
    self._next_token = None  # the sampler, compiled at the first evaluation
    self.step = steps_lib.build_step(config, self.graphdef, self.rest, self.initial_params,
                                     self.axes, schedule=self.schedule)
    self.tx = self.step.tx
    if config.mesh:  # the same steps, sharded over a device mesh
      mesh = mesh_lib.make_mesh(**mesh_lib.parse_mesh(config.mesh))
      self.spmd = mesh_lib.spmd_steps(
          mesh, self.step, self.initial_params, axes=self.axes, fsdp=config.fsdp,
          expert_parallel=self.model_config.moe_impl == "expert_parallel")
      self.train_step, self.eval_step = self.spmd.train_step, self.spmd.eval_step
    else:
      self.train_step = jax.jit(self.step.train_step, donate_argnums=(0, 1))
      self.eval_step = jax.jit(self.step.eval_step)

  def batch_at(self, step: int):
    """Training batch ``step`` (a pure function of ``(seed, step)``).

    On a mesh it is a global array built from only this process's rows: each
    process reads the windows of its own devices' rows, nothing else.
    """
    if self.spmd is None:
      return self.dataset.batch_at(step)
    return mesh_lib.batch_from_rows(
        lambda rows: self.dataset.batch_at(step, rows=rows),
        (self.config.batch_size * self.config.accumulate, self.seq_len),
        self.spmd.shardings.batch)

  def init_state(self):
    if self.spmd is not None:
      return self.spmd.init(self.initial_params)
    params = jax.tree.map(jnp.copy, self.initial_params)
    return params, self.step.init(params)

  def sample(self, params, step: int) -> str:
    """A continuation of the validation text's first tokens (``sample_tokens`` of them).

    Sampled at temperature 1 with top-k 40 and a key from ``(seed, step)``;
    the full recompute per token is :mod:`experiments.training.sampling`'s.
    """
    if self._next_token is None:
      self._next_token = sampling.make_next_token(self.graphdef, self.rest, top_k=40)
    prompt = self.data.val_tokens[:SAMPLE_PROMPT_TOKENS]
    ids = sampling.generate(self._next_token, params, prompt, self.config.sample_tokens,
                            window=self.seq_len, seed=self.config.seed * 1_000_003 + step)
    return self.data.tokenizer.decode(list(prompt) + ids)

  def evaluate(self, params) -> float:
    """Validation perplexity: exp of the mean next-token cross-entropy."""
    total, count = 0.0, 0
    for inputs, targets in self.eval_set:
      ce_sum, n = self.eval_step(params, inputs, targets)
      total += float(ce_sum)
      count += int(n)
    return math.exp(total / count)


def abstract_run_state(config: TrainConfig):
  """``(graphdef, rest, params, opt_state)`` of a run, shapes only: what its
  checkpoints restore onto (e.g. to sample from one), with no data read."""
  graphdef, params, rest, axes = steps_lib.abstract_split(config.model_config())
  step = steps_lib.build_step(config, graphdef, rest, params, axes)
  return graphdef, rest, params, jax.eval_shape(step.init, params)


def _summary_bytes(state) -> dict[str, int]:
  return skewadam_jax.state_bytes_by_tier(state)


@jax.jit
def _all_finite(tree) -> jax.Array:
  finite = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
            if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(finite)) if finite else jnp.array(True)


def train(config: TrainConfig, out_dir: str | os.PathLike, *, resume: bool = False,
          stop_after: int | None = None, cache_dir: str | os.PathLike | None = None,
          progress: bool = True, nan_grad_steps: Collection[int] = (),
          run: "Run | None" = None) -> dict:
  """Trains, evaluates and checkpoints one run; returns its summary.

  Args:
    config: the run.
    out_dir: folder for ``metrics.jsonl``, ``ckpt/`` and ``summary.json``.
    resume: continue from the latest usable checkpoint in ``out_dir/ckpt``
      (its configuration and data must match; a damaged latest checkpoint is
      reported and the previous one used); without it an existing checkpoint
      is an error, so a run is never overwritten by accident. Resuming a
      finished run changes nothing and returns its summary.
    stop_after: stop (with a checkpoint) after this many steps in total, as an
      interruption would; ``--resume`` continues the same schedule.
    cache_dir: tokenizer cache (default ``<repo>/.cache/tokenizers``).
    progress: show a progress bar on stderr.
    nan_grad_steps: fault injection for tests: the gradients of these
      (0-based) steps are multiplied by NaN.
    run: a :class:`Run` of this ``config`` to reuse (its steps are already
      compiled: several runs in one process, e.g. tests, compile once).

  Returns:
    A :class:`TrainResult`: the summary (as ``summary.json``) and the final
    parameters and optimizer state.

  Raises:
    ValueError: bad configuration or data, or a checkpoint of another run
      (``CheckpointError``), or no usable checkpoint.
    TrainingError: the gradients were non-finite ``--skip-nonfinite`` times in
      a row, or (without it) the loss or the parameters became non-finite.
      The bad state is not checkpointed.
  """
  if run is None:
    run = Run(config, cache_dir=cache_dir)
  elif config not in (run.requested, run.config):
    raise ValueError("train(run=...) was built for another configuration")
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  ckpt = Checkpointer(out / "ckpt")
  try:
    return _train(run, out, ckpt, resume=resume, stop_after=stop_after,
                  progress=progress, poisoned=frozenset(nan_grad_steps))
  finally:
    ckpt.close()


def _train(run: Run, out: pathlib.Path, ckpt: Checkpointer, *, resume: bool,
           stop_after: int | None, progress: bool, poisoned: frozenset) -> TrainResult:
  config = run.config
  config_dict = config.as_dict()
  params, opt_state = run.init_state()
  start = 0
  latest = ckpt.latest_step()
  if latest is not None and not resume:
    raise ValueError(f"{out / 'ckpt'} already holds a checkpoint (step {latest}); "
                     "pass --resume to continue it or choose another --out")
  if resume and latest is not None:
    start, (params, opt_state), _ = ckpt.restore_latest(
        (params, opt_state), check=config_lib.resume_check(config_dict, run.data_fingerprint))
  metrics_path = out / "metrics.jsonl"
  if resume and start == config.steps and (out / "summary.json").exists():
    # A finished run: resuming it changes nothing, its figures are kept.
    summary = json.loads((out / "summary.json").read_text())
    return TrainResult(summary, params, opt_state, already_finished=True)
  # In a multi-process run every process trains (and saves checkpoints jointly),
  # but only process 0 writes the logs, the summary and the progress bar.
  is_chief = jax.process_index() == 0
  if is_chief:
    records = read_metrics(metrics_path, start) if resume else []
    write_atomically(metrics_path, "".join(json.dumps(r) + "\n" for r in records))
  tokens_per_step = config.batch_size * config.accumulate * run.seq_len
  end = config.steps if stop_after is None else min(stop_after, config.steps)
  meta = {"config": config_dict, "data_fingerprint": run.data_fingerprint}
  skip = config.skip_nonfinite

  def last_checkpoint() -> str:
    step = ckpt.latest_step()
    return ("no checkpoint was saved" if step is None
            else f"the last checkpoint is step {step} in {ckpt.directory}")

  log = MetricsLog(metrics_path if is_chief else None, tokens_per_step=tokens_per_step,
                   progress=progress and is_chief, total=config.steps, initial=start,
                   desc=config.optimizer)
  board = monitoring.TensorBoardLog(out / "tensorboard") if is_chief else None
  if is_chief:  # what experiments.sample needs to turn ids back into text
    run.data.tokenizer.save(str(out / "tokenizer.json"))
  routing: dict = {}  # the last logged step's per-layer routing metrics

  def evaluate_and_log(done: int, params) -> float:
    """Validation perplexity and a text sample, logged and in TensorBoard."""
    ppl = run.evaluate(params)
    log.write({"step": done, "tokens": done * tokens_per_step, "val_ppl": ppl})
    sample = run.sample(params, done) if config.sample_tokens else None
    if sample is not None:
      log.write({"step": done, "sample": sample[:SAMPLE_LOG_CHARS]})
    if board is not None:
      board.scalars(done, {"val/loss": math.log(ppl), "val/perplexity": ppl})
      if sample is not None:
        board.text(done, "sample", sample)
    return ppl

  def read(done: int, metrics) -> None:
    """Checks and logs step ``done``'s metrics (a host sync only where needed)."""
    if skip:
      # Every step: optax applies the (K+1)-th consecutive bad update, so the
      # loop must see the K-th and stop before saving anything after it.
      consecutive = int(metrics["notfinite_count"])
      if consecutive:
        log.write({"step": done, "skipped_nonfinite": True,
                   "consecutive_nonfinite": consecutive,
                   "nonfinite_skips": int(metrics["total_notfinite"])})
      if consecutive >= skip:
        raise TrainingError(
            f"step {done}: {consecutive} consecutive steps with non-finite gradients "
            f"(--skip-nonfinite {skip}); stopped without applying or saving them; "
            f"{last_checkpoint()}")
    if done % config.log_every and done != end:
      return
    host = jax.device_get(metrics)
    step_routing = {k: host.pop(k) for k in models.ROUTING_METRICS if k in host}
    values = {k: float(v) for k, v in host.items()}
    if skip:
      values.pop("notfinite_count")
      values["nonfinite_skips"] = int(values.pop("total_notfinite"))
    elif not math.isfinite(values["loss"]):
      raise TrainingError(
          f"step {done}: the loss is {values['loss']}, so the parameters are no longer "
          f"finite; nothing more is saved and {last_checkpoint()} "
          "(--skip-nonfinite K skips steps with non-finite gradients)")
    # Skipped steps do not advance the optimizer's schedule count.
    lr_step = done - 1 - values.get("nonfinite_skips", 0)
    lr = float(run.schedule(lr_step))
    health = {}
    if step_routing:
      routing.update(step_routing, step=done)
      health = monitoring.routing_health(step_routing["expert_fraction"],
                                         step_routing["lb_loss_by_layer"],
                                         step_routing["z_loss_by_layer"])
      values["max_mean_load"] = health["routing/max_mean_load"]
      values["starved_fraction"] = health["routing/starved_fraction"]
    log.record_step(done, lr, values)
    if board is not None:
      scalars = {f"train/{k}": v for k, v in values.items() if k in TRAIN_SCALARS}
      if "ce_loss" in values:
        scalars["train/perplexity"] = math.exp(min(values["ce_loss"], 50.0))
      board.scalars(done, {
          **scalars, "train/learning_rate": lr,
          "train/tokens_per_s": log.tokens_per_s() or 0.0,
          "train/skipped_steps": values.get("nonfinite_skips", 0), **health})

  pending = None  # (step, metrics) dispatched but not yet read
  try:
    for step in range(start, end):
      inputs, targets = run.batch_at(step)
      extra = {}
      if config.stochastic_rounding:
        extra["key"] = jax.random.fold_in(run.rounding_key, step)
      if poisoned:
        extra["grad_scale"] = np.float32(np.nan if step in poisoned else 1.0)
      params, opt_state, metrics = run.train_step(params, opt_state, inputs, targets, **extra)
      if pending is not None:  # the previous step's, while this one runs
        read(*pending)
      done = step + 1
      pending = (done, metrics)
      evaluate = done % config.eval_every == 0 and done != config.steps
      save = done % config.ckpt_every == 0 or done == end
      if evaluate or save:
        read(*pending)
        pending = None
      if evaluate:
        evaluate_and_log(done, params)
        log.pause_timer()  # evaluation time is not training time
      if save:
        if not bool(_all_finite(params)):  # never replace a good checkpoint by a NaN one
          raise TrainingError(f"step {done}: the parameters are not finite; not saving a "
                              f"checkpoint; {last_checkpoint()}")
        ckpt.save(done, (params, opt_state), meta)
        log.pause_timer()
      log.advance()
    log.close_bar()
    summary = {
        "preset": config.preset, "optimizer": config.optimizer, "steps": end,
        "completed": end == config.steps,
        "train_loss": log.last.get("loss"),
        "tokens_per_s": log.tokens_per_s(),
        "median_step_s": log.median_step_s(),
        "unigram_ppl": run.data.info["unigram_val_perplexity"],
        "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
        "opt_state_bytes_by_tier": _summary_bytes(opt_state),
        "vocab_size": run.data.vocab_size,
        "val_works": run.data.info["val_names"],
        # From the optimizer state, so it counts the skips before a resume too.
        "nonfinite_skips": int(opt_state.total_notfinite) if skip else 0,
        "machine": machine(),
        "config": config_dict,
    }
    if end == config.steps:
      summary["val_ppl"] = evaluate_and_log(end, params)
      if is_chief:
        write_atomically(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    if is_chief and routing:
      monitoring.save_load_heatmap(
          routing["expert_fraction"], out / "expert_load.png",
          title=f"expert load at step {routing['step']} (1 = fair share)")
  finally:
    log.close()
    if board is not None:
      board.close()
  return TrainResult(summary, params, opt_state)
