"""Text from a trained model: temperature and top-k sampling, one token at a time.

Each new token recomputes the model over a fixed window of the last ``window``
tokens (no KV cache): one jit-compiled function, compiled once per window
size, whose cost per token is one forward pass over ``window`` tokens, i.e.
about ``2 · active parameters · window`` FLOPs (``small`` with its 128-token
window: 1.2 GFLOP a token, milliseconds on a CPU; ``moe-6.78b`` with 2048:
about 4 TFLOP a token). Causal attention makes the padding after the last
real token irrelevant, so one shape serves every prompt length.

Sampling from logits ``z`` (float32) at temperature ``τ`` with top-k ``K``:
keep the ``K`` largest logits (all if ``K = 0``), then draw from
``softmax(z / τ)``; ``τ = 0`` takes the arg-max. The key of token ``i`` is
``fold_in(key(seed), i)``, so a seed gives the same text every time.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def sample_logits(logits_V: jax.Array, key: jax.Array, *, temperature: float,
                  top_k: int) -> jax.Array:
  """One token id from ``logits_V`` (see the module docstring).

  Example:
    >>> logits = jnp.array([0.0, 5.0, 1.0])
    >>> int(sample_logits(logits, jax.random.key(0), temperature=0.0, top_k=0))
    1
    >>> int(sample_logits(logits, jax.random.key(0), temperature=1.0, top_k=1))
    1
  """
  if temperature == 0:
    return jnp.argmax(logits_V).astype(jnp.int32)
  logits_V = logits_V.astype(jnp.float32)
  if top_k:
    kth = jax.lax.top_k(logits_V, top_k)[0][-1]
    logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
  return jax.random.categorical(key, logits_V / temperature).astype(jnp.int32)


def make_next_token(graphdef, rest, *, temperature: float = 1.0, top_k: int = 0):
  """``next_token(params, window_1T, length, key) -> id``: the token after
  ``window_1T[0, :length]`` (jitted; the window's shape fixes one compile)."""
  @jax.jit
  def next_token(params, window_1T, length, key):
    model = nnx.merge(graphdef, params, rest)
    x_1TD, _ = model.features(window_1T)
    x_D = jax.lax.dynamic_index_in_dim(x_1TD[0], length - 1, keepdims=False)
    kernel_DV = model.unembed.kernel[...]
    logits_V = jnp.matmul(x_D.astype(model.config.compute_dtype),
                          kernel_DV.astype(model.config.compute_dtype),
                          preferred_element_type=jnp.float32)
    return sample_logits(logits_V, key, temperature=temperature, top_k=top_k)
  return next_token


def generate(next_token, params, prompt_ids: Sequence[int], max_tokens: int, *,
             window: int, seed: int = 0) -> list[int]:
  """``max_tokens`` ids continuing ``prompt_ids`` (which must not be empty)."""
  if not len(prompt_ids):
    raise ValueError("the prompt encodes to no token")
  tokens = [int(t) for t in prompt_ids]
  key = jax.random.key(seed)
  out = []
  for i in range(max_tokens):
    context = tokens[-window:]
    buffer = np.zeros((1, window), np.int32)
    buffer[0, :len(context)] = context
    token = int(next_token(params, buffer, np.int32(len(context)), jax.random.fold_in(key, i)))
    tokens.append(token)
    out.append(token)
  return out


def continue_text(tokenizer, next_token, params, prompt: str, max_tokens: int, *,
                  window: int, seed: int = 0) -> str:
  """The text the model writes after ``prompt`` (decoded; the prompt not included)."""
  ids = tokenizer.encode(prompt).ids
  return tokenizer.decode(generate(next_token, params, ids, max_tokens, window=window,
                                   seed=seed))
