"""experiments/training/mesh.py, distributed.py and the parallel command: mesh, shardings, the sharded step, several processes.

Layout rules are checked in this process on an ``AbstractMesh`` (no devices
needed). The checks that need devices run in subprocesses, because the CPU
device count is fixed when JAX starts: 8 simulated devices
(tests/_parallel_worker.py) and two processes joined by ``jax.distributed`` on
loopback (``python -m experiments.parallel``, the documented command, docs/guides/scaling-out.md).
"""

import doctest
import json
import pathlib
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

import models
import skewadam_jax
from experiments.training import optimizers
from experiments.training import distributed
from experiments.training import mesh as mesh_lib
from experiments.training import steps
from experiments import train as train_lib
from tests import _subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
MESH = AbstractMesh((2, 4), ("data", "expert"))
EXPERTS = "layers/moe/experts"


@pytest.fixture(scope="module")
def tiny_params():
  model = nnx.eval_shape(lambda: models.Transformer(models.get_preset("tiny"),
                                                    rngs=nnx.Rngs(0)))
  return nnx.as_pure(nnx.state(model, nnx.Param))


@pytest.fixture(scope="module")
def tiny_axes():
  return models.logical_axes(models.abstract_params(models.get_preset("tiny")))


def by_path(tree):
  return {skewadam_jax.labels.path_to_str(p): x
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def stripped(spec):
  spec = list(spec)
  while spec and spec[-1] is None:
    spec.pop()
  return tuple(spec)


# --------------------------------------------------------------------------
# In this process.
# --------------------------------------------------------------------------


def test_parse_mesh():
  assert mesh_lib.parse_mesh("data=4,expert=2") == {"data": 4, "expert": 2}
  assert mesh_lib.parse_mesh(" expert=8 ") == {"expert": 8}
  assert mesh_lib.parse_mesh("") == {}
  for bad, message in [("model=2", "bad --mesh entry 'model=2'"),
                       ("data4", "bad --mesh entry 'data4'"),
                       ("data=0", "data must be a positive integer, got '0'"),
                       ("data=x", "data must be a positive integer, got 'x'"),
                       ("data=2,data=2", "names 'data' twice")]:
    with pytest.raises(ValueError, match=message):
      mesh_lib.parse_mesh(bad)


def test_make_mesh_uses_every_device():
  mesh = mesh_lib.make_mesh()
  assert dict(mesh.shape) == {"data": jax.device_count(), "expert": 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ValueError, match="needs 16 devices, but there are 1.*"
                     "xla_force_host_platform_device_count"):
    mesh_lib.make_mesh(data=4, expert=4, devices=jax.devices()[:1])


def test_param_shardings_split_experts_on_their_expert_axis(tiny_params, tiny_axes):
  specs = {k: stripped(s.spec) for k, s in
           by_path(mesh_lib.param_shardings(tiny_params, MESH, axes=tiny_axes)).items()}
  for name in ("w_gate", "w_up", "w_down"):  # [L, E, d_in, d_out]
    assert specs.pop(f"{EXPERTS}/{name}") == (None, "expert")
  assert specs.pop("layers/moe/router/kernel") == (None, None, "expert")  # [L, D, E]
  assert set(specs.values()) == {()}  # the backbone replicated


def test_param_shardings_fsdp(tiny_params, tiny_axes):
  shapes = {k: x.shape for k, x in by_path(tiny_params).items()}
  specs = {k: stripped(s.spec) for k, s in by_path(
      mesh_lib.param_shardings(tiny_params, MESH, axes=tiny_axes, fsdp=True)).items()}
  assert shapes["embed/embedding"] == (256, 32)
  assert specs["embed/embedding"] == ("data",)
  assert specs["unembed/kernel"] == (None, "data")
  assert shapes[f"{EXPERTS}/w_down"] == (2, 4, 48, 32)
  assert specs[f"{EXPERTS}/w_down"] == (None, "expert", "data")
  assert specs["final_norm/scale"] == ()  # vectors stay replicated
  assert specs["layers/attn_norm/scale"] == ()  # stacked ones too
  for name, spec in specs.items():  # never the scanned layer axis
    if name.startswith("layers/") and len(shapes[name]) >= 3:
      assert spec[:1] in ((), (None,)), name


def test_param_shardings_fsdp_with_the_expert_parallel_moe_split_the_backbone_over_both_axes(
    tiny_params, tiny_axes):
  # The expert-parallel MoE splits the batch over data and expert: so does FSDP.
  mesh = AbstractMesh((2, 4), ("data", "expert"))
  specs = {k: stripped(s.spec) for k, s in by_path(mesh_lib.param_shardings(
      tiny_params, mesh, axes=tiny_axes, fsdp=True, expert_parallel=True)).items()}
  assert specs["embed/embedding"] == (("data", "expert"),)  # [256, 32]: 8 ways
  assert specs["unembed/kernel"] == (None, ("data", "expert"))
  assert specs["layers/attn/query/kernel"] == (None, None, ("data", "expert"))
  # A bank already split over expert by its experts adds only data.
  assert specs[f"{EXPERTS}/w_down"] == (None, "expert", "data")
  assert specs["final_norm/scale"] == ()


def test_gradients_are_pinned_to_the_parameter_layout_only_in_a_sharded_step():
  mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
  grads = {"w": jnp.ones((4, 8))}
  layout = {"w": NamedSharding(mesh, P(None, "data"))}

  def constraints(fn):
    return [e for e in jax.make_jaxpr(fn)(grads).eqns if e.primitive.name == "sharding_constraint"]

  assert constraints(mesh_lib.in_parameter_layout) == []

  def pinned(g):
    with mesh_lib.parameter_layout(layout):
      return mesh_lib.in_parameter_layout(g)

  (eqn,) = constraints(pinned)
  assert eqn.params["sharding"].spec == P(None, "data")
  assert constraints(mesh_lib.in_parameter_layout) == []  # the layout is reset after the block


def test_param_shardings_need_experts_to_divide(tiny_params, tiny_axes):
  with pytest.raises(ValueError, match="'layers/moe/experts/w_down'.*'experts', size 4.*"
                     "expert=3"):
    mesh_lib.param_shardings(tiny_params, AbstractMesh((1, 3), ("data", "expert")),
                             axes=tiny_axes)
  with pytest.raises(ValueError, match="'embed/embedding' has no declared logical axes"):
    mesh_lib.param_shardings(tiny_params, MESH, axes={})


@pytest.mark.parametrize("optimizer", optimizers.OPTIMIZERS)
def test_every_optimizer_gets_valid_state_shardings(tiny_params, tiny_axes, optimizer):
  tx = optimizers.make_optimizer(optimizer, learning_rate=1e-3, axes=tiny_axes)
  shardings = mesh_lib.train_shardings(MESH, tx, tiny_params, axes=tiny_axes, fsdp=True)
  state = jax.eval_shape(tx.init, tiny_params)
  for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings.opt_state)):
    s.shard_shape(x.shape)  # raises unless every split axis divides evenly
  per_device = mesh_lib.device_state_bytes_by_tier(state, shardings.opt_state)
  whole = skewadam_jax.state_bytes_by_tier(state)
  assert 0 < per_device["expert"] <= whole["expert"] // 4


def test_device_state_bytes_split_the_expert_tier(tiny_params, tiny_axes):
  tx = optimizers.make_optimizer("skewadam", learning_rate=1e-3, axes=tiny_axes)
  shardings = mesh_lib.train_shardings(MESH, tx, tiny_params, axes=tiny_axes)
  state = jax.eval_shape(tx.init, tiny_params)
  per_device = mesh_lib.device_state_bytes_by_tier(state, shardings.opt_state)
  whole = skewadam_jax.state_bytes_by_tier(state)
  assert per_device["expert"] * 4 == whole["expert"]
  assert per_device["backbone"] == whole["backbone"]  # replicated
  assert shardings.batch.spec == P("data")
  assert shardings.replicated.spec == P()


def test_put_places_and_keeps():
  mesh = mesh_lib.make_mesh()
  sharding = NamedSharding(mesh, P("data"))
  x = mesh_lib.put(np.arange(4.0), sharding)
  assert x.sharding == sharding
  assert mesh_lib.put(x, sharding) is x  # already there: no copy
  y = mesh_lib.put(jnp.arange(4.0), NamedSharding(mesh, P()))
  assert y.sharding.spec == P()


def test_put_moves_typed_prng_keys():
  mesh = mesh_lib.make_mesh()
  key = mesh_lib.put(jax.random.key(0), NamedSharding(mesh, P()))
  assert key.sharding.spec == P()
  assert jax.random.key_impl(key) == jax.random.key_impl(jax.random.key(0))


def test_spmd_steps_take_host_batches_and_keyword_arguments():
  tx = optax.sgd(0.5)

  def train_step(params, opt_state, inputs, targets, scale=1.0):
    loss = lambda p: scale * jnp.sum(p["w"]) * jnp.mean(inputs + targets)
    grads = jax.grad(loss)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss(params)}

  params = {"w": jnp.ones((4, 2))}
  step = steps.TrainStep(tx, train_step, None, tx.init,
                         lambda p, s: skewadam_jax.state_shardings(tx, p, s), None)
  spmd = mesh_lib.spmd_steps(mesh_lib.make_mesh(), step, params, axes={"w": ("embed", "mlp")})
  p, state = spmd.init(params)
  ones = np.ones((2, 3), np.int32)
  p, state, metrics = spmd.train_step(p, state, ones, ones, scale=np.float32(2.0))
  assert float(metrics["loss"]) == 32.0  # 2 * 8 * 2
  p, state, metrics = spmd.train_step(p, state, ones, ones)  # default scale
  assert float(metrics["loss"]) == -16.0  # w = 1 - 0.5 * (2 * 2) = -1
  np.testing.assert_array_equal(params["w"], 1.0)  # init copied, never donated
  assert p["w"].sharding == spmd.shardings.params["w"]


def test_initialize_distributed_is_a_no_op_for_one_process():
  assert distributed.initialize_distributed(environ={}) is False
  assert distributed.initialize_distributed(
      environ={"JAX_NUM_PROCESSES": "1", "JAX_PROCESS_ID": "0"}) is False


@pytest.mark.parametrize("args, environ, message", [
    ((None, 2, 0), {}, "need --coordinator-address too"),
    (("localhost:1234", None, None), {}, "need --num-processes, --process-id too"),
    ((None, None, None), {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "two"},
     "JAX_NUM_PROCESSES='two' is not a valid int"),
    (("localhost:1234", 2, 2), {}, r"--process-id must be in \[0, 2\), got 2"),
])
def test_initialize_distributed_rejects_partial_settings(args, environ, message):
  with pytest.raises(ValueError, match=message):
    distributed.initialize_distributed(*args, environ=environ)


@pytest.mark.parametrize("flags, message", [
    (["--mesh", "data=0"], "--mesh 'data=0': data must be a positive integer"),
    (["--num-processes", "2", "--process-id", "0"], "need --coordinator-address too"),
])
def test_train_command_rejects_bad_parallel_flags(capsys, monkeypatch, flags, message):
  for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
    monkeypatch.delenv(var, raising=False)
  argv = ["--preset", "tiny", "--no-progress", "--out", "/tmp/unused",
          "--data", str(ROOT / "data" / "README.md")] + flags
  assert train_lib.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and message in err and "\n" not in err


def test_docstring_examples_run():
  result = doctest.testmod(mesh_lib)
  assert result.attempted > 0 and result.failed == 0


# --------------------------------------------------------------------------
# 8 simulated devices.
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_device_params(tmp_path_factory):
  """Where the worker saves its single-device SkewAdam parameters."""
  return tmp_path_factory.mktemp("reference") / "one.npz"


@pytest.fixture(scope="module")
def eight_devices(one_device_params):
  proc = subprocess.run(
      [sys.executable, str(ROOT / "tests" / "_parallel_worker.py"), str(one_device_params)],
      env=_subprocess.environment(devices=8),
      # A safety net against a hung worker, not a speed check: it takes 1 to 2.5 min
      # on 2 shared cores, and twice that has been seen on a slow day.
      capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", ["skewadam", "adamw_fsdp"])
def test_sharded_step_matches_one_device(eight_devices, case):
  result = eight_devices[case]
  np.testing.assert_allclose(result["losses"], result["ref_losses"], rtol=1e-6)
  # Two steps at lr 1e-3. Adam divides each gradient by its own magnitude, so
  # a rounding difference in a near-zero gradient (sums split across devices)
  # moves that element by a visible fraction of one step: allow 5 % of it.
  assert result["max_param_diff"] < 5e-5, result["max_param_diff"]


@pytest.mark.parametrize("case", ["skewadam", "adamw_fsdp"])
def test_state_is_laid_out_as_the_helper_says(eight_devices, case):
  result = eight_devices[case]
  # Init (jit with out_shardings) and two updates: every array on all 8
  # devices with the helper's sharding and shard shapes.
  assert result["placement_errors"] == []
  # Each device holds 1/n of the expert tier: n = 4 experts-ways, and with
  # FSDP also 2 data-ways.
  ways = 8 if case == "adamw_fsdp" else 4
  total = result["expert_bytes_total"]
  assert total > 0
  for when in ("expert_bytes_per_device_at_init", "expert_bytes_per_device"):
    assert len(result[when]) == 8
    assert set(result[when].values()) == {total // ways}, (when, result[when])
  # The abstract per-device count agrees with the live shards.
  assert result["helper_bytes_per_device"]["expert"] == total // ways


def test_train_command_with_a_mesh(eight_devices):
  result = eight_devices["train"]
  assert np.isfinite(result["val_ppl"]) and np.isfinite(result["train_loss"])
  # [L, E, D, F]: experts over `expert`, and with --fsdp the larger matrix axis over `data`.
  assert result["w_up_spec"] == ["None", "expert", "None", "data"]
  assert result["checkpoints"] == ["3"]


def test_train_command_with_a_mesh_and_the_update_in_backward(eight_devices):
  """--mesh data=2,expert=4 --update-in-backward gives the one-device run, and the planner
  compiles the very step the command runs on that mesh."""
  result = eight_devices["train_layerwise"]
  assert len(result["losses"]) == 3
  # float32 compute: only the order of sums split across devices differs (bound as
  # test_sharded_step_matches_one_device's; measured 6.5e-7 on 2 CPU cores).
  np.testing.assert_allclose(result["losses"], result["ref_losses"], rtol=1e-6)
  assert result["max_param_diff"] < 5e-5, result
  assert result["planned_fingerprint"] == result["trained_fingerprint"]
  assert result["planned_temp"] == result["trained_temp"]
  # --mesh data=2,expert=4 alone: the planner's step is the command's too.
  assert result["standard_planned_fingerprint"] == result["standard_trained_fingerprint"]
  assert result["standard_planned_fingerprint"] != result["planned_fingerprint"]


# --------------------------------------------------------------------------
# Two processes on loopback.
# --------------------------------------------------------------------------


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def json_lines(stdout: str) -> list[dict]:
  # gloo also writes its connection notices to stdout.
  return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def run_together(commands, tmp_path, timeout=240, **popen):
  """Runs the commands at once; the first failure stops the others.

  Returns each one's stdout. A process whose peer died would otherwise wait
  for it until jax.distributed's own timeout.
  """
  logs = [(open(tmp_path / f"{i}.out", "w+"), open(tmp_path / f"{i}.err", "w+"))
          for i in range(len(commands))]
  procs = [subprocess.Popen(cmd, stdout=out, stderr=err, text=True, **popen)
           for cmd, (out, err) in zip(commands, logs)]
  deadline = time.monotonic() + timeout
  try:
    while (any(p.poll() is None for p in procs) and time.monotonic() < deadline
           and not any(p.poll() for p in procs)):
      time.sleep(0.2)
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  outputs, failures = [], []
  for i, (proc, (out, err)) in enumerate(zip(procs, logs)):
    out.seek(0)
    err.seek(0)
    outputs.append(out.read())
    if proc.returncode:  # negative: killed here, after a peer failed or timed out
      failures.append(f"process {i} exited {proc.returncode}:\n{err.read()[-3000:]}")
    out.close()
    err.close()
  assert not failures, "\n".join(failures)
  return outputs


def test_two_processes_match_one(tmp_path, eight_devices, one_device_params):
  # The worker's single-device reference run: same preset, optimizer and batches.
  address = f"127.0.0.1:{_free_port()}"
  commands = [
      [sys.executable, "-m", "experiments.parallel", "--preset", "tiny",
       "--compute-dtype", "float32", "--steps", "2", "--batch-size", "8",
       "--seq-len", "32", "--lr", "1e-3", "--seed", "0", "--json",
       "--mesh", "data=2,expert=2", "--save-params", str(tmp_path / "two.npz"),
       "--coordinator-address", address, "--num-processes", "2", "--process-id", str(i)]
      for i in range(2)]
  outputs = run_together(
      commands, tmp_path, cwd=ROOT,
      env=_subprocess.environment(devices=2))
  assert json_lines(outputs[1]) == []  # only process 0 reports
  [result] = json_lines(outputs[0])
  assert result["processes"] == 2 and result["devices"] == 4
  assert result["mesh"] == {"data": 2, "expert": 2}
  np.testing.assert_allclose(result["losses"], eight_devices["skewadam"]["ref_losses"],
                             rtol=1e-6)
  assert result["state_bytes_per_device"]["expert"] * 2 == result["state_bytes"]["expert"]
  with np.load(tmp_path / "two.npz") as two_params, np.load(one_device_params) as one_params:
    assert sorted(two_params) == sorted(one_params)
    for name in one_params:
      np.testing.assert_allclose(two_params[name], one_params[name], rtol=0, atol=5e-5,
                                 err_msg=name)


def test_expert_parallel_layer_matches_one_device(eight_devices):
  # tiny, moe_impl='expert_parallel' on data=2 x expert=4, 3 AdamW steps,
  # against one device with the dense lowering (float32 compute).
  result = eight_devices["expert_parallel"]
  np.testing.assert_allclose(result["losses"], result["ref_losses"], rtol=1e-6)
  assert result["max_param_diff"] < 5e-5, result["max_param_diff"]  # as above
  assert result["batch_spec"] == ["('data', 'expert')"]  # no repeated dense work
  # With FSDP the backbone is split over both axes, as the batch, and the step is the same.
  assert result["fsdp_query_spec"] == ["None", "None", "('data', 'expert')"]
  np.testing.assert_allclose(result["fsdp_losses"], result["ref_losses"], rtol=1e-6)
  assert result["fsdp_max_param_diff"] < 5e-5, result["fsdp_max_param_diff"]


def test_expert_parallel_step_moves_tokens_not_expert_banks(eight_devices):
  result = eight_devices["expert_parallel"]
  assert result["all_to_all"] > 0
  assert result["bank_all_gathers"] == []
  # Each device receives exactly the assignments routed to its own experts.
  assert result["received_counts"] == result["wanted_counts"]
