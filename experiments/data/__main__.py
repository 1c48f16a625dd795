"""``python -m experiments.data``: inspect, prepare or generate a corpus."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from experiments.data.batches import prepare_data
from experiments.data.shards import DEFAULT_SAMPLE_MB, DEFAULT_SHARD_TOKENS, prepare_corpus
from experiments.data.synthetic import generate_corpus


def build_parser() -> argparse.ArgumentParser:
  """The ``python -m experiments.data`` command line: three subcommands."""
  parser = argparse.ArgumentParser(
      prog="python -m experiments.data", description=__doc__.splitlines()[0])
  commands = parser.add_subparsers(dest="command", required=True)
  info = commands.add_parser(
      "info", help="load, split and tokenize a corpus in memory; print its "
      "statistics as JSON (the default command)")
  info.add_argument("--path", default=None,
                    help="corpus file or folder (default: bundled)")
  info.add_argument("--vocab-size", type=int, default=4096)
  info.add_argument("--cache-dir", default=None)
  info.add_argument("--val-fraction", type=float, default=0.1)

  prepare = commands.add_parser(
      "prepare", help="tokenize a corpus of any size into memory-mapped "
      "shards plus a manifest (streamed, bounded memory)")
  prepare.add_argument("--data", default=None,
                       help="corpus file or folder (default: bundled)")
  prepare.add_argument("--out", required=True, help="folder to write")
  prepare.add_argument("--vocab-size", type=int, default=4096)
  prepare.add_argument("--val-fraction", type=float, default=0.1)
  prepare.add_argument("--tokenizer", default=None,
                       help="use this tokenizers JSON file instead of training")
  prepare.add_argument("--tokenizer-sample-mb", type=float,
                       default=DEFAULT_SAMPLE_MB,
                       help="train the tokenizer on the first this many million "
                       f"characters of training text (default {DEFAULT_SAMPLE_MB})")
  prepare.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                       help=f"token ids per shard (default {DEFAULT_SHARD_TOKENS})")
  prepare.add_argument("--cache-dir", default=None, help="tokenizer cache")
  prepare.add_argument("--overwrite", action="store_true",
                       help="replace a prepared corpus in --out")
  prepare.add_argument("--no-progress", action="store_true")

  generate = commands.add_parser(
      "generate", help="write a synthetic corpus by resampling the lines of "
      "the bundled one (for scale tests)")
  generate.add_argument("--out", required=True, help="folder to write")
  generate.add_argument("--gb", type=float, required=True,
                        help="size in GB (10**9 bytes)")
  generate.add_argument("--file-mb", type=float, default=8.0,
                        help="size of each file in MB (default 8)")
  generate.add_argument("--seed", type=int, default=0)
  generate.add_argument("--no-progress", action="store_true")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Command line: ``info`` (default), ``prepare`` or ``generate``.

  Bad input prints one line ``error: ...`` and returns 2.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] not in ("info", "prepare", "generate", "-h", "--help"):
    argv.insert(0, "info")  # The command line before subcommands.
  args = build_parser().parse_args(argv)
  try:
    if args.command == "info":
      data = prepare_data(args.path, args.vocab_size, args.cache_dir,
                          args.val_fraction)
      print(json.dumps(data.info, indent=2))
    elif args.command == "generate":
      files = generate_corpus(args.out, int(args.gb * 1e9), seed=args.seed,
                              file_bytes=int(args.file_mb * 1e6),
                              progress=not args.no_progress)
      size = sum(f.stat().st_size for f in files)
      print(f"wrote {len(files)} files, {size:,} bytes, to {args.out}")
    else:
      manifest = prepare_corpus(
          args.data, args.out, vocab_size=args.vocab_size,
          val_fraction=args.val_fraction, tokenizer=args.tokenizer,
          sample_mb=args.tokenizer_sample_mb, cache_dir=args.cache_dir,
          shard_tokens=args.shard_tokens, overwrite=args.overwrite,
          progress=not args.no_progress)
      splits, split = manifest["splits"], manifest["split"]
      tok = manifest["tokenizer"]
      docs = split["num_train_docs"] + split["num_val_docs"]
      print(f"prepared {args.out}: {splits['train']['num_tokens']:,} train and "
            f"{splits['val']['num_tokens']:,} validation tokens "
            f"({manifest['dtype']}; {split['num_val_docs']} of {docs} documents "
            f"held out), vocabulary {tok['vocab_size']} ({tok['source']}), "
            f"{manifest['seconds']} s")
  except (ValueError, OSError) as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())


if __name__ == "__main__":
  sys.exit(main())
