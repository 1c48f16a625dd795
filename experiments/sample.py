"""Text from a training run's latest checkpoint.

    python -m experiments.sample --run runs/small-skewadam --prompt "ROMEO:" --max-tokens 64

Reads the run's configuration from its latest checkpoint, restores the
parameters, encodes the prompt with the run's tokenizer (``tokenizer.json``,
written by the training command) and prints the prompt and its continuation:
temperature and top-k sampling with a seeded key, each token a full forward
pass over the run's context window (no KV cache; ``experiments/training/sampling.py``
states the cost). Bad flags or a run without a checkpoint: one line, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
from typing import Sequence

import experiments
from experiments.training import checkpoint as ckpt_lib
from experiments.training import sampling
from experiments.training import run as training
from experiments.training.config import TrainConfig


def load_run(run_dir: str | pathlib.Path):
  """``(config, graphdef, rest, params, tokenizer, step)`` of a run's latest checkpoint."""
  from tokenizers import Tokenizer  # pylint: disable=import-outside-toplevel
  run_dir = pathlib.Path(run_dir)
  checkpointer = ckpt_lib.Checkpointer(run_dir / "ckpt")
  try:
    step = checkpointer.latest_step()
    if step is None:
      raise ValueError(f"{run_dir / 'ckpt'} holds no checkpoint")
    saved = checkpointer.read_meta(step)["config"]
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in saved.items() if k in fields})
    graphdef, rest, params, opt_state = training.abstract_run_state(config)
    step, (params, _), _ = checkpointer.restore_latest((params, opt_state))
  finally:
    checkpointer.close()
  tokenizer_path = run_dir / "tokenizer.json"
  if not tokenizer_path.exists():
    raise ValueError(f"{tokenizer_path} is missing (written by experiments.train)")
  return config, graphdef, rest, params, Tokenizer.from_file(str(tokenizer_path)), step


def build_parser() -> argparse.ArgumentParser:
  """The command's flags."""
  parser = argparse.ArgumentParser(prog="python -m experiments.sample",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--run", required=True, help="a training run's --out folder")
  parser.add_argument("--prompt", required=True)
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--temperature", type=float, default=1.0, help="0: the most likely token")
  parser.add_argument("--top-k", type=int, default=40, help="0: no cut")
  parser.add_argument("--seed", type=int, default=0)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  experiments.use_cpu_without_gpu()
  args = build_parser().parse_args(argv)
  try:
    if args.max_tokens < 1 or args.top_k < 0 or not args.temperature >= 0:
      raise ValueError("--max-tokens must be >= 1, --top-k >= 0 and --temperature >= 0")
    config, graphdef, rest, params, tokenizer, step = load_run(args.run)
    window = config.seq_len or config.model_config().max_seq_len
    next_token = sampling.make_next_token(graphdef, rest, temperature=args.temperature,
                                          top_k=args.top_k)
    text = sampling.continue_text(tokenizer, next_token, params, args.prompt, args.max_tokens,
                                  window=window, seed=args.seed)
  except (ValueError, OSError) as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  print(f"[{args.run}, step {step}, temperature {args.temperature}, top-k {args.top_k}, "
        f"seed {args.seed}]", file=sys.stderr)
  print(args.prompt + text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
