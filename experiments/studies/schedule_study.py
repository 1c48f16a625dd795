"""The schedule study as a library: peak-rate grids per schedule, loss spikes, the summary table and plots.

:func:`sweep_schedules` trains every optimizer (and SkewAdam configuration)
under every schedule at a grid of peak rates around the rate a comparison
tuned; :func:`loss_spikes` counts a run's spikes; :func:`summary_table` and
:func:`plot` render the rows. ``python -m experiments.schedules`` is the
command over it.
"""

from __future__ import annotations

import math
import pathlib
import statistics
from typing import Sequence

from experiments.studies.sweeps import (IMPLICIT, default_config, entry_key,
                                        resolve_entry, row_key, run_name, run_or_reuse,
                                        train_overrides, tuned_rates)
from experiments.training import optimizers


LR_FACTORS = (0.25, 0.5, 1.0, 2.0, 4.0)
SPIKE_WINDOW = 20
SPIKE_RATIO = 1.1


def loss_spikes(losses: Sequence[float], window: int = SPIKE_WINDOW,
                ratio: float = SPIKE_RATIO) -> int:
  """Loss spikes in a run's per-step training losses.

  A step spikes when its loss exceeds ``ratio`` times the median of the
  ``window`` steps before it (from the first full window on); consecutive
  spiking steps are one spike. A non-finite loss spikes.

  Example:
    >>> loss_spikes([3.0] * 30 + [4.0, 4.0] + [3.0] * 5 + [3.2])  # 3.2: within 10 %
    1
  """
  spikes, inside = 0, False
  for t in range(window, len(losses)):
    spiking = not math.isfinite(losses[t]) or (
        losses[t] > ratio * statistics.median(losses[t - window:t]))
    spikes += spiking and not inside
    inside = spiking
  return spikes


def _row_key(row: dict) -> tuple:
  return (*row_key(row), row["schedule"])


def sweep_schedules(entries: Sequence[tuple[str, dict | None]], *, base, out_dir: pathlib.Path,
                    tuned: Sequence[dict], schedules: Sequence[str], steps: int,
                    seeds: Sequence[int], lr_factors: Sequence[float] = LR_FACTORS,
                    cache_dir=None, reuse_runs: bool = False, log=print) -> list[dict]:
  """Runs the study for ``entries`` = [(optimizer, SkewAdam configuration or None)].

  Args:
    entries: what to sweep; SkewAdam configurations are resolved against the
      library's defaults.
    base: the shared configuration (:func:`experiments.studies.sweeps.base_config`).
    out_dir: the runs' folders.
    tuned: rows of a saved comparison; each entry's grid is centred on its
      row's ``lr`` (a ``ValueError`` names an entry without one).
    schedules: from :data:`experiments.training.optimizers.SCHEDULES`.
    steps: each run's horizon (warmup: a tenth of it, as in the comparison).
    seeds: the grid runs with the first; the others run at each schedule's best rate.
    lr_factors: the grid, as multiples of the tuned rate.
    cache_dir: JAX's compilation cache folder.
    reuse_runs: read finished (or diverged) runs of the same configuration.
    log: progress messages.

  Returns:
    One row per entry, schedule and rate (see the module docstring).
  """
  centres = tuned_rates(entries, tuned, what="tuned learning rate")
  resolved = []
  for optimizer, config in entries:
    config = resolve_entry(optimizer, config)
    if (optimizer, config) not in resolved:
      resolved.append((optimizer, config))
  for schedule in schedules:
    if schedule not in optimizers.SCHEDULES:
      raise ValueError(f"unknown schedule {schedule!r}; choose from "
                       f"{', '.join(optimizers.SCHEDULES)}")
  rows = []
  for optimizer, config in resolved:
    centre = centres[entry_key(optimizer, config)]
    name = run_name(optimizer, config)
    overrides = train_overrides(config) if config else {}
    for schedule in schedules:
      def run(lr, seed):
        result = run_or_reuse(base, out_dir / f"{name}-{schedule}-lr{lr:.2e}-seed{seed}",
                              cache_dir, reuse=reuse_runs, allow_divergence=True,
                              optimizer=optimizer, lr=lr, steps=steps, seed=seed,
                              warmup_steps=max(1, steps // 10), schedule=schedule, **overrides)
        spikes = loss_spikes([loss for _, loss in result["losses"]])
        log(f"{name} {schedule} lr {lr:.2e} seed {seed}: val ppl {result['val_ppl']:.2f}"
            f"{' (diverged)' if result['diverged'] else ''}, {spikes} loss spikes")
        return result["val_ppl"], result["diverged"], spikes

      grid = {factor: [run(centre * factor, seeds[0])] for factor in lr_factors}
      best = min(grid, key=lambda f: grid[f][0][0])
      if math.isfinite(grid[best][0][0]):
        grid[best] += [run(centre * best, seed) for seed in seeds[1:]]
      for factor, results in grid.items():
        ppls = [ppl for ppl, _, _ in results]
        finite = all(math.isfinite(p) for p in ppls)
        rows.append({
            "optimizer": optimizer, "config": config or "default", "schedule": schedule,
            "lr": centre * factor, "lr_factor": factor,
            "seeds": list(seeds[:len(results)]),
            "val_ppl_by_seed": [p if math.isfinite(p) else None for p in ppls],
            "val_ppl_mean": statistics.mean(ppls) if finite else None,
            "val_ppl_std": statistics.stdev(ppls) if finite and len(ppls) > 1 else 0.0,
            "diverged": sum(d for _, d, _ in results),
            "loss_spikes": [s for _, _, s in results],
        })
  return rows


def _label(row: dict) -> str:
  if not isinstance(row["config"], dict):
    return row["optimizer"]
  default = default_config()
  changed = {k: v for k, v in {**{k: IMPLICIT.get(k) for k in default}, **row["config"]}.items()
             if default.get(k) != v}
  return "skewadam" + (" " + ",".join(f"{k}={v}" for k, v in changed.items()) if changed
                       else " (default)")


def summary_table(rows: Sequence[dict]) -> str:
  """One line per optimizer and schedule: its best rate, the perplexity there, the
  width of its good range, and its divergences and loss spikes over the grid."""
  groups: dict[tuple, list[dict]] = {}
  for r in rows:
    groups.setdefault(_row_key(r), []).append(r)
  lines = ["| optimizer | schedule | best lr | val ppl at best (mean ± std, seeds) "
           "| rates within 10 % of best | val ppl across the grid, lowest rate first (seed 0) "
           "| diverged runs | loss spikes (all runs) |",
           "|---|---|---|---|---|---|---|---|"]
  for group in groups.values():
    group = sorted(group, key=lambda r: r["lr"])
    finite = [r for r in group if r["val_ppl_mean"] is not None]
    best = min(finite, key=lambda r: r["val_ppl_mean"], default=None)
    if best is None:
      cells = ["–", "all diverged", "0"]
    else:
      cells = [f"{best['lr']:.2e}",
               f"{best['val_ppl_mean']:.2f} ± {best['val_ppl_std']:.2f} "
               f"({len(best['seeds'])})",
               str(sum(r["val_ppl_mean"] <= 1.1 * best["val_ppl_mean"] for r in finite))]
    grid = " / ".join("div" if r["val_ppl_mean"] is None else f"{r['val_ppl_by_seed'][0]:.1f}"
                      for r in group)
    lines.append(f"| {_label(group[0])} | {group[0]['schedule']} | {cells[0]} | {cells[1]} "
                 f"| {cells[2]} | {grid} | {sum(r['diverged'] for r in group)} "
                 f"| {sum(sum(r['loss_spikes']) for r in group)} |")
  return "\n".join(lines)


def plot(rows: Sequence[dict], out_dir: pathlib.Path) -> list[pathlib.Path]:
  """``schedule_<name>.png``: validation perplexity (seed 0) against peak rate, per schedule."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  paths = []
  top = max((p for r in rows for p in r["val_ppl_by_seed"] if p is not None), default=1.0)
  for schedule in dict.fromkeys(r["schedule"] for r in rows):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in dict.fromkeys(_row_key(r)[:2] for r in rows):
      group = sorted((r for r in rows if _row_key(r) == (*key, schedule)), key=lambda r: r["lr"])
      if not group:
        continue
      lrs = [r["lr"] for r in group]
      ppl = [r["val_ppl_by_seed"][0] for r in group]
      line, = ax.plot([x for x, p in zip(lrs, ppl) if p is not None],
                      [p for p in ppl if p is not None], marker="o", label=_label(group[0]))
      diverged = [x for x, p in zip(lrs, ppl) if p is None]
      ax.plot(diverged, [top * 1.2] * len(diverged), "x", color=line.get_color(),
              markersize=9)
    ax.set(xscale="log", yscale="log", xlabel="peak learning rate",
           ylabel="validation perplexity (seed 0; x: diverged)",
           title=f"Schedule: {schedule}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / f"schedule_{schedule}.png")
    fig.savefig(paths[-1], dpi=120)
  plt.close("all")
  return paths
