"""Orbax checkpoints of a training run: parameters, optimizer state, metadata.

The arrays are saved as a flat, numbered dict of leaves (``"000000"``,
``"000001"``, ...) and restored onto the tree structure that the run itself
builds from its configuration. That keeps optimizer-state keys (SkewAdam keys
its tiers by parameter path, with ``/`` in the names) out of orbax's file
names, and it makes a structural mismatch a clear error instead of a silent
partial restore. Orbax writes each step to a temporary directory and renames it
when complete, so an interrupted save never replaces the previous checkpoint.

The metadata is JSON: the step and the run's configuration. Restoring refuses a
checkpoint whose configuration differs in a field that changes the model, the
optimizer or its state, naming the field.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

# Config fields a resumed run must share with its checkpoint.
STRUCTURAL_FIELDS = ("preset", "optimizer", "moe_impl", "expert_momentum",
                     "backbone_second_moment", "router_second_moment", "seed",
                     "batch_size", "seq_len", "data", "steps", "lr", "warmup_steps",
                     "weight_decay", "clip_norm")


class CheckpointError(ValueError):
  """A checkpoint that cannot be used for this run."""


def _leaf_dict(tree) -> dict[str, Any]:
  return {f"{i:06d}": leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


class Checkpointer:
  """Saves and restores ``(params, opt_state)`` with metadata, by step."""

  def __init__(self, directory: str | pathlib.Path, *, max_to_keep: int = 2):
    self.directory = pathlib.Path(directory).resolve()
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def save(self, step: int, state, meta: dict) -> None:
    """Saves ``state`` (any pytree of arrays) at ``step`` and waits for it."""
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_leaf_dict(state)),
        meta=ocp.args.JsonSave({**meta, "step": step})))
    self.manager.wait_until_finished()

  def restore(self, step: int, like, *, expect: dict | None = None):
    """Restores the checkpoint at ``step`` onto the structure of ``like``.

    Args:
      step: a saved step.
      like: a pytree (arrays or ``ShapeDtypeStruct``) with the structure,
        shapes and dtypes to restore.
      expect: configuration the checkpoint must match on ``STRUCTURAL_FIELDS``.

    Returns:
      ``(state, meta)``.

    Raises:
      CheckpointError: for a configuration or structure mismatch.
    """
    meta = self.manager.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]
    if expect is not None:
      saved = meta.get("config", {})
      for field in STRUCTURAL_FIELDS:
        if field in expect and saved.get(field) != expect[field]:
          raise CheckpointError(
              f"checkpoint at step {step} in {self.directory} has {field}="
              f"{saved.get(field)!r} but this run has {field}={expect[field]!r}")
    leaves, treedef = jax.tree.flatten(like)
    abstract = {f"{i:06d}": jax.ShapeDtypeStruct(np.shape(x), x.dtype)
                for i, x in enumerate(leaves)}
    if meta.get("num_leaves") not in (None, len(leaves)):
      raise CheckpointError(
          f"checkpoint at step {step} holds {meta['num_leaves']} arrays; this "
          f"run's state has {len(leaves)}")
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract)))["state"]
    return jax.tree.unflatten(treedef, [restored[k] for k in sorted(restored)]), meta

  def close(self) -> None:
    self.manager.close()
