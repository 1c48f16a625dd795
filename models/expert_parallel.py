"""Expert parallelism: tokens travel to the devices that hold their experts.

``moe_impl='expert_parallel'``. On a mesh with an ``expert`` axis of size
``n`` (set as the context mesh, ``jax.set_mesh``), each device holds
``E_loc = E / n`` experts and ``1 / (data · n)`` of the tokens (the batch is
split over both mesh axes). Under ``jax.shard_map``, per device:

1. **dispatch**: each of its ``N = T_loc · k`` assignments ``(t, j)`` goes to
   device ``d = e_tj // E_loc`` as local expert ``e_tj mod E_loc``; the
   assignments for ``d`` fill row block ``d`` of a send buffer
   ``[n, N, D]`` in token order (``N`` rows per destination is the worst
   case, so no token is ever dropped);
2. ``all_to_all`` over ``expert`` (a fixed-size collective: XLA:CPU has no
   ``ragged_all_to_all``): device ``d`` receives ``[n, N, D]``, the rows every
   device sent it;
3. **compute**: :func:`grouped_swiglu` runs the received rows through the
   local experts in single-expert blocks, skipping blocks that hold only
   padding (``lax.cond``), so a device computes its experts' tokens and not
   the buffer's empty rows;
4. ``all_to_all`` back, then each assignment's output is read from the row it
   was sent to and combined with its routing weight, exactly as the
   single-device lowerings do (dropless, exact).

Expert weights never move (their gradients are summed over ``data``, where
they are replicated, by ``shard_map``'s transpose). Without a mesh, or with
an ``expert`` axis of size 1, the same grouped computation runs locally.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from models import grouped

EXPERT_AXIS = 'expert'
TOKEN_AXES = ('data', 'expert')  # the mesh axes the tokens are split over


def grouped_swiglu(x_ND, group_N, w_gate, w_up, w_down, *, block_size: int):
  """``y_n = SwiGLU_{group_n}(x_n)`` per row; rows with ``group_n >= E`` give 0.

  Rows are sorted by group and each group padded to whole blocks of
  ``block_size`` rows (``0``: :func:`models.grouped.auto_block_size` of the
  rows); a scan over the ``N // block_size + E`` blocks (enough for any
  grouping) runs one expert per block (:func:`models.grouped.scan_blocks`)
  and skips, by ``lax.cond``, the blocks that hold no row, so the work
  follows the real rows.
  """
  n, D = x_ND.shape
  num_groups = w_gate.shape[0]
  block_size = grouped.resolve_block_size(block_size, n, num_groups)
  num_blocks = n // block_size + num_groups
  order_N = jnp.argsort(group_N, stable=True)  # out-of-range rows sort last
  sorted_group_N = group_N[order_N]
  group_sizes_E = jnp.bincount(group_N, length=num_groups).astype(jnp.int32)
  padded_start_E, _, block_group_B = grouped.block_layout(
      group_sizes_E, block_size, num_blocks)
  group_start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
  valid_N = sorted_group_N < num_groups
  safe_group_N = jnp.minimum(sorted_group_N, num_groups - 1)
  # Padded row of each sorted row; rows outside every group go past the end.
  capacity = num_blocks * block_size
  row_N = jnp.where(valid_N, padded_start_E[safe_group_N] + jnp.arange(n)
                    - group_start_E[safe_group_N], capacity)
  src_P = jnp.full((capacity + 1,), n, jnp.int32).at[row_N].set(order_N)[:capacity]
  x_PD = jnp.concatenate([x_ND, jnp.zeros((1, D), x_ND.dtype)])[src_P]
  y_PD = grouped.scan_blocks(x_PD, block_group_B, w_gate, w_up, w_down,
                             block_size=block_size, real_B=block_group_B < num_groups)
  y_PD = jnp.concatenate([y_PD, jnp.zeros((1, D), y_PD.dtype)])
  row_of_input_N = jnp.zeros_like(row_N).at[order_N].set(row_N)
  return y_PD[row_of_input_N]


def _dispatch_slots(dest_N: jax.Array, num_devices: int):
  """Each assignment's position among those going to the same device (token order)."""
  one_hot_ND = jax.nn.one_hot(dest_N, num_devices, dtype=jnp.int32)
  return jnp.sum((jnp.cumsum(one_hot_ND, axis=0) - 1) * one_hot_ND, axis=1)


def dispatch(x_TD, experts_TK, *, local_experts: int, num_devices: int):
  """Sends each assignment's token to the device of its expert (inside ``shard_map``).

  Returns:
    ``(recv_xd, recv_e, dest_N, slot_N)``: the rows this device received
    from each device ``[n, N, D]``, their local expert ids ``[n, N]``
    (``local_experts`` marks an empty row), and where each of this device's
    assignments was sent (device, row), to read its output back.
  """
  T, K = experts_TK.shape
  D = x_TD.shape[-1]
  n = T * K
  expert_N = experts_TK.reshape(-1)
  dest_N = expert_N // local_experts
  slot_N = _dispatch_slots(dest_N, num_devices)
  x_ND = x_TD[jnp.arange(n) // K]
  send_xd = jnp.zeros((num_devices, n, D), x_TD.dtype).at[dest_N, slot_N].set(x_ND)
  send_e = jnp.full((num_devices, n), local_experts, jnp.int32).at[dest_N, slot_N].set(
      expert_N % local_experts)
  if num_devices > 1:
    send_xd = jax.lax.all_to_all(send_xd, EXPERT_AXIS, 0, 0)
    send_e = jax.lax.all_to_all(send_e, EXPERT_AXIS, 0, 0)
  return send_xd, send_e, dest_N, slot_N


def _local_experts(x_TD, weights_TK, experts_TK, w_gate, w_up, w_down, *, block_size,
                   num_devices: int):
  """One device's part (inside ``shard_map``; see the module docstring)."""
  T, K = experts_TK.shape
  D = x_TD.shape[-1]
  # In the backward pass, the weights' gradients (summed over `data` at the
  # shard_map boundary) then wait for the dispatch's transposed all_to_all:
  # every device issues the collectives in the same order (XLA:CPU runs
  # independent collectives concurrently and can deadlock otherwise).
  x_TD, w_gate, w_up, w_down = jax.lax.optimization_barrier((x_TD, w_gate, w_up, w_down))
  recv_xd, recv_e, dest_N, slot_N = dispatch(
      x_TD, experts_TK, local_experts=w_gate.shape[0], num_devices=num_devices)
  # Sized to the rows a device receives on average (its own T·k), not to the
  # worst-case receive buffer (n times that).
  block_size = grouped.resolve_block_size(block_size, T * K, w_gate.shape[0])
  y_RD = grouped_swiglu(recv_xd.reshape(-1, D), recv_e.reshape(-1),
                        w_gate, w_up, w_down, block_size=block_size)
  y_xd = y_RD.reshape(recv_xd.shape)
  if num_devices > 1:
    y_xd = jax.lax.all_to_all(y_xd, EXPERT_AXIS, 0, 0)
  y_TKD = y_xd[dest_N, slot_N].reshape(T, K, D)
  y_TD = jnp.einsum('tkd,tk->td', y_TKD, weights_TK.astype(y_TKD.dtype),
                    preferred_element_type=jnp.float32)
  return y_TD.astype(x_TD.dtype)


def experts_expert_parallel(x_TD, weights_TK, experts_TK, w_gate, w_up, w_down, *,
                            block_size: int = 0, **_):
  """The expert computation of ``moe_impl='expert_parallel'`` (module docstring).

  Same contract as ``models.moe.EXPERT_IMPLS``: ``y_TD = Σ_j w_tj ·
  SwiGLU_{e_tj}(x_t)``. Uses the context mesh (``jax.set_mesh``); without an
  ``expert`` axis it computes locally.
  """
  mesh = jax.sharding.get_abstract_mesh()
  num_devices = (mesh.shape.get(EXPERT_AXIS, 1)
                 if mesh is not None and not mesh.empty else 1)
  if num_devices == 1:
    return _local_experts(x_TD, weights_TK, experts_TK, w_gate, w_up, w_down,
                          block_size=block_size, num_devices=1)
  if w_gate.shape[0] % num_devices:
    raise ValueError(f'{w_gate.shape[0]} experts do not divide over the mesh axis '
                     f'{EXPERT_AXIS!r} of size {num_devices}')
  token_axes = tuple(a for a in TOKEN_AXES if a in mesh.axis_names)
  tokens = P(token_axes, None)
  banks = P(EXPERT_AXIS, None, None)
  local = jax.shard_map(
      lambda *args: _local_experts(*args, block_size=block_size, num_devices=num_devices),
      in_specs=(tokens, tokens, tokens, banks, banks, banks), out_specs=tokens)
  return local(x_TD, weights_TK, experts_TK, w_gate, w_up, w_down)
