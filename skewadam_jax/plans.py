"""The first thing to run on a new model: how SkewAdam will store each leaf, as a table.

:func:`plan_table` prints, for every parameter, its path and shape, its tier,
the axes that form its matrix (or ``vector``), its momentum encoding, its
second moment, its direction, whether it is decayed, and its state bytes per
parameter: the same resolution ``init`` and ``update`` make
(:func:`~skewadam_jax.leaf_plans`), from shapes only (nothing is allocated, so
``jax.ShapeDtypeStruct`` trees of any size work). A misrouted expert bank (a
``backbone`` row with an ``[E, d, f]`` shape) or a stacked norm factored
across layers is visible here before a long run; without ``matrix_axes``
every row's axes are marked ``(guessed)`` (the last two of each leaf).
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax

from skewadam_jax import accounting
from skewadam_jax import axes as axes_lib
from skewadam_jax import labels as labels_lib
from skewadam_jax import transform

COLUMNS = ("path", "shape", "tier", "matrix axes", "momentum", "second moment", "direction",
           "decay", "state B/param")


def plan_rows(params, *, mask: Any = transform.MATRICES, **skewadam_kwargs) -> list[dict]:
  """One dict per leaf with the :data:`COLUMNS` of :func:`plan_table`, in flattening order.

  ``"state B/param"`` is ``None`` for a leaf with no entries (``-`` in the table).
  """
  plans = transform.leaf_plans(params, warn=True, **{
      k: v for k, v in skewadam_kwargs.items()
      if k in ("param_labels", "matrix_axes", "backbone", "expert", "router",
               "orthogonal_mask")})
  paths, leaves, _ = labels_lib.flatten_with_paths(params)
  with warnings.catch_warnings():  # leaf_plans has warned already
    warnings.simplefilter("ignore", UserWarning)
    # each leaf's own bytes: in the stacked layout a group's first leaf holds them all
    per_param = accounting.state_bytes_per_param(
        transform.scale_by_skewadam(**{**skewadam_kwargs, "group_leaves": False}), params)
  matrix_axes = axes_lib.for_labels(skewadam_kwargs.get("matrix_axes"),
                                    skewadam_kwargs.get("param_labels"))
  decay = transform.decayed_leaves(mask, params, matrix_axes)
  masked_off = _masked_off_reasons(params, plans, skewadam_kwargs)
  # Without a declaration the axes are a guess (the last two): say so on every row.
  guessed = " (guessed)" if matrix_axes is None else ""
  rows = []
  for path, leaf, plan, nbytes, decayed, reason in zip(paths, leaves, plans, per_param, decay,
                                                      masked_off):
    size = math.prod(leaf.shape)
    second = ("per-neuron float32" if plan.neuron_b2 is not None else
              "none" if plan.orthogonal else
              f"{'factored' if plan.factored else 'exact'} {plan.nu_dtype.name}")
    rows.append({
        "path": path or "<root>", "shape": list(leaf.shape), "tier": plan.tier,
        "matrix axes": ("vector" if plan.axes is None
                        else f"({plan.axes.rows}, {plan.axes.cols})") + guessed,
        "momentum": "none" if plan.encoding is None else plan.encoding.name,
        "second moment": second,
        "direction": ("normalized orthogonal" if plan.neuron_b2 is not None
                      else "orthogonal" if plan.orthogonal else "adam")
                     + (", width-scaled" if plan.orthogonal_scale == "width" else "")
                     + (f" ({reason})" if reason else ""),
        "decay": "yes" if decayed else "no",
        # a leaf with no entries has state (its factored statistics) but no per-entry rate
        "state B/param": round(nbytes / size, 3) if size else None})
  return rows


def _masked_off_reasons(params, plans, skewadam_kwargs) -> list:
  """Per leaf: why a real matrix of an orthogonal tier keeps Adam's direction, or ``None``.

  The embedding mask of ``skewadam_orthogonal`` names its rule ("embedding",
  "unembedding, vocabulary V", "position embedding"); any other mask is
  named as the argument.
  """
  mask = skewadam_kwargs.get("orthogonal_mask")
  if mask is None:
    return [None] * len(plans)
  roles = mask.roles(params) if hasattr(mask, "roles") else [None] * len(plans)
  defaults = {"backbone": transform.DEFAULT_BACKBONE, "expert": transform.DEFAULT_EXPERT,
              "router": transform.DEFAULT_ROUTER}
  directions = {tier: transform._as_tier_config(  # pylint: disable=protected-access
      tier, skewadam_kwargs.get(tier), default).direction for tier, default in defaults.items()}
  leaves = jax.tree.leaves(params)
  return [(role or "orthogonal_mask")
          if (directions[plan.tier] in transform.ORTHOGONAL_DIRECTIONS and plan.axes is not None
              and not plan.orthogonal
              and not transform._is_complex(leaf))  # pylint: disable=protected-access
          else None
          for plan, leaf, role in zip(plans, leaves, roles)]


def plan_table(params, *, mask: Any = transform.MATRICES, **skewadam_kwargs) -> str:
  """How :func:`~skewadam_jax.skewadam` will store each leaf of ``params``, as a text table.

  Args:
    params: parameters or ``jax.ShapeDtypeStruct`` s.
    mask: the weight-decay mask, as :func:`~skewadam_jax.skewadam`'s.
    **skewadam_kwargs: ``param_labels``, ``matrix_axes``, ``backbone``,
      ``expert``, ``router``, ``orthogonal_mask`` (and the other arguments
      of :func:`~skewadam_jax.scale_by_skewadam`), as you will pass them.

  Returns:
    A table with a header row and one row per leaf (:data:`COLUMNS`).

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> params = {"embed": jax.ShapeDtypeStruct((64, 8), jnp.float32),
    ...           "moe": {"router": jax.ShapeDtypeStruct((8, 4), jnp.float32),
    ...                   "experts": jax.ShapeDtypeStruct((4, 8, 16), jnp.float32)}}
    >>> print(plan_table(params))  # doctest: +NORMALIZE_WHITESPACE
    path         shape       tier      matrix axes      momentum  second moment     direction  decay  state B/param
    embed        [64, 8]     backbone  (0, 1) (guessed)  bf16      factored float32  adam       yes    2.562
    moe/experts  [4, 8, 16]  expert    (1, 2) (guessed)  sign      factored float32  adam       yes    1.625
    moe/router   [8, 4]      router    (0, 1) (guessed)  fp32      exact float32     adam       yes    8.0
  """
  rows = plan_rows(params, mask=mask, **skewadam_kwargs)
  cells = [list(COLUMNS)] + [[_cell(row[c]) for c in COLUMNS] for row in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(COLUMNS))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _cell(value) -> str:
  if value is None:
    return "-"
  return "[" + ", ".join(str(d) for d in value) + "]" if isinstance(value, list) else str(value)
