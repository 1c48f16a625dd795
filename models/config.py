"""Model configuration and named presets.

Each preset is a file, ``models/presets/<name>.toml``, whose ``[model]`` table
sets every :class:`ModelConfig` field. The same file is a training
configuration (``python -m experiments.train --config models/presets/small.toml``),
so a new shape is a copy of one with its keys changed.

Example::

  from models import get_preset
  cfg = get_preset('small', moe_impl='ragged')
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tomllib
from typing import Any

import jax.numpy as jnp
import numpy as np

MOE_IMPLS = ('dense', 'ragged', 'blocked', 'expert_parallel')
ATTENTION_IMPLS = (None, 'xla', 'cudnn')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Hyper-parameters of the decoder-only MoE transformer.

  Attributes:
    vocab_size: Number of token ids.
    d_model: Width of the residual stream (D).
    num_layers: Number of transformer blocks (L), stacked and scanned.
    num_heads: Attention heads (H); head size is ``d_model // num_heads``.
    num_experts: Experts per MoE layer (E).
    top_k: Experts each token is routed to (k).
    d_ff: Hidden width of each SwiGLU expert (F).
    max_seq_len: Longest sequence accepted by ``__call__``.
    rope_theta: RoPE base frequency.
    norm_eps: RMSNorm epsilon.
    param_dtype: Storage dtype of every parameter.
    compute_dtype: Dtype of activations and matmul inputs. The router logits,
      softmaxes, norms and returned logits are float32 regardless.
    moe_impl: How the dropless expert computation is lowered, all exact:
      ``'dense'`` runs every expert on every token and masks by the combine
      weights (E/k times the useful FLOPs; simplest, fine for tiny shapes);
      ``'ragged'`` sorts assignments by expert and uses ``jax.lax.ragged_dot``
      (ideal where ragged_dot has a grouped kernel; XLA:GPU lowers it
      densely, in jax 0.10.2 and 0.12.1 alike: docs/guides/throughput.md);
      ``'blocked'`` pads each expert's
      group to ``moe_block_size`` rows and scans over blocks, gathering one
      expert's weights per block (bounded memory on GPU, and the fastest of
      the three on CPU for ``small``); ``'expert_parallel'`` sends each token
      to the devices that hold its experts with ``all_to_all`` on a mesh with
      an ``expert`` axis, computing each expert where it lives
      (``models/expert_parallel.py``; locally without such a mesh).
    moe_block_size: Rows per block for ``moe_impl='blocked'`` and
      ``'expert_parallel'``; ``0`` sizes the blocks to the batch
      (:func:`models.grouped.auto_block_size`: the largest power of two whose
      padding bound, ``E`` blocks' worth, is at most an eighth of the rows).
    lb_loss_coef: Weight of the Switch/GShard load-balancing loss.
    z_loss_coef: Weight of the ST-MoE router z-loss.
    remat: Rematerialise each layer in the backward pass (``nnx.remat``).
    loss_chunk_size: If > 0, the cross-entropy computes float32 logits this
      many tokens at a time (forward and backward), never holding the whole
      ``[B*T, V]`` logits; 0 computes them in one piece.
    attention_impl: ``implementation`` passed to
      ``jax.nn.dot_product_attention`` (None lets JAX choose).
  """

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_experts: int
  top_k: int
  d_ff: int
  max_seq_len: int
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-6
  param_dtype: Any = jnp.float32
  compute_dtype: Any = jnp.bfloat16
  moe_impl: str = 'ragged'
  moe_block_size: int = 256
  lb_loss_coef: float = 0.01
  z_loss_coef: float = 1e-3
  remat: bool = True
  loss_chunk_size: int = 0
  attention_impl: str | None = None

  def __post_init__(self):
    # Accept 'bfloat16' etc. from command lines; store canonical np.dtype so
    # the config stays hashable and compares equal however it was spelled.
    for name in ('param_dtype', 'compute_dtype'):
      object.__setattr__(self, name, np.dtype(jnp.dtype(getattr(self, name))))
    if self.d_model % self.num_heads:
      raise ValueError(
          f'd_model={self.d_model} is not divisible by'
          f' num_heads={self.num_heads}')
    if self.head_dim % 2:
      raise ValueError(f'RoPE needs an even head_dim, got {self.head_dim}')
    if not 1 <= self.top_k <= self.num_experts:
      raise ValueError(
          f'top_k={self.top_k} must be in [1, num_experts={self.num_experts}]')
    if self.moe_impl not in MOE_IMPLS:
      raise ValueError(
          f'moe_impl={self.moe_impl!r} is not one of {MOE_IMPLS}')
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(
          f'attention_impl={self.attention_impl!r} is not one of'
          f' {ATTENTION_IMPLS}')
    if self.loss_chunk_size < 0:
      raise ValueError(f'loss_chunk_size must be >= 0, got {self.loss_chunk_size}')
    if self.moe_block_size < 0:
      raise ValueError(
          f'moe_block_size must be >= 0 (0: sized to the batch), got {self.moe_block_size}')

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


PRESETS_DIR = pathlib.Path(__file__).resolve().parent / 'presets'


def load_preset_file(path: str | os.PathLike) -> ModelConfig:
  """The :class:`ModelConfig` of a preset file: its ``[model]`` table, every key a field.

  A preset file is also a training configuration file (the ``[model]``
  table of ``experiments.training.config.load_config_file``), so copying one
  and changing a key is how to describe a new shape.

  Raises:
    ValueError: naming the file, for a missing ``[model]`` table or a key
      that is not a :class:`ModelConfig` field.

  Example:
    >>> load_preset_file(PRESETS_DIR / 'tiny.toml').d_model
    32
  """
  path = pathlib.Path(path)
  with open(path, 'rb') as f:
    table = tomllib.load(f).get('model')
  if not isinstance(table, dict):
    raise ValueError(f'{path}: no [model] table')
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(table) - fields)
  if unknown:
    raise ValueError(f'{path}: unknown [model] keys {unknown}; the fields are {sorted(fields)}')
  return ModelConfig(**table)


def _expert_bank_size(config: ModelConfig) -> int:
  return config.num_layers * config.num_experts * config.d_model * config.d_ff


# The named presets, one file each in models/presets/ (the file's stem is the
# name), smallest first (the order ``--help`` lists them in).
PRESETS: dict[str, ModelConfig] = dict(sorted(
    ((path.stem, load_preset_file(path)) for path in PRESETS_DIR.glob('*.toml')),
    key=lambda item: _expert_bank_size(item[1])))


def get_preset(name: str, **overrides: Any) -> ModelConfig:
  """Returns preset ``name`` with ``overrides`` applied.

  Args:
    name: A key of ``PRESETS``.
    **overrides: ``ModelConfig`` fields to replace.

  Raises:
    ValueError: if ``name`` is unknown or an override is not a field.
  """
  if name not in PRESETS:
    raise ValueError(
        f'Unknown model preset {name!r}; known presets: {sorted(PRESETS)}')
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(
        f'Unknown ModelConfig field(s) {unknown}; fields: {sorted(fields)}')
  return dataclasses.replace(PRESETS[name], **overrides)
