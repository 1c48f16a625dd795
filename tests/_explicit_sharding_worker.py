"""Explicit-sharding stability of SkewAdam's state on 8 simulated CPU devices.

Run by tests/skewadam_jax/test_transform_table.py in a subprocess, because the CPU device count
is fixed when JAX starts (``XLA_FLAGS=--xla_force_host_platform_device_count=8``)
and the pytest process already started JAX with one device. It reads the
configuration table as JSON from its first argument or stdin (a list of ``{"id", "momentum",
"second_moment", "int8_block_size", "dtype"}``; ``momentum`` null for the
library's default tiers; ``{"id", "alias": "orthogonal", "dtype"}`` for
``skewadam_orthogonal``'s), and prints one JSON object: config id -> result.

For every configuration, under ``jax.make_mesh((8,), ("x",),
axis_types=(Explicit,))``, it records ``jax.typeof`` (shape, dtype, weak type
and sharding) of every state leaf after ``jax.eval_shape(tx.init)``,
``tx.init``, an eager ``tx.update`` and a jitted ``tx.update`` (twice, the
second time on the first call's state), and of the updates; the test asserts
that they all agree. Standalone:

    echo '[{"id": "d", "momentum": null, "dtype": "float32"}]' | \\
      XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_explicit_sharding_worker.py
"""

import json
import pathlib
import sys
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import skewadam_jax  # noqa: E402

# Leaves chosen for the awkward cases: "w"'s columns (16) are sharded over all
# 8 devices, so its packed sign bits have 2 columns and its int8 blocks (of 4)
# 4 columns, neither a multiple of 8; the expert bank is sharded on its batch
# (expert) axis; the router on its rows; a vector is sharded; one matrix is
# replicated.
SHAPES_SPECS = {
    "w": ((8, 16), P(None, "x")),
    "norm": ((16,), P("x")),
    "w_rep": ((6, 5), P()),
    "moe": {
        "router": ((16, 3), P("x", None)),
        "experts": ((8, 5, 6), P("x")),
    },
}


def _is_entry(x):
  return isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], P)


def make_tx(entry):
  lr, wd = 1e-2, 0.1
  if entry.get("alias") == "orthogonal":  # skewadam_orthogonal's defaults (lowrank experts)
    # The expert bank only: Newton-Schulz of a matrix sharded along its own rows or
    # columns is not supported under explicit axes (its Gram product's sharding).
    experts_only = {"w": False, "norm": False, "w_rep": False,
                    "moe": {"router": False, "experts": True}}
    return skewadam_jax.skewadam_orthogonal(lr, orthogonal_mask=experts_only,
                                            expert=entry.get("expert"))
  if entry["momentum"] is None:
    return skewadam_jax.skewadam(lr, weight_decay=wd)
  tier = skewadam_jax.TierConfig(entry["momentum"], entry["second_moment"],
                                 int8_block_size=entry["int8_block_size"])
  return skewadam_jax.skewadam(lr, weight_decay=wd, backbone=tier, expert=tier, router=tier)


def by_path(tree):
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def types(tree):
  return {k: str(jax.typeof(x)) for k, x in by_path(tree).items()}


def run_one(entry, mesh):
  dtype = jnp.dtype(entry["dtype"])
  shapes = jax.tree.map(lambda e: e[0], SHAPES_SPECS, is_leaf=_is_entry)
  specs = jax.tree.map(lambda e: e[1], SHAPES_SPECS, is_leaf=_is_entry)
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(jax.random.PRNGKey(0), 2 * len(leaves))
  spec_leaves = treedef.flatten_up_to(specs)

  def place(arrs):
    return treedef.unflatten([
        jax.device_put(a.astype(dtype), NamedSharding(mesh, s)) for a, s in zip(arrs, spec_leaves)])

  params = place([jax.random.normal(k, s) for k, s in zip(keys[::2], leaves)])
  grads = place([jax.random.normal(k, s) for k, s in zip(keys[1::2], leaves)])
  tx = make_tx(entry)
  result = {"params": types(params)}
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          params)
  stages = {}
  try:
    stages["eval_shape_init"] = types(jax.eval_shape(tx.init, abstract))
  except Exception:  # noqa: BLE001 -- reported, asserted on by the test
    result["eval_shape_init_error"] = traceback.format_exc(limit=-6)
  state = tx.init(params)
  stages["init"] = types(state)
  try:
    eager_updates, eager_state = tx.update(grads, state, params)
    stages["eager_update"] = types(eager_state)
    result["eager_updates"] = types(eager_updates)
  except Exception:  # noqa: BLE001
    result["eager_update_error"] = traceback.format_exc(limit=-6)
  step = jax.jit(tx.update, compiler_options={"xla_backend_optimization_level": 0})
  try:
    jit_updates, jit_state = step(grads, state, params)
    stages["jit_update"] = types(jit_state)
    result["jit_updates"] = types(jit_updates)
    _, jit_state2 = step(grads, jit_state, params)
    stages["jit_update_2"] = types(jit_state2)
    result["jit_cache_size"] = step._cache_size()  # pylint: disable=protected-access
  except Exception:  # noqa: BLE001
    result["jit_update_error"] = traceback.format_exc(limit=-6)
  result["stages"] = stages
  return result


def main():
  entries = json.loads(sys.argv[1]) if len(sys.argv) > 1 else json.load(sys.stdin)
  assert jax.device_count() == 8, jax.devices()
  mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
  out = {}
  with jax.set_mesh(mesh):
    for entry in entries:
      try:
        out[entry["id"]] = run_one(entry, mesh)
      except Exception:  # noqa: BLE001
        out[entry["id"]] = {"error": traceback.format_exc(limit=-8)}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
