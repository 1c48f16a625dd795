"""Grouped SwiGLU: each row through its own expert, in single-expert blocks of rows.

The dropless expert computation of ``moe_impl='blocked'`` and of
``'expert_parallel'`` (on each device). Rows sorted by expert are laid out
with each expert's group padded to whole blocks of ``b`` rows; a scan over
the blocks runs one expert's SwiGLU per block, gathering that expert's
weights:

  gate = x_b W_gate[e],  up = x_b W_up[e],  y_b = (silu(gate) * up) W_down[e]

Two choices make the work close to the useful work:

* **No recompute of the matmuls in the backward pass.** The scan body is
  checkpointed with a policy that saves ``gate`` and ``up`` (``[rows, F]``,
  the activations any SwiGLU keeps) and nothing else: the backward pass
  re-gathers the expert's weights (a copy, no FLOPs) instead of keeping
  ``3 · D · F`` gathered weights per block, and recomputes only the
  elementwise ``silu(gate) * up``. Per block the step then does the
  forward's 3 matmuls and the backward's 6, as a dense layer does.
* **Blocks sized to the batch** (:func:`auto_block_size`). The scan's length
  is static, ``rows // b + E`` blocks, enough for any routing: up to
  ``E · b`` rows of padding. A fixed ``b = 256`` doubled the expert FLOPs of
  ``moe-6.78b`` at one sequence (16,384 assignments, 64 experts);
  ``moe_block_size = 0`` picks the largest power-of-two ``b`` whose padding
  bound is at most an eighth of the rows.

Fewer FLOPs are not a faster step on a GPU here: XLA:GPU copies each block's
expert weights out of the bank and adds each block's weight gradient back in
place, so the step-time estimate prefers fewer, larger blocks despite their
padding, and the presets keep 256 rows (docs/guides/throughput.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# The static padding bound E * b may be at most this share of the rows.
PADDING_BUDGET = 1 / 8
MIN_AUTO_BLOCK = 16  # a tensor-core tile's rows
MAX_AUTO_BLOCK = 512

_SAVED = ('grouped_gate', 'grouped_up')
_SAVE_PROJECTIONS = jax.checkpoint_policies.save_only_these_names(*_SAVED)


def auto_block_size(rows: int, groups: int) -> int:
  """Rows per block for ``rows`` rows in ``groups`` groups (``moe_block_size = 0``).

  The largest power of two ``b`` in ``[16, 512]`` with ``groups · b <=
  rows / 8``: padding (at most ``groups · b`` rows) stays within an eighth of
  the work while blocks stay as large as that allows.

  Example:
    >>> auto_block_size(16_384, 64)   # moe-6.78b, one 2048-token sequence, top-8
    32
    >>> auto_block_size(11 * 16_384, 64)
    256
  """
  if rows < 1 or groups < 1:
    raise ValueError(f'auto_block_size needs rows >= 1 and groups >= 1, got {rows}, {groups}')
  block = MIN_AUTO_BLOCK
  while block < MAX_AUTO_BLOCK and groups * 2 * block <= rows * PADDING_BUDGET:
    block *= 2
  return block


def resolve_block_size(block_size: int, rows: int, groups: int) -> int:
  """``block_size`` itself if positive, else :func:`auto_block_size`."""
  return block_size if block_size > 0 else auto_block_size(rows, groups)


def block_layout(group_sizes_E: jax.Array, block_size: int, num_blocks: int):
  """Where each group's rows go when every group is padded to whole blocks.

  Returns:
    ``(padded_start_E, padded_end_E, block_group_B)``: the first padded row
    of each group, the end of each group's padded rows, and the group owning
    each of ``num_blocks`` blocks (blocks past the last group get ``E``).
  """
  padded_sizes_E = -(-group_sizes_E // block_size) * block_size
  padded_end_E = jnp.cumsum(padded_sizes_E)
  block_group_B = jnp.searchsorted(padded_end_E, jnp.arange(num_blocks) * block_size,
                                   side='right')
  return padded_end_E - padded_sizes_E, padded_end_E, block_group_B


def _swiglu(x_bD, w_gate_DF, w_up_DF, w_down_FD):
  gate = checkpoint_name(x_bD @ w_gate_DF, _SAVED[0])
  up = checkpoint_name(x_bD @ w_up_DF, _SAVED[1])
  return (jax.nn.silu(gate) * up) @ w_down_FD


def scan_blocks(x_PD, block_group_B, w_gate, w_up, w_down, *, block_size: int,
                real_B=None):
  """``y`` of each block of ``x_PD`` through its group's SwiGLU: ``[num_blocks · b, D]``.

  ``block_group_B`` holds each block's group, clipped to a valid one here;
  with ``real_B``, the blocks it marks False are skipped (``lax.cond``) and
  give zeros. The body saves only the two projections (module docstring).
  """
  num_groups = w_gate.shape[0]
  num_blocks = block_group_B.shape[0]
  D = x_PD.shape[-1]
  block_group_B = jnp.minimum(block_group_B, num_groups - 1)

  def body(carry, xs):
    x_bD, e, *real = xs
    ffn = lambda x: _swiglu(x, w_gate[e], w_up[e], w_down[e])
    if real:
      return carry, jax.lax.cond(real[0], ffn, jnp.zeros_like, x_bD)
    return carry, ffn(x_bD)

  xs = (x_PD.reshape(num_blocks, block_size, D), block_group_B)
  if real_B is not None:
    xs = xs + (real_B,)
  _, y_BbD = jax.lax.scan(
      jax.checkpoint(body, prevent_cse=False, policy=_SAVE_PROJECTIONS), None, xs)
  return y_BbD.reshape(num_blocks * block_size, D)
