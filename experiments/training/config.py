"""The training configuration: one definition of every setting.

Each field of :class:`TrainConfig` carries its help text, its allowed values
and whether it is *structural* (it changes the model, the optimizer state, the
data or the schedule, so a checkpoint may only be resumed under the same
value). The training command's flags (``--help`` included) and the
checkpoint's resume check are derived from these fields, not from copies of
them.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import re
from typing import Any

import jax.numpy as jnp

import models
import skewadam_jax
from experiments.training import optimizers
from experiments.training import mesh as mesh_lib

PARAM_DTYPES = ("float32", "bfloat16")
ROOT = pathlib.Path(__file__).resolve().parents[2]  # the checkout


_AS_DEFAULT = object()


def setting(default: Any, help: str, *, structural: bool, choices=None, kind=None,  # pylint: disable=redefined-builtin
            before: Any = _AS_DEFAULT, saved_none: Any = None):
  """A config field with its help text, allowed values and resume rule.

  Args:
    default: the default value (``None``: decided by the preset or optimizer).
    help: one line for ``--help``.
    structural: whether a resumed run must keep the checkpoint's value.
    choices: the allowed values, shown in ``--help`` and checked by argparse.
    kind: the flag's type (``int``, ``float``, ``str``, ``bool``); by default
      that of ``default``.
    before: what runs saved before the field existed did, when that is not
      ``default`` (:func:`with_defaults`).
    saved_none: what a saved ``None`` did, for a field whose default was
      ``None`` once and is a value now (:func:`with_defaults`).
  """
  kind = kind or type(default)
  return dataclasses.field(default=default, metadata={
      "help": help, "structural": structural, "choices": choices, "kind": kind,
      "before": default if before is _AS_DEFAULT else before, "saved_none": saved_none})


_ENCODINGS = tuple(skewadam_jax.ENCODINGS)
_FORMS = ("exact", "factored")
_DIRECTIONS = skewadam_jax.DIRECTIONS
_ORTHOGONAL_SCALES = skewadam_jax.orthogonal.SCALES
_ORTHOGONAL_EXPERT = skewadam_jax.ORTHOGONAL_TIER_SETTINGS["expert"]  # the help texts name it


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """Everything that defines a training run (see the module docstring)."""

  preset: str = setting("small", "model preset", structural=True,
                        choices=tuple(models.PRESETS))
  optimizer: str = setting("skewadam", "optimizer", structural=True,
                           choices=tuple(optimizers.OPTIMIZERS))
  steps: int = setting(600, "training steps (the schedule's length)", structural=True)
  batch_size: int = setting(16, "sequences per step (per micro-batch with --accumulate)",
                            structural=True)
  accumulate: int = setting(1, "micro-batches of --batch-size sequences summed into one "
                            "optimizer step (gradient accumulation; the step's batch is "
                            "their product)", structural=True)
  accumulate_dtype: str = setting("float32", "dtype of the gradient accumulator with "
                                  "--accumulate: 'float32' or 'params' (the parameters' "
                                  "dtype: half the memory with bfloat16 parameters)",
                                  structural=True, choices=("float32", "params"))
  seq_len: int | None = setting(None, "tokens per sequence (default: the preset's "
                                "maximum)", structural=True, kind=int)
  lr: float | None = setting(None, "peak learning rate (default: the optimizer's "
                             "sweep centre; SkewAdam's orthogonal tiers' 1600-step best, "
                             "experiments.training.optimizers.default_lr)",
                             structural=True, kind=float)
  warmup_steps: int = setting(60, "linear warmup steps before the decay",
                              structural=True)
  schedule: str = setting("cosine", "learning-rate schedule after the warmup: 'cosine' "
                          "(to lr/10 at the last step), 'wsd' (constant, then a 1-sqrt "
                          "decay to 0 over --decay-fraction of the steps) or 'cooldown' "
                          "(constant, then linear to 0 over --decay-fraction)",
                          structural=True, choices=optimizers.SCHEDULES)
  decay_fraction: float = setting(0.2, "with --schedule wsd or cooldown: the share of the "
                                  "steps spent in the final decay", structural=True)
  weight_decay: float | None = setting(
      None, "decoupled weight decay on matrices (default: the optimizer's, 0.1; SkewAdam with "
      "an orthogonal expert direction: skewadam_jax.skewadam_orthogonal()'s; "
      "experiments.training.optimizers.default_weight_decay)", structural=True, kind=float,
      before=optimizers.DEFAULT_WEIGHT_DECAY, saved_none=optimizers.DEFAULT_WEIGHT_DECAY)
  b1: float = setting(0.9, "first-moment decay of AdamW, of every SkewAdam tier and of "
                      "Muon's AdamW part (Muon's own momentum is --muon-momentum)",
                      structural=True)
  muon_momentum: float = setting(0.95, "Muon's own momentum on the matrices it "
                                 "orthogonalises (optax.contrib.muon's beta)", structural=True)
  clip_norm: float = setting(1.0, "global gradient-norm clipping threshold",
                             structural=True)
  seed: int = setting(0, "seed of the parameters and the batch order", structural=True)
  data: str | None = setting(None, "UTF-8 text file or folder, or a folder written by "
                             "'python -m experiments.data prepare' (memory-mapped "
                             "shards; default: the bundled Shakespeare corpus)",
                             structural=True, kind=str)
  val_fraction: float = setting(0.1, "share of the characters held out for validation "
                                "(whole works; a prepared --data keeps its own split)",
                                structural=True)
  eval_every: int = setting(100, "evaluate every this many steps", structural=False)
  eval_batches: int = setting(16, "validation batches per evaluation", structural=False)
  ckpt_every: int = setting(100, "checkpoint every this many steps", structural=False)
  log_every: int = setting(10, "log metrics every this many steps", structural=False)
  sample_tokens: int = setting(48, "tokens of text sampled at each evaluation, logged "
                               "and in TensorBoard (0: none)", structural=False,
                               before=0)  # runs sampled no text before the flag
  moe_impl: str | None = setting(None, "dropless expert lowering (default: the "
                                 "preset's)", structural=True,
                                 choices=tuple(models.MOE_IMPLS), kind=str)
  vocab_size: int | None = setting(None, "model vocabulary (default: with a prepared "
                                   "--data, its tokenizer's; else the preset's, and the "
                                   "tokenizer is trained to it)", structural=True, kind=int)
  num_layers: int | None = setting(None, "transformer blocks (default: the preset's)",
                                   structural=True, kind=int)
  d_model: int | None = setting(None, "model width (default: the preset's)", structural=True,
                                kind=int)
  num_heads: int | None = setting(None, "attention heads; d_model / num_heads must be even "
                                  "(default: the preset's)", structural=True, kind=int)
  num_experts: int | None = setting(None, "experts per MoE layer (default: the preset's)",
                                    structural=True, kind=int)
  top_k: int | None = setting(None, "experts each token is routed to (default: the preset's)",
                              structural=True, kind=int)
  d_ff: int | None = setting(None, "each expert's hidden width (default: the preset's)",
                             structural=True, kind=int)
  max_seq_len: int | None = setting(None, "longest sequence the model takes (default: the "
                                    "preset's)", structural=True, kind=int)
  compute_dtype: str | None = setting(None, "dtype of activations and matmul inputs "
                                      "(default: the preset's)", structural=True,
                                      choices=PARAM_DTYPES, kind=str)
  moe_block_size: int | None = setting(None, "rows per block of the blocked and "
                                       "expert-parallel MoE (0: sized to the batch, "
                                       "models.grouped.auto_block_size; default: the "
                                       "preset's)",
                                       structural=True, kind=int)
  remat: bool | None = setting(None, "rematerialise each layer in the backward pass "
                               "(--no-remat: keep its activations; default: the preset's)",
                               structural=True, kind=bool)
  loss_chunk_size: int | None = setting(None, "tokens per chunk of the cross-entropy's "
                                        "logits (0: all at once; default: the preset's)",
                                        structural=True, kind=int)
  rope_theta: float | None = setting(None, "RoPE base frequency (default: the preset's)",
                                     structural=True, kind=float)
  norm_eps: float | None = setting(None, "RMSNorm epsilon (default: the preset's)",
                                   structural=True, kind=float)
  lb_loss_coef: float | None = setting(None, "weight of the load-balancing loss (default: "
                                       "the preset's)", structural=True, kind=float)
  z_loss_coef: float | None = setting(None, "weight of the router z-loss (default: the "
                                      "preset's)", structural=True, kind=float)
  attention_impl: str | None = setting(None, "jax.nn.dot_product_attention's implementation "
                                       "(default: the preset's, else JAX chooses)",
                                       structural=True, choices=("xla", "cudnn"), kind=str)
  # None follows the expert tier's direction (direction_default): the
  # orthogonal ones take skewadam_orthogonal's factors (rank 84 in int8 since
  # the tuning against Muon's last row, rank 42 in bfloat16 before it, rank 16
  # in float32 before the tuning against Muon), which the comparison's rule chose
  # over packed signs (docs/results/quality.md); Adam's keeps the library's
  # signs. Runs save the value it resolved to (as_dict), so a saved None is from
  # before that rule: the library's sign. The same holds for the rank, dtype
  # and update scales below: a saved None is the library's.
  expert_momentum: str | None = setting(
      None, "SkewAdam expert-tier momentum encoding (default: lowrank, "
      f"rank-{_ORTHOGONAL_EXPERT['lowrank_rank']} {_ORTHOGONAL_EXPERT['lowrank_dtype']} "
      "factors, with an orthogonal expert direction, as skewadam_jax.skewadam_orthogonal(); the "
      "library's sign with --expert-direction adam, as skewadam_jax.skewadam())",
      structural=True, choices=_ENCODINGS, kind=str, before="sign", saved_none="sign")
  expert_lowrank_rank: int | None = setting(
      None, "with --expert-momentum lowrank: the rank of each expert matrix's momentum "
      f"factors (default: {_ORTHOGONAL_EXPERT['lowrank_rank']} with an orthogonal expert "
      "direction, as "
      "skewadam_jax.skewadam_orthogonal(); else the library's, 16)", structural=True, kind=int)
  expert_lowrank_dtype: str | None = setting(
      None, "with --expert-momentum lowrank: the factors' storage dtype (bfloat16: half "
      "the bytes, so twice the rank at the same state; int8: a quarter, plus a float32 "
      f"scale per rank a matrix; default: {_ORTHOGONAL_EXPERT['lowrank_dtype']} with an orthogonal "
      "expert direction, as skewadam_jax.skewadam_orthogonal(); else the library's, float32)",
      structural=True, choices=skewadam_jax.encodings.LOWRANK_DTYPES, kind=str)
  expert_lowrank_complement: float | None = setting(
      None, "with --expert-momentum lowrank and an orthogonal expert direction: the weight "
      "of the update's part outside the momentum's rank-r subspace, 0 to 1 (default: the "
      "library's, 1: the update as orthogonalised)", structural=False, kind=float)
  expert_lowrank_orthogonalise: str | None = setting(
      None, "with --expert-momentum lowrank and an orthogonal expert direction: what "
      "Newton-Schulz runs on, full (the whole matrix) or factors (its projection on the "
      "momentum's rank-r subspace, through the factors: a rank-r update at a small "
      "fraction of the FLOPs; default: the library's, full)", structural=False,
      choices=skewadam_jax.transform.LOWRANK_ORTHOGONALISE, kind=str)
  backbone_momentum: str | None = setting(
      None, "SkewAdam backbone momentum encoding (default: the library's)",
      structural=True, choices=_ENCODINGS, kind=str)
  backbone_second_moment: str | None = setting(
      None, "SkewAdam backbone second moment (default: the library's)",
      structural=True, choices=_FORMS, kind=str)
  router_second_moment: str | None = setting(
      None, "SkewAdam router second moment (default: the library's)",
      structural=True, choices=_FORMS, kind=str)
  # The two directions are the training command's own defaults, not the
  # library's (adam): the rule of experiments.studies.comparison.choose_default
  # chose the orthogonal tiers on the 1600-step comparison
  # (experiments/results/compare-long.json). A saved None is the library's.
  backbone_direction: str | None = setting(
      optimizers.DEFAULT_DIRECTION, "SkewAdam backbone update direction for matrices: "
      "adam (the library's skewadam()), orthogonal (Newton-Schulz, as Muon; "
      "skewadam_jax.skewadam_orthogonal()) or normalized_orthogonal", structural=True,
      choices=_DIRECTIONS, kind=str, saved_none=optimizers.LIBRARY_DIRECTION)
  expert_direction: str | None = setting(
      optimizers.DEFAULT_DIRECTION, "SkewAdam expert-bank update direction (as "
      "--backbone-direction)", structural=True, choices=_DIRECTIONS, kind=str,
      saved_none=optimizers.LIBRARY_DIRECTION)
  backbone_orthogonal_scale: str | None = setting(
      None, "with an orthogonal backbone direction: its update scale, adam_rms (Adam's "
      "update RMS) or width (Muon's sqrt(max(1, d_out/d_in))); default: width, as "
      "skewadam_jax.skewadam_orthogonal() (the library's is adam_rms)",
      structural=True, choices=_ORTHOGONAL_SCALES, kind=str)
  expert_orthogonal_scale: str | None = setting(
      None, "the same for an orthogonal expert-bank direction", structural=True,
      choices=_ORTHOGONAL_SCALES, kind=str)
  orthogonal_chunk: str | None = setting(
      None, "with an orthogonal direction: how many stacked matrices Newton-Schulz "
      "iterates at once: auto (a chunk of at most 64 MB in float32), all (a layer's whole "
      "bank) or a number; default: the library's (auto)", structural=True, kind=str)
  orthogonal_dtype: str | None = setting(
      None, "with an orthogonal direction: the Newton-Schulz iterates' dtype, float32 or "
      "bfloat16 (float32 accumulation); default: the library's (float32)", structural=True,
      choices=skewadam_jax.orthogonal.COMPUTE_DTYPES, kind=str)
  orthogonal_owner_axes: str | None = setting(
      None, "with an orthogonal direction: the mesh axes (comma-separated, e.g. data) over "
      "which each chunk of the orthogonalised matrices is spread whole before Newton-Schulz, "
      "so a matrix split by FSDP is iterated on one owner device instead of all-reducing the "
      "iteration's products (the backbone's, and the expert banks' unless they are "
      "orthogonalised through their factors, whose small products are cheaper to "
      "all-reduce); default: none",
      structural=False, kind=str)
  momentum_rounding: str | None = setting(
      None, "SkewAdam: how a bf16 momentum is rounded when stored, stochastic (unbiased) or "
      "nearest; default: the library's (stochastic)", structural=True,
      choices=skewadam_jax.encodings.ROUNDINGS, kind=str, before="nearest")
  update_clip: str | None = setting(
      None, "SkewAdam: Adafactor's update clip per matrix, auto (d = 1 where the form has no "
      "bound of its own), off, or a number d; default: the library's (auto)",
      structural=True, kind=str, before="off")
  contain_nonfinite: str | None = setting(
      None, "SkewAdam: count NaN, Inf and overflowing gradient entries as zero, on or off; "
      "default: the library's (on)", structural=True, choices=("on", "off"), kind=str,
      before="off")
  nesterov: str | None = setting(
      None, "SkewAdam: Nesterov's momentum on the leaves in Adam's direction (as "
      "optax.adamw(nesterov=True), which Muon's AdamW part uses), on or off; the orthogonal "
      "directions always use it; default: the library's (off)", structural=True,
      choices=("on", "off"), kind=str)
  orthogonal_rest_tier: str | None = setting(
      None, "with an orthogonal backbone direction: the SkewAdam tier of the backbone "
      "leaves it leaves out (embeddings, unembedding, vectors): backbone (its compact "
      "moments; the default) or router (fp32 m, exact v: AdamW's moments, as Muon's "
      "AdamW part)", structural=True, choices=("backbone", "router"), kind=str)
  mesh: str | None = setting(None, "SPMD mesh, e.g. data=4,expert=2 "
                             "(experiments/training/mesh.py); a checkpoint resumes on "
                             "any mesh", structural=False, kind=str)
  fsdp: bool = setting(False, "with --mesh: also split every matrix (its larger axis; "
                       "parameters, gradients and optimizer state) over the mesh's data "
                       "axis, as the memory planner's default layout does", structural=False)
  param_dtype: str | None = setting(None, "parameter dtype (default: the preset's)",
                                    structural=True, choices=PARAM_DTYPES, kind=str)
  stochastic_rounding: bool = setting(False, "round updates to bf16 parameters "
                                      "stochastically", structural=True)
  update_in_backward: bool = setting(
      False, "apply each layer's update inside the backward pass, so one layer's "
      "gradients are alive at a time (skewadam_jax.layerwise)", structural=True)
  clip_mode: str = setting("exact", "with --update-in-backward: 'exact' (a first pass "
                           "for the global norm) or 'stale' (the previous step's norm)",
                           structural=True, choices=("exact", "stale"))
  skip_nonfinite: int = setting(0, "skip steps with NaN/Inf gradients, stop after this "
                                "many in a row (0: off, stop at a non-finite loss)",
                                structural=True)

  def model_config(self) -> models.ModelConfig:
    overrides = {"moe_impl": self.moe_impl} if self.moe_impl else {}
    if self.param_dtype:
      overrides["param_dtype"] = self.param_dtype
    for name in MODEL_FIELDS + MODEL_OPTIONS:
      if getattr(self, name) is not None:
        overrides[name] = getattr(self, name)
    return models.get_preset(self.preset, **overrides)

  def resolved(self, field: str) -> Any:
    """A SkewAdam tier field's value, or, where it is unset (``None``), the
    training command's default for its tier's direction
    (:func:`direction_default`); ``None``: the library's.

    Example:
      >>> TrainConfig().resolved("expert_momentum")
      'lowrank'
      >>> TrainConfig(expert_direction="adam").resolved("expert_momentum") is None
      True
    """
    value = getattr(self, field)
    setting = _tier_setting(field)
    if value is not None or setting is None:
      return value
    return direction_default(field, getattr(self, f"{setting[0]}_direction", None),
                             self.expert_momentum)

  @property
  def resolved_weight_decay(self) -> float:
    """``weight_decay``, or the optimizer's default
    (:func:`~experiments.training.optimizers.default_weight_decay`)."""
    if self.weight_decay is not None:
      return self.weight_decay
    return optimizers.default_weight_decay(self.optimizer, self.skewadam_tiers())

  @property
  def resolved_expert_momentum(self) -> str | None:
    """``expert_momentum``, or its default for ``expert_direction``
    (:meth:`resolved`); ``None``: the library's."""
    return self.resolved("expert_momentum")

  def as_dict(self) -> dict:
    """The fields as a run saves them (``dataclasses.asdict``), with the
    defaults that follow another field resolved (:meth:`resolved`: the tier
    settings that follow a direction, ``expert_momentum`` also to the
    library's; :attr:`resolved_weight_decay`), so a saved configuration reads
    the same after such a default changes."""
    saved = dataclasses.asdict(self)
    saved.update({name: self.resolved(name) for name in TIER_FIELDS if saved[name] is None})
    saved["expert_momentum"] = saved["expert_momentum"] or skewadam_jax.DEFAULT_EXPERT.momentum
    saved["weight_decay"] = self.resolved_weight_decay
    return saved

  def skewadam_tiers(self) -> dict:
    """SkewAdam's tier settings that this configuration sets: ``{"backbone": {...},
    "expert": {...}, "router": {...}}`` (a tier only where a field is set), and
    :data:`optimizers.REST_TIER` with ``--orthogonal-rest-tier``'s value
    (:func:`optimizers.tier_configs` leaves it out for the library)."""
    tiers = {}
    # The library's arguments: its own direction is left out, so a step with
    # Adam's direction has the same tiers as one planned before the training
    # command's default changed.
    library = lambda d: None if d == optimizers.LIBRARY_DIRECTION else d
    rank = self.resolved("expert_lowrank_rank")
    expert = {k: v for k, v in (("momentum", self.resolved("expert_momentum")),
                                ("lowrank_rank", None if rank is None else int(rank)),
                                ("lowrank_dtype", self.resolved("expert_lowrank_dtype")),
                                ("direction", library(self.expert_direction)),
                                ("orthogonal_scale", self.resolved("expert_orthogonal_scale")))
              if v}
    complement = self.resolved("expert_lowrank_complement")
    if complement is not None:  # 0 is a value
      expert["lowrank_complement"] = float(complement)
    orthogonalise = self.resolved("expert_lowrank_orthogonalise")
    if orthogonalise is not None:
      expert["lowrank_orthogonalise"] = orthogonalise
    chunk = _chunk_value(self.orthogonal_chunk)
    if chunk is None and _expert_shards(self.mesh) > 1:
      # Strided chunks of the expert axis, one expert a shard: the loop stays
      # local (a smaller chunk gathers every expert to every device).
      chunk = _expert_shards(self.mesh)
    schedule = {k: v for k, v in (("orthogonal_chunk", chunk),
                                  ("orthogonal_dtype", self.orthogonal_dtype)) if v}
    if schedule and self.expert_direction != optimizers.LIBRARY_DIRECTION:
      expert.update(schedule)
    if expert:
      tiers["expert"] = expert
    backbone = {k: v for k, v in (("momentum", self.resolved("backbone_momentum")),
                                  ("second_moment", self.resolved("backbone_second_moment")),
                                  ("direction", library(self.backbone_direction)),
                                  ("orthogonal_scale", self.resolved("backbone_orthogonal_scale")))
                if v}
    if schedule and self.backbone_direction != optimizers.LIBRARY_DIRECTION:
      backbone.update(schedule)
    owners = tuple(a.strip() for a in (self.orthogonal_owner_axes or "").split(",")
                   if a.strip())
    if owners and self.backbone_direction != optimizers.LIBRARY_DIRECTION:
      backbone["orthogonal_owner_axes"] = owners
    # Through the factors the expert iterate is r x C: its all-reduced products are
    # small, and resharding whole banks to owners costs more (moe-47b: 59 GB of
    # all-to-all against 44 GB of all-reduce).
    if (owners and self.expert_direction != optimizers.LIBRARY_DIRECTION
        and orthogonalise not in skewadam_jax.tiers.THROUGH_FACTORS):
      tiers.setdefault("expert", {})["orthogonal_owner_axes"] = owners
    if backbone:
      tiers["backbone"] = backbone
    router_second_moment = self.resolved("router_second_moment")
    if router_second_moment:
      tiers["router"] = {"second_moment": router_second_moment}
    if self.momentum_rounding:
      for name in ("backbone", "expert", "router"):
        tiers.setdefault(name, {})["momentum_rounding"] = self.momentum_rounding
    if self.orthogonal_rest_tier:
      tiers[optimizers.REST_TIER] = self.orthogonal_rest_tier
    if self.update_clip:
      tiers["clip_threshold"] = _clip_value(self.update_clip)
    if self.contain_nonfinite:
      tiers["contain_nonfinite"] = self.contain_nonfinite == "on"
    if self.nesterov:
      tiers["nesterov"] = self.nesterov == "on"
    return tiers

  def validate(self) -> None:
    """Raises ValueError with a one-line message for a bad setting."""
    if self.optimizer not in optimizers.OPTIMIZERS:
      raise ValueError(f"unknown optimizer {self.optimizer!r}; "
                       f"choose from {', '.join(optimizers.OPTIMIZERS)}")
    # Checked before the model config, which would raise a TypeError from
    # deep inside numpy for an unknown dtype name.
    if self.param_dtype not in (None, *PARAM_DTYPES):
      raise ValueError(f"--param-dtype must be one of {', '.join(PARAM_DTYPES)}, "
                       f"got {self.param_dtype!r}")
    for name in MODEL_FIELDS:
      value = getattr(self, name)
      if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                or value < 1):
        raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if self.compute_dtype not in (None, *PARAM_DTYPES):
      raise ValueError(f"--compute-dtype must be one of {', '.join(PARAM_DTYPES)}, "
                       f"got {self.compute_dtype!r}")
    if self.attention_impl not in (None, "xla", "cudnn"):
      raise ValueError(f"--attention-impl must be xla or cudnn, got {self.attention_impl!r}")
    for name in ("rope_theta", "norm_eps"):
      value = getattr(self, name)
      if value is not None and not 0 < value < math.inf:
        raise ValueError(f"--{name.replace('_', '-')} must be > 0 and finite, got {value}")
    for name in ("lb_loss_coef", "z_loss_coef"):
      value = getattr(self, name)
      if value is not None and not 0 <= value < math.inf:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 0 and finite, got {value}")
    _chunk_value(self.orthogonal_chunk)
    _clip_value(self.update_clip)
    self.model_config()  # unknown preset / moe_impl, a shape the model refuses
    if self.stochastic_rounding and self.model_config().param_dtype != jnp.bfloat16:
      raise ValueError("--stochastic-rounding needs bfloat16 parameters "
                       "(--param-dtype bfloat16)")
    if not 0.0 <= self.b1 < 1.0:
      raise ValueError(f"--b1 must be in [0, 1), got {self.b1}")
    if not 0.0 <= self.muon_momentum < 1.0:
      raise ValueError(f"--muon-momentum must be in [0, 1), got {self.muon_momentum}")
    if self.skip_nonfinite < 0:
      raise ValueError(f"--skip-nonfinite must be >= 0, got {self.skip_nonfinite}")
    if not 0 < self.val_fraction < 1:
      raise ValueError(f"--val-fraction must be in (0, 1), got {self.val_fraction}")
    if self.sample_tokens < 0:
      raise ValueError(f"--sample-tokens must be >= 0, got {self.sample_tokens}")
    for name in ("steps", "batch_size", "accumulate", "eval_batches", "eval_every",
                 "ckpt_every", "log_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                         f"got {getattr(self, name)}")
    if self.seq_len is not None and self.seq_len < 1:
      raise ValueError(f"--seq-len must be >= 1, got {self.seq_len}")
    if self.lr is not None and not self.lr > 0:  # also rejects NaN
      raise ValueError(f"--lr must be > 0, got {self.lr}")
    if self.lr is not None and not math.isfinite(self.lr):
      raise ValueError(f"--lr must be finite, got {self.lr}")
    for name in ("weight_decay", "clip_norm", "warmup_steps"):
      if getattr(self, name) is not None and not 0 <= getattr(self, name) < math.inf:  # NaN too
        raise ValueError(f"--{name.replace('_', '-')} must be >= 0 and finite, "
                         f"got {getattr(self, name)}")
    if self.seed < 0:
      raise ValueError(f"--seed must be >= 0, got {self.seed}")
    if self.schedule not in optimizers.SCHEDULES:
      raise ValueError(f"--schedule must be one of {', '.join(optimizers.SCHEDULES)}, "
                       f"got {self.schedule!r}")
    if not 0 < self.decay_fraction <= 1:  # also rejects NaN
      raise ValueError(f"--decay-fraction must be in (0, 1], got {self.decay_fraction}")
    optimizers.lr_schedule(1.0, self.steps, self.warmup_steps, kind=self.schedule,
                           decay_fraction=self.decay_fraction)  # a decay inside the warmup
    skewadam_jax.scale_by_skewadam(**optimizers.tier_configs(self.skewadam_tiers()))
    if self.mesh:
      sizes = mesh_lib.parse_mesh(self.mesh)
      shards = sizes.get("data", 1) * sizes.get("expert", 1)
      if self.model_config().moe_impl == "expert_parallel" and self.batch_size % shards:
        raise ValueError(f"--batch-size {self.batch_size} must divide by data x expert "
                         f"= {shards}: expert parallelism splits the batch over both")
    if self.fsdp and not self.mesh:
      raise ValueError("--fsdp splits parameters over a mesh: give --mesh too")
    if self.clip_mode not in ("exact", "stale"):
      raise ValueError(f"--clip-mode must be exact or stale, got {self.clip_mode!r}")
    if self.accumulate_dtype not in ("float32", "params"):
      raise ValueError(f"--accumulate-dtype must be float32 or params, "
                       f"got {self.accumulate_dtype!r}")
    if self.update_in_backward:
      if self.skip_nonfinite and self.clip_mode != "exact":
        raise ValueError("--skip-nonfinite with --update-in-backward needs --clip-mode "
                         "exact (in 'stale' mode a layer is updated before the later "
                         "layers' gradients are seen)")


# The library's tier defaults, by tier name.
LIBRARY_TIERS = {"backbone": skewadam_jax.DEFAULT_BACKBONE, "expert": skewadam_jax.DEFAULT_EXPERT,
                 "router": skewadam_jax.DEFAULT_ROUTER}


def _tier_setting(field: str) -> tuple[str, str] | None:
  """``"expert_lowrank_rank"`` → ``("expert", "lowrank_rank")``; ``None`` for a
  field that is not one tier's setting (``orthogonal_chunk``)."""
  tier, _, key = field.partition("_")
  return (tier, key) if tier in LIBRARY_TIERS and key != "direction" else None


def direction_default(field: str, direction: str | None,
                      expert_momentum: str | None = None) -> Any:
  """The training command's value of an unset SkewAdam tier field, for its
  tier's direction.

  With an orthogonal direction, the setting
  :func:`skewadam_jax.skewadam_orthogonal` gives the tier
  (:data:`skewadam_jax.ORTHOGONAL_TIER_SETTINGS`); with Adam's (the
  library's), or for a setting the alias leaves alone, ``None``: the
  library's, as :func:`skewadam_jax.skewadam` has it. The low-rank
  momentum's settings (``expert_lowrank_*``) only where the expert momentum
  (``expert_momentum``, unset: its own default) is ``lowrank``: another
  momentum does not read them, so a run of it is the same run whatever
  they are.

  Example:
    >>> direction_default("expert_momentum", "orthogonal"), direction_default("expert_momentum", "adam")
    ('lowrank', None)
    >>> direction_default("expert_lowrank_rank", "orthogonal", expert_momentum="sign") is None
    True
  """
  setting = _tier_setting(field)
  if setting is None or direction in (None, optimizers.LIBRARY_DIRECTION):
    return None
  tier, key = setting
  if field in LOWRANK_FIELDS and (
      expert_momentum or direction_default("expert_momentum", direction)) != "lowrank":
    return None
  return skewadam_jax.ORTHOGONAL_TIER_SETTINGS.get(tier, {}).get(key)


def library_where_unset(config: dict) -> dict:
  """``config`` with each tier field it leaves unset (``None`` or absent) that
  the training command's default for its tier's direction sets
  (:func:`direction_default`) set to the library's value instead: what the
  field meant where it was saved unset, or what a tiers dict of the
  library's arguments leaves out.

  Example:
    >>> library_where_unset({"expert_direction": "orthogonal", "expert_momentum": None})
    {'expert_direction': 'orthogonal', 'expert_momentum': 'sign', 'expert_orthogonal_scale': 'adam_rms'}
  """
  filled = dict(config)
  for field in TIER_FIELDS:  # expert_momentum first: the lowrank settings follow it
    setting = _tier_setting(field)
    if (setting and filled.get(field) is None
        and direction_default(field, filled.get(f"{setting[0]}_direction"),
                              filled.get("expert_momentum")) is not None):
      filled[field] = getattr(LIBRARY_TIERS[setting[0]], setting[1])
  return filled


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
STRUCTURAL_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig)
                          if f.metadata["structural"])


def with_defaults(saved: dict) -> dict:
  """A saved configuration (a checkpoint's, a run's summary) with the fields it predates filled in.

  A field added to :class:`TrainConfig` after a run was saved takes what that
  run did: its default, or the field's ``before`` value where the default
  changed behaviour (``sample_tokens``: runs sampled no text before it). A
  saved ``None`` of a field whose ``None`` meant a value that is no longer
  the default is that value (``backbone_direction``: ``None`` was the
  library's ``adam``, the default is now ``orthogonal``).

  Example:
    >>> with_defaults({"backbone_direction": None})["backbone_direction"]
    'adam'
  """
  fields = dataclasses.fields(TrainConfig)
  defaults = {f.name: f.metadata["before"] for f in fields}
  was_none = {f.name: f.metadata["saved_none"] for f in fields
              if f.metadata["saved_none"] is not None and saved.get(f.name, 0) is None}
  filled = {**defaults, **saved, **was_none}
  if filled.get("optimizer") != "skewadam":
    return filled  # it reads no tier field: nothing it saved unset meant a value
  # A run saves the tier settings that follow a direction resolved
  # (TrainConfig.as_dict), so one it saved unset was the library's.
  return library_where_unset(filled)


def comparable(config: dict) -> dict:
  """A saved or current configuration as two runs of one setting compare it.

  :func:`with_defaults`, and SkewAdam's tier fields blanked for the other
  optimizers, which do not read them (an AdamW run is the same run whatever
  the training command's SkewAdam default was when it was saved), as are the
  low-rank momentum's settings for another expert momentum.

  Example:
    >>> comparable({"optimizer": "adamw", "expert_direction": "orthogonal"})["expert_direction"]
  """
  config = with_defaults(config)
  if config.get("optimizer") != "skewadam":
    config.update(dict.fromkeys(TIER_FIELDS))
  elif config.get("expert_momentum") != "lowrank":  # no other momentum reads them
    config.update(dict.fromkeys(LOWRANK_FIELDS))
  return config


def resume_check(config: dict, data_fingerprint: str | None = None):
  """The test a checkpoint's metadata must pass to be resumed by this run.

  Returns a function of a checkpoint's metadata that gives the first
  difference that makes it another run's (a :data:`STRUCTURAL_FIELDS` field,
  or the training data's fingerprint), or ``None``: the checkpoint store
  (:meth:`~experiments.training.checkpoint.Checkpointer.restore`) calls it and
  refuses the checkpoint with that reason; it knows nothing of the policy.

  Example:
    >>> check = resume_check({"optimizer": "adamw"}, "abc")
    >>> check({"config": {"optimizer": "skewadam"}})
    "has optimizer='skewadam' but this run has optimizer='adamw'"
    >>> check({"config": {"optimizer": "adamw"}, "data_fingerprint": "abc"}) is None
    True
  """
  current = comparable(config)

  def check(meta: dict) -> str | None:
    saved = comparable(meta.get("config", {}))
    for field in STRUCTURAL_FIELDS:
      if field in config and saved.get(field) != current[field]:
        return f"has {field}={saved.get(field)!r} but this run has {field}={current[field]!r}"
    if (data_fingerprint is not None and "data_fingerprint" in meta
        and meta["data_fingerprint"] != data_fingerprint):
      return (f"has data_fingerprint={meta['data_fingerprint']!r} but this run has "
              f"data_fingerprint={data_fingerprint!r}")
    return None

  return check


# The fields that set the model's shape on top of its preset (TrainConfig.model_config).
MODEL_FIELDS = ("vocab_size", "num_layers", "d_model", "num_heads", "num_experts", "top_k",
                "d_ff", "max_seq_len")

# The model's other settings on top of its preset (TrainConfig.model_config):
# with MODEL_FIELDS, moe_impl and param_dtype, every models.ModelConfig field,
# so a preset file (models/presets/) is a configuration file too.
MODEL_OPTIONS = ("compute_dtype", "moe_block_size", "remat", "loss_chunk_size", "rope_theta",
                 "norm_eps", "lb_loss_coef", "z_loss_coef", "attention_impl")

def _expert_shards(mesh: str | None) -> int:
  """The size of a ``--mesh`` spec's ``expert`` axis (1 without one)."""
  found = re.search(r"(?:^|,)\s*expert\s*=\s*(\d+)", mesh or "")
  return int(found.group(1)) if found else 1


def _chunk_value(text: str | None):
  """``--orthogonal-chunk``'s value as the library takes it (a number becomes an int)."""
  if text is None or text in skewadam_jax.orthogonal.CHUNKINGS:
    return text
  if str(text).isdigit() and int(text) > 0:
    return int(text)
  raise ValueError(f"--orthogonal-chunk must be auto, all or a positive number, got {text!r}")


def _clip_value(text: str | None):
  """``--update-clip``'s value as the library's ``clip_threshold`` takes it."""
  if text is None or text == "auto":
    return text
  if text == "off":
    return None
  try:
    value = float(text)
  except ValueError:
    value = math.nan
  if not 0 < value < math.inf:
    raise ValueError(f"--update-clip must be auto, off or a number > 0, got {text!r}")
  return value


# The fields that choose SkewAdam's tiers (TrainConfig.skewadam_tiers).
TIER_FIELDS = ("expert_momentum", "backbone_momentum", "backbone_second_moment",
               "router_second_moment", "backbone_direction", "expert_direction",
               "backbone_orthogonal_scale", "expert_orthogonal_scale", "orthogonal_chunk",
               "orthogonal_dtype", "orthogonal_owner_axes", "orthogonal_rest_tier",
               "momentum_rounding", "update_clip",
               "contain_nonfinite", "nesterov", "expert_lowrank_rank",
               "expert_lowrank_complement", "expert_lowrank_dtype",
               "expert_lowrank_orthogonalise")
# The expert tier's settings that only its lowrank momentum reads.
LOWRANK_FIELDS = tuple(f for f in TIER_FIELDS if f.startswith("expert_lowrank_"))


def add_flags(parser, fields: tuple[str, ...] | None = None) -> None:
  """Adds a ``--flag`` per :class:`TrainConfig` field, with its help, default and choices.

  Allowed values are shown, not enforced by argparse: :meth:`TrainConfig.validate`
  checks them with one-line messages.

  Args:
    parser: an ``argparse.ArgumentParser``.
    fields: only these fields (e.g. :data:`TIER_FIELDS`, for a command that
      does not train, so the help says nothing of ``--resume``); default all.
  """
  for field in dataclasses.fields(TrainConfig):
    if fields is not None and field.name not in fields:
      continue
    meta = field.metadata
    flag = "--" + field.name.replace("_", "-")
    extra = []
    if meta["choices"]:
      extra.append("one of " + ", ".join(map(str, meta["choices"])))
    if meta["kind"] is not bool:
      extra.append(f"default {field.default}" if field.default is not None else "")
    if meta["structural"] and fields is None:
      extra.append("fixed on --resume")
    help_text = meta["help"] + "".join(f"; {e}" for e in extra if e)
    if meta["kind"] is bool and field.default is None:  # unset: the preset decides
      parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                          help=help_text)
    elif meta["kind"] is bool:
      parser.add_argument(flag, action="store_true", default=field.default, help=help_text)
    else:
      metavar = "{" + ",".join(map(str, meta["choices"])) + "}" if meta["choices"] else None
      parser.add_argument(flag, type=meta["kind"], default=field.default, help=help_text,
                          metavar=metavar)


def from_args(args) -> TrainConfig:
  """The :class:`TrainConfig` of parsed :func:`add_flags` arguments."""
  return TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})


def tier_fields(tiers: dict, *, library_directions: bool = True) -> dict:
  """The :data:`TIER_FIELDS` values that give SkewAdam's ``tiers`` (the inverse of
  :meth:`TrainConfig.skewadam_tiers`).

  ``tiers`` are the library's arguments, so a tier's direction they leave out
  is the library's (``adam``), not the training command's default; with
  ``library_directions=False`` (a configuration file's ``tiers`` table, which
  amends the training command's settings) it is left to the default.

  Raises:
    ValueError: naming a tier setting no flag spells.

  Example:
    >>> tier_fields({"expert": {"momentum": "int8"}, "router": {"second_moment": "exact"}},
    ...             library_directions=False)
    {'expert_momentum': 'int8', 'router_second_moment': 'exact'}
    >>> tier_fields({"expert": {"direction": "orthogonal"}})
    {'backbone_direction': 'adam', 'expert_direction': 'orthogonal', 'expert_momentum': 'sign', 'expert_orthogonal_scale': 'adam_rms'}
  """
  fields = ({f"{tier}_direction": optimizers.LIBRARY_DIRECTION for tier in ("backbone", "expert")}
            if library_directions else {})
  for tier, settings in tiers.items():
    if tier == optimizers.REST_TIER:
      fields["orthogonal_rest_tier"] = settings
      continue
    if tier == "clip_threshold":
      fields["update_clip"] = "off" if settings is None else str(settings)
      continue
    if tier in ("contain_nonfinite", "nesterov"):
      fields[tier] = "on" if settings else "off"
      continue
    for key, value in dict(settings).items():
      if key in ("orthogonal_chunk", "orthogonal_dtype", "momentum_rounding"):
        fields[key] = str(value)  # one flag for every tier
        continue
      if key == "orthogonal_owner_axes":
        fields[key] = ",".join((value,) if isinstance(value, str) else value)
        continue
      name = f"{tier}_{key}"
      if name not in TIER_FIELDS:
        raise ValueError(f"SkewAdam tier setting {tier}.{key} has no training flag; "
                         f"the flags are {', '.join(TIER_FIELDS)}")
      fields[name] = value
  # What the library's arguments leave out is the library's, which the training
  # command's default for an orthogonal tier (direction_default) may not be.
  return library_where_unset(fields) if library_directions else fields


def tiers_from_args(args) -> dict:
  """SkewAdam's tiers (:meth:`TrainConfig.skewadam_tiers`) from :data:`TIER_FIELDS` flags."""
  return TrainConfig(**{name: getattr(args, name) for name in TIER_FIELDS}).skewadam_tiers()


# --------------------------------------------------------------------------
# Configuration files.
# --------------------------------------------------------------------------

# Where each field goes in a configuration file: every field in one section,
# spelled as its flag is (``num_layers`` for ``--num-layers``).
SECTIONS = {
    "model": ("preset", *MODEL_FIELDS, "moe_impl", "param_dtype", *MODEL_OPTIONS),
    "optimizer": ("optimizer", "lr", "schedule", "warmup_steps", "decay_fraction",
                  "weight_decay", "b1", "muon_momentum", "clip_norm", "stochastic_rounding",
                  "skip_nonfinite",
                  *TIER_FIELDS),
    "data": ("data", "val_fraction", "batch_size", "accumulate", "accumulate_dtype", "seq_len"),
    "parallel": ("mesh", "fsdp"),
    "layerwise": ("update_in_backward", "clip_mode"),
    "run": ("steps", "seed", "eval_every", "eval_batches", "ckpt_every", "log_every",
            "sample_tokens"),
}


def _check_type(name: str, value, where: str):
  field = _FIELDS[name]
  kind = field.metadata["kind"]
  ok = (isinstance(value, bool) if kind is bool
        else isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float
        else isinstance(value, int) and not isinstance(value, bool) if kind is int
        else isinstance(value, kind))
  if not ok:
    raise ValueError(f"{where}: {name} must be {kind.__name__}, got {value!r}")
  return float(value) if kind is float else value


def load_config_file(path) -> dict:
  """The :class:`TrainConfig` fields a TOML configuration file sets.

  The file has up to six tables, :data:`SECTIONS`: ``[model]`` (the preset
  and every dimension on top of it), ``[optimizer]`` (with its SkewAdam tiers
  as flat fields, ``expert_momentum = "int8"``, or as a sub-table
  ``[optimizer.tiers.expert]`` with ``momentum = "int8"``), ``[data]``,
  ``[parallel]``, ``[layerwise]`` and ``[run]``; each key is a field spelled as
  its flag (``num_layers`` for ``--num-layers``). The command line overrides
  the file.

  Raises:
    ValueError: naming the file and the key, for an unknown table or key, a
      key in the wrong table, or a value of the wrong type.

  Example:
    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "mine.toml"
    >>> _ = path.write_text('''
    ... [model]
    ... preset = "tiny"
    ... num_layers = 6
    ... [optimizer.tiers.expert]
    ... momentum = "int8"
    ... ''')
    >>> load_config_file(path)
    {'preset': 'tiny', 'num_layers': 6, 'expert_momentum': 'int8'}
  """
  import tomllib  # pylint: disable=import-outside-toplevel  (Python 3.11+, as flax)
  path = pathlib.Path(path)
  try:
    tables = tomllib.loads(path.read_text(encoding="utf-8"))
  except FileNotFoundError:
    raise ValueError(f"{path}: no such configuration file") from None
  except tomllib.TOMLDecodeError as err:
    raise ValueError(f"{path}: not valid TOML ({err})") from None
  home = {name: section for section, names in SECTIONS.items() for name in names}
  values = {}
  for section, table in tables.items():
    if section not in SECTIONS or not isinstance(table, dict):
      raise ValueError(f"{path}: unknown table [{section}]; the tables are "
                       f"{', '.join(f'[{s}]' for s in SECTIONS)}")
    for key, value in table.items():
      where = f"{path}: [{section}]"
      if section == "optimizer" and key == "tiers" and isinstance(value, dict):
        for name, tier_value in tier_fields(value, library_directions=False).items():
          values[name] = _check_type(name, tier_value, f"{where} tiers")
        continue
      if key not in home:
        raise ValueError(f"{where}: unknown key {key!r} (keys are the flags' names; "
                         f"this table's: {', '.join(SECTIONS[section])})")
      if home[key] != section:
        raise ValueError(f"{where}: {key!r} belongs in [{home[key]}]")
      values[key] = _check_type(key, value, where)
  return values


def parse_with_config_file(parser, argv=None):
  """``parser.parse_args(argv)`` with a ``--config FILE``'s settings as the defaults.

  Adds ``--config`` to ``parser``; the file's keys that are ``parser`` 's
  destinations become its defaults (so flags given on the command line win).

  Returns:
    ``(args, file_values)``: the parsed arguments and everything the file set
    (also the fields ``parser`` has no flag for).
  """
  if not any("--config" in a.option_strings for a in parser._actions):  # pylint: disable=protected-access
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="a TOML configuration file (experiments/training/config.py, "
                        "load_config_file); flags given here override it")
  first = argparse.ArgumentParser(add_help=False)
  first.add_argument("--config", default=None)
  known, _ = first.parse_known_args(argv)
  values = load_config_file(known.config) if known.config else {}
  dests = {a.dest for a in parser._actions}  # pylint: disable=protected-access
  parser.set_defaults(**{k: v for k, v in values.items() if k in dests})
  return parser.parse_args(argv), values
