"""Trains a MoE preset on text with any of the compared optimizers.

    python -m experiments.train --preset small --optimizer skewadam --out runs/small-skewadam

Data: the bundled Shakespeare corpus (or ``--data PATH``, any UTF-8 file or
folder), split into whole held-out works, tokenised with a byte-level BPE trained
locally and cached (``experiments/data/``); or ``--data DIR``, a corpus of any
size prepared once by ``python -m experiments.data prepare`` and read through
``np.memmap`` (a bad manifest is a one-line error). The train step is one jitted
function (forward, backward, optimizer update) with the parameters and optimizer
state donated. Batch ``s`` is a pure function of ``(seed, s)``, so a resumed run
sees exactly the batches of an uninterrupted one; on a mesh each process reads
only its own devices' rows of it. ``--mesh data=4,expert=2``
shards the same step over a device mesh and ``--coordinator-address``,
``--num-processes``, ``--process-id`` join several processes
(``experiments/training/mesh.py``, ``experiments/training/distributed.py``). The run itself is
:mod:`experiments.training.run`; this module is its command line. Every flag is a field of
:class:`experiments.training.config.TrainConfig`, which also says which settings a
resumed run must keep.

Outputs under ``--out``: ``metrics.jsonl`` (one JSON object per logged step and
per evaluation), ``ckpt/`` (orbax checkpoints every ``--ckpt-every`` steps and at
the end), and ``summary.json`` (validation perplexity, the unigram baseline,
tokens/s, optimizer-state bytes by tier); the command prints one result line
(``--json``: the summary too). Resuming a finished run changes nothing.

Faults (docs/explanations/failure-behaviour.md): bad flags, data or checkpoints print one
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
import json
import pathlib
import sys
from typing import Sequence

import experiments
from experiments.training import config as config_lib
from experiments.training import distributed
from experiments.training.config import TrainConfig
from experiments.training.run import TrainingError, train

ROOT = pathlib.Path(__file__).resolve().parent.parent


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
  distributed.add_distributed_flags(parser)
  return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainConfig, argparse.Namespace]:
  """The run's configuration: a ``--config FILE``'s settings, overridden by the flags."""
  args, _ = config_lib.parse_with_config_file(build_parser(), argv)
  return config_lib.from_args(args), args


def main(argv: Sequence[str] | None = None) -> int:
  experiments.use_cpu_without_gpu()
  try:
    config, args = parse_args(argv)
    # Before anything touches a device: joins the other processes, if any.
    distributed.initialize_distributed(args.coordinator_address, args.num_processes,
                                    args.process_id)
    out = args.out or str(ROOT / "runs" / f"{config.preset}-{config.optimizer}")
    result = train(config, out, resume=args.resume, stop_after=args.stop_after,
                   progress=not args.no_progress)
  except (ValueError, OSError) as err:  # bad flags, data or checkpoints: one line
    print(f"error: {err}", file=sys.stderr)
    return 2
  except TrainingError as err:  # the run diverged; its last good checkpoint is kept
    print(f"error: {err}", file=sys.stderr)
    return 3
  summary = result.summary
  if result.already_finished:
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
