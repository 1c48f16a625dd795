"""Every warning the library gives names the user's line, whatever wraps the call.

The library warns from inside ``init`` (leaf labels, guessed axes, a stalling
bf16 momentum, the alias's embedding patterns). A user reaches it through
``optax.chain``, ``optax.inject_hyperparams`` or a ``jax.jit`` trace; each
warning's filename must be this file (the call below), not the library's,
optax's or JAX's.
"""

import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import skewadam_jax as sa

NO_EXPERTS = {"w": jnp.zeros((4, 8))}
# Stacked [L, E, R, C] banks labelled by the user's own patterns: no axes declared.
STACKED = {"moe": {"experts": jnp.zeros((2, 3, 4, 8)), "gate": jnp.zeros((2, 4, 3))},
           "attn": jnp.zeros((2, 4, 8))}
NEAREST_BF16 = sa.TierConfig("bf16", momentum_rounding="nearest")

WARNINGS = {
    "labels": (lambda: sa.skewadam(1e-3), NO_EXPERTS, "found no expert and no router"),
    "guessed axes": (lambda: sa.skewadam(1e-3, param_labels=sa.moe_param_labels(
        None, router=r"gate", expert=r"experts")), STACKED, "guessed the matrix axes"),
    "bf16 momentum": (lambda: sa.skewadam(1e-3, b1=0.99, backbone=NEAREST_BF16),
                      NO_EXPERTS, "bf16 momentum at b1=0.99 can stall"),
    "embeddings": (lambda: sa.skewadam_orthogonal(1e-3), NO_EXPERTS,
                   "no parameter path matched the embedding patterns"),
}
WRAPPERS = {
    "direct": lambda make, params: make().init(params),
    "chain": lambda make, params: optax.chain(optax.clip_by_global_norm(1.0), make()).init(params),
    "jit": lambda make, params: jax.jit(make().init)(params),
    "inject_hyperparams": lambda make, params: optax.inject_hyperparams(
        lambda learning_rate: optax.chain(make(), optax.scale(learning_rate)))(
            learning_rate=1.0).init(params),
}


@pytest.mark.parametrize("wrapper", WRAPPERS)
@pytest.mark.parametrize("name", WARNINGS)
def test_the_warning_names_the_users_line(name, wrapper):
  make, params, match = WARNINGS[name]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    WRAPPERS[wrapper](make, params)
  ours = [w for w in caught if match in str(w.message)]
  assert ours, [str(w.message)[:80] for w in caught]
  for w in ours:
    assert w.filename == __file__, (w.filename, w.lineno)
