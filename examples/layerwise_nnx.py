"""The update inside the backward pass for a Flax NNX ``nnx.scan`` stack.

The blocks are created with ``nnx.vmap`` (their parameters stacked on axis 0)
and run with ``nnx.scan``. For :func:`skewadam_jax.layerwise.layerwise_step`,
``nnx.split`` gives each part's graph definition once; the three functions
merge their own parameters back into a module and call it. Trained both ways
(the standard step with ``optax.clip_by_global_norm`` and the layerwise step
with exact clipping) from the same start::

    python examples/layerwise_nnx.py
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import skewadam_jax
from skewadam_jax.layerwise import layerwise_step, scanned_matrix_axes

VOCAB, WIDTH, HIDDEN, LAYERS, BATCH, SEQ = 64, 16, 32, 3, 4, 8
CLIP = 0.05


class Block(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.RMSNorm(WIDTH, rngs=rngs)
    self.up = nnx.Linear(WIDTH, HIDDEN, rngs=rngs)
    self.down = nnx.Linear(HIDDEN, WIDTH, rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.gelu(self.up(self.norm(x))))


class Model(nnx.Module):

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(VOCAB, WIDTH, rngs=rngs)

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make_blocks(rngs):
      return Block(rngs)

    self.blocks = make_blocks(rngs)
    self.head = nnx.Linear(WIDTH, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(x, block):
      return block(x)
    return self.head(run(self.embed(tokens), self.blocks))


def cross_entropy(logits, targets):
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def model_functions(model: Model):
  """``embed``, ``block`` and ``head`` of ``model`` (its structure; parameters come in)."""
  parts = {name: nnx.split(getattr(model, name), nnx.Param, ...)
           for name in ("embed", "blocks", "head")}

  def merged(name, params):
    graphdef, _, rest = parts[name]
    return nnx.merge(graphdef, params[name], rest)

  def embed(params, batch):
    return merged("embed", params)(batch["inputs"])

  def block(params, x, batch, layer):
    return merged("blocks", params)(x), None

  def head(params, x, aux, batch):
    loss = cross_entropy(merged("head", params)(x), batch["targets"])
    return loss, {"loss": loss}

  return embed, block, head


def batches(steps: int, seed: int = 1):
  rng = np.random.default_rng(seed)
  for _ in range(steps):
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1))
    yield {"inputs": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:])}


def compare(steps: int = 5) -> dict:
  """Trains both ways with SkewAdam; returns the losses and the largest parameter difference."""
  model = Model(nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = nnx.as_pure(params)
  # No experts or router here: every leaf is in the backbone tier (fp32 momentum).
  # The layerwise step's optimizer sees one layer's slice, where the default
  # matrix guess is right; the standard step's sees the stacked tree, so it is
  # told which leaves are matrices once the layer axis is set aside.
  tiers = dict(param_labels="backbone", backbone={"momentum": "fp32"})
  tx = skewadam_jax.skewadam(3e-3, **tiers)
  standard_tx = optax.chain(
      optax.clip_by_global_norm(CLIP),
      skewadam_jax.skewadam(3e-3, matrix_axes=scanned_matrix_axes("blocks"), **tiers))

  @jax.jit
  def standard_step(params, state, batch):
    def loss_fn(p):
      logits = nnx.merge(graphdef, p, rest)(batch["inputs"])
      return cross_entropy(logits, batch["targets"])
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, state = standard_tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, {"loss": loss,
                                                          "grad_norm": optax.tree.norm(grads)}

  engine = layerwise_step(tx, *model_functions(model), stack="blocks", clip_norm=CLIP)
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
  return {"standard_losses": losses_a, "layerwise_losses": losses_b, "grad_norms": norms,
          "max_param_diff": diff}


def main() -> None:
  result = compare()
  print("loss, standard step:  ", " ".join(f"{x:.4f}" for x in result["standard_losses"]))
  print("loss, inside backward:", " ".join(f"{x:.4f}" for x in result["layerwise_losses"]))
  print(f"largest parameter difference after 5 steps: {result['max_param_diff']:.1e}")


if __name__ == "__main__":
  main()
