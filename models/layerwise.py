"""This project's :class:`~models.Transformer` as the three functions of a layerwise step.

:func:`skewadam_jax.layerwise.layerwise_step` updates each layer inside the
backward pass for any scanned model given as ``embed``, ``block`` and
``head``; this module is that adapter for our model: the token embedding,
one pre-norm MoE block (its ``lb_loss``, ``z_loss`` and ``expert_fraction``
as the block's ``aux``), and the final norm with the cross-entropy and the
weighted router losses (:func:`models.loss_from_unembedding`). The stack is
``layers`` on axis 0. The batch is a :class:`LMBatch`, whose rotary tables
are computed once per step, outside the scans.

Example:
  >>> import jax, jax.numpy as jnp, optax
  >>> from flax import nnx
  >>> import models
  >>> from models import layerwise
  >>> model = models.Transformer(models.get_preset("tiny"), rngs=nnx.Rngs(0))
  >>> graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  >>> engine = layerwise.layerwise_step(model, optax.adam(1e-3), clip_norm=1.0)
  >>> params = nnx.as_pure(params)
  >>> state = engine.init(params)
  >>> tokens = jnp.zeros((2, 9), jnp.int32)
  >>> batch = layerwise.lm_batch(model.config, tokens[:, :-1], tokens[:, 1:])
  >>> params, state, metrics = jax.jit(engine.step)(params, state, batch)
  >>> float(metrics["loss"]) > 0
  True
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models import axes as model_axes
from models.config import ModelConfig
from models.transformer import Transformer, loss_from_unembedding, mean_aux, rope_tables
from skewadam_jax import layerwise as engine_lib

STACK = model_axes.LAYERS  # the parameter tree's key of the layer stack


class LMBatch(NamedTuple):
  """One step's batch for the layerwise step: ids, targets and the rotary tables."""
  inputs: jax.Array
  targets: jax.Array
  sin_TK: jax.Array
  cos_TK: jax.Array


def lm_batch(config: ModelConfig, inputs, targets) -> LMBatch:
  """``inputs`` and ``targets`` ``[B, T]`` with the rotary tables for ``T`` tokens."""
  seq_len = inputs.shape[-1]
  if seq_len > config.max_seq_len:
    raise ValueError(f"sequence length {seq_len} exceeds max_seq_len={config.max_seq_len}")
  return LMBatch(inputs, targets, *rope_tables(seq_len, config.head_dim, config.rope_theta))


def lm_micro_batches(config: ModelConfig, inputs, targets, micro_batches: int) -> LMBatch:
  """``[K·b, T]`` ids and targets as ``K`` micro-batches stacked on a leading axis.

  Micro-batch ``k`` holds rows ``k, K + k, 2K + k, ...`` (as
  :func:`experiments.training.steps.accumulated_value_and_grad` splits a
  batch), each with the rotary tables: the ``batch`` of a layerwise step
  built with ``micro_batches=K``.

  Example:
    >>> import jax.numpy as jnp, models
    >>> ids = jnp.arange(12).reshape(6, 2)
    >>> lm_micro_batches(models.get_preset("tiny"), ids, ids, 3).inputs[1].tolist()
    [[2, 3], [8, 9]]
  """
  rows = inputs.shape[0]
  if rows % micro_batches:
    raise ValueError(f"a batch of {rows} sequences does not split into "
                     f"{micro_batches} micro-batches")
  split = lambda x: jnp.swapaxes(
      x.reshape(rows // micro_batches, micro_batches, *x.shape[1:]), 0, 1)
  one = lm_batch(config, inputs[:1], targets[:1])
  tile = lambda t: jnp.broadcast_to(t, (micro_batches, *t.shape))
  return LMBatch(split(inputs), split(targets), tile(one.sin_TK), tile(one.cos_TK))


def slice_axes(axes: Mapping[str, tuple]) -> dict[str, tuple]:
  """The logical axes an optimizer sees for one layer's slice.

  A parameter stacked over ``layers`` loses that leading axis; the others are
  unchanged. Build the layerwise step's optimizer from these, so its matrix
  axes and tiers describe the slice.

  Example:
    >>> slice_axes({"layers/moe/experts/w_up": ("layers", "experts", "embed", "mlp"),
    ...             "final_norm/scale": ("embed",)})
    {'layers/moe/experts/w_up': ('experts', 'embed', 'mlp'), 'final_norm/scale': ('embed',)}
  """
  return {p: tuple(n[1:]) if n and n[0] == STACK else tuple(n) for p, n in axes.items()}


def model_functions(model: Transformer):
  """``(embed, block, head)`` of ``model`` for :func:`skewadam_jax.layerwise.layerwise_step`.

  Only the module structure and the non-parameter state of ``model`` are
  used (an abstract model from ``nnx.eval_shape`` will do); the parameters
  come in through the functions' first argument.
  """
  config = model.config
  embed_def, _, embed_rest = nnx.split(model.embed, nnx.Param, ...)
  block_def, _, block_rest = nnx.split(model.layers, nnx.Param, ...)
  norm_def, _, norm_rest = nnx.split(model.final_norm, nnx.Param, ...)

  def embed(params, batch: LMBatch):
    token_embed = nnx.merge(embed_def, params["embed"], embed_rest)
    return token_embed(batch.inputs).astype(config.compute_dtype)

  def block(params, x_BTD, batch: LMBatch, layer):
    rest_l = jax.tree.map(lambda a: a[layer], block_rest)
    y_BTD, aux = nnx.merge(block_def, params[STACK], rest_l)(x_BTD, batch.sin_TK, batch.cos_TK)
    return y_BTD, aux

  def head(params, x_BTD, aux_L, batch: LMBatch):
    final_norm = nnx.merge(norm_def, params["final_norm"], norm_rest)
    return loss_from_unembedding(config, params["unembed"]["kernel"], final_norm(x_BTD),
                                 mean_aux(aux_L), batch.targets)

  return embed, block, head


def layerwise_step(model: Transformer, tx: optax.GradientTransformation,
                   **options: Any) -> engine_lib.LayerwiseStep:
  """The library's layerwise step for ``model`` (``options``: clip and skip settings).

  ``tx`` is the per-layer optimizer, built for :func:`slice_axes`.
  """
  return engine_lib.layerwise_step(tx, *model_functions(model), stack=STACK, layer_axis=0,
                                   **options)
