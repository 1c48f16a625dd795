"""The optimizer comparison as a library: the protocol, the rule that picks SkewAdam's default, tables and plots.

:func:`compare` runs the protocol for a list of optimizers and SkewAdam
configurations: same model, data, token budget and seeds, each at its own
tuned learning rate (a sweep at ``sweep_steps``, then every seed at the best
rate). :func:`choose_default` is the rule that picked the defaults;
:func:`markdown_table`, :func:`verdict_text`, :func:`horizon_table` and
:func:`plot` render saved rows. ``python -m experiments.compare`` is the
command over it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Sequence

import jax.numpy as jnp

import models
from experiments.training import optimizers
from experiments.planning import accounting
from experiments.training import config as config_lib
from experiments.training.config import TrainConfig, with_defaults
from experiments.studies.sweeps import default_config, entry_key
from experiments.studies.sweeps import resolve_entry, row_key, run_name, run_or_reuse, train_overrides
from experiments.studies.sweeps import TIER_DEFAULTS, tuned_rates

# --quick is a first look: AdamW, SkewAdam's default and Muon, 3 seeds, no sweep
# (each trains at the rate the full protocol tuned, experiments/results/compare.json),
# and a verdict that names the pairs it cannot separate (verdict_text).
QUICK = dict(steps=80, sweep_steps=0, seeds=(0, 1, 2), eval_every=40, eval_batches=8,
             max_extensions=0)
QUICK_OPTIMIZERS = "adamw,skewadam,muon"
# The rates the 1600-step tuning chose (compare --lr-from's form: the first file
# with a row wins): the long comparison's rows, the expert momentum's
# (experiments/expert_momentum.sh: the rank-16 default's), then the tuning
# against Muon's tuned candidate (experiments/muon_gap.sh: the default's since
# the rule chose it).
_RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"
TUNED_RATES = ",".join(str(_RESULTS / name) for name in (
    "compare-long.json", "expert-momentum.json", "muon-gap.json"))
NOISE_MULTIPLE = 2  # an ordering is reported only when it exceeds twice the seeds' spread
FULL = dict(steps=400, sweep_steps=150, seeds=(0, 1), eval_every=100, eval_batches=16,
            max_extensions=2)

# The ablation: one tier setting at a time away from REFERENCE (1-bit expert
# momentum, everything else as in Adam), plus the smallest configuration that
# keeps momentum in all three tiers.
REFERENCE = {"backbone_m": "fp32", "backbone_v": "exact", "expert_m": "sign", "router_v": "exact"}
ABLATION = (
    [REFERENCE]
    + [{**REFERENCE, "expert_m": m} for m in ("fp32", "bf16", "int8", "none")]
    + [{**REFERENCE, "backbone_v": "factored"}, {**REFERENCE, "router_v": "factored"},
       {**REFERENCE, "backbone_m": "bf16", "backbone_v": "factored"}])

STATE_BUDGET_6P78B = 1.29e9  # the published optimizer state for moe-6.78b


def state_bytes_6p78b(optimizer: str, skewadam_tiers: dict | None = None) -> int:
  """Optimizer-state bytes of ``optimizer`` at ``moe-6.78b`` (bf16 parameters),
  the comparison's state column."""
  return accounting.state_bytes("moe-6.78b", optimizer, skewadam_tiers=skewadam_tiers,
                                param_dtype=jnp.bfloat16)["total"]


def _full_tiers(tiers: dict) -> tuple:
  """SkewAdam tier settings (``TrainConfig.skewadam_tiers()``'s form) with every
  field filled from the library's defaults, so two spellings of one
  configuration compare equal."""
  # The rounding of a bf16 momentum changes no byte of memory: not part of a plan's identity.
  full = tuple(dataclasses.replace(default, **{k: v for k, v in tiers.get(name, {}).items()
                                               if k != "momentum_rounding"})
               for name, default in TIER_DEFAULTS.items())
  return full + (tiers.get(optimizers.REST_TIER) or "backbone",)


def row_tiers(row: dict) -> dict:
  """The SkewAdam tier settings a comparison row trained with."""
  config = row["config"] if isinstance(row["config"], dict) else {}
  return TrainConfig(**train_overrides(config)).skewadam_tiers()


def standard_step_fits(row: dict, reports: Sequence[dict]) -> bool | None:
  """Whether the memory planner found ``row``'s configuration's standard train
  step at ``moe-6.78b`` to fit the A100-40GB target at batch 1 × 2048.

  ``reports`` are planner reports (``python -m experiments.memory --json``);
  the one for the row is the one-device, standard-step (not
  ``--update-in-backward``, no ``--accumulate``, the preset's MoE block size)
  report with the same tiers. ``None``: no such
  report, so the row's fit is not known (plan it with ``python -m
  experiments.memory --preset moe-6.78b --optimizer skewadam`` and the row's
  tier flags).
  """
  wanted = _full_tiers(row_tiers(row))
  for report in reports:
    if (report.get("preset"), report.get("optimizer"), report.get("target")) != (
        "moe-6.78b", "skewadam", "a100-40gb"):
      continue
    if (report.get("batch"), report.get("seq"), report.get("devices", 1)) != (1, 2048, 1):
      continue
    if report.get("update_in_backward") or report.get("mesh"):
      continue
    # The training command's step: no accumulation, the preset's MoE blocks.
    if report.get("accumulate", 1) > 1 or report.get("moe_block_size") not in (
        None, models.get_preset("moe-6.78b").moe_block_size):
      continue
    if _full_tiers(report.get("skewadam_tiers") or {}) == wanted:
      return bool(report["fits"])
  return None


def load_reports(directory: str | os.PathLike) -> list[dict]:
  """Every planner report (``*.json`` with a ``peak_bytes``) in ``directory``."""
  reports = []
  for path in sorted(pathlib.Path(directory).glob("*.json")):
    report = json.loads(path.read_text())
    if isinstance(report, dict) and "peak_bytes" in report:
      reports.append(report)
  return reports


def choose_default(rows: Sequence[dict], budget: float = STATE_BUDGET_6P78B,
                   reports: Sequence[dict] | None = None,
                   equal_time: Sequence[dict] | None = None) -> dict | None:
  """The rule that picks SkewAdam's default from a comparison's rows.

  A configuration *matches* AdamW when its mean validation perplexity is no
  worse than AdamW's by more than the larger of the two seed spreads (std).
  Among the configurations whose ``moe-6.78b`` state is at most ``budget``,
  the best perplexity, if any of them matches AdamW; otherwise the smallest
  state among those that match; ``None`` if none does (or there is no AdamW row).
  With planner ``reports``, only configurations whose standard train step
  at ``moe-6.78b`` is known to fit the A100-40GB target at batch 1
  (:func:`standard_step_fits`) are candidates: the training command's
  default must fit without ``--update-in-backward``.

  The compute term: with ``equal_time``, the rows of the same configurations
  trained for AdamW's wall-clock (``compare --equal-time``), the best within
  the budget is the best *at equal time*, and a configuration without an
  equal-time row is not chosen; matching AdamW is still read at equal steps.
  """
  adamw = next((r for r in rows if r["optimizer"] == "adamw"), None)
  if adamw is None:
    return None
  matching = [r for r in rows if r["optimizer"] == "skewadam" and r["val_ppl_mean"]
              <= adamw["val_ppl_mean"] + max(r["val_ppl_std"], adamw["val_ppl_std"])
              and (reports is None or standard_step_fits(r, reports))]
  within = [r for r in matching if r["opt_state_bytes_6p78b"] <= budget]
  if equal_time is not None:
    timed = {row_key(r): r["val_ppl_mean"] for r in equal_time}
    within = [r for r in within if row_key(r) in timed]
    if within:
      return min(within, key=lambda r: timed[row_key(r)])
  if within:
    return min(within, key=lambda r: r["val_ppl_mean"])
  return min(matching, key=lambda r: r["opt_state_bytes_6p78b"], default=None)


def lr_grid(optimizer: str, factors: Sequence[float], centre: float | None = None) -> list[float]:
  """The sweep's rates: ``factors`` times ``centre`` (default: the optimizer's default rate)."""
  centre = optimizers.DEFAULT_LR[optimizer] if centre is None else centre
  return [centre * f for f in factors]


class RunClock:
  """How long a comparison has left, told after every run.

  Each run still to go is priced at the mean time of the trained runs of its
  optimizer, or of all trained runs for an optimizer not seen yet; a run read
  back (``reuse_runs``) counts as done and costs nothing.
  """

  def __init__(self, planned: Sequence[str], log=print, clock=time.monotonic):
    self.planned = list(planned)  # the optimizer of every run the protocol may take
    self.times: dict[str, list[float]] = {}
    self.log, self.clock = log, clock
    self.start = clock()

  def drop(self, optimizer: str, count: int) -> None:
    """Runs of ``optimizer`` the protocol will not take after all (a sweep ended early)."""
    for _ in range(count):
      self.planned.remove(optimizer)

  def left_s(self) -> float | None:
    """Seconds the planned runs are expected to take; ``None`` before any run trained."""
    every = [t for ts in self.times.values() for t in ts]
    if not every:
      return None
    mean = lambda ts: sum(ts) / len(ts)  # noqa: E731
    return sum(mean(self.times.get(o) or every) for o in self.planned)

  def run(self, optimizer: str, train):
    """``train()`` timed as one of ``optimizer``'s runs, then a line on what is left."""
    began = self.clock()
    result = train()
    took = self.clock() - began
    self.planned.remove(optimizer)
    if took > 1.0:  # trained, not read back
      self.times.setdefault(optimizer, []).append(took)
    done = sum(len(t) for t in self.times.values())
    left = self.left_s()
    self.log(f"compare: {len(self.planned)} runs to go after {(self.clock() - self.start) / 60:.1f}"
             f" min ({done} trained)"
             + ("" if left is None else f"; about {left / 60:.1f} min left"))
    return result


def compare(entries: Sequence[tuple[str, dict | None]], *, base: TrainConfig,
            out_dir: str | pathlib.Path, steps: int, sweep_steps: int,
            seeds: Sequence[int], lr_factors: Sequence[float] = (1 / 3, 1, 3),
            max_extensions: int = 2, cache_dir=None, log=print,
            keep_checkpoints: bool = False, progress: bool = False,
            reuse_runs: bool = False, fixed_lrs: Sequence[dict] | None = None,
            sweep_around: Sequence[dict] | None = None,
            steps_by_entry: dict | None = None) -> list[dict]:
  """Runs the protocol for ``entries`` = [(optimizer, SkewAdam configuration or None)].

  SkewAdam configurations are resolved against the defaults and run once
  each, however many entries name them. Each run keeps its ``metrics.jsonl``
  and ``summary.json``; its checkpoints are deleted unless
  ``keep_checkpoints``. ``progress`` shows one bar over all runs (its total is
  the most runs the protocol can take, lowered as grids end early). With
  ``reuse_runs`` a run whose folder holds a finished run of the same
  configuration is read instead of trained again, so an interrupted
  comparison continues where it stopped. With ``fixed_lrs`` (rows of a saved
  comparison) there is no sweep: each entry trains at the rate of its row
  there (a ``ValueError`` names an entry without one). With ``sweep_around``
  (rows of a saved comparison) the grid is ``lr_factors`` times each entry's
  rate there instead of times the optimizer's default rate. When the sweep
  trains as long as the final runs (``sweep_steps == steps``), the best rate's
  sweep run is the first seed's final run: it is not trained twice. With
  ``steps_by_entry`` (:func:`~experiments.studies.sweeps.entry_key` → steps; an equal
  time budget, :mod:`experiments.studies.equal_time`) an entry's final runs
  train for its own steps, warmup a tenth of them; every row records its
  ``steps``.
  """
  out_dir = pathlib.Path(out_dir)
  rows, seen = [], []
  unique = {entry_key(o, resolve_entry(o, c)) for o, c in entries}
  if fixed_lrs is not None:
    lr_factors, max_extensions = (), 0
    fixed = tuned_rates(entries, fixed_lrs)
  centres = tuned_rates(entries, sweep_around) if sweep_around is not None else None
  extensions = max_extensions if len(lr_factors) > 1 else 0
  per_entry = len(lr_factors) + extensions + len(seeds)
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  bar = tqdm(total=per_entry * len(unique), desc="compare", unit="run", disable=not progress,
             dynamic_ncols=True, file=sys.stderr)
  run_or_read = functools.partial(run_or_reuse, keep_checkpoints=keep_checkpoints,
                                  reuse=reuse_runs)
  resolved = list(dict.fromkeys(entry_key(o, resolve_entry(o, c)) for o, c in entries))
  if progress:  # each line above the bar, not glued to it
    log = functools.partial(bar.write, file=sys.stderr)
  clock = RunClock([key[0] for key in resolved for _ in range(per_entry)], log=log)
  log(f"compare: {per_entry * len(unique)} runs at most; the time left is told after each run")

  def run_one(*args, optimizer, **kwargs):
    return clock.run(optimizer, lambda: run_or_read(*args, optimizer=optimizer, **kwargs))
  for optimizer, config in entries:
    config = resolve_entry(optimizer, config)
    if (optimizer, config) in seen:
      continue
    seen.append((optimizer, config))
    overrides = train_overrides(config) if config else {}
    name = run_name(optimizer, config)
    sweep, sweep_runs = [], {}

    def try_lr(lr):
      result = sweep_runs[lr] = run_one(base, out_dir / f"{name}-sweep-lr{lr:.2e}", cache_dir,
                    optimizer=optimizer, lr=lr, steps=sweep_steps, seed=seeds[0],
                    warmup_steps=max(1, sweep_steps // 10), **overrides)
      sweep.append({"lr": lr, "val_ppl": result["val_ppl"]})
      sweep.sort(key=lambda r: r["lr"])
      log(f"{name}: sweep lr {lr:.2e} -> val ppl {result['val_ppl']:.2f}")
      bar.update(1)

    score = lambda r: r["val_ppl"] if math.isfinite(r["val_ppl"]) else math.inf
    centre = (centres[entry_key(optimizer, config)] if centres is not None
              else optimizers.DEFAULT_LR[optimizer])
    for lr in lr_grid(optimizer, lr_factors, centre):
      try_lr(lr)
    # A best rate at the edge of the grid is not a tuned rate: extend the grid
    # (by the grid's own step) in that direction, a bounded number of times.
    step = (max(lr_factors) / min(lr_factors)) ** (1 / max(1, len(lr_factors) - 1)) \
        if lr_factors else 1.0
    for _ in range(extensions):
      best = min(sweep, key=score)
      if best is sweep[-1]:
        try_lr(best["lr"] * step)
      elif best is sweep[0]:
        try_lr(best["lr"] / step)
      else:
        break
    bar.total -= len(lr_factors) + extensions - len(sweep)  # extensions not needed
    clock.drop(optimizer, len(lr_factors) + extensions - len(sweep))
    bar.refresh()
    best_lr = (fixed[entry_key(optimizer, config)] if fixed_lrs is not None
               else min(sweep, key=score)["lr"])
    own_steps = (steps_by_entry or {}).get(entry_key(optimizer, config), steps)
    same_budget = fixed_lrs is None and sweep_steps == own_steps
    if same_budget:  # the best rate's sweep run is the first seed's final run
      clock.drop(optimizer, 1)
    # An equal-time run's folder names its steps: it is not the equal-steps run.
    stem = name if own_steps == steps else f"{name}-steps{own_steps}"
    finals = [sweep_runs[best_lr] if same_budget and seed == seeds[0] else
              run_one(base, out_dir / f"{stem}-seed{seed}", cache_dir,
                      optimizer=optimizer, lr=best_lr, steps=own_steps, seed=seed,
                      warmup_steps=max(1, own_steps // 10), **overrides) for seed in seeds]
    bar.update(len(finals))
    ppls = [f["val_ppl"] for f in finals]
    tiers = dataclasses.replace(base, **overrides).skewadam_tiers()  # pylint: disable=no-member
    rows.append({
        "optimizer": optimizer, "config": config or "default", "lr": best_lr,
        "steps": own_steps, "seeds": list(seeds), "val_ppl_by_seed": ppls,
        "val_ppl_mean": statistics.mean(ppls),
        "val_ppl_std": statistics.stdev(ppls) if len(ppls) > 1 else 0.0,
        "opt_state_bytes_small": finals[0]["opt_state_bytes"],
        "opt_state_bytes_6p78b": state_bytes_6p78b(optimizer, tiers),
        "tokens_per_s": statistics.median(f["tokens_per_s"] or 0.0 for f in finals),
        "median_step_s": statistics.median(f["median_step_s"] or 0.0 for f in finals),
        "curve_seed0": finals[0]["curve"], "sweep": sweep,
    })
    log(f"{name}: lr {best_lr:.2e}, val ppl {rows[-1]['val_ppl_mean']:.2f} "
        f"± {rows[-1]['val_ppl_std']:.2f}")
  bar.close()
  _add_step_time_ratios(rows)
  return rows


def _add_step_time_ratios(rows: Sequence[dict]) -> None:
  adamw = next((r for r in rows if r["optimizer"] == "adamw"), None)
  for r in rows:
    # Medians of per-step times: robust to another process borrowing the cores.
    r["step_time_ratio_to_adamw"] = (
        r["median_step_s"] / adamw["median_step_s"]
        if adamw and adamw["median_step_s"] and r["median_step_s"] else None)


def merge_rows(kept: Sequence[dict], rerun: Sequence[dict]) -> list[dict]:
  """``kept`` with each row that ``rerun`` has again (same optimizer and config) replaced.

  Rows only in ``rerun`` follow; step-time ratios are recomputed against the
  merged AdamW row. For re-running some rows (say SkewAdam's, after a change
  to the library) and keeping the others.
  """
  fresh = {row_key(r): r for r in rerun}
  rows = [fresh.pop(row_key(r), r) for r in kept]
  rows += [r for r in rerun if row_key(r) in fresh]
  _add_step_time_ratios(rows)
  return rows


def is_default(row: dict) -> bool:
  """Whether a row is its optimizer's default configuration in the training command as it is now."""
  return not isinstance(row["config"], dict) or row["config"] == default_config()


def plot_name(row: dict) -> str:
  """A row's name for plots: the optimizer, and SkewAdam's configuration in full."""
  if row["optimizer"] != "skewadam":
    return row["optimizer"]
  config = ", ".join(f"{k}={v}" for k, v in row["config"].items())
  return f"skewadam {config}" + (" (default)" if is_default(row) else "")


def _config_cell(row: dict, mark_default: bool = True) -> str:
  if not isinstance(row["config"], dict):
    return row["config"]
  cell = ", ".join(f"{k}={v}" for k, v in row["config"].items())
  return f"**{cell}** (default)" if mark_default and is_default(row) else cell


def markdown_table(rows: Sequence[dict], *, step_time: bool = True) -> str:
  """The comparison's rows as a Markdown table; the library's default marked in bold.

  ``step_time=False`` leaves out the step-time column (a timing: the rest of
  the table is a pure function of the code and the machine's CPU type).
  """
  # Rows of an equal-time budget (or of several step counts) show their steps.
  steps = len({r.get("steps") for r in rows}) > 1 or any("budget" in r for r in rows)
  head = ("| optimizer | config | lr |" + (" steps |" if steps else "")
          + " val ppl (mean ± std) | seeds | state, this preset | state, moe-6.78b |")
  lines = [head + (" step time ÷ AdamW |" if step_time else ""),
           "|---" * (7 + steps + step_time) + "|"]
  for r in rows:
    seeds = ", ".join(f"{p:.2f}" for p in r.get("val_ppl_by_seed", ())) or "–"
    line = (f"| {r['optimizer']} | {_config_cell(r)} | {r['lr']:.2e} | "
            + (f"{r.get('steps', '–')} | " if steps else "")
            + f"{r['val_ppl_mean']:.2f} ± {r['val_ppl_std']:.2f} | {seeds} "
            f"| {r['opt_state_bytes_small'] / 1e6:.2f} MB "
            f"| {r['opt_state_bytes_6p78b'] / 1e9:.3f} GB |")
    if step_time:
      ratio = f"{r['step_time_ratio_to_adamw']:.2f}" if r["step_time_ratio_to_adamw"] else "–"
      line += f" {ratio} |"
    lines.append(line)
  return "\n".join(lines)


def machine_text() -> str:
  """The CPU model and core count (figures of a comparison vary across CPU types)."""
  model = platform.processor() or platform.machine()
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        model = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  return f"{model}, {os.cpu_count()} cores"


def ordering(a: dict, b: dict, multiple: float = NOISE_MULTIPLE) -> tuple[str, float]:
  """``("lower" | "higher" | "within noise", margin)`` of ``a``'s mean perplexity against ``b``'s.

  ``margin`` is ``|difference| / max(spreads)``: an ordering is reported only
  above ``multiple``; below it the two are a tie at this many seeds.

  Example:
    >>> ordering({"val_ppl_mean": 100.0, "val_ppl_std": 2.0},
    ...          {"val_ppl_mean": 110.0, "val_ppl_std": 1.0})
    ('lower', 5.0)
    >>> ordering({"val_ppl_mean": 100.0, "val_ppl_std": 2.0},
    ...          {"val_ppl_mean": 103.0, "val_ppl_std": 1.0})
    ('within noise', 1.5)
  """
  diff = a["val_ppl_mean"] - b["val_ppl_mean"]
  spread = max(a["val_ppl_std"], b["val_ppl_std"])
  margin = abs(diff) / spread if spread > 0 else math.inf
  if margin <= multiple:
    return "within noise", margin
  return ("lower" if diff < 0 else "higher"), margin


def verdict_text(rows: Sequence[dict]) -> str:
  """SkewAdam's default against AdamW and against Muon: an ordering, or "within noise".

  Each pair is ordered only when its difference exceeds :data:`NOISE_MULTIPLE`
  times the larger seed spread (std), so a verdict does not flip with the CPU
  type, whose code changes the seeds' results. A row of one seed has no spread:
  its pairs get their differences and no ordering.
  """
  default = next((r for r in rows if r["optimizer"] == "skewadam" and is_default(r)), None)
  if default is None:
    return "No row of SkewAdam's default: no verdict."
  parts, one_seed = [], False
  for other in ("adamw", "muon"):
    row = next((r for r in rows if r["optimizer"] == other), None)
    if row is None:
      continue
    diff = default["val_ppl_mean"] - row["val_ppl_mean"]
    if min(len(default.get("val_ppl_by_seed", ())), len(row.get("val_ppl_by_seed", ()))) < 2:
      one_seed = True
      parts.append(f"against {other}: difference {diff:+.2f}")
      continue
    order, margin = ordering(default, row)
    if order == "within noise":
      parts.append(f"against {other}: within noise (difference {diff:+.2f}, "
                   f"{margin:.1f}x the larger seed spread, at most {NOISE_MULTIPLE}x)")
    else:
      parts.append(f"against {other}: {order} perplexity by {abs(diff):.2f} "
                   f"({margin:.1f}x the larger seed spread)")
  if not parts:
    return "No AdamW or Muon row: SkewAdam's default has nothing to be ordered against."
  if one_seed:
    return ("No verdict for SkewAdam's default: a row of one seed has no seed spread to "
            "order a pair by; " + "; ".join(parts) + ".")
  seeds = len(default.get("val_ppl_by_seed", ()))
  return f"Verdict for SkewAdam's default ({seeds} seeds): " + "; ".join(parts) + "."


def choice_text(rows: Sequence[dict], reports: Sequence[dict] | None = None) -> str:
  """What :func:`choose_default` picks from ``rows`` (with the planner's
  ``reports``, among the configurations whose standard step fits), and why,
  in one paragraph."""
  adamw = next((r for r in rows if r["optimizer"] == "adamw"), None)
  choice = choose_default(rows, reports=reports)
  if adamw is None:
    return "No AdamW row: the default rule needs one."
  if choice is None:
    return (f"No SkewAdam configuration matches AdamW's validation perplexity "
            f"({adamw['val_ppl_mean']:.2f} ± {adamw['val_ppl_std']:.2f}).")
  within = choice["opt_state_bytes_6p78b"] <= STATE_BUDGET_6P78B
  tie = ("; it matches AdamW only by the spread rule (a tie, not a win)"
         if ordering(choice, adamw)[0] != "lower" else "")
  return (f"Chosen by `choose_default`: {_config_cell(choice, mark_default=False)}: "
          f"val ppl {choice['val_ppl_mean']:.2f} ± {choice['val_ppl_std']:.2f} against AdamW's "
          f"{adamw['val_ppl_mean']:.2f} ± {adamw['val_ppl_std']:.2f} "
          f"(difference {choice['val_ppl_mean'] - adamw['val_ppl_mean']:+.2f}), "
          f"state at moe-6.78b {choice['opt_state_bytes_6p78b'] / 1e9:.3f} GB, "
          f"{adamw['opt_state_bytes_6p78b'] / choice['opt_state_bytes_6p78b']:.1f}x less than "
          f"AdamW's {adamw['opt_state_bytes_6p78b'] / 1e9:.1f} GB" + tie
          + (f"; the best perplexity within {STATE_BUDGET_6P78B / 1e9:.2f} GB"
             if within else f"; nothing within {STATE_BUDGET_6P78B / 1e9:.2f} GB matches "
             "AdamW, so the smallest state that does")
          + (" whose standard train step fits the A100-40GB target at moe-6.78b (the "
             "planner's reports)." if reports is not None else "."))


def _pyplot():
  """matplotlib's pyplot on the file-only backend (no display here)."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def _curve(row: dict) -> tuple[tuple, tuple]:
  """A row's seed-0 validation curve as (tokens, perplexities)."""
  return tuple(zip(*row["curve_seed0"])) if row.get("curve_seed0") else ((), ())


def horizon_table(shorter: Sequence[dict], longer: Sequence[dict]) -> str:
  """The rows both comparisons share: perplexity and rank at each horizon, and the ratio.

  The ratio ``longer / shorter`` of a row's mean perplexities says how much
  it gained from the extra tokens; ranks are among the shared rows.
  """
  short = {row_key(r): r for r in shorter}
  shared = [(short[row_key(r)], r) for r in longer if row_key(r) in short]
  if not shared:
    return "No row is in both comparisons."
  def ranks(rows):
    order = sorted(rows, key=lambda r: r["val_ppl_mean"])
    return {row_key(r): order.index(r) + 1 for r in rows}
  rank_short, rank_long = ranks([s for s, _ in shared]), ranks([l for _, l in shared])
  lines = [f"| optimizer | config | val ppl, {_tokens(shared[0][0])} tokens (rank) "
           f"| val ppl, {_tokens(shared[0][1])} tokens (rank) | longer ÷ shorter |",
           "|---|---|---|---|---|"]
  for s, l in shared:
    lines.append(f"| {l['optimizer']} | {_config_cell(l)} "
                 f"| {s['val_ppl_mean']:.2f} ± {s['val_ppl_std']:.2f} ({rank_short[row_key(s)]}) "
                 f"| {l['val_ppl_mean']:.2f} ± {l['val_ppl_std']:.2f} ({rank_long[row_key(l)]}) "
                 f"| {l['val_ppl_mean'] / s['val_ppl_mean']:.3f} |")
  return "\n".join(lines)


def _tokens(row: dict) -> str:
  tokens, _ = _curve(row)
  return f"{tokens[-1] / 1e6:.2f}M" if tokens else "?"


def _legend_below(ax) -> None:
  """The legend under the axes, one row a line: a SkewAdam row's name spells its
  whole configuration, wider than the plot."""
  ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), frameon=False)


def _save(fig, path: pathlib.Path) -> None:
  # bbox_inches="tight" grows the image to hold a legend or labels outside the axes.
  fig.savefig(path, dpi=120, bbox_inches="tight")


def plot_horizons(shorter: Sequence[dict], longer: Sequence[dict],
                  path: pathlib.Path) -> pathlib.Path:
  """Validation perplexity against tokens (seed 0) for both horizons: the shorter dashed."""
  plt = _pyplot()
  short = {row_key(r): r for r in shorter}
  fig, ax = plt.subplots(figsize=(8, 5))
  for r in longer:
    line, = ax.plot(*_curve(r), label=plot_name(r))
    if row_key(r) in short:
      ax.plot(*_curve(short[row_key(r)]), "--", color=line.get_color())
  ax.set(xlabel="training tokens", ylabel="validation perplexity", yscale="log",
         title="Validation perplexity (seed 0): longer horizon solid, shorter dashed")
  _legend_below(ax)
  _save(fig, path)
  plt.close(fig)
  return path


def plot(rows: Sequence[dict], out_dir: pathlib.Path, prefix: str = "") -> list[pathlib.Path]:
  """Writes val_ppl.png, state_bytes.png and (with a SkewAdam row) frontier.png,
  their names prefixed by ``prefix``."""
  plt = _pyplot()
  names = [plot_name(r) for r in rows]
  fig, ax = plt.subplots(figsize=(8, 5))
  for name, r in zip(names, rows):
    ax.plot(*_curve(r), marker="o", markersize=3, label=name)
  ax.set(xlabel="training tokens", ylabel="validation perplexity", yscale="log",
         title="Validation perplexity (seed 0)")
  _legend_below(ax)
  paths = [out_dir / f"{prefix}val_ppl.png"]
  _save(fig, paths[-1])
  fig, ax = plt.subplots(figsize=(11, 5))
  ax.barh(names, [r["opt_state_bytes_6p78b"] / 1e9 for r in rows])
  ax.set(xlabel="optimizer state at moe-6.78b (GB)", xscale="log",
         title="Optimizer state for the 6.78B MoE")
  paths.append(out_dir / f"{prefix}state_bytes.png")
  _save(fig, paths[-1])
  if any(r["optimizer"] == "skewadam" for r in rows):
    paths.append(_plot_frontier(plt, rows, names, out_dir / f"{prefix}frontier.png"))
  plt.close("all")
  return paths


def _plot_frontier(plt, rows, names, path):
  """Perplexity against state at moe-6.78b; rows far above SkewAdam's are listed, not drawn."""
  skew = [r for r in rows if r["optimizer"] == "skewadam"]
  top = max(r["val_ppl_mean"] + r["val_ppl_std"] for r in skew)
  bottom = min(r["val_ppl_mean"] - r["val_ppl_std"] for r in rows)
  limit = top + 0.25 * (top - bottom)
  fig, ax = plt.subplots(figsize=(13, 5.5))
  markers = "osD^v<>pPX*h"
  shown, hidden = [], []
  for k, (name, r) in enumerate(zip(names, rows)):
    if r["val_ppl_mean"] > limit:
      hidden.append(f"{name}: {r['val_ppl_mean']:.0f}")
      continue
    shown.append(r)
    ax.errorbar(r["opt_state_bytes_6p78b"] / 1e9, r["val_ppl_mean"], yerr=r["val_ppl_std"],
                fmt=markers[k % len(markers)], color=plt.cm.tab20(k % 20), capsize=3, label=name)
  # The frontier: configurations that no other beats on both state and perplexity.
  frontier, best = [], math.inf
  for r in sorted(shown, key=lambda r: (r["opt_state_bytes_6p78b"], r["val_ppl_mean"])):
    if r["val_ppl_mean"] < best:
      frontier.append(r)
      best = r["val_ppl_mean"]
  ax.step([r["opt_state_bytes_6p78b"] / 1e9 for r in frontier],
          [r["val_ppl_mean"] for r in frontier], where="post", color="gray", alpha=0.6,
          label="frontier")
  ax.axvline(STATE_BUDGET_6P78B / 1e9, color="gray", linestyle="--",
             label=f"{STATE_BUDGET_6P78B / 1e9:.2f} GB (published)")
  ax.set(xlabel="optimizer state at moe-6.78b (GB, log)", xscale="log",
         ylabel="validation perplexity (mean ± std over seeds)",
         xticks=[t for t in (0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100)
                 if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]],
         title="Quality against optimizer memory"
         + (f"\noff the chart: {'; '.join(hidden)}" if hidden else ""))
  ax.xaxis.set_major_formatter(plt.matplotlib.ticker.FormatStrFormatter("%g"))
  ax.xaxis.set_minor_formatter(plt.matplotlib.ticker.NullFormatter())
  ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
  _save(fig, path)
  return path


# Settings that say where or how a run was logged, not what it trained.
_LOGISTICS = {"seed", "eval_every", "eval_batches", "ckpt_every", "log_every", "sample_tokens",
              "data"}


def _same(a, b) -> bool:
  """Equal settings; rates equal to round-off (``0.5 * 0.027`` is the ``0.0135`` a flag gives)."""
  if isinstance(a, float) and isinstance(b, float):
    return math.isclose(a, b, rel_tol=1e-9)
  return a == b


def runs_table(run_dirs: Sequence[str | os.PathLike], baseline: str | os.PathLike) -> str:
  """A Markdown table of finished runs set against one baseline run.

  Each row is a run folder (its ``summary.json``): what its training settings
  change from the baseline's (read from the two saved configs, so the table
  cannot disagree with what trained), its validation perplexity, the
  difference from the baseline's, and its optimizer state at ``moe-6.78b``
  (:func:`experiments.planning.accounting.state_bytes` with its tiers).
  Used for the attribution rows of the long protocol.
  """

  def read(path):
    path = pathlib.Path(path)
    summary = json.loads((path / "summary.json").read_text())
    if not summary.get("completed"):
      raise ValueError(f"{path}: the run did not finish")
    return summary

  def state_gb(summary):
    config = TrainConfig(**with_defaults(summary["config"]))
    return state_bytes_6p78b(config.optimizer, config.skewadam_tiers()) / 1e9

  base = read(baseline)
  lines = [f"Against `{pathlib.Path(baseline).name}` (validation perplexity "
           f"{base['val_ppl']:.2f}, state at moe-6.78b {state_gb(base):.3f} GB):", "",
           "| run | changes | val ppl | Δ | state, moe-6.78b |", "|---|---|---|---|---|"]
  for path in run_dirs:
    summary = read(path)
    # None is a setting left to its default; SkewAdam's tier settings are not
    # read by another optimizer (a flag's default and compare's saved value differ).
    unread = (set(config_lib.TIER_FIELDS) if summary["config"].get("optimizer") != "skewadam"
              else set())
    # A baseline saved before a setting existed ran with its default.
    base_config = with_defaults(base["config"])
    changed = [f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}"
               for key, value in summary["config"].items()
               if key not in _LOGISTICS | unread and value is not None
               and not _same(base_config.get(key), value)]
    lines.append(f"| `{pathlib.Path(path).name}` | {', '.join(changed) or 'none'} "
                 f"| {summary['val_ppl']:.2f} | {summary['val_ppl'] - base['val_ppl']:+.2f} "
                 f"| {state_gb(summary):.3f} GB |")
  return "\n".join(lines)
