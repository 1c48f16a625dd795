"""A run's ``metrics.jsonl``, its throughput clock and its progress bar.

One JSON object per line: a logged step (``step``, ``lr``, ``tokens``,
``tokens_per_s`` and the step's metrics), an evaluation (``val_ppl``) or a
skipped step. Throughput counts only training time: the clock pauses over
evaluations and checkpoints. A per-interval median of the step time shrugs off
a busy machine's spikes.
"""

from __future__ import annotations

import json
import os
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Optional


def machine() -> dict:
  """What a run ran on, for its summary: CPU model, cores, load average, JAX, devices.

  Step times compare only between runs on the same machine under the same
  load; a summary that says which is the only way to tell afterwards.

  Example:
    >>> sorted(machine())
    ['cores', 'cpu', 'devices', 'jax', 'jaxlib', 'load_average']
  """
  import jax  # the summary is written after training: JAX has long started
  import jaxlib
  cpu = None
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      cpu = next((line.split(":", 1)[1].strip() for line in f
                  if line.startswith("model name")), None)
  except OSError:
    pass
  try:
    load = [round(x, 2) for x in os.getloadavg()]
  except OSError:
    load = None
  return {"cpu": cpu, "cores": os.cpu_count(), "load_average": load,
          "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "devices": sorted({d.device_kind for d in jax.devices()})}


def read_metrics(path: pathlib.Path, upto_step: int) -> list[dict]:
  """The records of ``path`` up to ``upto_step``; a line cut short by a crash is dropped."""
  if not path.exists():
    return []
  records = []
  for line in path.read_text().splitlines():
    try:
      records.append(json.loads(line))
    except ValueError:
      continue
  return [r for r in records if isinstance(r, dict) and r.get("step", 0) <= upto_step]


def write_atomically(path: pathlib.Path, text: str) -> None:
  """Writes a temporary file and renames it: a crash leaves the old or the new file.

  The temporary file's name is unique, so two processes writing the same
  path (a shared tokenizer cache) never write into each other's file; it is
  made readable by all, as a plain write would be, and removed on failure.
  """
  path = pathlib.Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes it private
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


class MetricsLog:
  """Appends records to a run's metrics file and drives its progress bar.

  Args:
    path: the ``metrics.jsonl`` to append to; ``None`` writes nothing (the
      processes other than process 0 of a multi-process run).
    tokens_per_step: tokens in one step's batch.
    progress: show a ``tqdm`` bar on stderr.
    total, initial, desc: the bar's step count, starting step and label.

  Example:
    >>> import tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "metrics.jsonl"
    >>> log = MetricsLog(path, tokens_per_step=8, progress=False, total=2)
    >>> log.record_step(1, 0.1, {"loss": 2.0})
    >>> log.close()
    >>> json.loads(path.read_text())["tokens"]
    8
  """

  def __init__(self, path: Optional[pathlib.Path], *, tokens_per_step: int,
               progress: bool, total: int, initial: int = 0, desc: str = ""):
    self._file = path.open("a") if path is not None else None
    self.tokens_per_step = tokens_per_step
    self.last: dict = {}  # the last logged step's metrics
    self._timed_steps, self._timed_seconds = 0, 0.0
    self._t_last: Optional[float] = None
    self._step_last = 0
    self._step_seconds: list[float] = []
    self._bar = None
    if progress:
      from tqdm import tqdm  # pylint: disable=import-outside-toplevel
      self._bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True,
                       file=sys.stderr)

  def write(self, record: dict) -> None:
    """Appends one record (an evaluation, a skipped step) as a JSON line."""
    if self._file is not None:
      self._file.write(json.dumps(record) + "\n")
      self._file.flush()

  def record_step(self, step: int, lr: float, metrics: dict) -> None:
    """Logs step ``step`` (1-based, after its update) with its metrics."""
    now = time.perf_counter()
    if self._t_last is not None and step > self._step_last:
      self._timed_seconds += now - self._t_last
      self._timed_steps += step - self._step_last
      self._step_seconds.append((now - self._t_last) / (step - self._step_last))
    self._t_last, self._step_last = now, step
    self.last = dict(metrics)
    tok_s = self.tokens_per_s() or 0.0
    self.write({"step": step, "lr": lr, "tokens": step * self.tokens_per_step,
                "tokens_per_s": tok_s, **metrics})
    if self._bar is not None:
      self._bar.set_postfix(loss=f"{metrics['loss']:.3f}", tok_s=f"{tok_s:,.0f}")

  def pause_timer(self) -> None:
    """Time until the next logged step is not training time (evaluation, saving)."""
    self._t_last = None

  def advance(self, steps: int = 1) -> None:
    """Moves the progress bar on by ``steps``."""
    if self._bar is not None:
      self._bar.update(steps)

  def tokens_per_s(self) -> Optional[float]:
    """Training tokens per second over the timed intervals; ``None`` before any."""
    if not self._timed_seconds:
      return None
    return self._timed_steps * self.tokens_per_step / self._timed_seconds

  def median_step_s(self) -> Optional[float]:
    """The median seconds per step over the timed intervals; ``None`` before any."""
    return statistics.median(self._step_seconds) if self._step_seconds else None

  def close_bar(self) -> None:
    """Closes the progress bar (the log stays open)."""
    if self._bar is not None:
      self._bar.close()
      self._bar = None

  def close(self) -> None:
    """Closes the progress bar and the file."""
    self.close_bar()
    if self._file is not None:
      self._file.close()
      self._file = None
