"""Where the suite's compile time goes: each XLA compile's time beside the test that asked for it.

A pytest plugin (``-p tests._compile_log``) and its summary (``python -m
tests._compile_log``). With it, every process of the run (each xdist worker)
turns on ``jax_log_compiles`` and appends one tab-separated line per finished
compile to ``compiles-<worker>.tsv`` in ``$COMPILE_LOG_DIR`` (default
``skewadam-compile-log`` in the temporary directory; start from an empty one,
as lines are appended): the test's id,
the compiled function (``jit(train_step)``) and the seconds it took. Compiles
in the subprocesses tests start are not logged. From the repository root::

    COMPILE_LOG_DIR=/tmp/compiles .venv/bin/python -m pytest -p tests._compile_log
    .venv/bin/python -m tests._compile_log /tmp/compiles

The summary prints the total, then the functions and the tests that took the
most compile time (docs/development.md, "Where the test suite's time goes").
"""

from __future__ import annotations

import collections
import logging
import os
import pathlib
import re
import sys
import tempfile
from typing import Iterable

DEFAULT_DIR = pathlib.Path(tempfile.gettempdir()) / "skewadam-compile-log"
FINISHED = re.compile(r"Finished XLA compilation of (.+) in ([0-9.eE+-]+) sec")


class CompileLog(logging.Handler):
  """Appends ``test<TAB>function<TAB>seconds`` for each compile JAX logs as finished."""

  def __init__(self, path: pathlib.Path):
    super().__init__(logging.DEBUG)
    self.path = path
    self.test = "(outside a test)"

  def emit(self, record: logging.LogRecord) -> None:
    match = FINISHED.search(record.getMessage())
    if match:
      with open(self.path, "a") as f:
        f.write(f"{self.test}\t{match.group(1)}\t{match.group(2)}\n")


_handler: CompileLog | None = None


def pytest_configure(config):
  del config
  global _handler
  folder = pathlib.Path(os.environ.get("COMPILE_LOG_DIR", DEFAULT_DIR))
  folder.mkdir(parents=True, exist_ok=True)
  worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
  import jax  # pylint: disable=import-outside-toplevel
  jax.config.update("jax_log_compiles", True)
  _handler = CompileLog(folder / f"compiles-{worker}.tsv")
  logging.getLogger("jax").addHandler(_handler)


def pytest_runtest_protocol(item, nextitem):
  del nextitem
  if _handler is not None:
    _handler.test = item.nodeid


def read(folder: pathlib.Path) -> list[tuple[str, str, float]]:
  """Every ``(test, function, seconds)`` line of the folder's ``compiles-*.tsv`` files."""
  rows = []
  for path in sorted(folder.glob("compiles-*.tsv")):
    for line in path.read_text().splitlines():
      test, function, seconds = line.split("\t")
      rows.append((test, function, float(seconds)))
  return rows


def summary(rows: Iterable[tuple[str, str, float]], top: int = 15) -> str:
  """The total, then the ``top`` functions and tests by compile seconds, with their counts."""
  rows = list(rows)
  lines = [f"{sum(s for _, _, s in rows):.1f} s in {len(rows)} compiles"]
  for title, key in (("by function", 1), ("by test", 0)):
    seconds, count = collections.Counter(), collections.Counter()
    for row in rows:
      seconds[row[key]] += row[2]
      count[row[key]] += 1
    lines.append(f"\n{title}: seconds, compiles")
    lines += [f"{s:8.1f} {count[name]:6d}  {name}" for name, s in seconds.most_common(top)]
  return "\n".join(lines)


if __name__ == "__main__":
  print(summary(read(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR)))
