"""Orbax checkpoints of a training run: parameters, optimizer state, metadata.

The arrays are saved as a flat, numbered dict of leaves (``"000000"``,
``"000001"``, ...) and restored onto the tree structure that the run itself
builds from its configuration. That keeps optimizer-state keys (SkewAdam keys
its tiers by parameter path, with ``/`` in the names) out of orbax's file
names, and it makes a structural mismatch a clear error instead of a silent
partial restore.

What protects a run:

* **Atomic saves.** Orbax writes a step to ``<step>.orbax-checkpoint-tmp`` and
  renames it to ``<step>`` only when everything is written, so a save killed
  at any point leaves the previous checkpoints as they were; the partial
  directory is never listed as a step and is removed by the next manager
  (``cleanup_tmp_directories``) or by the next save of that step.
* **Checksums.** The metadata holds, for every leaf, its path, shape, dtype
  and a fingerprint of its bits (two wrapping sums of its 32/16/8-bit words,
  one of them position-weighted; computed on device, so it costs one pass
  over the state). Orbax itself restores a flipped byte without complaint;
  the fingerprint catches it.
* **Fallback.** :meth:`Checkpointer.restore_latest` tries the newest step
  first; a step that cannot be read or fails its checksum is reported in one
  line, moved aside to ``<dir>-corrupt/`` (so later saves of lower steps are
  not refused by orbax) and the previous step is tried.
* **Refusal.** A checkpoint that the caller's ``check`` says is another
  run's (the training run passes
  :func:`experiments.training.config.resume_check`: a field that changes the
  model, the optimizer, its state or the data, or other training data), or
  whose leaves differ in path, shape or dtype, is refused with a message
  naming the difference; it is *not* treated as damage and nothing falls
  back. The store itself is storage only: it knows no training policy.
"""

from __future__ import annotations

import os
import pathlib
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

_MAX_REASON_CHARS = 240


class CheckpointError(ValueError):
  """A checkpoint that cannot be used for this run."""


class CorruptCheckpointError(CheckpointError):
  """A checkpoint that is damaged: unreadable, truncated, or fails its checksum."""


def _leaf_dict(tree) -> dict[str, Any]:
  return {f"{i:06d}": leaf for i, leaf in enumerate(jax.tree.leaves(tree))}


def leaf_specs(tree) -> list[list]:
  """``[path, shape, dtype]`` of every leaf of ``tree`` (arrays or ShapeDtypeStructs)."""
  return [[jax.tree_util.keystr(path), list(np.shape(x)), str(jnp.dtype(x.dtype))]
          for path, x in jax.tree_util.tree_leaves_with_path(tree)]


def _words(x: jax.Array) -> jax.Array:
  """The bits of ``x`` as a flat uint32 vector (one word per 32/16/8-bit element)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
  return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32).ravel()


@jax.jit
def _fingerprints(leaves: list[jax.Array]) -> jax.Array:
  rows = []
  for x in leaves:
    w = _words(x)
    # Odd weights are invertible mod 2**32: any single changed word changes
    # both sums, and swapped words change the weighted one.
    weights = 2 * jnp.arange(w.size, dtype=jnp.uint32) + 1
    rows.append(jnp.stack([jnp.sum(w, dtype=jnp.uint32),
                           jnp.sum(w * weights, dtype=jnp.uint32)]))
  return jnp.stack(rows) if rows else jnp.zeros((0, 2), jnp.uint32)


def fingerprint(tree) -> list[list[int]]:
  """Per-leaf ``[sum, weighted sum]`` of the leaf's bits, as Python ints."""
  return np.asarray(jax.device_get(_fingerprints(jax.tree.leaves(tree)))).tolist()


def _short(err: BaseException) -> str:
  """One line of an exception (orbax/TensorStore messages run to pages)."""
  while err.__cause__ is not None:  # orbax wraps the TensorStore error that says why
    err = err.__cause__
  text = " ".join(str(err).split()) or type(err).__name__
  if len(text) > _MAX_REASON_CHARS:
    text = text[:_MAX_REASON_CHARS] + "..."
  return f"{type(err).__name__}: {text}"


def _is_placed(x) -> bool:
  """Whether ``x`` asks for a placement: a committed array or a sharded struct."""
  if isinstance(x, jax.Array):
    return x.committed
  return getattr(x, "sharding", None) is not None


def _restore_target(x):
  """What orbax restores a leaf as.

  A placed leaf (e.g. sharded over a mesh) is restored straight into its
  sharding. Any other leaf is read as numpy and put on the default device
  uncommitted, as freshly created arrays are: a committed array would miss
  the cache of steps jitted before the restore and compile them again.
  """
  if _is_placed(x):
    return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=x.sharding)
  return np.empty(np.shape(x), x.dtype)  # only its type, shape and dtype are used


def _warn(message: str) -> None:
  print(message, file=sys.stderr, flush=True)


class Checkpointer:
  """Saves and restores ``(params, opt_state)`` with metadata, by step."""

  def __init__(self, directory: str | pathlib.Path, *, max_to_keep: int = 2):
    self.directory = pathlib.Path(directory).resolve()
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True,
            # Leftovers of saves killed mid-write: never steps, only clutter.
            cleanup_tmp_directories=True),
        item_names=("state", "meta"))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state, meta: dict) -> None:
    """Saves ``state`` (any pytree of arrays) at ``step`` and waits for it.

    ``meta`` (JSON) is stored with the step, the leaves' paths, shapes and
    dtypes, and their fingerprints.

    Raises:
      CheckpointError: the directory already holds ``step`` or a later step
        (orbax would silently skip the save).
    """
    meta = {**meta, "step": step, "num_leaves": len(jax.tree.leaves(state)),
            "leaves": leaf_specs(state), "fingerprint": fingerprint(state)}
    saved = self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(_leaf_dict(state)),
        meta=ocp.args.JsonSave(meta)))
    if not saved:
      raise CheckpointError(
          f"not saving step {step} in {self.directory}: it already holds step "
          f"{self.latest_step()}")
    self.manager.wait_until_finished()

  def read_meta(self, step: int) -> dict:
    """The metadata saved with ``step`` (``config``, ``data_fingerprint``, ...).

    Raises:
      CorruptCheckpointError: it cannot be read.
    """
    try:
      meta = self.manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore()))["meta"]
    except Exception as err:  # pylint: disable=broad-except
      raise CorruptCheckpointError(
          f"checkpoint at step {step} in {self.directory}: cannot read its "
          f"metadata ({_short(err)})") from None
    if not isinstance(meta, dict) or meta.get("step", step) != step:
      raise CorruptCheckpointError(
          f"checkpoint at step {step} in {self.directory}: its metadata is "
          "damaged or belongs to another step")
    return meta

  def restore(self, step: int, like, *, check: Callable[[dict], str | None] | None = None):
    """Restores the checkpoint at ``step`` onto the structure of ``like``.

    Args:
      step: a saved step.
      like: a pytree (arrays or ``ShapeDtypeStruct``) with the structure,
        shapes and dtypes to restore.
      check: called with the checkpoint's metadata; a string it returns is
        why the checkpoint is another run's, and it is refused with it
        (``None``: accepted).

    Returns:
      ``(state, meta)``.

    Raises:
      CheckpointError: the checkpoint belongs to another run: configuration,
        data or state structure differ (the message names the difference).
      CorruptCheckpointError: the checkpoint is damaged.
    """
    meta = self.read_meta(step)
    where = f"checkpoint at step {step} in {self.directory}"
    reason = check(meta) if check is not None else None
    if reason:
      raise CheckpointError(f"{where} {reason}")
    leaves, treedef = jax.tree.flatten(like)
    specs = leaf_specs(like)
    if meta.get("num_leaves") not in (None, len(leaves)):
      raise CheckpointError(
          f"{where} holds {meta['num_leaves']} arrays; this run's state has "
          f"{len(leaves)}")
    for saved_spec, spec in zip(meta.get("leaves", specs), specs):
      if saved_spec != spec:
        raise CheckpointError(
            f"{where} does not match this run's state: leaf {saved_spec[0]} is "
            f"{saved_spec[2]}{saved_spec[1]} there and {spec[0]} is "
            f"{spec[2]}{spec[1]} here")
    target = {f"{i:06d}": _restore_target(x) for i, x in enumerate(leaves)}
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(target)))["state"]
    except Exception as err:  # pylint: disable=broad-except
      raise CorruptCheckpointError(
          f"{where}: cannot read its arrays ({_short(err)})") from None
    state = [restored[k] if _is_placed(x) else jnp.asarray(restored[k])
             for k, x in zip(sorted(restored), leaves)]
    if "fingerprint" in meta:
      got = fingerprint(state)
      for (path, _, _), want, have in zip(specs, meta["fingerprint"], got):
        if list(want) != list(have):
          raise CorruptCheckpointError(
              f"{where}: leaf {path} does not match its checksum (damaged file)")
    return jax.tree.unflatten(treedef, state), meta

  def restore_latest(self, like, *, check: Callable[[dict], str | None] | None = None,
                     warn: Callable[[str], None] = _warn):
    """Restores the newest usable checkpoint, falling back past damaged ones.

    Args:
      like, check: as in :meth:`restore`.
      warn: called with a one-line message for each damaged checkpoint
        skipped (default: print to stderr).

    Returns:
      ``(step, state, meta)``, or ``None`` if the directory holds no
      checkpoint.

    Raises:
      CheckpointError: a checkpoint belongs to another run (no fallback: the
        older ones would too), or every checkpoint is damaged.
    """
    damaged = []
    for step in reversed(self.all_steps()):
      try:
        state, meta = self.restore(step, like, check=check)
      except CorruptCheckpointError as err:
        warn(f"warning: {err}; falling back to the previous checkpoint")
        damaged.append((step, err))
        continue
      for bad_step, _ in damaged:
        moved = self._move_aside(bad_step)
        warn(f"warning: moved the damaged step {bad_step} to {moved}")
      return step, state, meta
    if damaged:
      raise CheckpointError(
          f"no usable checkpoint in {self.directory}: "
          + "; ".join(f"step {s} is damaged" for s, _ in damaged)
          + " (move them away to start afresh)")
    return None

  def _move_aside(self, step: int) -> pathlib.Path:
    """Moves a damaged step out of the managed directory (kept for inspection)."""
    quarantine = self.directory.parent / f"{self.directory.name}-corrupt"
    quarantine.mkdir(parents=True, exist_ok=True)
    target = quarantine / str(step)
    n = 1
    while target.exists():
      n += 1
      target = quarantine / f"{step}.{n}"
    os.replace(self.directory / str(step), target)
    self.manager.reload()
    return target

  def close(self) -> None:
    self.manager.close()
