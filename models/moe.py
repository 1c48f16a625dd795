"""Mixture-of-Experts feed-forward layer: top-k router and stacked SwiGLU experts.

Routing, for token t with router logits z_t = x_t W_r (float32):

  p_t = softmax(z_t)                       # [E]
  S_t = top-k indices of p_t               # k experts
  w_tj = p_tj / sum_{i in S_t} p_ti        # combine weights, sum to 1
  y_t = sum_{j in S_t} w_tj * SwiGLU_j(x_t)

Renormalising over the selected experts (as Mixtral does) keeps the output
scale independent of how peaked the router is; the router still learns
through w (ratios among the chosen experts) and through the auxiliary losses
below, which see all of p_t. With top_k=1 the weight is always 1, so only the
auxiliary losses would train the router (Switch instead uses the raw p).

Auxiliary losses, over T tokens:

  load balancing (Switch / GShard):  E * sum_e f_e * P_e
      f_e = (# of the T*k assignments that go to e) / (T*k)   (no gradient)
      P_e = mean_t p_te
  router z-loss (ST-MoE):            mean_t logsumexp(z_t)^2

Both equal 1 and (log E)^2 respectively for a uniform router.

Every expert implementation is dropless (no capacity, no token dropping) and
exact; they differ only in how XLA sees the work, see ``ModelConfig.moe_impl``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models.axes import EMBED, EXPERTS, MLP, param_with_axes
from models.config import ModelConfig
from models import grouped
from models.expert_parallel import experts_expert_parallel

# Router in full float32: on GPUs the default f32 matmul may use TF32.
_ROUTER_PRECISION = jax.lax.Precision.HIGHEST


def _expert_init(fan_in_axis: int) -> nnx.Initializer:
  # The leading expert axis is a batch axis: each expert matrix gets its own
  # fan-in scaling, as if it were a separate nnx.Linear.
  return nnx.initializers.variance_scaling(
      1.0, 'fan_in', 'truncated_normal', in_axis=fan_in_axis, out_axis=-1,
      batch_axis=(0,))


# --------------------------------------------------------------------------
# Routing and auxiliary losses (pure functions).
# --------------------------------------------------------------------------


def route(logits_TE: jax.Array, top_k: int
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Top-k routing.

  Args:
    logits_TE: Router logits, float32.
    top_k: Number of experts per token.

  Returns:
    ``(weights_TK, experts_TK, probs_TE)``: combine weights (the top-k
    probabilities renormalised to sum to 1 per token), the chosen expert ids
    (int32, best first) and the full softmax probabilities.
  """
  probs_TE = jax.nn.softmax(logits_TE, axis=-1)
  top_probs_TK, experts_TK = jax.lax.top_k(probs_TE, top_k)
  weights_TK = top_probs_TK / jnp.sum(top_probs_TK, axis=-1, keepdims=True)
  return weights_TK, experts_TK.astype(jnp.int32), probs_TE


def expert_fraction(experts_TK: jax.Array, num_experts: int) -> jax.Array:
  """f_e: fraction of the T*k assignments routed to each expert, shape [E]."""
  counts_E = jnp.bincount(experts_TK.reshape(-1), length=num_experts)
  return counts_E.astype(jnp.float32) / experts_TK.size


def load_balancing_loss(probs_TE: jax.Array, experts_TK: jax.Array
                        ) -> jax.Array:
  """Switch/GShard auxiliary loss ``E * sum_e f_e * P_e`` (1 when balanced)."""
  num_experts = probs_TE.shape[-1]
  f_E = expert_fraction(experts_TK, num_experts)
  P_E = jnp.mean(probs_TE, axis=0)
  return num_experts * jnp.sum(f_E * P_E)


def router_z_loss(logits_TE: jax.Array) -> jax.Array:
  """ST-MoE router z-loss ``mean_t logsumexp(z_t)^2``."""
  return jnp.mean(jnp.square(jax.nn.logsumexp(logits_TE, axis=-1)))


# --------------------------------------------------------------------------
# Expert computation (pure functions, one per ``moe_impl``).
#
# All take x_TD, the combine weights and expert ids [T, k], and the stacked
# expert weights w_gate [E, D, F], w_up [E, D, F], w_down [E, F, D] already in
# the compute dtype; all return y_TD = sum_j w_tj SwiGLU_{e_tj}(x_t).
# --------------------------------------------------------------------------


def _combine(y_TKD: jax.Array, weights_TK: jax.Array) -> jax.Array:
  y_TD = jnp.einsum('tkd,tk->td', y_TKD, weights_TK.astype(y_TKD.dtype),
                    preferred_element_type=jnp.float32)
  return y_TD.astype(y_TKD.dtype)


def experts_dense(x_TD, weights_TK, experts_TK, w_gate, w_up, w_down, **_):
  """Every expert on every token, masked by the (mostly zero) weights [T, E].

  Exact: an unselected expert's output and its gradients are multiplied by 0.
  Costs E/k times the useful FLOPs and a [T, E, F] activation.
  """
  num_experts = w_gate.shape[0]
  # Dense combine weights; zeros for the experts a token was not routed to.
  weights_TE = jnp.einsum(
      'tk,tke->te', weights_TK,
      jax.nn.one_hot(experts_TK, num_experts, dtype=weights_TK.dtype))
  gate_TEF = jnp.einsum('td,edf->tef', x_TD, w_gate)
  up_TEF = jnp.einsum('td,edf->tef', x_TD, w_up)
  # Weighting before the (linear) down projection avoids a [T, E, D] tensor.
  h_TEF = jax.nn.silu(gate_TEF) * up_TEF * weights_TE.astype(x_TD.dtype)[..., None]
  y_TD = jnp.einsum('tef,efd->td', h_TEF, w_down,
                    preferred_element_type=jnp.float32)
  return y_TD.astype(x_TD.dtype)


def _sort_by_expert(experts_TK: jax.Array, num_experts: int):
  """Sorts the T*k assignments by expert id (stable, so token order is kept).

  Returns:
    order: [T*k] assignment index (t*k + j) of each sorted row.
    token: [T*k] token index of each sorted row.
    group_sizes: [E] int32 rows per expert.
  """
  flat_N = experts_TK.reshape(-1)
  order_N = jnp.argsort(flat_N, stable=True)
  token_N = order_N // experts_TK.shape[1]
  group_sizes_E = jnp.bincount(flat_N, length=num_experts).astype(jnp.int32)
  return order_N, token_N, group_sizes_E


def _inverse_permutation(perm_N: jax.Array) -> jax.Array:
  n = perm_N.shape[0]
  return jnp.zeros_like(perm_N).at[perm_N].set(jnp.arange(n, dtype=perm_N.dtype))


def experts_ragged(x_TD, weights_TK, experts_TK, w_gate, w_up, w_down, **_):
  """Sort assignments by expert and run grouped matmuls with ragged_dot."""
  T, K = experts_TK.shape
  order_N, token_N, group_sizes_E = _sort_by_expert(experts_TK, w_gate.shape[0])
  x_ND = x_TD[token_N]
  gate_NF = jax.lax.ragged_dot(x_ND, w_gate, group_sizes_E)
  up_NF = jax.lax.ragged_dot(x_ND, w_up, group_sizes_E)
  y_ND = jax.lax.ragged_dot(jax.nn.silu(gate_NF) * up_NF, w_down, group_sizes_E)
  # Unsort with a gather (its transpose is a cheap scatter-add).
  y_TKD = y_ND[_inverse_permutation(order_N)].reshape(T, K, -1)
  return _combine(y_TKD, weights_TK)


def experts_blocked(x_TD, weights_TK, experts_TK, w_gate, w_up, w_down, *,
                    block_size: int = 0, **_):
  """Sorted assignments in single-expert blocks, scanned (:mod:`models.grouped`).

  Each expert's group is padded to a multiple of ``block_size`` rows
  (``0``: :func:`models.grouped.auto_block_size` of the batch's ``T·k``
  assignments), so every block belongs to one expert whose weights are
  gathered inside the scan body. The body saves only its two projections
  for the backward pass, never the gathered weights: memory is
  O(activations) instead of O(E * T*k) (what XLA:GPU makes of ragged_dot)
  and no matmul is recomputed. Padding rows are zeros and contribute
  nothing to outputs or gradients. The static block count
  ``T*k // block_size + E`` bounds ``sum_e ceil(n_e / block_size)``.
  """
  T, K = experts_TK.shape
  num_experts, D, _ = w_gate.shape
  n = T * K
  block_size = grouped.resolve_block_size(block_size, n, num_experts)
  num_blocks = n // block_size + num_experts
  order_N, token_N, group_sizes_E = _sort_by_expert(experts_TK, num_experts)

  padded_start_E, _, block_expert_B = grouped.block_layout(
      group_sizes_E, block_size, num_blocks)
  group_start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
  expert_N = experts_TK.reshape(-1)[order_N]
  # Row of the padded buffer that holds each sorted assignment.
  row_N = padded_start_E[expert_N] + jnp.arange(n) - group_start_E[expert_N]

  # Padding rows read token T: an appended zero row.
  src_P = jnp.full((num_blocks * block_size,), T, jnp.int32).at[row_N].set(token_N)
  x_PD = jnp.concatenate([x_TD, jnp.zeros((1, D), x_TD.dtype)])[src_P]
  y_PD = grouped.scan_blocks(x_PD, block_expert_B, w_gate, w_up, w_down,
                             block_size=block_size)
  # Row of each assignment (t, j), in original order; one gather unsorts.
  row_of_assignment_N = jnp.zeros_like(row_N).at[order_N].set(row_N)
  y_TKD = y_PD[row_of_assignment_N].reshape(T, K, D)
  return _combine(y_TKD, weights_TK)


EXPERT_IMPLS: dict[str, Callable[..., jax.Array]] = {
    'dense': experts_dense,
    'ragged': experts_ragged,
    'blocked': experts_blocked,
    'expert_parallel': experts_expert_parallel,
}


# --------------------------------------------------------------------------
# Modules.
# --------------------------------------------------------------------------


class Router(nnx.Module):
  """Linear gate without bias; ``kernel`` has shape [D, E]."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.kernel = param_with_axes(init(
        rngs.params(), (config.d_model, config.num_experts),
        config.param_dtype), EMBED, EXPERTS)

  def __call__(self, x_TD: jax.Array) -> jax.Array:
    return jnp.dot(x_TD.astype(jnp.float32),
                   self.kernel[...].astype(jnp.float32),
                   precision=_ROUTER_PRECISION)


class Experts(nnx.Module):
  """E SwiGLU experts with stacked weights [E, d_in, d_out]."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    E, D, F = config.num_experts, config.d_model, config.d_ff
    dtype = config.param_dtype
    init = _expert_init(-2)
    self.w_gate = param_with_axes(init(rngs.params(), (E, D, F), dtype), EXPERTS, EMBED, MLP)
    self.w_up = param_with_axes(init(rngs.params(), (E, D, F), dtype), EXPERTS, EMBED, MLP)
    self.w_down = param_with_axes(init(rngs.params(), (E, F, D), dtype), EXPERTS, MLP, EMBED)
    self.impl = config.moe_impl
    self.block_size = config.moe_block_size
    self.compute_dtype = config.compute_dtype

  def __call__(self, x_TD, weights_TK, experts_TK):
    cast = lambda p: p[...].astype(self.compute_dtype)
    return EXPERT_IMPLS[self.impl](
        x_TD.astype(self.compute_dtype), weights_TK, experts_TK,
        cast(self.w_gate), cast(self.w_up), cast(self.w_down),
        block_size=self.block_size)


class MoE(nnx.Module):
  """Dropless top-k MoE feed-forward layer.

  Parameters: ``router/kernel`` [D, E], ``experts/w_gate`` [E, D, F],
  ``experts/w_up`` [E, D, F], ``experts/w_down`` [E, F, D].
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.top_k = config.top_k
    self.router = Router(config, rngs=rngs)
    self.experts = Experts(config, rngs=rngs)

  def __call__(self, x_BTD: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Applies the layer.

    Args:
      x_BTD: Input activations; any leading shape, last axis D.

    Returns:
      ``(y, aux)``: output in the compute dtype with the shape of ``x_BTD``,
      and float32 ``aux`` with scalars ``lb_loss``, ``z_loss`` and
      ``expert_fraction`` [E] (f_e, for logging).
    """
    x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
    logits_TE = self.router(x_TD)
    weights_TK, experts_TK, probs_TE = route(logits_TE, self.top_k)
    y_TD = self.experts(x_TD, weights_TK, experts_TK)
    aux = {
        'lb_loss': load_balancing_loss(probs_TE, experts_TK),
        'z_loss': router_z_loss(logits_TE),
        'expert_fraction': expert_fraction(experts_TK, probs_TE.shape[-1]),
    }
    return y_TD.reshape(x_BTD.shape[:-1] + y_TD.shape[-1:]), aux
