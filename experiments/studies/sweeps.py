"""What every sweep of training runs shares (the comparison, the schedule study).

* the base configuration every run of a sweep starts from (:func:`base_config`);
* SkewAdam configurations by short name (``expert_m=int8,backbone_dir=orthogonal``):
  :func:`parse_skewadam_config`, :func:`resolve_config`, :func:`train_overrides`;
* runs that are read instead of trained again when a finished run of exactly
  the same configuration is already in their folder (:func:`run_or_reuse`), so
  an interrupted sweep continues where it stopped, in this session or the next;
  with ``allow_divergence`` a run whose loss stops being finite is a result
  (``diverged``), not an error, and is remembered as one.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import shutil

from experiments.training import config as config_lib
from experiments.training import optimizers
from experiments.training import run as training
from experiments.training.config import TrainConfig
from skewadam_jax import transform as skewadam_transform

# Short name → (tier, TierConfig field, TrainConfig field).
TIER_KEYS = {
    "backbone_m": ("backbone", "momentum", "backbone_momentum"),
    "backbone_v": ("backbone", "second_moment", "backbone_second_moment"),
    "expert_m": ("expert", "momentum", "expert_momentum"),
    "expert_rank": ("expert", "lowrank_rank", "expert_lowrank_rank"),
    "expert_dtype": ("expert", "lowrank_dtype", "expert_lowrank_dtype"),
    "expert_complement": ("expert", "lowrank_complement", "expert_lowrank_complement"),
    "expert_orth": ("expert", "lowrank_orthogonalise", "expert_lowrank_orthogonalise"),
    "router_v": ("router", "second_moment", "router_second_moment"),
    "backbone_dir": ("backbone", "direction", "backbone_direction"),
    "expert_dir": ("expert", "direction", "expert_direction"),
    "backbone_scale": ("backbone", "orthogonal_scale", "backbone_orthogonal_scale"),
    "expert_scale": ("expert", "orthogonal_scale", "expert_orthogonal_scale"),
    # Not tier settings: the tier of the leaves an orthogonal backbone leaves out,
    # and the Newton–Schulz schedule of both orthogonal tiers.
    "rest": (None, None, "orthogonal_rest_tier"),
    "ns_chunk": (None, None, "orthogonal_chunk"),
    "ns_dtype": (None, None, "orthogonal_dtype"),
    # The library's safety settings (0.3.0's defaults): how a bf16 momentum is
    # rounded, the update clip, the containment of non-finite gradient entries.
    "m_round": (None, None, "momentum_rounding"),
    "u_clip": (None, None, "update_clip"),
    "contain": (None, None, "contain_nonfinite"),
    # The decoupled weight decay: the training command's SkewAdam default follows
    # skewadam_orthogonal's (optimizers.default_weight_decay), so a row names it.
    "wd": (None, None, "weight_decay"),
}
# Keys a configuration names only when they differ from this value (so rows
# saved before the key existed keep their identity and their runs' folders).
IMPLICIT = {"backbone_dir": "adam", "expert_dir": "adam", "backbone_scale": "adam_rms",
            "expert_scale": "adam_rms", "rest": "backbone", "ns_chunk": "auto",
            "ns_dtype": "float32", "m_round": "nearest", "u_clip": "off", "contain": "off",
            "expert_rank": 16, "expert_dtype": "float32", "expert_complement": 1.0,
            "expert_orth": "full",
            "wd": optimizers.DEFAULT_WEIGHT_DECAY}
# What the library does now where that is not IMPLICIT's value: a configuration
# that does not name the key runs this.
CURRENT = {"m_round": "stochastic", "u_clip": "auto", "contain": "on"}


def without_safety(config: dict) -> dict:
  """A resolved configuration without the safety keys (:data:`CURRENT`'s): its tiers.

  The comparisons chose the tiers; 0.3.0's safety settings were re-measured on
  the chosen row (``experiments/safe_defaults.sh``), not swept.
  """
  return {k: v for k, v in config.items() if k not in CURRENT}


def base_config(*, preset: str = "small", batch_size: int = 16, data: str | None = None,
                eval_every: int = 100, eval_batches: int = 16,
                model: dict | None = None) -> TrainConfig:
  """The configuration a sweep's runs share before their own settings.

  ``model``: the model's fields on top of ``preset`` (a configuration file's
  ``[model]`` table without its ``preset``: ``num_layers``, ``d_model``, ...).
  """
  return TrainConfig(preset=preset, batch_size=batch_size, data=data, eval_every=eval_every,
                     eval_batches=eval_batches, ckpt_every=10**9, **(model or {}),
                     # every step timed and logged, for step-time ratios and
                     # loss spikes; no text samples (they change no number)
                     log_every=1, sample_tokens=0)


def parse_skewadam_config(text: str) -> dict:
  """``expert_m=int8,backbone_v=factored`` → ``{"expert_m": "int8", ...}``.

  A number is read as its training flag reads it (``expert_rank=42`` is the
  int 42, ``wd=0.2`` the float), so a spelled value names the same row as
  the training command's own.

  Example:
    >>> parse_skewadam_config("expert_m=lowrank,expert_rank=42,wd=0.2")
    {'expert_m': 'lowrank', 'expert_rank': 42, 'wd': 0.2}
  """
  out = {}
  for part in filter(None, text.split(",")):
    key, _, value = part.partition("=")
    if key not in TIER_KEYS or not value:
      raise ValueError(f"bad SkewAdam configuration {text!r}: use "
                       f"{', '.join(k + '=...' for k in TIER_KEYS)}")
    kind = TrainConfig.__dataclass_fields__[TIER_KEYS[key][2]].metadata["kind"]
    if kind in (int, float):
      try:
        value = kind(value)
      except ValueError:
        raise ValueError(f"bad SkewAdam configuration {text!r}: {key} must be "
                         f"{kind.__name__}, got {value!r}") from None
    out[key] = value
  return out


# The library's tier defaults, by tier name.
TIER_DEFAULTS = config_lib.LIBRARY_TIERS


def resolve_config(config: dict) -> dict:
  """A partial SkewAdam configuration, completed from the library's defaults."""
  resolved = {key: config.get(key, CURRENT.get(key, IMPLICIT[key]) if tier is None
                              else getattr(TIER_DEFAULTS[tier], field))
              for key, (tier, field, _) in TIER_KEYS.items()}
  return {k: v for k, v in resolved.items() if IMPLICIT.get(k) != v}


def train_overrides(config: dict) -> dict:
  """A SkewAdam configuration (:func:`resolve_config`'s form) as ``TrainConfig`` fields.

  The directions are always set: a configuration leaves out the library's
  (``adam``), which is not the training command's default.

  Example:
    >>> train_overrides({"expert_m": "int8"})  # doctest: +NORMALIZE_WHITESPACE
    {'backbone_direction': 'adam', 'expert_direction': 'adam', 'momentum_rounding': 'nearest',
     'update_clip': 'off', 'contain_nonfinite': 'off', 'expert_momentum': 'int8',
     'weight_decay': 0.1}
  """
  library = {TIER_KEYS[key][2]: IMPLICIT[key] for key in TRAIN_DEFAULT}
  # A key a resolved configuration leaves out has IMPLICIT's value, also where
  # the library's default is now another (CURRENT): a row saved before runs as it ran.
  before = {TIER_KEYS[key][2]: IMPLICIT[key] for key in CURRENT}
  overrides = {**library, **before, **{TIER_KEYS[key][2]: value for key, value in config.items()}}
  # A tier key it leaves out has the library's value, which the training
  # command's default for an orthogonal tier (config.direction_default) may not be.
  filled = config_lib.library_where_unset(overrides)
  # Likewise the weight decay, which the training command's default takes from the alias.
  filled.setdefault("weight_decay", IMPLICIT["wd"])
  return filled


def parse_entries(optimizer_names: str, skewadam_configs: str) -> list[tuple[str, dict | None]]:
  """``"adamw,muon"`` and ``"expert_m=int8;backbone_dir=orthogonal"`` → the entries of a sweep.

  Raises:
    ValueError: one line, for an unknown optimizer or SkewAdam setting, or an
      unknown encoding (found here, not an hour into the sweep).
  """
  entries = [(name, None) for name in filter(None, optimizer_names.split(","))]
  for name, _ in entries:
    if name not in optimizers.OPTIMIZERS:
      raise ValueError(f"unknown optimizer {name!r}; choose from "
                       f"{', '.join(optimizers.OPTIMIZERS)}")
  configs = [parse_skewadam_config(c) for c in skewadam_configs.split(";") if c]
  for config in configs:
    skewadam_transform.scale_by_skewadam(**optimizers.tier_configs(
        TrainConfig(**train_overrides(config)).skewadam_tiers()))
  return entries + [("skewadam", c) for c in configs]


# The training command's default SkewAdam configuration where it is not the
# library's: what a sweep's entry (`--optimizers skewadam`, a partial
# `--skewadam-configs`) starts from, so that it runs what `train` runs.
TRAIN_DEFAULT = {key: TrainConfig.__dataclass_fields__[field].default
                 for key, (_, _, field) in TIER_KEYS.items()
                 if TrainConfig.__dataclass_fields__[field].default is not None}


def resolve_entry(optimizer: str, config: dict | None) -> dict | None:
  """An entry's configuration as its row names it: SkewAdam's resolved, else ``None``.

  A SkewAdam entry completes from the training command's defaults
  (:data:`TRAIN_DEFAULT`, then the library's); a saved row's configuration is
  already complete (:func:`resolve_config`).

  Example:
    >>> resolve_entry("skewadam", {"backbone_dir": "adam", "expert_dir": "adam"}) == resolve_config({})
    True
  """
  if optimizer != "skewadam":
    return None
  config = {**TRAIN_DEFAULT, **(config or {})}
  for key, (tier, _, field) in TIER_KEYS.items():  # expert_m before the lowrank keys
    if key not in config and tier is not None:  # the training command's default follows the direction
      value = config_lib.direction_default(field, config.get(f"{tier}_dir", IMPLICIT.get(f"{tier}_dir")),
                                           config.get("expert_m"))
      if value is not None:
        config[key] = value
  if "wd" not in config:
    config["wd"] = optimizers.default_weight_decay(
        "skewadam", {"expert": {"direction": config.get("expert_dir", IMPLICIT["expert_dir"])}})
  return resolve_config(config)


def default_config() -> dict:
  """The training command's default SkewAdam configuration, resolved."""
  return resolve_entry("skewadam", None)


def row_key(row: dict) -> tuple[str, str]:
  """What identifies a sweep's row: its optimizer and configuration."""
  return row["optimizer"], json.dumps(row["config"], sort_keys=True)


def entry_key(optimizer: str, resolved: dict | None) -> tuple[str, str]:
  """:func:`row_key` of the row an entry (configuration from :func:`resolve_entry`) makes."""
  return row_key({"optimizer": optimizer, "config": resolved or "default"})


def tuned_rates(entries, rows, *, what: str = "learning rate") -> dict[tuple[str, str], float]:
  """Each entry's learning rate in a saved comparison's ``rows``, by :func:`entry_key`.

  Raises:
    ValueError: naming an entry that has no row there.
  """
  rates = {row_key(r): r["lr"] for r in rows}
  for optimizer, config in entries:
    if entry_key(optimizer, resolve_entry(optimizer, config)) not in rates:
      raise ValueError(f"no {what} for {optimizer} {config or ''} in the given comparison rows")
  return rates


def run_name(optimizer: str, config: dict | None) -> str:
  """A configuration's folder-name stem: the optimizer and SkewAdam's settings."""
  return optimizer + "".join(f"-{v}" for v in (config or {}).values())


def _same_config(saved: dict | None, config: TrainConfig) -> bool:
  # A run saved before a config field existed ran with that field's default.
  saved = json.loads(json.dumps(config_lib.comparable(saved or {})))
  return saved == json.loads(json.dumps(config_lib.comparable(config.as_dict())))


def finished_summary(out: pathlib.Path, config: TrainConfig) -> dict | None:
  """The summary of a finished run of exactly ``config`` in ``out``, else ``None``."""
  try:
    summary = json.loads((out / "summary.json").read_text())
  except (OSError, ValueError):
    return None
  same = _same_config(summary.get("config"), config)
  return summary if same and summary.get("completed") and "val_ppl" in summary else None


def _diverged_record(out: pathlib.Path, config: TrainConfig) -> dict | None:
  try:
    record = json.loads((out / "diverged.json").read_text())
  except (OSError, ValueError):
    return None
  return record if _same_config(record.get("config"), config) else None


def run_or_reuse(base: TrainConfig, out: pathlib.Path, cache_dir, *,
                 keep_checkpoints: bool = False, reuse: bool = False,
                 allow_divergence: bool = False, **overrides) -> dict:
  """Trains ``base`` with ``overrides`` into ``out``, or reads it back.

  Args:
    base: the sweep's shared configuration (:func:`base_config`).
    out: the run's folder.
    cache_dir: JAX's compilation cache folder (or ``None``).
    keep_checkpoints: keep the run's checkpoints (by default only its
      metrics and summary stay).
    reuse: read a finished (or, with ``allow_divergence``, diverged) run of
      exactly this configuration in ``out`` instead of training it again.
    allow_divergence: a run stopped by a non-finite loss returns
      ``val_ppl = inf`` and ``diverged = True`` (and leaves ``diverged.json``)
      instead of raising :class:`~experiments.training.run.TrainingError`.
    **overrides: ``TrainConfig`` fields of this run.

  Returns:
    ``{"val_ppl", "diverged", "tokens_per_s", "median_step_s",
    "opt_state_bytes", "curve": [(tokens, val_ppl)], "losses": [(step, loss)]}``.
  """
  config = dataclasses.replace(base, **overrides)
  summary = finished_summary(out, config) if reuse else None
  diverged = _diverged_record(out, config) if reuse and allow_divergence else None
  if summary is None and diverged is None:
    shutil.rmtree(out, ignore_errors=True)  # a rerun replaces its own earlier run
    try:
      summary = training.train(config, out, cache_dir=cache_dir, progress=False)
    except training.TrainingError as err:
      if not allow_divergence:
        raise
      diverged = {"config": config.as_dict(), "error": str(err)}
      (out / "diverged.json").write_text(json.dumps(diverged, indent=2) + "\n")
  if not keep_checkpoints:  # a sweep needs the metrics and summary only
    shutil.rmtree(out / "ckpt", ignore_errors=True)
  metrics = out / "metrics.jsonl"
  records = ([json.loads(line) for line in metrics.read_text().splitlines()]
             if metrics.exists() else [])
  result = {"curve": [(r["tokens"], r["val_ppl"]) for r in records if "val_ppl" in r],
            "losses": [(r["step"], r["loss"]) for r in records if "loss" in r]}
  if diverged is not None:
    return {**result, "val_ppl": math.inf, "diverged": True, "tokens_per_s": None,
            "median_step_s": None, "opt_state_bytes": None}
  return {**result, "val_ppl": summary["val_ppl"], "diverged": False,
          "tokens_per_s": summary["tokens_per_s"],
          "median_step_s": summary.get("median_step_s"),
          "opt_state_bytes": summary["opt_state_bytes_by_tier"]["total"]}
