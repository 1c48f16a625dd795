"""Watching a run live: TensorBoard event files, MoE routing health, the expert-load heatmap.

Routing health of one MoE layer, from ``f_e``, the fraction of the step's
``T·k`` token-to-expert assignments routed to expert ``e`` (``Σ_e f_e = 1``):

  load_e = E · f_e                                  (1 = exactly its fair share)
  max/mean load ratio = max_e load_e                (the mean of load_e is 1)
  starved fraction    = |{e : load_e < 0.1}| / E    (experts under 10 % of their share)

plus the layer's load-balancing and z losses (``models.moe``). A balanced
layer has ratio 1 and no starved expert; a collapsed one routes everything to
``k`` experts (ratio ``E/k``, starved fraction ``1 − k/E``).

The writer is ``tensorboardX``: a maintained writer of TensorBoard event
files with no TensorFlow (clu's metric writers need TensorFlow to write
TensorBoard files); :func:`read_scalars` reads them back (TFRecord framing
and tensorboardX's own ``Event`` protocol buffer), for tests and scripts.
"""

from __future__ import annotations

import pathlib
import struct
from typing import Mapping

import numpy as np

STARVED_SHARE = 0.1  # an expert below this share of its fair load counts as starved


def routing_health(expert_fraction_LE, lb_loss_L, z_loss_L) -> dict[str, float]:
  """Per-layer routing scalars, named for TensorBoard, plus two over all layers.

  Args:
    expert_fraction_LE: ``f_e`` per layer, ``[L, E]``.
    lb_loss_L, z_loss_L: each layer's load-balancing and z losses, ``[L]``.

  Returns:
    ``{"routing/layer_00/max_mean_load": ..., ".../starved_fraction",
    ".../lb_loss", ".../z_loss", ..., "routing/max_mean_load" (the worst
    layer), "routing/starved_fraction" (mean over layers)}``.

  Example:
    >>> health = routing_health([[0.5, 0.5, 0.0, 0.0]], [2.0], [1.5])
    >>> health["routing/layer_00/max_mean_load"], health["routing/layer_00/starved_fraction"]
    (2.0, 0.5)
  """
  load_LE = np.asarray(expert_fraction_LE, np.float64)
  load_LE = load_LE * load_LE.shape[-1]
  ratio_L = load_LE.max(axis=-1)
  starved_L = (load_LE < STARVED_SHARE).mean(axis=-1)
  out: dict[str, float] = {}
  for l, (ratio, starved, lb, z) in enumerate(zip(ratio_L, starved_L, np.asarray(lb_loss_L),
                                                  np.asarray(z_loss_L))):
    layer = f"routing/layer_{l:02d}"
    out.update({f"{layer}/max_mean_load": float(ratio),
                f"{layer}/starved_fraction": float(starved),
                f"{layer}/lb_loss": float(lb), f"{layer}/z_loss": float(z)})
  out["routing/max_mean_load"] = float(ratio_L.max())
  out["routing/starved_fraction"] = float(starved_L.mean())
  return out


class TensorBoardLog:
  """Scalars and text into TensorBoard event files under ``logdir``."""

  def __init__(self, logdir: str | pathlib.Path):
    from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel
    self.logdir = pathlib.Path(logdir)
    self._writer = SummaryWriter(str(self.logdir))

  def scalars(self, step: int, values: Mapping[str, float]) -> None:
    for tag, value in values.items():
      self._writer.add_scalar(tag, float(value), step)
    self._writer.flush()

  def text(self, step: int, tag: str, text: str) -> None:
    self._writer.add_text(tag, text, step)
    self._writer.flush()

  def close(self) -> None:
    self._writer.close()


def save_load_heatmap(expert_fraction_LE, path: str | pathlib.Path, *, title: str = "") -> None:
  """Writes the layers × experts load (``E · f_e``; 1 = fair share) as a PNG."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  load_LE = np.asarray(expert_fraction_LE, np.float64)
  load_LE = load_LE * load_LE.shape[-1]
  num_layers, num_experts = load_LE.shape
  fig, ax = plt.subplots(figsize=(max(5.0, 0.35 * num_experts + 2), max(2.5, 0.35 * num_layers + 1.5)))
  image = ax.imshow(load_LE, cmap="viridis", aspect="auto", vmin=0.0,
                    vmax=max(2.0, float(load_LE.max())))
  ax.set_xlabel("expert")
  ax.set_ylabel("layer")
  ax.set_xticks(range(num_experts))
  ax.set_yticks(range(num_layers))
  ax.set_title(title or "expert load (1 = fair share)", fontsize=10)
  fig.colorbar(image, ax=ax, label="load")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _records(path: pathlib.Path):
  data = path.read_bytes()
  offset = 0
  while offset + 12 <= len(data):
    (length,) = struct.unpack("<Q", data[offset:offset + 8])
    start = offset + 12  # length, then its CRC
    yield data[start:start + length]
    offset = start + length + 4  # the record, then its CRC


def _summary_values(logdir):
  """``(step, value)`` of every summary value in the event files under ``logdir``."""
  from tensorboardX.proto import event_pb2  # pylint: disable=import-outside-toplevel
  for path in sorted(pathlib.Path(logdir).glob("events.out.tfevents.*")):
    for record in _records(path):
      event = event_pb2.Event.FromString(record)
      for value in event.summary.value:
        yield event.step, value


def read_scalars(logdir: str | pathlib.Path) -> dict[str, list[tuple[int, float]]]:
  """Every scalar in the event files under ``logdir``: ``{tag: [(step, value), ...]}``."""
  out: dict[str, list[tuple[int, float]]] = {}
  for step, value in _summary_values(logdir):
    if value.HasField("simple_value"):
      out.setdefault(value.tag, []).append((step, value.simple_value))
  return out


def read_texts(logdir: str | pathlib.Path) -> dict[str, list[tuple[int, str]]]:
  """Every text summary under ``logdir``: ``{tag: [(step, text), ...]}``."""
  out: dict[str, list[tuple[int, str]]] = {}
  for step, value in _summary_values(logdir):
    if value.HasField("tensor") and value.tensor.string_val:
      tag = value.tag.removesuffix("/text_summary")
      out.setdefault(tag, []).append((step, value.tensor.string_val[0].decode("utf-8")))
  return out
