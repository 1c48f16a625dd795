"""The update inside the backward pass for a plain-JAX scanned MoE stack.

A residual stack of ``L`` soft-routed MoE blocks, written with ``jax.lax.scan``
over parameters stacked on axis 0, trained two ways from the same start:

* the standard step: ``jax.value_and_grad`` of the whole model, then
  ``optax.chain(clip_by_global_norm, tx)``;
* :func:`skewadam_jax.layerwise.layerwise_step`: each layer's update applied
  inside the backward pass, clipping by the exact global norm.

Each block returns its load-balancing term as ``aux``; the head adds their
mean to the loss, so the router's gradient flows through both paths. Run it::

    python examples/layerwise_plain_jax.py

It prints the largest parameter difference after 5 steps of SkewAdam (fp32
momentum in every tier, so only float round-off separates the two).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import skewadam_jax
from skewadam_jax.layerwise import layerwise_step

VOCAB, WIDTH, LAYERS, EXPERTS, BATCH, SEQ = 64, 16, 3, 4, 4, 8
CLIP = 0.05  # below the gradient norm at every step, so clipping is active
AUX_WEIGHT = 0.01


def init_params(seed: int = 0) -> dict:
  k = iter(jax.random.split(jax.random.key(seed), 4))
  normal = lambda shape, scale: jax.random.normal(next(k), shape) * scale
  return {"embed": normal((VOCAB, WIDTH), 1.0),
          "blocks": {"router": normal((LAYERS, WIDTH, EXPERTS), 0.3),
                     "experts": normal((LAYERS, EXPERTS, WIDTH, WIDTH), 0.3)},
          "unembed": normal((WIDTH, VOCAB), 0.3)}


def embed(params, batch):
  return params["embed"][batch["inputs"]]


def block(params, x, batch, layer):
  """One MoE block: softmax routing over all experts; ``aux``: its load-balancing term."""
  p = params["blocks"]
  gates = jax.nn.softmax(x @ p["router"], axis=-1)                   # [B, T, E]
  expert_out = jnp.tanh(jnp.einsum("btd,edf->btef", x, p["experts"]))
  y = x + jnp.einsum("bte,btef->btf", gates, expert_out)
  load = jnp.mean(gates, axis=(0, 1))
  return y, EXPERTS * jnp.sum(load * load)


def head(params, x, aux_per_layer, batch):
  logits = x @ params["unembed"]
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()
  loss = ce + AUX_WEIGHT * jnp.mean(aux_per_layer)
  return loss, {"loss": loss, "ce": ce}


def loss_fn(params, batch):
  """The same model as one function, for the standard step."""
  def scanned(x, layer):
    blocks = jax.tree.map(lambda a: a[layer], params["blocks"])
    return block({"blocks": blocks}, x, batch, layer)
  x, aux = jax.lax.scan(scanned, embed(params, batch), jnp.arange(LAYERS))
  return head(params, x, aux, batch)


def batches(steps: int, seed: int = 1):
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
    yield {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def optimizer():
  fp32 = {"momentum": "fp32"}
  return skewadam_jax.skewadam(3e-3, backbone=fp32, expert=fp32)


def compare(steps: int = 5) -> dict:
  """Trains both ways; returns the losses and the largest parameter difference."""
  tx = optimizer()
  standard_tx = optax.chain(optax.clip_by_global_norm(CLIP), tx)

  @jax.jit
  def standard_step(params, state, batch):
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, state = standard_tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, {**metrics,
                                                          "grad_norm": optax.tree.norm(grads)}

  engine = layerwise_step(tx, embed, block, head, stack="blocks", clip_norm=CLIP)
  inside_step = jax.jit(engine.step, donate_argnums=(0, 1))

  params_a = init_params()
  params_b = jax.tree.map(jnp.copy, params_a)
  state_a, state_b = standard_tx.init(params_a), engine.init(params_b)
  losses_a, losses_b, norms = [], [], []
  for batch in batches(steps):
    params_a, state_a, m_a = standard_step(params_a, state_a, batch)
    params_b, state_b, m_b = inside_step(params_b, state_b, batch)
    losses_a.append(float(m_a["loss"]))
    losses_b.append(float(m_b["loss"]))
    norms.append(float(m_a["grad_norm"]))
  diff = max(float(jnp.max(jnp.abs(a - b)))
             for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b)))
  return {"standard_losses": losses_a, "layerwise_losses": losses_b,
          "grad_norms": norms, "max_param_diff": diff}


def main() -> None:
  result = compare()
  print("loss, standard step:  ", " ".join(f"{x:.4f}" for x in result["standard_losses"]))
  print("loss, inside backward:", " ".join(f"{x:.4f}" for x in result["layerwise_losses"]))
  print(f"largest parameter difference after 5 steps: {result['max_param_diff']:.1e}")


if __name__ == "__main__":
  main()
