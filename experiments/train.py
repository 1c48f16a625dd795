"""Trains a MoE preset on text with any of the compared optimizers.

    python -m experiments.train --preset small --optimizer skewadam --out runs/small-skewadam

Data: the bundled Shakespeare corpus (or ``--data PATH``, any UTF-8 file or
folder), split into whole held-out works, tokenised with a byte-level BPE trained
locally and cached (``experiments/data.py``). The train step is one jitted
function (forward, backward, optimizer update) with the parameters and optimizer
state donated. Batch ``s`` is a pure function of ``(seed, s)``, so a resumed run
sees exactly the batches of an uninterrupted one. ``--mesh data=4,expert=2``
shards the same step over a device mesh and ``--coordinator-address``,
``--num-processes``, ``--process-id`` join several processes
(``experiments/parallel.py``). Every flag is a field of
:class:`experiments.config.TrainConfig`, which also says which settings a
resumed run must keep.

Outputs under ``--out``: ``metrics.jsonl`` (one JSON object per logged step and
per evaluation), ``ckpt/`` (orbax checkpoints every ``--ckpt-every`` steps and at
the end), and ``summary.json`` (validation perplexity, the unigram baseline,
tokens/s, optimizer-state bytes by tier); the command prints one result line
(``--json``: the summary too). Resuming a finished run changes nothing.

Faults (README, "Failure behaviour"): bad flags, data or checkpoints print one
line ``error: ...`` and exit 2; ``--skip-nonfinite K`` skips steps with
NaN/Inf gradients (``optax.apply_if_finite`` around the whole optimizer) and
stops, exit 3, after K in a row; without it a non-finite loss stops the run
(exit 3). A checkpoint of non-finite parameters is never written, a damaged
latest checkpoint falls back to the previous one, and ``--param-dtype
bfloat16 --stochastic-rounding`` applies updates to bf16 parameters with
unbiased stochastic rounding (bits from ``(seed, step)``, so resume is exact).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import math
import os
import pathlib
import statistics
import sys
import time
from typing import Any, Collection, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import models
import skewadam_jax
import experiments
from experiments import data as data_lib
from experiments import optimizers
from experiments import parallel
from experiments import config as config_lib
from experiments.checkpoint import Checkpointer
from experiments.config import PARAM_DTYPES  # noqa: F401  (re-exported)
from experiments.config import TrainConfig
from experiments.steps import make_step_fns

ROOT = pathlib.Path(__file__).resolve().parent.parent


class TrainingError(RuntimeError):
  """The run cannot go on: its gradients or parameters stopped being finite.

  Raised before any checkpoint of the bad state is written; the command
  prints it as one line and exits with status 3.
  """




class Run:
  """A model, its optimizer, the data and the compiled step functions."""

  def __init__(self, config: TrainConfig, *, cache_dir: str | os.PathLike | None = None):
    config.validate()
    self.config = config
    self.model_config = config.model_config()
    seq_len = config.seq_len or self.model_config.max_seq_len
    if seq_len > self.model_config.max_seq_len:
      raise ValueError(f"--seq-len {seq_len} exceeds the preset's max_seq_len "
                       f"{self.model_config.max_seq_len}")
    self.seq_len = seq_len
    self.data = data_lib.prepare_data(
        config.data, vocab_size=self.model_config.vocab_size, cache_dir=cache_dir,
        val_fraction=config.val_fraction)
    corpus = self.data.info["path"]
    try:
      self.dataset = data_lib.TokenDataset(
          self.data.train_tokens, seq_len=seq_len, batch_size=config.batch_size,
          seed=config.seed)
    except data_lib.DataError as err:
      raise data_lib.DataError(f"{corpus}: training split too short: {err}") from None
    try:
      self.eval_set = data_lib.eval_batches(
          self.data.val_tokens, seq_len, config.batch_size, max_batches=config.eval_batches)
    except data_lib.DataError as err:
      raise data_lib.DataError(f"{corpus}: validation split too short: {err}") from None
    # Checked on resume: the same path with other text would silently give
    # other batches than the checkpointed run saw.
    self.data_fingerprint = hashlib.sha256(
        self.data.train_tokens.tobytes() + b"|" + self.data.val_tokens.tobytes()
    ).hexdigest()[:16]

    model = models.Transformer(self.model_config, rngs=nnx.Rngs(config.seed))
    self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
    self.axes = models.logical_axes(params)
    self.initial_params = nnx.as_pure(params)
    lr = config.lr if config.lr is not None else optimizers.DEFAULT_LR[config.optimizer]
    self.schedule = optimizers.lr_schedule(lr, config.steps, config.warmup_steps)
    self.tx = optimizers.make_optimizer(
        config.optimizer, learning_rate=self.schedule, axes=self.axes,
        weight_decay=config.weight_decay, clip_norm=config.clip_norm,
        skewadam_tiers=config.skewadam_tiers())
    if config.skip_nonfinite:
      # Outermost, so a skipped step leaves every inner state untouched
      # (moments, step count, schedule): as if the batch had not been drawn.
      # optax applies the (K+1)-th bad update; the loop stops at the K-th.
      self.tx = optax.apply_if_finite(self.tx, max_consecutive_errors=config.skip_nonfinite)
    # Stochastic-rounding bits are a pure function of (seed, step), like the
    # batches, so a resumed run rounds exactly as an uninterrupted one.
    self.rounding_key = jax.random.fold_in(jax.random.key(config.seed), 0x5352)
    train_step, eval_step = make_step_fns(self.graphdef, self.rest, self.tx,
                                          stochastic_rounding=config.stochastic_rounding)
    self.spmd = None
    if config.mesh:  # the same steps, sharded over a device mesh
      mesh = parallel.make_mesh(**parallel.parse_mesh(config.mesh))
      self.spmd = parallel.spmd_steps(mesh, self.tx, self.initial_params, train_step,
                                      eval_step, axes=self.axes)
      self.train_step, self.eval_step = self.spmd.train_step, self.spmd.eval_step
    else:
      self.train_step = jax.jit(train_step, donate_argnums=(0, 1))
      self.eval_step = jax.jit(eval_step)

  def init_state(self):
    if self.spmd is not None:
      return self.spmd.init(self.initial_params)
    params = jax.tree.map(jnp.copy, self.initial_params)
    return params, self.tx.init(params)

  def evaluate(self, params) -> float:
    """Validation perplexity: exp of the mean next-token cross-entropy."""
    total, count = 0.0, 0
    for inputs, targets in self.eval_set:
      ce_sum, n = self.eval_step(params, inputs, targets)
      total += float(ce_sum)
      count += int(n)
    return math.exp(total / count)


def _summary_bytes(state) -> dict[str, int]:
  return skewadam_jax.state_bytes_by_tier(state)


def _read_metrics(path: pathlib.Path, upto_step: int) -> list[dict]:
  if not path.exists():
    return []
  records = []
  for line in path.read_text().splitlines():
    try:
      records.append(json.loads(line))
    except ValueError:  # a line cut short by a crash: drop it, keep the run
      continue
  return [r for r in records if isinstance(r, dict) and r.get("step", 0) <= upto_step]


def _write_atomically(path: pathlib.Path, text: str) -> None:
  """Writes a temporary file and renames it: a crash leaves the old or the new file."""
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


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
      is an error, so a run is never overwritten by accident.
    stop_after: stop (with a checkpoint) after this many steps in total, as an
      interruption would; ``--resume`` continues the same schedule.
    cache_dir: tokenizer cache (default ``<repo>/.cache/tokenizers``).
    progress: show a progress bar on stderr.
    nan_grad_steps: fault injection for tests: the gradients of these
      (0-based) steps are multiplied by NaN.
    run: a :class:`Run` of this ``config`` to reuse (its steps are already
      compiled: several runs in one process, e.g. tests, compile once).

  Returns:
    The summary (as ``summary.json``, plus ``"_params"`` and
    ``"_opt_state"``, the final state).

  Raises:
    ValueError: bad configuration or data, or a checkpoint of another run
      (``CheckpointError``), or no usable checkpoint.
    TrainingError: the gradients were non-finite ``--skip-nonfinite`` times in
      a row, or (without it) the loss or the parameters became non-finite.
      The bad state is not checkpointed.
  """
  if run is None:
    run = Run(config, cache_dir=cache_dir)
  elif run.config != config:
    raise ValueError("train(run=...) was built for another configuration")
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  ckpt = Checkpointer(out / "ckpt")
  config_dict = dataclasses.asdict(config)
  params, opt_state = run.init_state()
  start = 0
  latest = ckpt.latest_step()
  if latest is not None and not resume:
    ckpt.close()
    raise ValueError(f"{out / 'ckpt'} already holds a checkpoint (step {latest}); "
                     "pass --resume to continue it or choose another --out")
  if resume and latest is not None:
    try:
      start, (params, opt_state), _ = ckpt.restore_latest(
          (params, opt_state), expect=config_dict,
          expect_meta={"data_fingerprint": run.data_fingerprint})
    except BaseException:
      ckpt.close()
      raise
  metrics_path = out / "metrics.jsonl"
  if resume and start == config.steps and (out / "summary.json").exists():
    # A finished run: resuming it changes nothing, its figures are kept.
    ckpt.close()
    summary = json.loads((out / "summary.json").read_text())
    return {**summary, "already_finished": True, "_params": params, "_opt_state": opt_state}
  # In a multi-process run every process trains (and saves checkpoints jointly),
  # but only process 0 writes the logs, the summary and the progress bar.
  is_chief = jax.process_index() == 0
  if is_chief:
    records = _read_metrics(metrics_path, start) if resume else []
    _write_atomically(metrics_path, "".join(json.dumps(r) + "\n" for r in records))
  log_path = metrics_path if is_chief else pathlib.Path(os.devnull)

  tokens_per_step = config.batch_size * run.seq_len
  end = config.steps if stop_after is None else min(stop_after, config.steps)
  meta = {"config": config_dict, "data_fingerprint": run.data_fingerprint}
  skip = config.skip_nonfinite
  poisoned = frozenset(nan_grad_steps)
  bar = None

  def last_checkpoint() -> str:
    step = ckpt.latest_step()
    return ("no checkpoint was saved" if step is None
            else f"the last checkpoint is step {step} in {ckpt.directory}")

  def stop(message: str):
    if bar is not None:
      bar.close()
    ckpt.close()
    raise TrainingError(message)

  if progress and is_chief:
    from tqdm import tqdm
    bar = tqdm(total=config.steps, initial=start, desc=f"{config.optimizer}",
               dynamic_ncols=True, file=sys.stderr)
  timed_steps, timed_seconds, t_last = 0, 0.0, None
  step_seconds = []  # per logged interval; the median shrugs off a busy machine's spikes
  last = {}
  with log_path.open("a") as log:
    for step in range(start, end):
      inputs, targets = run.dataset.batch_at(step)
      extra = {}
      if config.stochastic_rounding:
        extra["key"] = jax.random.fold_in(run.rounding_key, step)
      if poisoned:
        extra["grad_scale"] = np.float32(np.nan if step in poisoned else 1.0)
      params, opt_state, metrics = run.train_step(params, opt_state, inputs, targets, **extra)
      done = step + 1
      if skip:
        # A scalar read (host sync) every step: optax applies the (K+1)-th
        # consecutive bad update, so the loop must see the K-th and stop.
        consecutive = int(metrics["notfinite_count"])
        if consecutive:
          log.write(json.dumps({"step": done, "skipped_nonfinite": True,
                                "consecutive_nonfinite": consecutive,
                                "nonfinite_skips": int(metrics["total_notfinite"])}) + "\n")
          log.flush()
        if consecutive >= skip:
          stop(f"step {done}: {consecutive} consecutive steps with non-finite gradients "
               f"(--skip-nonfinite {skip}); stopped without applying or saving them; "
               f"{last_checkpoint()}")
      if done % config.log_every == 0 or done == end:
        last = {k: float(v) for k, v in jax.device_get(metrics).items()}
        if skip:
          last.pop("notfinite_count")
          last["nonfinite_skips"] = int(last.pop("total_notfinite"))
        elif not math.isfinite(last["loss"]):
          stop(f"step {done}: the loss is {last['loss']}, so the parameters are no longer "
               f"finite; nothing more is saved and {last_checkpoint()} "
               "(--skip-nonfinite K skips steps with non-finite gradients)")
        now = time.perf_counter()
        if t_last is not None:
          timed_seconds += now - t_last
          timed_steps += done - t_prev
          step_seconds.append((now - t_last) / (done - t_prev))
        t_last, t_prev = now, done
        tok_s = timed_steps * tokens_per_step / timed_seconds if timed_seconds else 0.0
        # Skipped steps do not advance the optimizer's schedule count.
        lr_step = step - last.get("nonfinite_skips", 0)
        record = {"step": done, "lr": float(run.schedule(lr_step)), "tokens": done * tokens_per_step,
                  "tokens_per_s": tok_s, **last}
        log.write(json.dumps(record) + "\n")
        log.flush()
        if bar is not None:
          bar.set_postfix(loss=f"{last['loss']:.3f}", tok_s=f"{tok_s:,.0f}")
      if done % config.eval_every == 0 and done != config.steps:
        val_ppl = run.evaluate(params)
        log.write(json.dumps({"step": done, "tokens": done * tokens_per_step,
                              "val_ppl": val_ppl}) + "\n")
        log.flush()
        t_last = None  # evaluation time is not training time
      if done % config.ckpt_every == 0 or done == end:
        if not bool(_all_finite(params)):  # never replace a good checkpoint by a NaN one
          stop(f"step {done}: the parameters are not finite; not saving a checkpoint; "
               f"{last_checkpoint()}")
        ckpt.save(done, (params, opt_state), meta)
        t_last = None
      if bar is not None:
        bar.update(1)
    if bar is not None:
      bar.close()

  summary = {
      "preset": config.preset, "optimizer": config.optimizer, "steps": end,
      "completed": end == config.steps,
      "train_loss": last.get("loss"),
      "tokens_per_s": timed_steps * tokens_per_step / timed_seconds if timed_seconds else None,
      "median_step_s": statistics.median(step_seconds) if step_seconds else None,
      "unigram_ppl": run.data.info["unigram_val_perplexity"],
      "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
      "opt_state_bytes_by_tier": _summary_bytes(opt_state),
      "vocab_size": run.data.vocab_size,
      "val_works": run.data.info["val_names"],
      # From the optimizer state, so it counts the skips before a resume too.
      "nonfinite_skips": int(opt_state.total_notfinite) if skip else 0,
      "config": config_dict,
  }
  if end == config.steps:
    summary["val_ppl"] = run.evaluate(params)
    with log_path.open("a") as log:
      log.write(json.dumps({"step": end, "tokens": end * tokens_per_step,
                            "val_ppl": summary["val_ppl"]}) + "\n")
    if is_chief:
      _write_atomically(out / "summary.json", json.dumps(summary, indent=2) + "\n")
  ckpt.close()
  summary["_params"] = params
  summary["_opt_state"] = opt_state
  return summary


class _ArgumentParser(argparse.ArgumentParser):
  """Reports a bad flag as a ValueError, so ``main`` prints it as one line."""

  def error(self, message):
    raise ValueError(message)


def build_parser() -> argparse.ArgumentParser:
  """The command's flags: one per config field, then the run's own."""
  parser = _ArgumentParser(
      prog="python -m experiments.train", description=__doc__.split("\n\n")[0])
  config_lib.add_flags(parser)
  parser.add_argument("--out", default=None, help="output folder (default runs/PRESET-OPTIMIZER)")
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  parser.add_argument("--stop-after", type=int, default=None,
                      help="stop after this many steps, keeping the schedule of --steps")
  parser.add_argument("--no-progress", action="store_true", help="no progress bar")
  parser.add_argument("--json", action="store_true",
                      help="print the run's summary as JSON (it is always in OUT/summary.json)")
  parallel.add_distributed_flags(parser)
  return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
  args = build_parser().parse_args(argv)
  return config_lib.from_args(args), args


def main(argv: Sequence[str] | None = None) -> int:
  experiments.use_cpu_without_gpu()
  try:
    config, args = parse_args(argv)
    # Before anything touches a device: joins the other processes, if any.
    parallel.initialize_distributed(args.coordinator_address, args.num_processes,
                                    args.process_id)
    out = args.out or str(ROOT / "runs" / f"{config.preset}-{config.optimizer}")
    summary = train(config, out, resume=args.resume, stop_after=args.stop_after,
                    progress=not args.no_progress)
  except (ValueError, OSError) as err:  # bad flags, data or checkpoints: one line
    print(f"error: {err}", file=sys.stderr)
    return 2
  except TrainingError as err:  # the run diverged; its last good checkpoint is kept
    print(f"error: {err}", file=sys.stderr)
    return 3
  summary.pop("_params")
  summary.pop("_opt_state")
  if summary.pop("already_finished", False):
    print(f"{out} already finished {summary['steps']} steps; nothing changed "
          f"(summary in {out}/summary.json)", file=sys.stderr)
  if args.json:
    print(json.dumps(summary, indent=2))
  if "val_ppl" in summary:
    # None when too few steps were timed (e.g. a resume with one log step left).
    speed = summary["tokens_per_s"]
    speed = f"{speed:,.0f} tokens/s" if speed else "tokens/s not measured"
    print(f"validation perplexity {summary['val_ppl']:.2f} "
          f"(unigram baseline {summary['unigram_ppl']:.2f}) after {summary['steps']} steps, "
          f"{speed}, optimizer state "
          f"{summary['opt_state_bytes_by_tier']['total'] / 1e6:.2f} MB", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
