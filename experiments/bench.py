"""Optimizer-update and train-step throughput, as ratios measured in one process.

    python -m experiments.bench            # update benchmark, then the train step
    python -m experiments.bench --json --skip-train-step

The update benchmark times ``params, state = apply(update(grads, state, params))``
jitted with parameters and state donated, on one MoE-shaped parameter tree
(a scaled-down ``moe-6.78b``: stacked ``[L, E, d_in, d_out]`` SwiGLU banks,
stacked attention, untied embeddings; 119M parameters by default), for
SkewAdam's default and each expert-momentum encoding, ``optax.adamw``,
``optax.adafactor`` and ``optax.lion``: the median over ``--repeats`` timed
calls after warm-up, in ``--rounds`` interleaved rounds (see
:func:`bench_updates`). An update is memory-bound, so next to the time it
reports the bytes each update must move per parameter (reads of parameters,
gradients and state, writes of parameters and state), the achieved
bandwidth against this machine's copy bandwidth measured in the same process
(a jitted ``x + 1`` over a large array: one read and one write), and the
bytes XLA's compiled update actually reads and writes (its cost analysis:
every kernel's operands and results, so a temporary counts twice).

The train-step benchmark trains the ``small`` preset for a few steps with
SkewAdam and with AdamW, alternating, and reports tokens/s of each.

On Linux the command re-executes itself with :data:`CPU_MALLOC_ENV` (unless
``--system-malloc``): XLA:CPU allocates an update's temporaries afresh on
every call, and glibc by default hands large freed blocks back to the kernel,
so every call page-faults them in again, one fault per 4 KiB page (about
25 ms per 92 MB temporary on the 2-core machine, more than the arithmetic).
Every optimizer runs under the same allocator; the JSON says which one.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import pathlib
import statistics
import sys
import time
from typing import Sequence
from unittest import mock

import jax
import jax.numpy as jnp
import optax

import experiments
from experiments.planning import hlo, planner
from experiments.studies import equal_time
from experiments.studies.comparison import machine_text
from experiments.training import steps as steps_lib
from experiments.training.config import TrainConfig
import skewadam_jax

GB = 1e9

# glibc: one arena, no mmap'd blocks, never trim: freed memory stays mapped.
CPU_MALLOC_ENV = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
                  "MALLOC_TRIM_THRESHOLD_": str(2**40)}


def malloc_setting() -> str:
  """``"tuned"`` when this process runs under :data:`CPU_MALLOC_ENV`, else ``"system"``."""
  tuned = all(os.environ.get(k) == v for k, v in CPU_MALLOC_ENV.items())
  return "tuned" if tuned else "system"


def moe_tree(*, layers=6, experts=16, d_model=512, d_ff=704, vocab=8192, dtype=jnp.float32,
             seed=0):
  """A MoE-shaped parameter tree (same paths as ``models``), random normal."""
  shapes = {
      "embed": {"embedding": (vocab, d_model)},
      "unembed": {"kernel": (d_model, vocab)},
      "final_norm": {"scale": (d_model,)},
      "layers": {
          "attn": {n: {"kernel": (layers, d_model, d_model)}
                   for n in ("query", "key", "value", "out")},
          "attn_norm": {"scale": (layers, d_model)},
          "moe_norm": {"scale": (layers, d_model)},
          "moe": {"router": {"kernel": (layers, d_model, experts)},
                  "experts": {"w_gate": (layers, experts, d_model, d_ff),
                              "w_up": (layers, experts, d_model, d_ff),
                              "w_down": (layers, experts, d_ff, d_model)}},
      },
  }
  is_shape = lambda x: isinstance(x, tuple)
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=is_shape)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      (0.02 * jax.random.normal(k, s)).astype(dtype) for k, s in zip(keys, leaves)])


def per_expert_tree(*, layers=20, experts=8, d_model=64, d_ff=128, vocab=256):
  """A Hugging Face Mixtral-shaped tree of ``ShapeDtypeStruct`` s: one 2-D leaf per expert weight.

  ``layers · (experts · 3 + 1) + 1`` leaves (501 by default): ``w1``/``w3``
  ``[d_model, d_ff]`` and ``w2`` ``[d_ff, d_model]`` under
  ``block_sparse_moe/experts/<e>/``, a router ``block_sparse_moe/gate``, and
  the embedding. Compile time does not depend on the sizes, the leaf count does.
  """
  leaf = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
  tree = {"embed": {"kernel": leaf(vocab, d_model)}}
  for layer in range(layers):
    tree[f"layer_{layer}"] = {"block_sparse_moe": {
        "gate": {"kernel": leaf(d_model, experts)},
        "experts": {str(e): {"w1": {"kernel": leaf(d_model, d_ff)},
                             "w2": {"kernel": leaf(d_ff, d_model)},
                             "w3": {"kernel": leaf(d_model, d_ff)}} for e in range(experts)}}}
  return tree


def hand_written_update(learning_rate: float = 1e-3, *, b1: float = 0.9, b2: float = 0.999,
                        expert=lambda path: "/experts/" in path) -> optax.GradientTransformation:
  """SkewAdam's default expert-tier math in plain ``jax.numpy``, no library: a floor.

  On every leaf ``expert(path)`` names (2-D, columns a multiple of 8): packed
  sign bits with row/column RMS statistics for ``m``, row/column means for
  ``v`` (Adafactor's rank-one estimate), Adafactor's RMS clip, the zero-gradient
  rule; Adam (fp32 ``m``, exact ``v``) on the rest; decoupled decay 1e-4. The
  fewest operations this math takes as written here, with one state array per
  statistic: what :func:`compile_times` compares the library against, to tell
  the cost of the math from the cost of the implementation. On expert leaves
  it equals ``skewadam(..., clip_threshold=1.0)``'s update to round-off
  (``tests/experiments/test_bench.py``).
  """
  def init(params):
    def one(path, p):
      if expert(skewadam_jax.labels.path_to_str(path)):
        r, c = p.shape
        zeros = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
        return {"bits": jnp.zeros((r, c // 8), jnp.uint8), "m_row": zeros(r), "m_col": zeros(c),
                "v_row": zeros(r), "v_col": zeros(c)}
      return {"m": jnp.zeros_like(p), "v": jnp.zeros_like(p)}
    return {"count": jnp.zeros([], jnp.int32),
            "leaves": jax.tree_util.tree_map_with_path(one, params)}

  def factored_sign(g, s, p, c1, c2):
    g2 = g * g + 1e-30
    v_row = b2 * s["v_row"] + (1 - b2) * jnp.mean(g2, 1)
    v_col = b2 * s["v_col"] + (1 - b2) * jnp.mean(g2, 0)
    negative = jnp.unpackbits(s["bits"], axis=1).astype(bool)
    size = (jnp.sqrt(s["m_row"] / jnp.maximum(jnp.mean(s["m_row"]), 1e-30))[:, None]
            * jnp.sqrt(s["m_col"])[None, :])
    m = (1 - b1) * g + b1 * jnp.where(negative, -size, size)
    v = v_row[:, None] * v_col[None, :] / jnp.maximum(jnp.mean(v_row), 1e-30)
    u = jnp.where(g == 0, 0.0, (m / c1) / (jnp.sqrt(v / c2) + 1e-8))
    u = u / jnp.maximum(1.0, jnp.sqrt(jnp.mean(u * u)))
    new = {"bits": jnp.packbits(m < 0, axis=1), "m_row": jnp.mean(m * m, 1),
           "m_col": jnp.mean(m * m, 0), "v_row": v_row, "v_col": v_col}
    return -learning_rate * (u + 1e-4 * p), new

  def adam(g, s, p, c1, c2):
    m, v = b1 * s["m"] + (1 - b1) * g, b2 * s["v"] + (1 - b2) * g * g
    return -learning_rate * ((m / c1) / (jnp.sqrt(v / c2) + 1e-8) + 1e-4 * p), {"m": m, "v": v}

  def update(grads, state, params):
    count = state["count"] + 1
    c1, c2 = 1 - b1**count, 1 - b2**count
    paths, grads_flat, treedef = skewadam_jax.labels.flatten_with_paths(grads)
    out = [(factored_sign if expert(path) else adam)(g, s, p, c1, c2) for path, g, s, p in zip(
        paths, grads_flat, treedef.flatten_up_to(state["leaves"]), jax.tree.leaves(params))]
    return (treedef.unflatten([u for u, _ in out]),
            {"count": count, "leaves": treedef.unflatten([s for _, s in out])})

  return optax.GradientTransformation(init, update)


def outputs_only_update(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx``'s inputs and outputs with no math: each array written by one elementwise kernel.

  The update is the gradients doubled and the state each array plus one (a
  bool negated): what a program with ``tx``'s state, leaf for leaf, costs to
  compile before any of its math, for :func:`compile_times`.
  """
  def update(grads, state, params=None):
    del params
    return jax.tree.map(lambda g: 2 * g, grads), jax.tree.map(_bumped, state)

  return optax.GradientTransformation(tx.init, update)


def _bumped(x):
  """``x`` written by one elementwise kernel: negated if bool, else plus one."""
  return ~x if x.dtype == jnp.bool_ else x + jnp.ones((), x.dtype)


def stacking_only_update(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` (a SkewAdam with ``group_leaves=True``) with each group's SkewAdam math replaced
  by :func:`outputs_only_update`'s: what stacking the groups and slicing each leaf's
  results out of them costs to compile by itself, for :func:`compile_times`.

  The library's per-leaf step (``skewadam_jax.transform._step_leaf``) is swapped
  for the no-math one while ``tx.update`` traces; everything around it (the
  plans, the groups, the stacking, the slices, the placeholders passed through)
  is the library's own, and so is what ``tx`` chains after it (``skewadam()``'s
  weight decay and rate). ``scale_by_skewadam`` so wrapped gives
  :func:`outputs_only_update`'s arrays, but for the one-byte placeholders, which it
  passes through as the library does.
  """
  def no_math(plan, g, parts, **_):
    del plan
    return 2 * g, {name: _bumped(x) for name, x in parts.items()
                   if not skewadam_jax.transform.is_placeholder(x)}

  def update(grads, state, params=None):
    with mock.patch.object(skewadam_jax.transform, "_step_leaf", no_math):
      return tx.update(grads, state, params)

  return optax.GradientTransformation(tx.init, update)


def compile_times(tree, *, rounds: int = 2, target: str = "cpu") -> dict:
  """Trace + lower and compile seconds of the jitted update, SkewAdam against optax.adamw.

  All in this process, alternating, ``rounds`` times each (medians); SkewAdam
  with the ``"hf"`` labels (so the per-expert leaves are its expert tier), each
  leaf stepped alone (``group_leaves=False``), the same with
  ``group_leaves=True`` (its leaves stacked by plan), and
  :func:`hand_written_update` (its expert math without the library) and
  :func:`outputs_only_update` (its state's arrays written with no math),
  :func:`stacking_only_update` (the grouped row's stacking and slicing with no math
  between them), and ``group_leaves="stacked"`` (grouped, each group's state
  kept stacked: the default on every backend), and ``skewadam_orthogonal`` as
  a user calls it. Nothing is allocated or run. ``target``: a planner target
  (``"a100-40gb"`` compiles with XLA:GPU, deviceless); ``"cpu"`` (default)
  with this machine's XLA:CPU.
  """
  sharding, warning = planner.target_sharding(target)
  if target == "cpu":
    warning = None  # the planner's CPU warning is about temp bytes, not compile time
  place = lambda t: planner.with_sharding(t, sharding)  # noqa: E731
  tree = place(tree)
  txs = {"optax.adamw": lambda: optax.adamw(1e-3),
         # Each leaf stepped alone (the CPU's default before 0.3.0, which the committed
         # rows measured through group_leaves="auto" on this CPU machine).
         "skewadam": lambda: skewadam_jax.skewadam(1e-3, param_labels=skewadam_jax.label_fn("hf"),
                                                   group_leaves=False),
         # Its leaves stacked by plan, shape and dtype whatever the backend,
         # each leaf's state kept leaf by leaf.
         "skewadam, leaves grouped": lambda: skewadam_jax.skewadam(
             1e-3, param_labels=skewadam_jax.label_fn("hf"), group_leaves=True),
         "the same math by hand": hand_written_update,
         # SkewAdam's state written with no math: the outputs' own cost.
         "skewadam's outputs, no math": lambda: outputs_only_update(skewadam_jax.skewadam(
             1e-3, param_labels=skewadam_jax.label_fn("hf"), group_leaves=False)),
         # The grouped row's stacking and slicing with no math between them.
         "skewadam grouped, no math": lambda: stacking_only_update(skewadam_jax.skewadam(
             1e-3, param_labels=skewadam_jax.label_fn("hf"), group_leaves=True)),
         # Grouped, each group's state kept stacked: only gradients stacked, updates
         # sliced (the default on every backend since 0.3.0).
         "skewadam, state stacked": lambda: skewadam_jax.skewadam(
             1e-3, param_labels=skewadam_jax.label_fn("hf"), group_leaves="stacked"),
         # The recommended optimizer as a user calls it (Newton-Schulz, low-rank
         # expert momentum), in the default's layout.
         "skewadam_orthogonal": lambda: skewadam_jax.skewadam_orthogonal(
             1.5e-2, param_labels=skewadam_jax.label_fn("hf"))}
  times = {name: {"trace_s": [], "compile_s": []} for name in txs}
  hlo_lines = {}
  for _ in range(rounds):
    for name, make in txs.items():
      tx = make()  # a new transformation each round: nothing is cached across rounds
      state = place(jax.eval_shape(tx.init, tree))
      start = time.perf_counter()
      lowered = jax.jit(tx.update).trace(tree, state, tree).lower()
      traced = time.perf_counter()
      lowered.compile()
      times[name]["trace_s"].append(traced - start)
      times[name]["compile_s"].append(time.perf_counter() - traced)
      hlo_lines[name] = lowered.as_text().count("\n")
  rows = {name: {"trace_s": statistics.median(t["trace_s"]),
                 "compile_s": statistics.median(t["compile_s"]), "hlo_lines": hlo_lines[name]}
          for name, t in times.items()}
  base = rows["optax.adamw"]["trace_s"] + rows["optax.adamw"]["compile_s"]
  for row in rows.values():
    row["total_s"] = row["trace_s"] + row["compile_s"]
    row["total_ratio_to_adamw"] = row["total_s"] / base
  return {"leaves": len(jax.tree.leaves(tree)), "rounds": rounds, "target": target,
          "warning": warning, "rows": rows}


def optimizers_to_bench() -> dict[str, optax.GradientTransformation]:
  lr = 1e-3
  txs = {"skewadam (default)": skewadam_jax.skewadam(lr)}
  for name in ("fp32", "bf16", "int8", "none"):
    txs[f"skewadam expert={name}"] = skewadam_jax.skewadam(lr, expert={"momentum": name})
  txs["skewadam orthogonal"] = skewadam_jax.skewadam(  # Muon's direction in both tiers
      lr, backbone={"direction": "orthogonal"}, expert={"direction": "orthogonal"})
  txs["optax.adamw"] = optax.adamw(lr)
  txs["optax.adafactor"] = optax.adafactor(lr)
  txs["optax.lion"] = optax.lion(lr)
  return txs


def _minor_page_faults() -> int:
  try:
    import resource  # pylint: disable=import-outside-toplevel
  except ImportError:  # not on this platform
    return 0
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _median_seconds(fn, *args, repeats: int, warmup: int = 2, faults: list | None = None,
                    carry: dict | None = None):
  """Median wall time of ``fn`` (which returns its donated arguments' successors).

  With ``faults``, appends the process's minor page faults per timed call;
  with ``carry``, stores the last successors in ``carry["args"]``.
  """
  for _ in range(warmup):
    args = fn(*args)
  jax.block_until_ready(args)
  times = []
  faults_before = _minor_page_faults()
  for _ in range(repeats):
    t0 = time.perf_counter()
    args = jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  if faults is not None:
    faults.append((_minor_page_faults() - faults_before) / repeats)
  if carry is not None:
    carry["args"] = args
  return statistics.median(times)


def copy_bandwidth_gbps(nbytes: int, repeats: int) -> float:
  """GB/s of a jitted ``x + 1`` over ``nbytes`` of float32 (one read, one write)."""
  x = jnp.zeros((nbytes // 4,), jnp.float32)
  step = jax.jit(lambda x: (x + 1,), donate_argnums=0)
  seconds = _median_seconds(step, x, repeats=repeats)
  return 2 * nbytes / seconds / GB


def _update_and_apply(tx):
  def step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
  return step


def _compiled_bytes(compiled) -> float | None:
  """XLA's own count of the bytes a compiled program reads and writes."""
  try:
    analysis = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except  # not every backend has one
    return None
  if isinstance(analysis, (list, tuple)):
    analysis = analysis[0] if analysis else None
  return None if not analysis else analysis.get("bytes accessed")


def bench_updates(params, *, repeats: int, rounds: int = 3) -> dict:
  """The update benchmark; returns ``{"copy_gbps", "num_params", "rounds", "rows"}``.

  Each optimizer's update is compiled once, with parameters and state donated
  (the gradients are a read-only input, as in training). Then ``rounds``
  rounds time every optimizer in turn (median of ``repeats`` calls after
  warm-up), so that a slow spell of a shared machine falls on all of them.
  ``update_ms`` is the median over rounds; ``ratio_to_adamw`` the median over
  rounds of that round's ratio, with its range over rounds.
  """
  grads = jax.tree.map(lambda p: 0.01 * jnp.ones_like(p), params)
  n = sum(x.size for x in jax.tree.leaves(params))
  param_bytes = skewadam_jax.tree_bytes(params)
  copy_gbps = copy_bandwidth_gbps(param_bytes, repeats)
  runs = {}
  for name, tx in optimizers_to_bench().items():
    state = tx.init(params)
    compiled = jax.jit(_update_and_apply(tx), donate_argnums=(0, 1)).lower(
        params, state, grads).compile()
    runs[name] = {"step": compiled, "args": (jax.tree.map(jnp.copy, params), state),
                  "state_bytes": skewadam_jax.tree_bytes(state),
                  "compiled_bytes": _compiled_bytes(compiled), "seconds": [], "faults": []}
  for _ in range(rounds):
    for run in runs.values():
      step = lambda p, s, step=run["step"]: step(p, s, grads)
      run["seconds"].append(_median_seconds(step, *run["args"], repeats=repeats,
                                            faults=run["faults"], carry=run))
  adamw = runs["optax.adamw"]["seconds"]
  rows = []
  for name, run in runs.items():
    seconds = statistics.median(run["seconds"])
    ratios = [t / a for t, a in zip(run["seconds"], adamw)]
    # Reads: params, grads, state; writes: params, state.
    moved = 2 * param_bytes + skewadam_jax.tree_bytes(grads) + 2 * run["state_bytes"]
    compiled = run["compiled_bytes"]
    rows.append({"optimizer": name, "update_ms": 1e3 * seconds,
                 "ratio_to_adamw": statistics.median(ratios),
                 "ratio_range": [min(ratios), max(ratios)],
                 "state_bytes_per_param": run["state_bytes"] / n,
                 "bytes_per_param": moved / n, "gbps": moved / seconds / GB,
                 "fraction_of_copy_bw": moved / seconds / GB / copy_gbps,
                 "compiled_bytes_per_param": None if compiled is None else compiled / n,
                 # Each 4 KiB page of a temporary that the allocator hands back to
                 # the kernel is faulted in again on the next call.
                 "page_faults_per_update": statistics.mean(run["faults"])})
  return {"copy_gbps": copy_gbps, "num_params": n, "rounds": rounds, "rows": rows}


# Leaf sizes at which grouping's run-time cost is measured: (layers, d_model,
# d_ff) of per_expert_tree, from compile_times' tree (8192-entry leaves) to
# leaves of 512K entries, the layer count shrinking as the leaves grow.
GROUPING_SIZES = ((20, 64, 128), (20, 128, 128), (8, 128, 512), (4, 512, 1024))


def grouping_step_times(*, repeats: int = 5, rounds: int = 3,
                        sizes=GROUPING_SIZES) -> dict:
  """The update's time with its leaves grouped against each alone, by leaf size.

  ``skewadam()`` with the ``"hf"`` labels on :func:`per_expert_tree` of each
  ``(layers, d_model, d_ff)`` of ``sizes``, ``group_leaves=True`` and
  ``"stacked"`` against ``False`` on this machine's default backend, compiled
  once each, parameters and state donated, timed as :func:`bench_updates` times
  (median of ``repeats`` calls, alternating over ``rounds``). Returns
  ``{"rounds", "rows": [{"leaf_entries", "leaves", "alone_ms", "grouped_ms",
  "grouped_over_alone", "stacked_ms", "stacked_over_alone"}]}``: what the
  stacking's copies cost or save at run time.
  """
  rows = []
  for layers, d_model, d_ff in sizes:
    params = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, s.dtype), per_expert_tree(
        layers=layers, d_model=d_model, d_ff=d_ff, vocab=4 * d_model))
    grads = jax.tree.map(lambda p: 0.01 * jnp.ones_like(p), params)
    runs = {}
    for grouped in (False, True, "stacked"):
      tx = skewadam_jax.skewadam(1e-3, param_labels=skewadam_jax.label_fn("hf"),
                                 group_leaves=grouped)
      compiled = jax.jit(_update_and_apply(tx), donate_argnums=(0, 1)).lower(
          params, tx.init(params), grads).compile()
      runs[grouped] = {"step": compiled, "seconds": [],
                       "args": (jax.tree.map(jnp.copy, params), tx.init(params))}
    for _ in range(rounds):
      for run in runs.values():
        step = lambda p, s, step=run["step"]: step(p, s, grads)
        run["seconds"].append(_median_seconds(step, *run["args"], repeats=repeats,
                                              carry=run))
    alone, grouped, stacked = (statistics.median(runs[g]["seconds"])
                               for g in (False, True, "stacked"))
    rows.append({"leaf_entries": d_model * d_ff, "leaves": len(jax.tree.leaves(params)),
                 "alone_ms": 1e3 * alone, "grouped_ms": 1e3 * grouped,
                 "grouped_over_alone": grouped / alone, "stacked_ms": 1e3 * stacked,
                 "stacked_over_alone": stacked / alone})
  return {"rounds": rounds, "rows": rows}


def grouping_markdown(result: dict) -> str:
  """The table of a :func:`grouping_step_times` result, with its machine and date."""
  return _titled_table(
      f"`skewadam()`'s update with its leaves grouped against each alone "
      f"({result.get('backend', 'cpu')}; medians of {result['rounds']} alternating rounds",
      result, ["expert leaf entries", "leaves", "alone (ms)", "grouped (ms)", "grouped ÷ alone",
               "state stacked (ms)", "stacked ÷ alone"],
      [f"| {r['leaf_entries']:,} | {r['leaves']} | {r['alone_ms']:.1f} | "
       f"{r['grouped_ms']:.1f} | {r['grouped_over_alone']:.2f} | "
       f"{r['stacked_ms']:.1f} | {r['stacked_over_alone']:.2f} |" for r in result["rows"]])


# The train steps compared: name → TrainConfig overrides.
TRAIN_STEPS = {
    # The library's skewadam() (Adam's direction), spelt out: the training
    # command's default is the orthogonal row.
    "skewadam": {"optimizer": "skewadam", "backbone_direction": "adam",
                 "expert_direction": "adam"},
    "adamw": {"optimizer": "adamw"},
    "skewadam orthogonal": {"optimizer": "skewadam", "backbone_direction": "orthogonal",
                            "expert_direction": "orthogonal"},
    "muon": {"optimizer": "muon"},
    # The default with its expert momentum orthogonalised through its factors.
    "skewadam orthogonal, expert factors": {
        "optimizer": "skewadam", "backbone_direction": "orthogonal",
        "expert_direction": "orthogonal", "expert_lowrank_orthogonalise": "factors"},
}


def bench_train_step(*, steps: int, rounds: int) -> dict:
  """tokens/s of the ``small`` train step for each of :data:`TRAIN_STEPS`, alternating rounds
  (:func:`experiments.studies.equal_time.measure_step_seconds`)."""
  configs = {name: TrainConfig(preset="small", steps=1000, **overrides)
             for name, overrides in TRAIN_STEPS.items()}
  seconds = equal_time.measure_step_seconds(configs, steps=steps, rounds=rounds)
  config = configs["skewadam"]
  tokens = config.batch_size * (config.seq_len or config.model_config().max_seq_len)
  result = {name: tokens / s for name, s in seconds.items()}
  return {"tokens_per_s": result, "ratio_skewadam_to_adamw": result["skewadam"] / result["adamw"],
          "step_time_ratio_to_adamw": {name: result["adamw"] / tps
                                       for name, tps in result.items()},
          "steps_per_round": steps, "rounds": rounds}


UPDATE_TEMP_ROWS = ("skewadam", "skewadam, as on a GPU", "skewadam, leaves grouped", "adamw")


def update_temp_bytes(preset: str = "moe-6.78b", target: str = "a100-40gb",
                      rows: Sequence[str] = UPDATE_TEMP_ROWS) -> dict:
  """XLA temp and kernel bytes of the optimizer update alone (update + apply).

  Compiled for ``target`` without a device, as the memory planner does; the
  parameters (bf16) and optimizer state are donated and the gradients are an
  input, so the temp is what the update needs beyond its inputs and outputs.
  ``kernel_bytes_per_param`` is :func:`~experiments.planning.hlo.kernel_bytes` of the compiled update
  over the number of parameters: what the update would read and write on
  that GPU. Row ``"skewadam"`` steps each leaf alone (``group_leaves=False``,
  the CPU's default before 0.3.0, which the committed rows measured),
  ``"skewadam, as on a GPU"`` as a GPU builds it (each group's state stacked,
  the default on every backend since) and ``"skewadam, leaves grouped"`` with
  ``group_leaves=True`` (the GPU's default before 0.3.0).
  """
  _, _, params, _ = steps_lib.abstract_model(preset, jnp.bfloat16)
  sharding, warning = planner.target_sharding(target)
  place = lambda t: planner.with_sharding(t, sharding)
  n = sum(x.size for x in jax.tree.leaves(params))
  temp, traffic = {}, {}
  grouped = functools.partial(skewadam_jax.skewadam, group_leaves=True)
  alone = functools.partial(skewadam_jax.skewadam, group_leaves=False)
  patches = {"skewadam": [mock.patch.object(skewadam_jax, "skewadam", alone)], "adamw": [],
             "skewadam, as on a GPU": [mock.patch.object(jax, "default_backend", lambda: "gpu")],
             "skewadam, leaves grouped": [mock.patch.object(skewadam_jax, "skewadam", grouped)]}
  for name in rows:
    with contextlib.ExitStack() as stack:
      for patch in patches[name]:  # in place while the optimizer is built and traced
        stack.enter_context(patch)
      tx = planner.make_tx(name.split(",")[0], preset)
      state = jax.eval_shape(tx.init, params)
      compiled = jax.jit(_update_and_apply(tx), donate_argnums=(0, 1)).lower(
          place(params), place(state), place(params)).compile()
    temp[name] = int(compiled.memory_analysis().temp_size_in_bytes)
    traffic[name] = hlo.kernel_bytes(compiled.as_text()) / n
  return {"preset": preset, "target": target, "warning": warning, "temp_bytes": temp,
          "kernel_bytes_per_param": traffic}


def markdown(update: dict, train: dict | None) -> str:
  lines = [f"update benchmark: {update['num_params']:,} parameters (fp32), copy bandwidth "
           f"{update['copy_gbps']:.1f} GB/s", "",
           "| optimizer | update (ms) | × AdamW (range over rounds) | state B/param "
           "| bytes moved / param | GB/s | of copy bw | XLA bytes / param "
           "| page faults / update |", "|---|---|---|---|---|---|---|---|---|"]
  for r in update["rows"]:
    low, high = r["ratio_range"]
    compiled = r["compiled_bytes_per_param"]
    lines.append(f"| {r['optimizer']} | {r['update_ms']:.1f} "
                 f"| {r['ratio_to_adamw']:.2f} ({low:.2f}–{high:.2f}) "
                 f"| {r['state_bytes_per_param']:.2f} | {r['bytes_per_param']:.1f} "
                 f"| {r['gbps']:.1f} | {100 * r['fraction_of_copy_bw']:.0f} % "
                 f"| {'n/a' if compiled is None else f'{compiled:.1f}'} "
                 f"| {r['page_faults_per_update']:,.0f} |")
  if train:
    lines += ["", train_step_table(train)]
  return "\n".join(lines)


def train_step_table(train: dict) -> str:
  """The train-step rows (:func:`bench_train_step`) as a Markdown table."""
  lines = ["| train step (small) | tokens/s | step time × AdamW |", "|---|---|---|"]
  lines += [f"| {name} | {tps:,.0f} | {train['step_time_ratio_to_adamw'][name]:.2f} |"
            for name, tps in train["tokens_per_s"].items()]
  return "\n".join(lines)


def train_step_markdown(result: dict) -> str:
  """``--train-step-only``'s result: its machine, load and date, then the table."""
  load = ", ".join(f"{x:.2f}" for x in result["load_average"])
  return (f"Machine: {result['machine']} (load average {load}), {result['date']}; "
          f"{result['rounds']} rounds of {result['steps_per_round']} steps\n\n"
          + train_step_table(result))


def _titled_table(title: str, result: dict, columns: list[str], rows: list[str]) -> str:
  """``title``, then the result's machine and date, then a Markdown table of ``rows``."""
  return "\n".join(
      [f"{title}; {result.get('machine', 'machine not recorded')}, "
       f"{result.get('date', 'no date')}):", "",
       "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)] + rows)


def compile_markdown(result: dict) -> str:
  """The table of a :func:`compile_times` result, with its machine and date."""
  return _titled_table(
      f"Jitted update on a {result['leaves']}-leaf per-expert tree, compiled for "
      f"{result.get('target', 'cpu')} (medians of {result['rounds']} alternating rounds",
      result, ["optimizer", "trace + lower (s)", "compile (s)", "StableHLO lines", "total × AdamW"],
      [f"| {name} | {r['trace_s']:.2f} | {r['compile_s']:.2f} | {r['hlo_lines']:,} "
       f"| {r['total_ratio_to_adamw']:.2f} |" for name, r in result["rows"].items()])


def build_parser() -> argparse.ArgumentParser:
  """The command's flags."""
  parser = argparse.ArgumentParser(prog="python -m experiments.bench",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--experts", type=int, default=16)
  parser.add_argument("--d-model", type=int, default=512)
  parser.add_argument("--d-ff", type=int, default=704, help="each expert's hidden width")
  parser.add_argument("--vocab", type=int, default=8192)
  parser.add_argument("--repeats", type=int, default=10,
                      help="timed calls per optimizer and round (median)")
  parser.add_argument("--rounds", type=int, default=3,
                      help="rounds over all optimizers, interleaved (median)")
  parser.add_argument("--skip-train-step", action="store_true")
  parser.add_argument("--train-step-only", action="store_true",
                      help="only the train-step rows (TRAIN_STEPS), with the machine and date")
  parser.add_argument("--train-steps", type=int, default=10)
  parser.add_argument("--train-rounds", type=int, default=3)
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--system-malloc", action="store_true",
                      help="keep glibc's default allocator settings (see the module docstring)")
  parser.add_argument("--compile-time", action="store_true",
                      help="only time tracing and compiling the update on a Hugging Face "
                           "Mixtral-shaped tree with one leaf per expert (per_expert_tree)")
  parser.add_argument("--target", default="cpu",
                      help="with --compile-time: the compiler to time, a memory-planner target "
                           "(a100-40gb: XLA:GPU without a GPU) or cpu (default)")
  parser.add_argument("--grouping-cost", action="store_true",
                      help="only time the update with its leaves grouped against each alone, "
                           "at several leaf sizes (grouping_step_times), on this machine")
  parser.add_argument("--render", metavar="BENCH_JSON",
                      help="only print the tables of a saved --json result, of the update "
                           "benchmark or of --compile-time (nothing is run)")
  parser.add_argument("--update-temp", action="store_true",
                      help="only report the XLA temp bytes of the update alone for moe-6.78b "
                           "on the A100-40GB target")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  experiments.use_cpu_without_gpu()
  args = build_parser().parse_args(argv)
  if args.render:
    saved = json.loads(pathlib.Path(args.render).read_text())
    if "leaves" in saved:  # a --compile-time result
      print(compile_markdown(saved))
      return 0
    if "steps_per_round" in saved:  # a --train-step-only result
      print(train_step_markdown(saved))
      return 0
    if "rows" in saved and saved["rows"] and "grouped_over_alone" in saved["rows"][0]:
      print(grouping_markdown(saved))  # a --grouping-cost result
      return 0
    print(markdown(saved, saved.get("train_step"))
          + f"\n\nallocator: {saved.get('malloc', 'not recorded')}")
    return 0
  if args.update_temp:
    planner.use_deviceless_gpu_environment()
    result = {**update_temp_bytes(), "date": datetime.date.today().isoformat()}
    print(json.dumps(result, indent=2) if args.json else "\n".join(
        [f"update alone, {result['preset']} (bf16 params), compiled for {result['target']}:"]
        + [f"  {k}: XLA temp {v / GB:.2f} GB, kernels read+write "
           f"{result['kernel_bytes_per_param'][k]:.1f} B/param"
           for k, v in result["temp_bytes"].items()]
        + ([f"  warning: {result['warning']}"] if result["warning"] else [])))
    return 0
  if args.compile_time:
    if args.target != "cpu":
      planner.use_deviceless_gpu_environment()
    # Times are this machine's: the JSON says which one and when.
    result = {**compile_times(per_expert_tree(), rounds=args.rounds, target=args.target),
              "machine": machine_text(), "date": datetime.date.today().isoformat()}
    print(json.dumps(result, indent=2) if args.json else compile_markdown(result))
    return 0
  if args.grouping_cost:
    result = {**grouping_step_times(repeats=args.repeats, rounds=args.rounds),
              "backend": jax.default_backend(), "machine": machine_text(),
              "date": datetime.date.today().isoformat()}
    print(json.dumps(result, indent=2) if args.json else grouping_markdown(result))
    return 0
  if args.train_step_only:
    result = {**bench_train_step(steps=args.train_steps, rounds=args.train_rounds),
              "machine": machine_text(), "load_average": os.getloadavg(),
              "date": datetime.date.today().isoformat()}
    print(json.dumps(result, indent=2) if args.json else train_step_markdown(result))
    return 0
  sizes = ("repeats", "rounds", "layers", "experts", "d_model", "d_ff", "vocab")
  if min(getattr(args, name) for name in sizes) < 1:
    print("error: " + ", ".join(f"--{n.replace('_', '-')}" for n in sizes) + " must be >= 1",
          file=sys.stderr)
    return 2
  tree = moe_tree(layers=args.layers, experts=args.experts, d_model=args.d_model,
                  d_ff=args.d_ff, vocab=args.vocab)
  update = bench_updates(tree, repeats=args.repeats, rounds=args.rounds)
  train = None if args.skip_train_step else bench_train_step(
      steps=args.train_steps, rounds=args.train_rounds)
  if args.json:
    print(json.dumps({**update, "malloc": malloc_setting(), "train_step": train}, indent=2))
  else:
    print(markdown(update, train) + f"\n\nallocator: {malloc_setting()} "
          "(see python -m experiments.bench --help)")
  return 0


def _cli(argv: Sequence[str]) -> int:
  if ("--system-malloc" not in argv and sys.platform.startswith("linux")
      and malloc_setting() == "system"):
    os.execve(sys.executable, [sys.executable, "-m", "experiments.bench", *argv],
              {**os.environ, **CPU_MALLOC_ENV})
  return main(argv)


if __name__ == "__main__":
  sys.exit(_cli(sys.argv[1:]))
