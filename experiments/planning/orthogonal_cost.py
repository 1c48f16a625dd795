"""What Muon's direction costs in a SkewAdam step: Newton–Schulz's working set and FLOPs.

The whole step's compiled memory analysis (:func:`experiments.planning.planner.plan`)
says what the step needs, not which part of it is the orthogonalisation. This
module asks XLA about that part alone: for every orthogonalised leaf it compiles
one loop iteration of the update's Newton–Schulz (one chunk of
``TierConfig.orthogonal_chunk`` matrices, :func:`skewadam_jax.orthogonal.chunk_size`)
for the same target, and reports the largest such working set (the chunk's
float32 input, the iteration's temporaries and its output), with the
iteration's matrix-multiply FLOPs over every matrix of the step.

A stacked leaf is stepped one layer at a time (the update's layer loop, and the
update inside the backward pass, see one layer's slice), so the chunk is taken
from one layer's slice.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

import skewadam_jax
from skewadam_jax import orthogonal
from experiments.training import optimizers


def _chunk_shape(shape: tuple[int, ...], plan, layer_axis: int | None) -> tuple[int, int, int, int]:
  """``(matrices in the step, matrices in a chunk, rows, cols)`` of an orthogonalised leaf."""
  rows, cols = orthogonal.matrix_sides(shape, plan.axes)
  matrix = set(plan.axes.row_axes + plan.axes.col_axes)
  batch = [a for a in range(len(shape)) if a not in matrix]
  total = math.prod(shape[a] for a in batch)
  if layer_axis is None and len(batch) >= 2:  # the update's own layer loop
    layer_axis = batch[0] if plan.axes.layer is None else plan.axes.layer
  inner = [a for a in batch if a != layer_axis]
  if not inner:
    return total, 1, rows, cols
  size = orthogonal.chunk_size(shape[inner[0]], rows * cols, plan.orthogonal_chunk)
  return total, size * math.prod(shape[a] for a in inner[1:]), rows, cols


def _iteration(plan, rows: int, cols: int):
  """The orthogonalisation of one ``rows × cols`` matrix of ``plan`` and its inputs' shapes.

  Newton–Schulz on the whole matrix, or, with low-rank momentum orthogonalised
  through its factors (``TierConfig.lowrank_orthogonalise="factors"``), on its
  projection's ``r × cols`` factor
  (:func:`skewadam_jax.orthogonal.newton_schulz_in_subspace`, ``P`` of
  ``rows × r``).
  """
  dtype = plan.orthogonal_dtype
  if plan.lowrank_orthogonalise in skewadam_jax.tiers.THROUGH_FACTORS:
    rank = min(plan.encoding.rank, rows, cols)
    return (lambda p, x: orthogonal.newton_schulz_in_subspace(p, x, dtype=dtype),
            [(rows, rank), (rows, cols)])
  return (lambda x: orthogonal.newton_schulz(x, dtype=dtype)), [(rows, cols)]


def _compile_analysis(fn, args, sharding):
  """XLA's memory analysis of ``fn(*args)`` compiled for ``sharding``'s device (bytes)."""
  xs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in args]
  analysis = jax.jit(fn).lower(*xs).compile().memory_analysis()
  return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
             + analysis.temp_size_in_bytes)


def orthogonalisation(params, axes: dict, skewadam_tiers: dict | None, *, sharding,
                      matmul_flops, expert_shards: int = 1, layer_name: str = "layers",
                      expert_name: str = "experts") -> dict | None:
  """Newton–Schulz's share of a SkewAdam step, or ``None`` when nothing is orthogonalised.

  Args:
    params: the step's parameters (``ShapeDtypeStruct`` s), stacked over layers.
    axes: their declared logical axes by path.
    skewadam_tiers: the run's tiers (``TrainConfig.skewadam_tiers()``).
    sharding: the target device's sharding (``planner.target_sharding``).
    matmul_flops: ``matmul_flops(fn, *args)``, the planner's count of a
      function's matrix-multiply FLOPs from its jaxpr.
    expert_shards: how many devices a bank's expert axis is split over: a
      chunk of such a bank (strided, :func:`skewadam_jax.orthogonal.map_in_chunks`)
      puts ``chunk / expert_shards`` of its matrices on each device.
    layer_name, expert_name: the logical axes of the layer stack and the expert bank.

  Returns:
    ``{"working_set_bytes", "leaf", "chunk", "matmul_flops", "matrices"}``:
    the largest one-chunk working set of a device over the orthogonalised
    leaves (that leaf's path and its ``[matrices, rows, cols]`` chunk on a
    device), and the
    orthogonalisation's matrix-multiply FLOPs per step over all its matrices.
  """
  plans = skewadam_jax.leaf_plans(params, **optimizers.skewadam_axes(axes, skewadam_tiers),
                                  **optimizers.tier_configs(skewadam_tiers))
  paths, leaves, _ = skewadam_jax.labels.flatten_with_paths(params)
  compiled: dict[tuple, int] = {}
  result = {"working_set_bytes": 0, "leaf": None, "chunk": None, "matmul_flops": 0,
            "matrices": 0}
  for path, leaf, plan in zip(paths, leaves, plans):
    if not plan.orthogonal:
      continue
    names = tuple(axes.get(path, ()))
    layer_axis = names.index(layer_name) if layer_name in names else None
    total, size, rows, cols = _chunk_shape(tuple(leaf.shape), plan, layer_axis)
    if expert_name in names and size % expert_shards == 0:
      size //= expert_shards
    ns, shapes = _iteration(plan, rows, cols)
    key = (size, rows, cols, plan.orthogonal_dtype, plan.lowrank_orthogonalise)
    if key not in compiled:
      compiled[key] = _compile_analysis(
          ns, [jax.ShapeDtypeStruct((size,) + s, jnp.float32) for s in shapes], sharding)
    # One matrix's FLOPs times the step's count of matrices.
    result["matmul_flops"] += total * matmul_flops(
        ns, *[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
    result["matrices"] += total
    if compiled[key] > result["working_set_bytes"]:
      result.update(working_set_bytes=compiled[key], leaf=path, chunk=[size, rows, cols])
  return result if result["matrices"] else None
