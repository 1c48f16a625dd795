"""A synthetic corpus of any size: resampled lines of the bundled one."""

from __future__ import annotations

import os
import pathlib

import numpy as np

from experiments.data.corpus import DEFAULT_CORPUS, read_text
from experiments.data.shards import progress_bar


def generate_corpus(out: str | os.PathLike, total_bytes: int, *, seed: int = 0,
                    file_bytes: int = 8 << 20,
                    source: str | os.PathLike | None = None,
                    progress: bool = False) -> list[pathlib.Path]:
  """Writes a synthetic text corpus by resampling the lines of a real one.

  Lines of ``source`` (the bundled Shakespeare by default; blank lines and
  the ``by William Shakespeare`` markers left out) are drawn uniformly with
  a seeded generator, with a blank line after one in eight, into files
  ``part-00000.txt``, ... of ``file_bytes`` bytes (cut at a line end). It is
  text-like (real words and lines, so BPE merges and token counts are
  realistic) and reproducible, and nothing is downloaded. Memory is one
  file's text.

  Args:
    out: The folder to write (created; existing ``part-*.txt`` files are
      replaced).
    total_bytes: About how many bytes to write in all (within one line per
      file).
    seed: Seed of the generator.
    file_bytes: Bytes per file.
    source: The corpus whose lines are resampled.
    progress: Show a progress bar on stderr.

  Returns:
    The files written.
  """
  if total_bytes < 1 or file_bytes < 1:
    raise ValueError("total_bytes and file_bytes must be >= 1")
  lines = [line for line in read_text(DEFAULT_CORPUS if source is None
                                      else source).split("\n")
           if line.strip() and "by William Shakespeare" not in line]
  encoded = np.array([len(line.encode("utf-8")) + 1 for line in lines])
  rng = np.random.default_rng(seed)
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  files, written = [], 0
  bar = progress_bar(progress, total_bytes, "generate")
  while written < total_bytes:
    target = min(file_bytes, total_bytes - written)
    count = int(target / encoded.mean() * 1.1) + 16
    picks = rng.integers(len(lines), size=count)
    breaks = rng.random(count) < 0.125
    sizes = np.cumsum(encoded[picks] + breaks)
    keep = max(1, int(np.searchsorted(sizes, target, side="right")))
    text = "".join(lines[i] + ("\n\n" if b else "\n")
                   for i, b in zip(picks[:keep], breaks[:keep]))
    path = out / f"part-{len(files):05d}.txt"
    path.write_text(text, encoding="utf-8")
    files.append(path)
    size = len(text.encode("utf-8"))
    written += size
    bar.update(size)
  bar.close()
  return files
