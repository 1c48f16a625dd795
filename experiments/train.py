"""Trains a MoE preset on text with any of the compared optimizers.

    python -m experiments.train --preset small --optimizer skewadam --out runs/small-skewadam

Data: the bundled Shakespeare corpus (or ``--data PATH``, any UTF-8 file or
folder), split into whole held-out works, tokenised with a byte-level BPE trained
locally and cached (``experiments/data.py``). The train step is one jitted
function (forward, backward, optimizer update) with the parameters and optimizer
state donated. Batch ``s`` is a pure function of ``(seed, s)``, so a resumed run
sees exactly the batches of an uninterrupted one.

Outputs under ``--out``: ``metrics.jsonl`` (one JSON object per logged step and
per evaluation), ``ckpt/`` (orbax checkpoints every ``--ckpt-every`` steps and at
the end), and ``summary.json`` (validation perplexity, the unigram baseline,
tokens/s, optimizer-state bytes by tier), which is also printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import models
import skewadam_jax
from experiments import data as data_lib
from experiments import optimizers
from experiments.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything that defines a run (saved with every checkpoint).

  ``lr=None`` takes the optimizer's default from ``optimizers.DEFAULT_LR``;
  ``seq_len=None`` the preset's ``max_seq_len``.
  """
  preset: str = "small"
  optimizer: str = "skewadam"
  steps: int = 600
  batch_size: int = 16
  seq_len: int | None = None
  lr: float | None = None
  warmup_steps: int = 60
  weight_decay: float = 0.1
  clip_norm: float = 1.0
  seed: int = 0
  data: str | None = None
  val_fraction: float = 0.1
  eval_every: int = 100
  eval_batches: int = 16
  ckpt_every: int = 100
  log_every: int = 10
  moe_impl: str | None = None
  expert_momentum: str | None = None     # SkewAdam ablations
  backbone_second_moment: str | None = None
  router_second_moment: str | None = None

  def model_config(self) -> models.ModelConfig:
    overrides = {"moe_impl": self.moe_impl} if self.moe_impl else {}
    return models.get_preset(self.preset, **overrides)

  def skewadam_tiers(self) -> dict:
    tiers = {}
    if self.expert_momentum:
      tiers["expert"] = {"momentum": self.expert_momentum}
    if self.backbone_second_moment:
      tiers["backbone"] = {"second_moment": self.backbone_second_moment}
    if self.router_second_moment:
      tiers["router"] = {"second_moment": self.router_second_moment}
    return tiers

  def validate(self) -> None:
    """Raises ValueError with a one-line message for a bad setting."""
    if self.optimizer not in optimizers.OPTIMIZERS:
      raise ValueError(f"unknown optimizer {self.optimizer!r}; "
                       f"choose from {', '.join(optimizers.OPTIMIZERS)}")
    self.model_config()  # unknown preset / moe_impl
    for name in ("steps", "batch_size", "eval_batches", "eval_every",
                 "ckpt_every", "log_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                         f"got {getattr(self, name)}")
    if self.seq_len is not None and self.seq_len < 1:
      raise ValueError(f"--seq-len must be >= 1, got {self.seq_len}")
    if self.lr is not None and not self.lr > 0:
      raise ValueError(f"--lr must be > 0, got {self.lr}")
    if self.weight_decay < 0 or self.clip_norm < 0 or self.warmup_steps < 0:
      raise ValueError("--weight-decay, --clip-norm and --warmup-steps must be >= 0")
    if self.seed < 0:
      raise ValueError(f"--seed must be >= 0, got {self.seed}")
    skewadam_jax.scale_by_skewadam(**self.skewadam_tiers())  # unknown encodings


def make_step_fns(graphdef, rest, tx):
  """The train and eval step functions (not yet jitted) of a split NNX model.

  ``train_step(params, opt_state, inputs, targets) -> (params, opt_state,
  metrics)`` runs forward, backward and the optimizer update; the training
  command jits it with ``donate_argnums=(0, 1)`` and the memory planner
  compiles exactly this function.
  ``eval_step(params, inputs, targets) -> (sum of token cross-entropies,
  token count)``.
  """
  def loss(params, inputs, targets):
    return models.lm_loss(nnx.merge(graphdef, params, rest), inputs, targets)

  def train_step(params, opt_state, inputs, targets):
    (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(params, inputs, targets)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = {k: v for k, v in metrics.items() if k != "expert_fraction"}
    metrics["grad_norm"] = optax.tree.norm(grads)
    return params, opt_state, metrics

  def eval_step(params, inputs, targets):
    _, metrics = loss(params, inputs, targets)
    return metrics["ce_loss"] * inputs.size, inputs.size

  return train_step, eval_step


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
    self.dataset = data_lib.TokenDataset(
        self.data.train_tokens, seq_len=seq_len, batch_size=config.batch_size,
        seed=config.seed)
    self.eval_set = data_lib.eval_batches(
        self.data.val_tokens, seq_len, config.batch_size, max_batches=config.eval_batches)

    model = models.Transformer(self.model_config, rngs=nnx.Rngs(config.seed))
    self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
    self.initial_params = nnx.as_pure(params)
    lr = config.lr if config.lr is not None else optimizers.DEFAULT_LR[config.optimizer]
    self.schedule = optimizers.lr_schedule(lr, config.steps, config.warmup_steps)
    self.tx = optimizers.make_optimizer(
        config.optimizer, learning_rate=self.schedule,
        weight_decay=config.weight_decay, clip_norm=config.clip_norm,
        skewadam_tiers=config.skewadam_tiers())
    train_step, eval_step = make_step_fns(self.graphdef, self.rest, self.tx)
    self.train_step = jax.jit(train_step, donate_argnums=(0, 1))
    self.eval_step = jax.jit(eval_step)

  def init_state(self):
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
  records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  return [r for r in records if r.get("step", 0) <= upto_step]


def train(config: TrainConfig, out_dir: str | os.PathLike, *, resume: bool = False,
          stop_after: int | None = None, cache_dir: str | os.PathLike | None = None,
          progress: bool = True) -> dict:
  """Trains, evaluates and checkpoints one run; returns its summary.

  Args:
    config: the run.
    out_dir: folder for ``metrics.jsonl``, ``ckpt/`` and ``summary.json``.
    resume: continue from the latest checkpoint in ``out_dir/ckpt`` (its
      configuration must match ``config``); without it an existing checkpoint
      is an error, so a run is never overwritten by accident.
    stop_after: stop (with a checkpoint) after this many steps in total, as an
      interruption would; ``--resume`` continues the same schedule.
    cache_dir: tokenizer cache (default ``<repo>/.cache/tokenizers``).
    progress: show a progress bar on stderr.
  """
  run = Run(config, cache_dir=cache_dir)
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  ckpt = Checkpointer(out / "ckpt")
  config_dict = dataclasses.asdict(config)
  params, opt_state = run.init_state()
  start = 0
  latest = ckpt.latest_step()
  if latest is not None and not resume:
    raise ValueError(f"{out / 'ckpt'} already holds a checkpoint (step {latest}); "
                     "pass --resume to continue it or choose another --out")
  if resume and latest is not None:
    (params, opt_state), _ = ckpt.restore(latest, (params, opt_state), expect=config_dict)
    start = latest
  metrics_path = out / "metrics.jsonl"
  records = _read_metrics(metrics_path, start) if resume else []
  metrics_path.write_text("".join(json.dumps(r) + "\n" for r in records))

  tokens_per_step = config.batch_size * run.seq_len
  end = config.steps if stop_after is None else min(stop_after, config.steps)
  meta = {"config": config_dict, "num_leaves": len(jax.tree.leaves((params, opt_state)))}
  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=config.steps, initial=start, desc=f"{config.optimizer}",
               dynamic_ncols=True, file=sys.stderr)
  timed_steps, timed_seconds, t_last = 0, 0.0, None
  last = {}
  with metrics_path.open("a") as log:
    for step in range(start, end):
      inputs, targets = run.dataset.batch_at(step)
      params, opt_state, metrics = run.train_step(params, opt_state, inputs, targets)
      done = step + 1
      if done % config.log_every == 0 or done == end:
        last = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        if t_last is not None:
          timed_seconds += now - t_last
          timed_steps += done - t_prev
        t_last, t_prev = now, done
        tok_s = timed_steps * tokens_per_step / timed_seconds if timed_seconds else 0.0
        record = {"step": done, "lr": float(run.schedule(step)), "tokens": done * tokens_per_step,
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
      "unigram_ppl": run.data.info["unigram_val_perplexity"],
      "num_params": int(sum(x.size for x in jax.tree.leaves(params))),
      "opt_state_bytes_by_tier": _summary_bytes(opt_state),
      "vocab_size": run.data.vocab_size,
      "val_works": run.data.info["val_names"],
      "config": config_dict,
  }
  if end == config.steps:
    summary["val_ppl"] = run.evaluate(params)
    with metrics_path.open("a") as log:
      log.write(json.dumps({"step": end, "tokens": end * tokens_per_step,
                            "val_ppl": summary["val_ppl"]}) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  ckpt.close()
  summary["_params"] = params
  return summary


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
  parser = argparse.ArgumentParser(
      prog="python -m experiments.train", description=__doc__.split("\n\n")[0])
  defaults = TrainConfig()
  parser.add_argument("--preset", default=defaults.preset, help="model preset (models.PRESETS)")
  parser.add_argument("--optimizer", default=defaults.optimizer,
                      help=f"one of {', '.join(optimizers.OPTIMIZERS)}")
  for field in dataclasses.fields(TrainConfig):
    if field.name in ("preset", "optimizer"):
      continue
    flag = "--" + field.name.replace("_", "-")
    kind = {"int": int, "float": float}.get(str(field.type).split(" ")[0], str)
    parser.add_argument(flag, type=kind, default=field.default)
  parser.add_argument("--out", default=None, help="output folder (default runs/PRESET-OPTIMIZER)")
  parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
  parser.add_argument("--stop-after", type=int, default=None,
                      help="stop after this many steps, keeping the schedule of --steps")
  parser.add_argument("--no-progress", action="store_true")
  args = parser.parse_args(argv)
  values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
  return TrainConfig(**values), args


def main(argv: Sequence[str] | None = None) -> int:
  try:
    config, args = parse_args(argv)
    out = args.out or str(ROOT / "runs" / f"{config.preset}-{config.optimizer}")
    summary = train(config, out, resume=args.resume, stop_after=args.stop_after,
                    progress=not args.no_progress)
  except (ValueError, OSError) as err:  # bad flags, data or checkpoints: one line
    print(f"error: {err}", file=sys.stderr)
    return 2
  summary.pop("_params")
  summary.pop("config")
  print(json.dumps(summary, indent=2))
  if "val_ppl" in summary:
    print(f"validation perplexity {summary['val_ppl']:.2f} "
          f"(unigram baseline {summary['unigram_ppl']:.2f}) after {summary['steps']} steps, "
          f"{summary['tokens_per_s']:,.0f} tokens/s, optimizer state "
          f"{summary['opt_state_bytes_by_tier']['total'] / 1e6:.2f} MB", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
