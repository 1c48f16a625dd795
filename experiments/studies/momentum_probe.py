"""What a compact expert momentum can keep: measures on a trained model's expert momentum.

The tuning against Muon asks for an expert momentum within 1.29 GB at
``moe-6.78b`` that carries what
float32 momentum does, and names two forms: low-rank factors per expert matrix,
and a momentum shared by a layer's experts. These measures say what each form
can keep, read off the float32 expert momentum of `small` after a few hundred
steps at the default's settings (:func:`probe`), before any run is spent on it:

* :func:`energy_share_of_mean` and :func:`mean_abs_cosine`: how much of the
  experts' momenta is common to a layer (a shared momentum keeps only that);
* :func:`top_rank_share` against :func:`shared_subspace_share` at equal bytes:
  rank-``r`` factors per expert against one subspace of the model side shared
  by the layer's experts;
* :func:`spectrum_split` and :func:`cosine`: the Newton–Schulz update's size
  inside the low-rank momentum's subspace and outside it, and how far outside
  it the update of a low-rank momentum points where float32's does;
* :func:`follow`: each stored form carried through the same gradients as
  float32's momentum, step after step, and its update's cosine with
  float32's (:func:`fidelity`, from :func:`record_gradients`).

``bash experiments/momentum_probe.sh`` runs :func:`probe` and :func:`fidelity`
and writes ``experiments/results/momentum-probe.json``.
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import skewadam_jax
from skewadam_jax import encodings, labels, orthogonal


def energy_share_of_mean(m: np.ndarray, axis: int) -> float:
  """The share of ``Σ_e ‖m_e‖²`` the mean over ``axis`` (the experts) keeps.

  ``E·‖mean_e m_e‖² / Σ_e ‖m_e‖²``: 1 when every expert's momentum is the same,
  ``1/E`` on average when they are independent, 0 when they cancel.

  Example:
    >>> m = np.stack([np.eye(2), np.eye(2)])
    >>> energy_share_of_mean(m, 0), energy_share_of_mean(np.stack([m[0], -m[0]]), 0)
    (1.0, 0.0)
  """
  m = np.asarray(m, np.float64)
  mean = np.broadcast_to(m.mean(axis=axis, keepdims=True), m.shape)
  return float(np.sum(mean ** 2) / np.sum(m ** 2))


def mean_abs_cosine(m: np.ndarray, axis: int) -> float:
  """The mean ``|cos|`` between two experts' momenta (each flattened), over
  every pair of experts along ``axis`` and every index of the other leading axes.

  ``m``'s last two axes are each expert's matrix.
  """
  m = np.moveaxis(np.asarray(m, np.float64), axis, -3)
  experts = m.shape[-3]
  flat = m.reshape(-1, experts, m.shape[-2] * m.shape[-1])
  flat = flat / np.linalg.norm(flat, axis=-1, keepdims=True)
  gram = flat @ np.swapaxes(flat, -1, -2)
  upper = np.triu_indices(experts, 1)
  return float(np.mean(np.abs(gram[:, upper[0], upper[1]])))


def top_rank_share(mats: np.ndarray, rank: int) -> float:
  """The share of the matrices' (the last two axes) energy their best rank-``rank``
  approximations keep, each matrix its own (Eckart–Young: the top singular values)."""
  s = np.linalg.svd(np.asarray(mats, np.float64), compute_uv=False)
  return float(np.sum(s[..., :rank] ** 2) / np.sum(s ** 2))


def shared_subspace_share(mats: np.ndarray, rank: int) -> float:
  """The share of the experts' energy one rank-``rank`` subspace of their rows keeps.

  ``mats`` is ``[..., E, d, o]``: ``E`` experts whose ``d`` side (the model's
  width) shares one subspace, the top ``rank`` left singular vectors of the
  experts side by side (``[d, E·o]``), per index of the leading axes. Its
  factors cost ``rank·(d/E + o)`` an expert against ``rank·(d + o)`` for
  factors of its own.
  """
  mats = np.asarray(mats, np.float64)
  side_by_side = np.concatenate(np.moveaxis(mats, -3, 0), axis=-1)  # [..., d, E·o]
  basis = np.linalg.svd(side_by_side, full_matrices=False)[0][..., :rank]
  kept = np.swapaxes(basis, -1, -2)[..., None, :, :] @ mats
  return float(np.sum(kept ** 2) / np.sum(mats ** 2))


def equal_bytes_shared_rank(rank: int, d: int, o: int, experts: int) -> int:
  """The shared subspace's rank with per-expert rank ``rank``'s bytes (rounded down).

  Example:
    >>> equal_bytes_shared_rank(42, 128, 256, 8)
    59
  """
  return int(rank * (d + o) / (d / experts + o))


def spectrum_split(u: np.ndarray, basis: np.ndarray) -> tuple[float, float]:
  """The mean squared singular value of ``u`` inside the span of ``basis``'s
  orthonormal columns and outside it: ``‖PPᵀu‖²/k`` and ``‖u − PPᵀu‖²/(n − k)``
  per matrix, averaged, with ``n = min(R, C)``.

  For an orthogonal ``u`` (every singular value 1) both are 1.
  """
  u, basis = np.asarray(u, np.float64), np.asarray(basis, np.float64)
  kept = basis @ (np.swapaxes(basis, -1, -2) @ u)
  k, n = basis.shape[-1], min(u.shape[-2:])
  count = int(np.prod(u.shape[:-2]))
  return (float(np.sum(kept ** 2) / (k * count)),
          float(np.sum((u - kept) ** 2) / ((n - k) * count)))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
  """The mean over matrices (the last two axes) of ``⟨a, b⟩ / (‖a‖·‖b‖)``."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  dot = np.sum(a * b, axis=(-2, -1))
  return float(np.mean(dot / (np.linalg.norm(a, axis=(-2, -1)) * np.linalg.norm(b, axis=(-2, -1)))))


def nesterov_input(momentum, gradient, b1: float):
  """The orthogonal step's Newton–Schulz input from the stored momentum and this
  step's gradient: ``m_t = b1·m + (1 − b1)·g``, then ``b1·m_t + (1 − b1)·g``."""
  m = b1 * momentum + (1 - b1) * gradient
  return m, b1 * m + (1 - b1) * gradient


def _orthogonal(x) -> np.ndarray:
  """Newton–Schulz over the last two axes, as the library's orthogonal step takes it."""
  return np.asarray(orthogonal.newton_schulz(jnp.asarray(x, jnp.float32),
                                             skewadam_jax.MatrixAxes(-2, -1)))


def _fp32_run(steps: int, seed: int):
  """`small` at the default's settings with float32 expert momentum, trained ``steps``
  steps: ``(run, result)``."""
  # Imported here: the measures above need neither the model nor the data.
  from experiments.training import config as config_lib  # pylint: disable=import-outside-toplevel
  from experiments.training import run as run_lib  # pylint: disable=import-outside-toplevel

  config = config_lib.TrainConfig(
      preset="small", steps=1600, optimizer="skewadam", lr=0.015, warmup_steps=160,
      weight_decay=0.2, expert_momentum="fp32", backbone_orthogonal_scale="width",
      expert_orthogonal_scale="width", eval_every=10 ** 9, ckpt_every=10 ** 9,
      log_every=100, sample_tokens=0, seed=seed)
  with tempfile.TemporaryDirectory() as out:
    result = run_lib.train(config, out, stop_after=steps, progress=False)
  return run_lib.Run(config), result


def _loss(run, params, inputs, targets):
  from flax import nnx  # pylint: disable=import-outside-toplevel
  import models  # pylint: disable=import-outside-toplevel
  return models.lm_loss(nnx.merge(run.graphdef, params, run.rest), inputs, targets)[0]


def probe(steps: int = 300, seed: int = 0, ranks=(6, 42), b1: float = 0.9) -> dict:
  """Trains `small` at the default's settings with float32 expert momentum for
  ``steps`` steps, then measures each stacked expert matrix's momentum.

  The low-rank momentum's update is the step's own with the stored momentum
  replaced by its best rank-``r`` approximation (what rank-``r`` factors could
  hold at best), on the gradient of batch ``steps``.

  Returns:
    One entry per expert leaf (``w_up``, ``w_gate``, ``w_down``) with the
    measures above, and the settings.
  """
  run, result = _fp32_run(steps, seed)
  inputs, targets = run.batch_at(steps)
  grads = jax.grad(lambda p: _loss(run, p, inputs, targets))(result.params)
  d_model = run.model_config.d_model
  by_path = {labels.path_to_str(p): g for p, g in jax.tree_util.tree_leaves_with_path(grads)}
  leaves = {}
  for path, mu in jax.tree_util.tree_leaves_with_path(result.opt_state):
    name = labels.path_to_str(path)
    parts = name.split("/")
    if "mu" not in parts or "experts" not in parts or np.ndim(mu) != 4:
      continue
    param = "/".join(parts[parts.index("mu") + 1:])
    momentum = np.asarray(mu, np.float32)  # [layers, experts, R, C]
    gradient = np.asarray(by_path[param], np.float32).reshape(momentum.shape)
    rows, cols = momentum.shape[-2:]
    # the model side first, for the shared subspace
    model_side = momentum if rows == d_model else np.swapaxes(momentum, -1, -2)
    experts = momentum.shape[1]
    entry = {"shape": list(momentum.shape),
             "energy_share_of_experts_mean": energy_share_of_mean(momentum, 1),
             "mean_abs_cosine_between_experts": mean_abs_cosine(momentum, 1),
             "ranks": {}}
    m, nest = nesterov_input(momentum, gradient, b1)
    full_update = _orthogonal(nest)
    left = np.linalg.svd(m.astype(np.float64), full_matrices=False)[0]
    for rank in ranks:
      shared_rank = equal_bytes_shared_rank(rank, d_model, model_side.shape[-1], experts)
      basis = left[..., :rank]
      # the best rank-r store of the momentum, then this step as the library takes it
      stored = basis @ (np.swapaxes(basis, -1, -2) @ momentum)
      m_low, nest_low = nesterov_input(stored, gradient, b1)
      low_update = _orthogonal(nest_low)
      low_basis = np.linalg.svd(m_low, full_matrices=False)[0][..., :rank]
      outside = lambda u, b=low_basis: u - b @ (np.swapaxes(b, -1, -2) @ u)  # noqa: E731
      entry["ranks"][str(rank)] = {
          "share_of_directions": rank / min(rows, cols),
          "top_rank_energy_share": top_rank_share(momentum, rank),
          "shared_rank_at_equal_bytes": shared_rank,
          "shared_subspace_energy_share": shared_subspace_share(model_side, shared_rank),
          "fp32_update_sq_singular_inside_outside": spectrum_split(full_update, basis),
          "lowrank_update_sq_singular_inside_outside": spectrum_split(low_update, low_basis),
          "cosine_outside_lowrank_vs_fp32": cosine(outside(low_update), outside(full_update)),
          "cosine_outside_gradient_update_vs_fp32": cosine(outside(_orthogonal(gradient)),
                                                           outside(full_update)),
      }
    leaves[param] = entry
  return {"preset": "small", "steps": steps, "seed": seed, "b1": b1,
          "settings": "the default's (rate 1.5e-2, warmup 160, weight decay 0.2, width "
                      "scaling) with float32 expert momentum",
          "leaves": leaves}



def float32_updates(gradients, b1: float = 0.9) -> list[np.ndarray]:
  """The orthogonal updates of float32 momentum, from zero, on ``gradients``
  (a sequence of ``[..., R, C]`` arrays, one a step): :func:`follow`'s reference."""
  momentum, updates = 0.0, []
  for g in gradients:
    momentum, nest = nesterov_input(momentum, np.asarray(g, np.float32), b1)
    updates.append(_orthogonal(nest))
  return updates


def follow(gradients, encoding, b1: float = 0.9, burn_in: int = 0, salt: int = 0,
           reference=None) -> float:
  """The mean cosine of a stored momentum's orthogonal update with float32's.

  Both momenta start at zero and take the same ``gradients`` (a sequence of
  ``[..., R, C]`` arrays, one a step); each step the stored one is decoded,
  updated and encoded again by ``encoding`` (a
  :class:`~skewadam_jax.encodings.MomentumEncoding`, or ``None``: no momentum,
  the update orthogonalises the gradient), as the library's orthogonal step
  does. The cosines of the steps after the first ``burn_in`` are averaged over
  steps and matrices: 1 for a form that keeps float32's momentum exactly.
  ``reference``: float32's updates on the same gradients
  (:func:`float32_updates`), computed here when not given.
  """
  if reference is None:
    reference = float32_updates(gradients, b1)
  stored = None
  cosines = []
  for step, (g, exact_update) in enumerate(zip(gradients, reference)):
    g = np.asarray(g, np.float32)
    axes = skewadam_jax.MatrixAxes(g.ndim - 2, g.ndim - 1)
    if encoding is None:
      nest = g
    else:
      previous = (np.zeros_like(g) if stored is None
                  else np.asarray(encoding.decode(stored, axes)))
      m, nest = nesterov_input(previous, g, b1)
      stored = encoding.encode(jnp.asarray(m), axes, salt=jnp.uint32(salt + step + 1),
                               previous=stored)
    if step >= burn_in:
      cosines.append(cosine(_orthogonal(nest), exact_update))
  return float(np.mean(cosines))


def record_gradients(steps: int, count: int, seed: int = 0) -> dict:
  """The expert matrices' gradients of ``count`` consecutive steps of `small`
  trained at the default's settings with float32 expert momentum, after
  ``steps`` steps: ``{param path: [count, layers, experts, R, C]}``."""
  recorded = {}

  def keep(grads):
    for path, g in jax.tree_util.tree_leaves_with_path(grads):
      name = labels.path_to_str(path)
      if "experts" in name.split("/") and np.ndim(g) == 4:
        recorded.setdefault(name, []).append(np.asarray(g, np.float32))

  run, result = _fp32_run(steps, seed)
  params, state = result.params, result.opt_state
  grad_fn = jax.jit(jax.grad(lambda p, x, y: _loss(run, p, x, y)))
  update_fn = jax.jit(run.tx.update)
  for step in range(steps, steps + count):
    grads = grad_fn(params, *run.batch_at(step))
    keep(grads)
    updates, state = update_fn(grads, state, params)
    params = jax.tree.map(lambda p, u: (p + u).astype(p.dtype), params, updates)
  return {name: np.stack(gs) for name, gs in recorded.items()}


# The stored forms :func:`fidelity` follows, by name: the library's encodings of the
# expert momentum at the ranks and dtypes the training runs measured (muon-gap.md),
# then the factors in int8 at the same bytes (rank 12 at rank 6 in bfloat16's, the
# default's share at moe-6.78b on small; rank 84 at rank 42 in bfloat16's).
FORMS = {
    "fp32": lambda: encodings.get_encoding("fp32"),
    "lowrank-42-bf16": lambda: encodings.get_encoding(
        "lowrank", rank=42, lowrank_dtype="bfloat16", rounding="stochastic"),
    "lowrank-16": lambda: encodings.get_encoding("lowrank", rank=16),
    "lowrank-6-bf16": lambda: encodings.get_encoding(
        "lowrank", rank=6, lowrank_dtype="bfloat16", rounding="stochastic"),
    "lowrank-2": lambda: encodings.get_encoding("lowrank", rank=2),
    "sign": lambda: encodings.get_encoding("sign"),
    "none": lambda: None,
    "lowrank-12-int8": lambda: encodings.get_encoding(
        "lowrank", rank=12, lowrank_dtype="int8", rounding="stochastic"),
    "lowrank-84-int8": lambda: encodings.get_encoding(
        "lowrank", rank=84, lowrank_dtype="int8", rounding="stochastic"),
}


def fidelity(gradients: dict, forms=tuple(FORMS), b1: float = 0.9, burn_in: int = 30) -> dict:
  """:func:`follow` for each form of :data:`FORMS` on each leaf's recorded gradients:
  ``{form: {param path: mean cosine}}``."""
  # float32's updates once a leaf, the reference of every form
  references = {name: float32_updates(gs, b1) for name, gs in gradients.items()}
  return {form: {name: follow(list(gs), FORMS[form](), b1=b1, burn_in=burn_in,
                              reference=references[name])
                 for name, gs in gradients.items()} for form in forms}
