"""Jitted updates of the recommended optimizers on trees a new user brings, run by
tests/skewadam_jax/test_no_hang.py in a subprocess with a timeout.

On jaxlib 0.10.2 the first jitted ``skewadam_orthogonal`` update of a tree with
several unscanned expert banks never returned on XLA:CPU: every batched LAPACK
QR of the low-rank expert momentum waited on the intra-op thread pool that the
others held (``docs/development.md``, "The batched-QR deadlock on XLA:CPU").
A deadlock cannot fail an assertion, only a clock, so each case runs here and
the test kills this process when it overruns. It prints one line a case,
``CASE seconds``, as each finishes, so a hang names the case it stopped in.
Runs without the suite's XLA flags (the defaults a user compiles with).
Standalone: ``python tests/_no_hang_worker.py``.
"""

import functools
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import skewadam_jax as sa  # noqa: E402  (first: a quiet JAX start)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from skewadam_jax import encodings  # noqa: E402


def user_tree():
  """The tree of #81: a 2-block Flax NNX MoE with names of its own, no flax needed."""
  def block():
    return {"attn": {"qkv": {"kernel": jnp.zeros((64, 192))},
                     "out": {"kernel": jnp.zeros((64, 64))}},
            "norm1": {"scale": jnp.ones((64,)), "bias": jnp.zeros((64,))},
            "norm2": {"scale": jnp.ones((64,)), "bias": jnp.zeros((64,))},
            "moe": {"gate": jnp.zeros((64, 4)), "wi": jnp.zeros((4, 64, 128)),
                    "wo": jnp.zeros((4, 128, 64))}}
  return {"tok": {"embedding": jnp.zeros((147, 64))}, "pos": jnp.zeros((64, 64)),
          "blocks": {"0": block(), "1": block()},
          "readout": {"kernel": jnp.zeros((64, 147)), "bias": jnp.zeros((147,))}}


USER_LABELS = functools.partial(sa.moe_param_labels, router=r"moe/gate$", expert=r"moe/w[io]$")


def four_banks_tree():
  """Four unscanned layers, each with its own expert banks and router (default names)."""
  return {"embed": jnp.zeros((97, 32)),
          **{f"l{i}": {"experts": {"wi": jnp.zeros((4, 32, 64)), "wo": jnp.zeros((4, 64, 32))},
                       "router": jnp.zeros((32, 4))} for i in range(4)},
          "unembed": jnp.zeros((32, 97))}


CASES = {
    "user-tree/skewadam_orthogonal": (
        user_tree, lambda: sa.skewadam_orthogonal(1.5e-2, param_labels=USER_LABELS)),
    "user-tree/skewadam_orthogonal/leaf-by-leaf": (
        user_tree, lambda: sa.skewadam_orthogonal(1.5e-2, param_labels=USER_LABELS,
                                                  group_leaves=False)),
    "four-banks/skewadam_orthogonal": (four_banks_tree, lambda: sa.skewadam_orthogonal(1.5e-2)),
    "four-banks/skewadam_orthogonal/leaf-by-leaf": (
        four_banks_tree, lambda: sa.skewadam_orthogonal(1.5e-2, group_leaves=False)),
    "four-banks/skewadam": (four_banks_tree, lambda: sa.skewadam(1e-3)),
}


def many_batched_qrs() -> float:
  """The smallest program that deadlocked jaxlib 0.10.2 on 2 cores, through the library's QR:
  32 batched QRs of ``[8, 64, 32]`` in one jit."""
  xs = [jax.random.normal(jax.random.key(i), (8, 64, 32)) for i in range(32)]
  start = time.perf_counter()
  jax.block_until_ready(jax.jit(lambda xs: [encodings.orthonormal_columns(2.0 * x)
                                            for x in xs])(xs))
  return time.perf_counter() - start


def run(name: str) -> float:
  if name == "many-batched-qrs":
    return many_batched_qrs()
  make_tree, make_tx = CASES[name]
  params = make_tree()
  tx = make_tx()
  state = tx.init(params)
  grads = jax.tree.map(lambda x: 0.01 * jnp.ones_like(x), params)
  update = jax.jit(tx.update)
  start = time.perf_counter()
  for _ in range(2):
    updates, state = update(grads, state, params)
    jax.block_until_ready((updates, state))
  return time.perf_counter() - start


if __name__ == "__main__":
  for case in sys.argv[1:] or ["many-batched-qrs", *CASES]:
    print(f"{case} {run(case):.2f}", flush=True)
