"""Checks on 8 simulated CPU devices, run by tests/experiments/test_parallel.py in a subprocess.

The device count is fixed when JAX starts, so this runs in its own process
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``) and prints one JSON
object; the test asserts on it. With a path argument it also saves the
single-device SkewAdam parameters there (.npz), the reference for the
two-process test. Standalone:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_parallel_worker.py
"""

import collections
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import models  # noqa: E402
import skewadam_jax  # noqa: E402
from experiments.training import optimizers  # noqa: E402
from experiments.training import mesh as mesh_lib  # noqa: E402
from experiments import parallel  # noqa: E402
from experiments.training import steps  # noqa: E402
from experiments.training import run as training  # noqa: E402
from experiments.training.config import TrainConfig  # noqa: E402
from experiments.training.metrics_log import read_metrics  # noqa: E402

# The run `python -m experiments.parallel --preset tiny --compute-dtype float32
# --steps 2 --batch-size 8 --seq-len 32 --lr 1e-3 --seed 0` makes.
STEPS, BATCH, SEQ, LR, SEED = 2, 8, 32, 1e-3, 0


def placement_errors(tree, shardings) -> list[str]:
  """Leaves not laid out as ``shardings`` says, on all 8 devices."""
  errors = []
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  for (path, x), want in zip(leaves, jax.tree.leaves(shardings)):
    name = jax.tree_util.keystr(path)
    if not x.sharding.is_equivalent_to(want, x.ndim):
      errors.append(f"{name}: {x.sharding.spec} != {want.spec}")
    shard_shapes = {tuple(s.data.shape) for s in x.addressable_shards}
    if len(x.addressable_shards) != 8 or shard_shapes != {want.shard_shape(x.shape)}:
      errors.append(f"{name}: shards {shard_shapes} on {len(x.addressable_shards)} "
                    f"devices, want {want.shard_shape(x.shape)}")
  return errors


def tier_bytes_per_device(state, tier: str) -> tuple[dict, int]:
  """Bytes of ``tier``'s state arrays held by each device, and in total."""
  per_device, total = collections.Counter(), 0
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    if skewadam_jax.labels.label_path(skewadam_jax.labels.path_to_str(path)) != tier:
      continue
    if skewadam_jax.transform.is_placeholder(x):  # one replicated byte, not the tier's
      continue
    total += x.nbytes
    for shard in x.addressable_shards:
      per_device[shard.device.id] += shard.data.nbytes
  return dict(per_device), total


def max_abs_diff(a, b) -> float:
  """The largest entry-wise difference between two trees, in float32."""
  return max(jax.tree.leaves(jax.tree.map(
      lambda x, y: float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32)))),
      a, b)))


def run_sharded(spmd, params, batches):
  """``spmd``'s init and train step over ``batches``: (params, state, losses)."""
  params, state = spmd.init(params)
  losses = []
  for inputs, targets in batches:
    params, state, metrics = spmd.train_step(params, state, inputs, targets)
    losses.append(float(metrics["loss"]))
  return params, state, losses


def compare(optimizer: str, fsdp: bool, save_reference: str | None = None) -> dict:
  """The sharded step against the single-device step, on `tiny` in float32."""
  # float32 compute: bf16 matmuls round partial sums differently once split.
  config = models.get_preset("tiny", compute_dtype="float32")
  graphdef, params, rest = nnx.split(
      models.Transformer(config, rngs=nnx.Rngs(SEED)), nnx.Param, ...)
  axes = models.logical_axes(params)
  params = nnx.as_pure(params)
  tx = optimizers.make_optimizer(optimizer, learning_rate=LR, axes=axes)
  train_step, _ = steps.make_step_fns(graphdef, rest, tx)
  batches = [parallel.synthetic_batch(s, BATCH, SEQ, config.vocab_size, SEED)
             for s in range(STEPS)]

  step = jax.jit(train_step)
  ref_params, ref_state = jax.tree.map(jnp.copy, params), tx.init(params)
  ref_losses = []
  for inputs, targets in batches:
    ref_params, ref_state, metrics = step(ref_params, ref_state, inputs, targets)
    ref_losses.append(float(metrics["loss"]))
  if save_reference:
    np.savez(save_reference, **{skewadam_jax.labels.path_to_str(k): np.asarray(v) for k, v
                                in jax.tree_util.tree_flatten_with_path(ref_params)[0]})

  mesh = mesh_lib.make_mesh(data=2, expert=4)
  spmd = mesh_lib.spmd_steps(mesh, steps.standard_step(graphdef, rest, tx), params, axes=axes,
                              fsdp=fsdp)
  want_state = skewadam_jax.state_shardings(tx, params, spmd.shardings.params)
  sharded_params, state = spmd.init(params)
  errors = [f"init: {e}" for e in placement_errors(state, want_state)]
  errors += [f"init params: {e}" for e in placement_errors(sharded_params, spmd.shardings.params)]
  init_expert = tier_bytes_per_device(state, "expert")
  losses = []
  for inputs, targets in batches:
    sharded_params, state, metrics = spmd.train_step(sharded_params, state, inputs, targets)
    losses.append(float(metrics["loss"]))
  errors += [f"update: {e}" for e in placement_errors(state, want_state)]
  errors += [f"update params: {e}" for e in placement_errors(sharded_params, spmd.shardings.params)]
  per_device, total = tier_bytes_per_device(state, "expert")
  return {
      "losses": losses, "ref_losses": ref_losses,
      "max_param_diff": max_abs_diff(sharded_params, ref_params),
      "placement_errors": errors,
      "expert_bytes_per_device": per_device, "expert_bytes_total": total,
      "expert_bytes_per_device_at_init": init_expert[0],
      "helper_bytes_per_device": mesh_lib.device_state_bytes_by_tier(state),
      "state_bytes": skewadam_jax.state_bytes_by_tier(state),
  }


def _write_corpus(folder: pathlib.Path, seed: int) -> pathlib.Path:
  """Three small generated 'works' (tokenizer training is instant)."""
  folder.mkdir()
  rng = np.random.default_rng(seed)
  words = ["thou", "art", "the", "king", "and", "queen", "of", "love", "night", "day"]
  for name in ("first", "second", "third"):
    (folder / f"{name}.txt").write_text(
        "\n".join(" ".join(rng.choice(words, size=12)) + "." for _ in range(200)))
  return folder


def train_command(tmp: pathlib.Path) -> dict:
  """`experiments.train` with --mesh and --fsdp: runs, evaluates, checkpoints sharded arrays."""
  corpus = _write_corpus(tmp / "corpus", seed=0)
  config = TrainConfig(
      preset="tiny", mesh="data=2,expert=4", fsdp=True, steps=3, batch_size=4, seq_len=16,
      eval_batches=1, warmup_steps=1, data=str(corpus))
  summary = training.train(config, tmp / "run", cache_dir=tmp / "tok", progress=False)
  expert = summary.params["layers"]["moe"]["experts"]["w_up"]
  return {"val_ppl": summary["val_ppl"], "train_loss": summary["train_loss"],
          "w_up_spec": [str(a) for a in expert.sharding.spec],
          "checkpoints": sorted(p.name for p in (tmp / "run" / "ckpt").iterdir())}


def train_command_layerwise(tmp: pathlib.Path) -> dict:
  """`experiments.train --mesh data=2,expert=4 --update-in-backward` against one device,
  and the memory planner's compiled step for that configuration against the command's."""
  from experiments.planning import planner  # pylint: disable=import-outside-toplevel
  corpus = _write_corpus(tmp / "corpus-layerwise", seed=1)
  # Adam's direction: this checks the layerwise engine on a mesh, not the direction
  # (the default's orthogonal step on 8 devices: train_command above and the
  # planner's devices tests), and Newton-Schulz's compiles would double its time.
  # float32 compute, as compare(): a bf16 sum split across devices rounds differently.
  settings = dict(preset="tiny", update_in_backward=True, steps=3, batch_size=8, seq_len=16,
                  eval_batches=1, warmup_steps=1, data=str(corpus), log_every=1,
                  sample_tokens=0, backbone_direction="adam", expert_direction="adam",
                  compute_dtype="float32")

  def steps_of(run):
    """The reference: ``run``'s own train step over the command's first 3 batches."""
    params, state = run.init_state()
    losses = []
    for step in range(settings["steps"]):
      params, state, metrics = run.train_step(params, state, *run.batch_at(step))
      losses.append(float(metrics["loss"]))
    return losses, params

  config = TrainConfig(mesh="data=2,expert=4", **settings)
  run = training.Run(config, cache_dir=tmp / "tok")
  sharded = training.train(config, tmp / "mesh", cache_dir=tmp / "tok", progress=False, run=run)
  ref_losses, one = steps_of(training.Run(TrainConfig(**settings), cache_dir=tmp / "tok"))
  # The standard step on the same mesh: the planner must compile it too.
  standard_run = training.Run(TrainConfig(mesh="data=2,expert=4",
                                          **{**settings, "update_in_backward": False}),
                              cache_dir=tmp / "tok")
  losses = [r["loss"] for r in read_metrics(tmp / "mesh" / "metrics.jsonl", 3) if "loss" in r]

  def fingerprints(run):
    """(the command's compiled step, the planner's) for ``run``'s configuration."""
    params, state = run.init_state()
    inputs, targets = run.batch_at(0)
    s = run.spmd.shardings
    trained = mesh_lib.sharded_train_step(run.step.train_step, s).lower(
        params, state, *mesh_lib.put((inputs, targets), (s.batch, s.batch)), {}).compile()
    planned = planner.compile_step(run.config, batch=8, seq=16, target="cpu", devices=8,
                                   mesh={"data": 2, "expert": 4})
    return trained, planned

  trained, planned = fingerprints(run)
  standard_trained, standard_planned = fingerprints(standard_run)
  return {"losses": losses, "ref_losses": ref_losses,
          "max_param_diff": max_abs_diff(sharded.params, one),
          "trained_fingerprint": planner.step_fingerprint(trained),
          "planned_fingerprint": planned["fingerprint"],
          "trained_temp": int(trained.memory_analysis().temp_size_in_bytes),
          "planned_temp": planned["xla"]["temp"],
          "standard_trained_fingerprint": planner.step_fingerprint(standard_trained),
          "standard_planned_fingerprint": standard_planned["fingerprint"]}


def expert_parallel() -> dict:
  """`tiny` with moe_impl='expert_parallel' on data=2 x expert=4 against one device."""
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from models import expert_parallel as ep  # pylint: disable=import-outside-toplevel
  # The one-device reference uses the dense lowering: another way to the same sums.
  ref_config = models.get_preset("tiny", compute_dtype="float32")
  config = models.get_preset("tiny", compute_dtype="float32", moe_impl="expert_parallel",
                             moe_block_size=8)
  model = models.Transformer(config, rngs=nnx.Rngs(SEED))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ref_graphdef = nnx.split(models.Transformer(ref_config, rngs=nnx.Rngs(SEED)), nnx.Param, ...)[0]
  axes = models.logical_axes(params)
  params = nnx.as_pure(params)
  tx = optimizers.make_optimizer("adamw", learning_rate=LR, axes=axes)
  batches = [parallel.synthetic_batch(s, BATCH, SEQ, config.vocab_size, SEED)
             for s in range(3)]
  ref_step = jax.jit(steps.make_step_fns(ref_graphdef, rest, tx)[0])
  ref_params, ref_state = jax.tree.map(jnp.copy, params), tx.init(params)
  ref_losses = []
  for inputs, targets in batches:
    ref_params, ref_state, metrics = ref_step(ref_params, ref_state, inputs, targets)
    ref_losses.append(float(metrics["loss"]))

  mesh = mesh_lib.make_mesh(data=2, expert=4)
  step_fns = steps.standard_step(graphdef, rest, tx)
  spmd = mesh_lib.spmd_steps(mesh, step_fns, params, axes=axes, expert_parallel=True)
  sharded_params, state, losses = run_sharded(spmd, params, batches)
  # FSDP with expert parallelism: the backbone split over both axes, as the batch.
  fsdp = mesh_lib.spmd_steps(mesh, step_fns, params, axes=axes, expert_parallel=True, fsdp=True)
  fsdp_params, _, fsdp_losses = run_sharded(fsdp, params, batches)

  s = spmd.shardings
  hlo = mesh_lib.sharded_train_step(step_fns.train_step, s).lower(
      sharded_params, state, *mesh_lib.put(batches[0], (s.batch, s.batch)), {}
  ).compile().as_text()
  bank_dims = {(config.num_experts, config.d_model, config.d_ff),
               (config.num_experts, config.d_ff, config.d_model)}
  gathered = [line.strip()[:160] for line in hlo.splitlines() if " all-gather(" in line
              and any(",".join(map(str, d)) in line for d in bank_dims)]

  # Which rows each device receives: only its own experts' assignments.
  inputs = batches[0][0]
  x_TD = jnp.zeros((inputs.size, config.d_model), jnp.float32)
  experts_TK = jnp.asarray(np.random.default_rng(1).integers(
      0, config.num_experts, (inputs.size, config.top_k)), jnp.int32)
  local = config.num_experts // 4

  def received(x_TD, experts_TK):
    _, recv_e, _, _ = ep.dispatch(x_TD, experts_TK, local_experts=local, num_devices=4)
    return recv_e.reshape(1, -1)
  with jax.set_mesh(mesh):
    recv = jax.jit(jax.shard_map(received, in_specs=(P(("data", "expert")),) * 2,
                                 out_specs=P(("data", "expert"))))(x_TD, experts_TK)
  recv = np.asarray(recv)  # [8 devices, rows]
  groups = np.asarray(experts_TK).reshape(2, -1)  # the two data shards' assignments
  received_counts, wanted_counts = [], []
  for device in range(8):
    data_shard, expert_shard = divmod(device, 4)
    real = recv[device][recv[device] < local]
    received_counts.append(int(real.size))
    wanted_counts.append(int(np.sum(groups[data_shard] // local == expert_shard)))
  return {"losses": losses, "ref_losses": ref_losses,
          "max_param_diff": max_abs_diff(sharded_params, ref_params),
          "all_to_all": hlo.count(" all-to-all("), "bank_all_gathers": gathered,
          "received_counts": received_counts, "wanted_counts": wanted_counts,
          "batch_spec": [str(a) for a in s.batch.spec],
          "fsdp_losses": fsdp_losses, "fsdp_max_param_diff": max_abs_diff(fsdp_params, ref_params),
          "fsdp_query_spec": [str(a) for a in
                              fsdp.shardings.params["layers"]["attn"]["query"]["kernel"].spec]}


def main() -> None:
  assert jax.device_count() == 8, jax.devices()
  with tempfile.TemporaryDirectory() as tmp:
    result = {
        "skewadam": compare("skewadam", fsdp=False,
                            save_reference=sys.argv[1] if len(sys.argv) > 1 else None),
        "adamw_fsdp": compare("adamw", fsdp=True),
        "train": train_command(pathlib.Path(tmp)),
        "train_layerwise": train_command_layerwise(pathlib.Path(tmp)),
        "expert_parallel": expert_parallel(),
    }
  print(json.dumps(result))


if __name__ == "__main__":
  main()
