"""Stochastic rounding for applying updates to bfloat16 parameters.

With bf16 parameters and no fp32 master copy, ``optax.apply_updates`` computes
``p + u`` and rounds it to the nearest bf16. bf16 keeps 8 significant bits, so
an update smaller than half a unit in the last place (2⁻⁹·|p| to 2⁻⁸·|p|
depending on where ``p`` sits in its binade; 0.0039 for ``p = 1``) is lost
entirely, every step: norm scales near 1 and large weights stop training.

Stochastic rounding (SR) rounds ``x = p + u`` (computed in fp32) up or down to
one of its two bf16 neighbours ``lo ≤ x ≤ hi`` with

    P(hi) = (x − lo) / (hi − lo),        so  E[SR(x)] = x  exactly,

and a tiny update moves the parameter by one bf16 step with a small
probability instead of never. The implementation is the usual bit trick: a
bf16 number is the upper 16 bits of an fp32 number, and the lower 16 bits of
``x``'s fp32 pattern are exactly ``(x − lo) / (hi − lo)`` in units of 2⁻¹⁶
(the fp32 grid is uniform between two bf16 neighbours, also across a binade
boundary and for subnormals). Adding 16 uniform random bits to the pattern
carries into the upper half with that probability; truncating the lower half
then gives ``lo`` or ``hi``. The sign is a separate bit, so the magnitude is
rounded and the rule holds for negative values too.

Examples:
  >>> import jax, jax.numpy as jnp
  >>> import skewadam_jax
  >>> params = {"w": jnp.ones((4,), jnp.bfloat16), "b": jnp.zeros((4,))}
  >>> updates = {"w": jnp.full((4,), 1e-3), "b": jnp.full((4,), 1e-3)}
  >>> new = skewadam_jax.apply_updates_stochastic(
  ...     params, updates, jax.random.key(0))
  >>> new["w"].dtype, new["b"].dtype
  (dtype(bfloat16), dtype('float32'))
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from skewadam_jax import _explicit

_LOW_BITS = 16  # fp32 has 16 more mantissa bits than bf16.
_HIGH_MASK = np.uint32(0xFFFF0000)  # numpy: no device work at import


def stochastic_round_to_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
  """Rounds ``x`` to bfloat16 up or down at random, unbiased.

  Args:
    x: values to round; computed and rounded as float32.
    key: a PRNG key (``jax.random.key`` or ``jax.random.PRNGKey``).

  Returns:
    A bfloat16 array of ``x``'s shape. Each element is one of the two bf16
    neighbours of ``float32(x)``, the upper one with probability
    ``(x − lo) / (hi − lo)``; values that are already bf16, infinities and
    NaNs are returned unchanged (as bf16). Values above the largest bf16
    round to it or to ``±inf``, as their neighbours are.
  """
  x32 = jnp.asarray(x, jnp.float32)
  return _round_with(x32, jax.random.bits(key, x32.shape, jnp.uint32))


def _round_with(x32: jax.Array, random_bits: jax.Array) -> jax.Array:
  """``x32`` rounded to bf16 by adding the top 16 of ``random_bits`` to its low half."""
  bits = jax.lax.bitcast_convert_type(x32, jnp.uint32)
  noise = random_bits >> (32 - _LOW_BITS)
  rounded = jax.lax.bitcast_convert_type((bits + noise) & _HIGH_MASK, jnp.float32)
  # A NaN whose payload sits in the low bits would truncate to ±inf: keep
  # non-finite values as they are. The cast below is exact for `rounded`.
  return jnp.where(jnp.isfinite(x32), rounded, x32).astype(jnp.bfloat16)


def _mix32(h: jax.Array) -> jax.Array:
  """MurmurHash3's 32-bit finaliser: every input bit flips each output bit with p ≈ 1/2."""
  h = h ^ (h >> 16)
  h = h * np.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * np.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _position(shape: tuple[int, ...]) -> jax.Array:
  """Each entry's row-major index within its last two axes (mod 2³²), computed in
  place by XLA, never stored. Leading (batch) axes are left out, so a matrix
  draws the same bits alone, in a stack, or in a slice of one."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(max(0, len(shape) - 2), len(shape))):
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * np.uint32(stride % 2**32)
    stride *= shape[axis]
  return index


def stochastic_round_to_bf16_hashed(x: jax.Array, salt) -> jax.Array:
  """:func:`stochastic_round_to_bf16` with its random bits hashed from ``(x, position, salt)``.

  For rounding inside an optimizer's update, which holds no PRNG key: the bits
  are MurmurHash3's finaliser of ``x``'s upper 16 bits (its two bf16
  neighbours, not where ``x`` lies between them, so the draw is independent
  of the fraction it rounds and a last-bit difference in ``x`` rarely
  changes the result), the entry's position within the last two axes (so
  stacking or slicing batch axes draws the same bits) and ``salt`` (the
  step count). A call is a pure function (a resumed run rounds as an
  uninterrupted one) and no random array is drawn or stored. Unbiased as :func:`stochastic_round_to_bf16`
  is, to the hash's uniformity: over 10⁶ draws the mean rounding error is
  within 0.3 % of a bf16 step (``tests/skewadam_jax/test_rounding.py``).

  Args:
    x: values to round (as float32).
    salt: an integer scalar (array or Python int) mixed into the bits; a new
      one each step.

  Returns:
    A bfloat16 array of ``x``'s shape.

  Examples:
    >>> import jax.numpy as jnp
    >>> from skewadam_jax import rounding
    >>> x = jnp.full((4096,), 1.0 + 2.0**-9)   # a quarter of the way to the next bf16
    >>> up = rounding.stochastic_round_to_bf16_hashed(x, 7) > 1
    >>> 0.2 < float(up.mean()) < 0.3
    True
  """
  x32 = jnp.asarray(x, jnp.float32)
  upper = jax.lax.bitcast_convert_type(x32, jnp.uint32) & _HIGH_MASK
  salt = jnp.asarray(np.uint32(salt % 2**32) if isinstance(salt, int) else salt)
  salt = salt.astype(jnp.uint32) * np.uint32(0x9E3779B9)
  if _explicit.explicit_spec(x32) is not None:
    # An explicitly sharded array cannot meet a replicated index array;
    # equal values then round alike within a step, still unbiased over steps.
    return _round_with(x32, _mix32(upper ^ _mix32(salt)))
  return _round_with(x32, _mix32(upper ^ _mix32(_position(x32.shape) + salt)))


def uniform_hashed(x: jax.Array, salt, stream: int = 0) -> jax.Array:
  """Uniform numbers in ``[0, 1)`` of ``x``'s shape, hashed from each entry's
  position and ``(salt, stream)``: the noise of a stochastic rounding
  ``floor(x + u)`` inside an optimizer's update, which holds no PRNG key.

  As :func:`stochastic_round_to_bf16_hashed`: positions are counted within the
  last two axes (a matrix draws the same numbers alone or in a stack), a call
  is a pure function (a resumed run draws as an uninterrupted one) and nothing
  random is stored. ``stream`` separates two draws of one step. Under explicit
  sharding the position is replaced by ``x``'s upper 16 bits, as in
  :func:`stochastic_round_to_bf16_hashed` (an explicitly sharded array cannot
  meet a replicated index array): for a given ``x`` the numbers are still
  uniform over salts, so ``floor(x + u)`` stays unbiased, and entries of
  different sizes draw apart within a step.

  Args:
    x: the array whose shape (and, under explicit sharding, upper bits)
      the numbers follow.
    salt: an integer scalar (array or Python int); a new one each step.
    stream: a small int telling apart the draws made with one salt.

  Returns:
    A float32 array of ``x``'s shape, multiples of 2⁻²⁴ in ``[0, 1)``.

  Examples:
    >>> import jax.numpy as jnp
    >>> from skewadam_jax import rounding
    >>> x = jnp.full((4096,), 2.25)   # a quarter of the way to 3
    >>> up = jnp.floor(x + rounding.uniform_hashed(x, 7)) == 3
    >>> 0.2 < float(up.mean()) < 0.3
    True
  """
  x32 = jnp.asarray(x, jnp.float32)
  salt = jnp.asarray(np.uint32(salt % 2**32) if isinstance(salt, int) else salt)
  salt = salt.astype(jnp.uint32) * np.uint32(0x9E3779B9) + np.uint32(stream * 0x85EBCA77 % 2**32)
  if _explicit.explicit_spec(x32) is not None:
    upper = jax.lax.bitcast_convert_type(x32, jnp.uint32) & _HIGH_MASK
    bits = _mix32(upper ^ _mix32(salt))
  else:
    bits = _mix32(_mix32(_position(x32.shape) + salt) ^ salt)
  return (bits >> 8).astype(jnp.float32) * np.float32(2.0**-24)


def apply_updates_stochastic(params, updates, key: jax.Array):
  """Applies updates as ``optax.apply_updates``, rounding bf16 leaves stochastically.

  For a bfloat16 leaf, ``p + u`` is computed in float32 and rounded to bf16
  with :func:`stochastic_round_to_bf16`, so that ``E[new p] = p + u`` and
  updates below bf16's resolution still move the parameter on average. Every
  other leaf (fp32, fp16, ...) is updated exactly as by
  ``optax.apply_updates``: ``(p + u).astype(p.dtype)``. ``None`` leaves stay
  ``None``.

  Each bf16 leaf draws its own random bits from ``key``; use a new key every
  step (e.g. ``jax.random.fold_in(key, step)``, which also makes a resumed run
  draw the same bits as an uninterrupted one).

  Args:
    params: a tree of parameters.
    updates: a tree of updates with the structure and shapes of ``params``.
    key: a PRNG key.

  Returns:
    The updated parameters, with the structure, shapes and dtypes of
    ``params``.

  Examples:
    >>> import jax, jax.numpy as jnp, optax
    >>> import skewadam_jax
    >>> params = {"w": jnp.ones((8, 4), jnp.bfloat16)}
    >>> tx = skewadam_jax.skewadam(1e-4)
    >>> state = tx.init(params)
    >>> grads = jax.tree.map(jnp.ones_like, params)
    >>> updates, state = tx.update(grads, state, params)
    >>> params = skewadam_jax.apply_updates_stochastic(
    ...     params, updates, jax.random.fold_in(jax.random.key(0), 0))
  """
  is_none = lambda x: x is None
  leaves, treedef = jax.tree.flatten(params, is_leaf=is_none)
  update_leaves = treedef.flatten_up_to(updates)
  keys = jax.random.split(key, max(1, len(leaves)))
  out = []
  for p, u, k in zip(leaves, update_leaves, keys):
    if p is None:
      out.append(None)
    elif jnp.asarray(p).dtype == jnp.bfloat16:
      out.append(stochastic_round_to_bf16(
          jnp.asarray(p, jnp.float32) + jnp.asarray(u, jnp.float32), k))
    else:
      out.append(optax.apply_updates(p, u))
  return jax.tree.unflatten(treedef, out)
