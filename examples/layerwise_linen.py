"""The update inside the backward pass for a Flax linen ``nn.scan`` stack, layer axis 1.

``nn.scan(Block, variable_axes={"params": 1})`` stacks every block parameter
on axis 1 (as MaxText's ``param_scan_axis=1`` does): a ``[D, F]`` kernel is
stored ``[D, L, F]``. :func:`skewadam_jax.layerwise.layerwise_step` takes that
as ``layer_axis=1``; the three functions apply the linen submodules to their
own parameters. Trained both ways (the standard step with
``optax.clip_by_global_norm`` and the layerwise step with exact clipping)
from the same start::

    python examples/layerwise_linen.py
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from skewadam_jax.layerwise import layerwise_step

VOCAB, WIDTH, HIDDEN, LAYERS, BATCH, SEQ = 64, 16, 32, 3, 4, 8
CLIP = 0.05


class Block(nn.Module):
  """A pre-norm residual MLP block (the scan's carry is the hidden state)."""

  @nn.compact
  def __call__(self, x, _):
    h = nn.Dense(HIDDEN, name="up")(nn.LayerNorm(name="norm")(x))
    return x + nn.Dense(WIDTH, name="down")(nn.gelu(h)), None


Stack = nn.scan(Block, variable_axes={"params": 1}, split_rngs={"params": True},
                length=LAYERS)


class Model(nn.Module):

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, WIDTH, name="embed")(tokens)
    x, _ = Stack(name="blocks")(x, None)
    return nn.Dense(VOCAB, name="head")(x)


def cross_entropy(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def embed(params, batch):
  return nn.Embed(VOCAB, WIDTH).apply({"params": params["params"]["embed"]}, batch["inputs"])


def block(params, x, batch, layer):
  y, _ = Block().apply({"params": params["params"]["blocks"]}, x, None)
  return y, None


def head(params, x, aux, batch):
  logits = nn.Dense(VOCAB).apply({"params": params["params"]["head"]}, x)
  loss = cross_entropy(logits, batch["targets"])
  return loss, {"loss": loss}


def batches(steps: int, seed: int = 1):
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
    yield {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def compare(steps: int = 5) -> dict:
  """Trains both ways with AdamW; returns the losses and the largest parameter difference."""
  model = Model()
  params = model.init(jax.random.key(0), jnp.zeros((BATCH, SEQ), jnp.int32))
  tx = optax.adamw(3e-3, weight_decay=0.1)
  standard_tx = optax.chain(optax.clip_by_global_norm(CLIP), tx)

  @jax.jit
  def standard_step(params, state, batch):
    def loss_fn(p):
      return cross_entropy(model.apply(p, batch["inputs"]), batch["targets"])
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = standard_tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, {"loss": loss,
                                                          "grad_norm": optax.tree.norm(grads)}

  engine = layerwise_step(tx, embed, block, head, stack="params/blocks", layer_axis=1,
                          clip_norm=CLIP)
  inside_step = jax.jit(engine.step, donate_argnums=(0, 1))

  params_a, params_b = params, jax.tree.map(jnp.copy, params)
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
  kernel_shape = params["params"]["blocks"]["up"]["kernel"].shape
  return {"standard_losses": losses_a, "layerwise_losses": losses_b, "grad_norms": norms,
          "max_param_diff": diff, "stacked_kernel_shape": kernel_shape}


def main() -> None:
  result = compare()
  print("stacked up-projection kernel:", result["stacked_kernel_shape"], "(layer axis 1)")
  print("loss, standard step:  ", " ".join(f"{x:.4f}" for x in result["standard_losses"]))
  print("loss, inside backward:", " ".join(f"{x:.4f}" for x in result["layerwise_losses"]))
  print(f"largest parameter difference after 5 steps: {result['max_param_diff']:.1e}")


if __name__ == "__main__":
  main()
