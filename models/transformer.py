"""Decoder-only Mixture-of-Experts transformer language model (Flax NNX).

  tokens_BT -> embed -> L x [x += attn(norm(x)); x += moe(norm(x))]
            -> norm -> unembed -> logits_BTV (float32)

The L blocks are created once with ``nnx.vmap`` so every parameter carries a
leading layer axis (``layers/moe/experts/w_up`` is [L, E, D, F]) and are run
with ``nnx.scan`` (one compiled block, whatever L), each optionally wrapped in
``nnx.remat`` so the backward pass stores only the residual stream between
layers. Parameters live in ``config.param_dtype``; matmuls run in
``config.compute_dtype``; norms, softmaxes, the router and the logits are
float32.

Example::

  model = Transformer(get_preset('tiny'), rngs=nnx.Rngs(0))
  logits_BTV, aux = model(tokens_BT)
  loss, metrics = lm_loss(model, tokens_BT, targets_BT)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models import axes
from models.config import ModelConfig
from models.moe import MoE

Array = jax.Array


class RMSNorm(nnx.Module):
  """Root-mean-square norm with a learned scale; statistics in float32."""

  def __init__(self, dim: int, *, eps: float, param_dtype):
    self.scale = axes.param_with_axes(jnp.ones((dim,), param_dtype), axes.EMBED)
    self.eps = eps

  def __call__(self, x: Array) -> Array:
    x32 = x.astype(jnp.float32)
    inv_rms = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
                            + self.eps)
    return (x32 * inv_rms * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float
                ) -> tuple[Array, Array]:
  """sin and cos of the rotary angles, each [T, head_dim // 2], float32."""
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  angles_TK = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq
  return jnp.sin(angles_TK), jnp.cos(angles_TK)


def apply_rope(x_BTHK: Array, sin_TK: Array, cos_TK: Array) -> Array:
  """Rotates the two halves of each head (GPT-NeoX / Llama layout)."""
  x1, x2 = jnp.split(x_BTHK.astype(jnp.float32), 2, axis=-1)
  sin, cos = sin_TK[:, None, :], cos_TK[:, None, :]  # Broadcast over heads.
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHK.dtype)


class Attention(nnx.Module):
  """Causal multi-head self-attention with RoPE; [D, D] projections, no bias."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    D = config.d_model
    init = nnx.initializers.lecun_normal()
    dense = lambda *names: nnx.Linear(
        D, D, use_bias=False, dtype=config.compute_dtype,
        param_dtype=config.param_dtype, kernel_init=axes.partitioned(init, *names),
        rngs=rngs)
    self.query, self.key, self.value = (dense(axes.EMBED, axes.HEADS) for _ in range(3))
    self.out = dense(axes.HEADS, axes.EMBED)
    self.num_heads = config.num_heads
    self.implementation = config.attention_impl

  def __call__(self, x_BTD: Array, sin_TK: Array, cos_TK: Array) -> Array:
    B, T, D = x_BTD.shape
    heads = lambda y: y.reshape(B, T, self.num_heads, D // self.num_heads)
    q_BTHK = apply_rope(heads(self.query(x_BTD)), sin_TK, cos_TK)
    k_BTHK = apply_rope(heads(self.key(x_BTD)), sin_TK, cos_TK)
    v_BTHK = heads(self.value(x_BTD))
    # Scores and softmax are float32 inside; 'cudnn' gives a fused kernel.
    o_BTHK = jax.nn.dot_product_attention(
        q_BTHK, k_BTHK, v_BTHK, is_causal=True,
        implementation=self.implementation)
    return self.out(o_BTHK.reshape(B, T, D))


class Block(nnx.Module):
  """Pre-norm block: attention then MoE feed-forward, both residual."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    norm = lambda: RMSNorm(config.d_model, eps=config.norm_eps,
                           param_dtype=config.param_dtype)
    self.attn_norm = norm()
    self.attn = Attention(config, rngs=rngs)
    self.moe_norm = norm()
    self.moe = MoE(config, rngs=rngs)

  def __call__(self, x_BTD, sin_TK, cos_TK):
    x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), sin_TK, cos_TK)
    y_BTD, aux = self.moe(self.moe_norm(x_BTD))
    return x_BTD + y_BTD, aux


# The layer stack's leading axis, added to every block parameter's logical axes.
_LAYER_AXIS = {nnx.PARTITION_NAME: axes.LAYERS}


def _block_step(x_BTD, block: Block, sin_TK, cos_TK):
  return block(x_BTD, sin_TK, cos_TK)


class Transformer(nnx.Module):
  """Decoder-only MoE language model with untied embeddings.

  Parameters (L leading axis from the layer stack)::

    embed/embedding                  [V, D]
    layers/attn_norm/scale           [L, D]
    layers/attn/{query,key,value,out}/kernel  [L, D, D]
    layers/moe_norm/scale            [L, D]
    layers/moe/router/kernel         [L, D, E]
    layers/moe/experts/w_gate, w_up  [L, E, D, F]
    layers/moe/experts/w_down        [L, E, F, D]
    final_norm/scale                 [D]
    unembed/kernel                   [D, V]
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = nnx.Embed(
        config.vocab_size, config.d_model, dtype=config.compute_dtype,
        param_dtype=config.param_dtype, rngs=rngs,
        embedding_init=axes.partitioned(
            nnx.initializers.variance_scaling(1.0, 'fan_in', 'normal', out_axis=0),
            axes.VOCAB, axes.EMBED))

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata=_LAYER_AXIS)
    def make_layers(rngs: nnx.Rngs) -> Block:
      return Block(config, rngs=rngs)

    self.layers = make_layers(rngs)
    self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps,
                              param_dtype=config.param_dtype)
    self.unembed = nnx.Linear(
        config.d_model, config.vocab_size, use_bias=False,
        dtype=config.compute_dtype, param_dtype=config.param_dtype,
        preferred_element_type=jnp.float32, rngs=rngs,
        kernel_init=axes.partitioned(nnx.initializers.lecun_normal(),
                                     axes.EMBED, axes.VOCAB))

  def embed_tokens(self, tokens_BT: Array) -> Array:
    """Token embeddings ``x_BTD`` in the compute dtype (the layer stack's input)."""
    return self.embed(tokens_BT).astype(self.config.compute_dtype)

  def rope(self, seq_len: int) -> tuple[Array, Array]:
    """The rotary tables ``(sin_TK, cos_TK)`` every block takes, for ``seq_len`` tokens."""
    cfg = self.config
    if seq_len > cfg.max_seq_len:
      raise ValueError(
          f'sequence length {seq_len} exceeds max_seq_len={cfg.max_seq_len}')
    return rope_tables(seq_len, cfg.head_dim, cfg.rope_theta)

  def features(self, tokens_BT: Array) -> tuple[Array, dict[str, Array]]:
    """Final-normed hidden states ``x_BTD`` (before the unembedding) and aux.

    See ``__call__`` for ``aux``.
    """
    sin_TK, cos_TK = self.rope(tokens_BT.shape[-1])
    x_BTD = self.embed_tokens(tokens_BT)
    step = nnx.remat(_block_step) if self.config.remat else _block_step
    x_BTD, aux_L = nnx.scan(
        step, in_axes=(nnx.Carry, 0, None, None), out_axes=(nnx.Carry, 0),
        transform_metadata=_LAYER_AXIS,
    )(x_BTD, self.layers, sin_TK, cos_TK)
    return self.final_norm(x_BTD), mean_aux(aux_L)

  def __call__(self, tokens_BT: Array) -> tuple[Array, dict[str, Array]]:
    """Runs the model.

    Args:
      tokens_BT: int token ids, [B, T] with T <= config.max_seq_len.

    Returns:
      ``(logits_BTV, aux)``: float32 logits, and float32 ``aux`` with
      ``lb_loss`` and ``z_loss`` averaged over layers (so their scale and the
      coefficients do not depend on depth; 1 and (log E)^2 for a uniform
      router) plus ``expert_fraction`` [L, E] (f_e per layer, for logging).
    """
    x_BTD, aux = self.features(tokens_BT)
    return self.unembed(x_BTD).astype(jnp.float32), aux


def token_cross_entropy(kernel_DV: Array, x_ND: Array, targets_N: Array,
                        compute_dtype) -> Array:
  """Per-token cross-entropy of ``targets_N`` under logits ``x_ND @ kernel_DV``.

  The matmul runs in ``compute_dtype`` and accumulates in float32, as the
  model's unembedding does; the logits are float32.
  """
  logits_NV = jnp.matmul(x_ND.astype(compute_dtype), kernel_DV.astype(compute_dtype),
                         preferred_element_type=jnp.float32)
  target_logit_N = jnp.take_along_axis(logits_NV, targets_N[:, None], axis=-1)[:, 0]
  return jax.nn.logsumexp(logits_NV, axis=-1) - target_logit_N


def chunked_cross_entropy(kernel_DV: Array, x_BTD: Array, targets_BT: Array,
                          chunk_size: int, compute_dtype) -> Array:
  """:func:`token_cross_entropy` ``[B, T]``, ``chunk_size`` tokens at a time.

  The float32 logits ``[B·T, V]`` are never held whole: a map over token
  chunks with a rematerialised body keeps one ``[chunk_size, V]`` block alive
  in the forward and in the backward pass. Tokens are padded to a whole number
  of chunks; the padding is dropped from the result.
  """
  B, T, D = x_BTD.shape
  n = B * T
  num_chunks = -(-n // chunk_size)
  pad = num_chunks * chunk_size - n
  x_CKD = jnp.pad(x_BTD.reshape(n, D), ((0, pad), (0, 0))).reshape(num_chunks, chunk_size, D)
  t_CK = jnp.pad(targets_BT.reshape(n), (0, pad)).reshape(num_chunks, chunk_size)
  chunk = jax.checkpoint(
      lambda xs: token_cross_entropy(kernel_DV, xs[0], xs[1], compute_dtype))
  ce_CK = jax.lax.map(chunk, (x_CKD, t_CK))
  return ce_CK.reshape(-1)[:n].reshape(B, T)


def mean_aux(aux_L: dict[str, Array]) -> dict[str, Array]:
  """The blocks' ``aux`` (leading layer axis) as the model reports it.

  ``lb_loss`` and ``z_loss`` are averaged over layers (so their scale and the
  coefficients do not depend on depth); for monitoring the routing of each
  layer, ``expert_fraction`` stays ``[L, E]`` and ``lb_loss_by_layer``,
  ``z_loss_by_layer`` are ``[L]`` (:data:`ROUTING_METRICS`).
  """
  return {
      'lb_loss': jnp.mean(aux_L['lb_loss']),
      'z_loss': jnp.mean(aux_L['z_loss']),
      'expert_fraction': aux_L['expert_fraction'],
      'lb_loss_by_layer': aux_L['lb_loss'],
      'z_loss_by_layer': aux_L['z_loss'],
  }


# The per-layer (non-scalar) entries of the model's metrics.
ROUTING_METRICS = ('expert_fraction', 'lb_loss_by_layer', 'z_loss_by_layer')


def lm_loss(model: Transformer, tokens_BT: Array, targets_BT: Array,
            weights_BT: Array | None = None) -> tuple[Array, dict[str, Array]]:
  """Next-token cross-entropy plus the weighted router losses.

  ``loss = CE + lb_loss_coef * lb_loss + z_loss_coef * z_loss``.

  Args:
    model: The transformer.
    tokens_BT: Input ids.
    targets_BT: Target ids (usually tokens shifted by one).
    weights_BT: Optional per-token weights (e.g. a padding mask); CE is the
      weighted mean. The router losses always cover every token.

  Returns:
    ``(loss, metrics)`` with float32 scalars ``loss``, ``ce_loss``,
    ``lb_loss``, ``z_loss``, and the per-layer :data:`ROUTING_METRICS`
    (``expert_fraction`` [L, E], ``lb_loss_by_layer`` and ``z_loss_by_layer`` [L]).
  """
  x_BTD, aux = model.features(tokens_BT)
  return loss_from_features(model, x_BTD, aux, targets_BT, weights_BT)


def loss_from_features(model: Transformer, x_BTD: Array, aux: dict[str, Array],
                       targets_BT: Array, weights_BT: Array | None = None
                       ) -> tuple[Array, dict[str, Array]]:
  """:func:`lm_loss` from the final-normed features and the averaged ``aux``.

  Uses only the unembedding of ``model`` (:func:`loss_from_unembedding`).
  """
  return loss_from_unembedding(model.config, model.unembed.kernel[...], x_BTD, aux,
                               targets_BT, weights_BT)


def loss_from_unembedding(cfg: ModelConfig, kernel_DV: Array, x_BTD: Array,
                          aux: dict[str, Array], targets_BT: Array,
                          weights_BT: Array | None = None) -> tuple[Array, dict[str, Array]]:
  """:func:`lm_loss` from the unembedding kernel, the final-normed features and ``aux``.

  A train step that runs the layer stack itself (:mod:`models.layerwise`)
  ends with it.
  """
  if cfg.loss_chunk_size and targets_BT.size > cfg.loss_chunk_size:
    ce_BT = chunked_cross_entropy(kernel_DV, x_BTD, targets_BT, cfg.loss_chunk_size,
                                  cfg.compute_dtype)
  else:
    B, T, D = x_BTD.shape
    ce_BT = token_cross_entropy(kernel_DV, x_BTD.reshape(B * T, D),
                                targets_BT.reshape(B * T), cfg.compute_dtype).reshape(B, T)
  if weights_BT is None:
    ce = jnp.mean(ce_BT)
  else:
    weights_BT = weights_BT.astype(jnp.float32)
    ce = jnp.sum(ce_BT * weights_BT) / jnp.maximum(jnp.sum(weights_BT), 1.0)
  loss = ce + cfg.lb_loss_coef * aux['lb_loss'] + cfg.z_loss_coef * aux['z_loss']
  metrics = {'loss': loss, 'ce_loss': ce, **aux}
  return loss, metrics


# --------------------------------------------------------------------------
# Parameter accounting (no allocation).
# --------------------------------------------------------------------------


def param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
  """Shapes of every parameter by '/'-joined path, via ``nnx.eval_shape``."""
  leaves = jax.tree_util.tree_flatten_with_path(abstract_params(config))[0]
  return {axes.path_to_str(p): tuple(leaf.shape) for p, leaf in leaves}


def abstract_params(config: ModelConfig):
  """The model's ``nnx.Param`` state from ``nnx.eval_shape``: shapes, dtypes
  and logical axes, nothing allocated."""
  abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
  return nnx.state(abstract, nnx.Param)


def count_params(config: ModelConfig) -> dict[str, int]:
  """Parameter counts without allocating: ``total`` and one per tier.

  Returns:
    ``{'total', 'backbone', 'expert', 'router'}`` (Python ints); each tier
    from the parameters' declared logical axes (:func:`models.axes.tier`).
  """
  params = abstract_params(config)
  names = axes.logical_axes(params)
  counts = {'total': 0, 'backbone': 0, 'expert': 0, 'router': 0}
  for path, shape in param_shapes(config).items():
    n = 1
    for s in shape:
      n *= s
    counts['total'] += n
    counts[axes.tier(names[path])] += n
  return counts
