"""Checks on 8 simulated CPU devices, run by tests/experiments/test_memory.py in a subprocess.

The device count is fixed when JAX starts, so this runs in its own process
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) and prints one JSON
object: the collective bytes :mod:`experiments.planning.hlo` reads from a function
with a known set of collectives, and the update-in-backward step of ``tiny``
sharded as the planner and the training command lay it out
(:func:`experiments.training.mesh.train_shardings` with the layerwise step's
``state_shardings``) against the same steps on one device. Standalone:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_collectives_worker.py
"""

import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import skewadam_jax  # noqa: E402,F401  (first: a quiet JAX start)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import models  # noqa: E402
from experiments.planning import hlo  # noqa: E402
from experiments.training import mesh as mesh_lib  # noqa: E402
from experiments.training import optimizers  # noqa: E402
from experiments import parallel  # noqa: E402
from experiments.training import steps as steps_lib  # noqa: E402
from models import layerwise as model_layerwise  # noqa: E402

LOOP = 5  # trip count of the scan holding an all-reduce and an all-to-all


def known_collectives() -> dict:
  """Collective bytes of a function whose collectives are known exactly.

  Per device the shard is f32[8, 128] (4,096 bytes): 5 loop iterations of an
  all-reduce and an all-to-all of it, then one all-gather to f32[64, 128]
  (32,768 bytes), one reduce-scatter back and one collective-permute.
  """
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ("x",))

  def body(x):
    def step(carry, _):
      carry = jax.lax.psum(carry, "x") * 0.5
      return jax.lax.all_to_all(carry, "x", 0, 0, tiled=True), None
    y, _ = jax.lax.scan(step, x, None, length=LOOP)
    gathered = jax.lax.all_gather(y, "x", tiled=True)
    scattered = jax.lax.psum_scatter(gathered, "x", tiled=True)
    return jax.lax.ppermute(scattered, "x", [(i, (i + 1) % 8) for i in range(8)])

  fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  x = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=NamedSharding(mesh, P("x")))
  report = hlo.collective_bytes(fn.lower(x).compile().as_text())
  return {"bytes": report.bytes, "counts": report.counts,
          "trip_counts": sorted(report.trip_counts.values()),
          "assumed": report.assumed_trip_counts}


def update_in_backward_sharded(steps: int = 2) -> dict:
  """The update-in-backward step of ``tiny`` on a data=2 x expert=4 mesh against one device."""
  config = models.get_preset("tiny", compute_dtype="float32")
  graphdef, params, rest = nnx.split(models.Transformer(config, rngs=nnx.Rngs(0)),
                                     nnx.Param, ...)
  axes = models.logical_axes(params)
  params = nnx.as_pure(params)
  tx = optimizers.make_optimizer("skewadam", learning_rate=1e-3,
                                 axes=model_layerwise.slice_axes(axes), clip_norm=0)
  built = steps_lib.layerwise_step(graphdef, rest, tx, params, clip_norm=1.0)
  train_step = built.train_step
  batches = [parallel.synthetic_batch(s, 8, 16, config.vocab_size, 0) for s in range(steps)]

  ref_params, ref_state = jax.tree.map(jnp.copy, params), built.init(params)
  for inputs, targets in batches:
    ref_params, ref_state, _ = jax.jit(train_step)(ref_params, ref_state, inputs, targets)

  mesh = mesh_lib.make_mesh(data=2, expert=4)
  # The training command's and the planner's shardings of this step.
  shardings = mesh_lib.train_shardings(mesh, tx, params, axes=axes,
                                       state_shardings=built.state_shardings)
  param_shardings = shardings.params
  init = mesh_lib.sharded_init(built.init, shardings)
  sharded_params = mesh_lib.put(params, param_shardings)
  state = init(sharded_params)
  step = mesh_lib.sharded_train_step(train_step, shardings)
  for inputs, targets in batches:
    sharded_params, state, _ = step(*mesh_lib.put((sharded_params, state, inputs, targets, {}),
                                                  (param_shardings, shardings.opt_state,
                                                   shardings.batch, shardings.batch, {})))
  misplaced = [jax.tree_util.keystr(path) for (path, x), want in zip(
      jax.tree_util.tree_flatten_with_path(state)[0], jax.tree.leaves(shardings.opt_state))
               if not x.sharding.is_equivalent_to(want, x.ndim)]
  # The bank's momentum: w_gate's and w_up's share a plan and shape, so the default
  # (stacked) layout keeps both at the first of them, with one more leading axis.
  banks = shardings.opt_state.layers[0].mu["layers"]["moe"]["experts"]
  w_up = next(banks[name] for name in sorted(banks)
              if not isinstance(banks[name], optax.MaskedNode) and name != "w_down")
  diffs = jax.tree.map(lambda a, b: float(np.max(np.abs(np.asarray(a) - np.asarray(b)))),
                       sharded_params, ref_params)
  return {"max_param_diff": max(jax.tree.leaves(diffs)), "misplaced": misplaced,
          "expert_momentum_spec": [str(a) for a in w_up.spec]}


def owner_devices(names=("w",), shape=(16, 256, 128), axes=skewadam_jax.MatrixAxes(1, 2)
                  ) -> dict:
  """An FSDP-split stack of matrices orthogonalised with and without owner devices.

  ``[16, 256, 128]`` split over ``data=8`` along its rows, as FSDP splits a
  backbone matrix: Newton–Schulz of the split matrices all-reduces its
  products; with ``orthogonal_owner_axes="data"`` each device iterates whole
  matrices (resharded to it and back) and nothing is all-reduced. With two
  banks of one shape (``names``, ``[L, E, R, C]`` with a declared layer axis)
  the library steps them as one group, a layer at a time, whose leading axis
  of 2 does not divide over 8 owners: the owners then split the experts.
  """
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(8), ("data",))
  split = NamedSharding(mesh, P(*[None] * (len(shape) - 2), "data", None))
  params = {name: jnp.zeros(shape) for name in names}

  def run(owners):
    tx = skewadam_jax.scale_by_skewadam(
        param_labels="backbone", matrix_axes=axes,
        backbone=skewadam_jax.TierConfig("fp32", direction="orthogonal",
                                         orthogonal_owner_axes=owners))
    state = tx.init(params)
    state_shardings = jax.tree.map(
        lambda x: NamedSharding(mesh, P(*[None] * (x.ndim - 2), "data", None))
        if x.shape[-2:] == shape[-2:] else NamedSharding(mesh, P()), state)
    splits = {name: split for name in names}

    def update(g, s):
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return tx.update(g, s)

    fn = jax.jit(update, in_shardings=(splits, state_shardings),
                 out_shardings=(splits, state_shardings))
    g = {name: jax.device_put(jax.random.normal(jax.random.key(i), shape), split)
         for i, name in enumerate(names)}
    s = jax.device_put(state, state_shardings)
    collectives = hlo.collective_bytes(fn.lower(g, s).compile().as_text()).bytes
    u, _ = fn(g, s)
    u, _ = fn(g, _)  # a second step: the momentum read back from its split state
    return np.stack([np.asarray(u[name]) for name in names]), collectives

  plain, plain_bytes = run(())
  owned, owned_bytes = run("data")
  return {"max_update_diff": float(np.max(np.abs(plain - owned))),
          "max_update": float(np.max(np.abs(plain))), "plain": plain_bytes,
          "owned": owned_bytes}


def main() -> None:
  assert jax.device_count() == 8, jax.devices()
  print(json.dumps({"known": known_collectives(),
                    "update_in_backward": update_in_backward_sharded(),
                    "owner_devices": owner_devices(),
                    "owner_devices_grouped": owner_devices(
                        ("v", "w"), (2, 8, 64, 32), skewadam_jax.MatrixAxes(2, 3, layer=0))}))


if __name__ == "__main__":
  main()
