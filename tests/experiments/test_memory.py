"""The memory planner: exact state bytes, XLA's analysis for a GPU target, the batch search."""

import json
import pathlib
import re
import shlex
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
import skewadam_jax
from experiments.training import config as config_lib
from experiments.training import steps as steps_lib
from experiments.planning import hlo
from experiments import memory
from experiments.planning import orthogonal_cost
from experiments.planning import planner
from experiments.training import optimizers
from tests import _subprocess
from tests import _xla


@pytest.mark.parametrize("optimizer", optimizers.OPTIMIZERS)
def test_planner_state_bytes_equal_a_real_state_on_tiny(optimizer):
  _, _, abstract, _ = steps_lib.abstract_model("tiny", jnp.bfloat16)
  tx = planner.make_tx(optimizer, "tiny")
  planned = skewadam_jax.abstract_state_bytes_by_tier(tx, abstract)
  params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract)
  state = tx.init(params)
  assert planned["total"] == sum(x.nbytes for x in jax.tree.leaves(state))
  assert planned == skewadam_jax.state_bytes_by_tier(state)


def test_6p78b_state_bytes_without_allocating():
  live_before = sum(x.nbytes for x in jax.live_arrays())
  _, _, params, _ = steps_lib.abstract_model("moe-6.78b", jnp.bfloat16)
  assert skewadam_jax.tree_bytes(params) == 2 * 6_775_424_000
  adamw = skewadam_jax.abstract_state_bytes_by_tier(planner.make_tx("adamw", "moe-6.78b"), params)
  assert adamw["total"] == 8 * 6_775_424_000 + 4 + 4  # fp32 m, v; adam and schedule counts
  assert round(adamw["total"] / 1e9, 1) == 54.2
  skew = skewadam_jax.abstract_state_bytes_by_tier(planner.make_tx("skewadam", "moe-6.78b"), params)
  assert skew["total"] == sum(skew[t] for t in ("backbone", "expert", "router", "other"))
  assert skew["total"] < 2.3e9
  assert sum(x.nbytes for x in jax.live_arrays()) - live_before < 1e6


def check_analysis(xla, params_and_state_bytes):
  assert xla["peak"] == xla["argument"] + xla["output"] - xla["alias"] + xla["temp"]
  # Parameters and optimizer state are donated: their buffers alias the outputs.
  assert xla["alias"] == params_and_state_bytes
  assert xla["argument"] >= params_and_state_bytes


@pytest.mark.gpu_compile
def test_gpu_target_compile_of_tiny():
  _xla.require_gpu_compile()
  _, _, params, _ = steps_lib.abstract_model("tiny", jnp.bfloat16)
  state = jax.eval_shape(planner.make_tx("skewadam", "tiny").init, params)
  result = planner.compile_step(planner.train_config("tiny", "skewadam"), batch=2, seq=16,
                                target="a100-40gb")
  assert result["warning"] is None
  check_analysis(result["xla"], skewadam_jax.tree_bytes((params, state)))


def test_cpu_compile_of_tiny_warns():
  _, _, params, _ = steps_lib.abstract_model("tiny", jnp.bfloat16)
  state = jax.eval_shape(planner.make_tx("adamw", "tiny").init, params)
  result = planner.compile_step(planner.train_config("tiny", "adamw"), batch=2, seq=16,
                                target="cpu")
  assert "compiled for the CPU" in result["warning"]
  check_analysis(result["xla"], skewadam_jax.tree_bytes((params, state)))


def test_max_batch_search_against_a_known_peak_curve():
  calls = []

  def peak_at(batch):
    calls.append(batch)
    return 10 + 3 * batch
  assert planner.max_batch_that_fits(peak_at, device_bytes=40, margin_bytes=2) == 9
  assert len(calls) <= 8
  assert planner.max_batch_that_fits(lambda b: 50, device_bytes=40, margin_bytes=2) == 0
  assert planner.max_batch_that_fits(lambda b: b, device_bytes=10**9, margin_bytes=0, limit=64) == 64


def test_command_prints_one_json_object(capsys, tmp_path):
  assert memory.main(["--preset", "tiny", "--optimizer", "skewadam", "--seq-len", "16",
                      "--target", "cpu", "--json", "--no-search"]) == 0
  report = json.loads(capsys.readouterr().out)
  for key in ("preset", "optimizer", "target", "batch", "seq", "num_params", "param_bytes",
              "grad_bytes", "opt_state_bytes", "opt_state_bytes_by_tier", "xla", "peak_bytes",
              "device_bytes", "fits", "max_batch_that_fits"):
    assert key in report, key
  assert set(report["xla"]) == {"argument", "output", "alias", "temp"}
  (tmp_path / "r.json").write_text(json.dumps(report))
  assert memory.main(["--table", str(tmp_path / "r.json")]) == 0
  table = capsys.readouterr().out.strip().splitlines()
  assert len(table) == 3 and table[2].startswith(
      "| skewadam | expert: lowrank/84/int8/orthogonal/width, backbone: orthogonal/width |")


def test_bad_arguments_fail_with_one_line(capsys):
  assert memory.main(["--preset", "tiny", "--optimizer", "sgd"]) == 2
  assert memory.main(["--preset", "tiny", "--target", "tpu-v9", "--no-search"]) == 2
  err = capsys.readouterr().err
  assert "unknown optimizer 'sgd'" in err and "unknown target 'tpu-v9'" in err


@pytest.mark.parametrize("update_in_backward", [False, True])
def test_gpu_check_phase_runs_tiny_steps_on_any_device(update_in_backward):
  from experiments import gpu_check
  result = gpu_check.run_phase("tiny", "skewadam", batch=1, seq=16, steps=2,
                               update_in_backward=update_in_backward)
  assert result["status"] == "ok", result.get("error")
  assert len(result["step_seconds"]) == 2 and np.isfinite(result["loss"])


def test_gpu_check_runs_the_step_the_planner_plans_by_default():
  from experiments import gpu_check
  # No tier flag: the training command's default, as `memory --optimizer skewadam` plans it.
  assert gpu_check.default_tiers() == config_lib.tiers_from_args(memory.build_parser().parse_args([]))
  args = gpu_check.build_parser().parse_args(["--backbone-direction", "adam",
                                              "--expert-direction", "adam"])
  assert config_lib.tiers_from_args(args) == {}  # the library's skewadam()


def test_every_phase_of_the_gpu_check_script_parses():
  """A lent GPU's minutes are few: a phase the parser refuses must fail here, not there."""
  from experiments import gpu_check
  script = (ROOT / "experiments" / "gpu_check.sh").read_text().replace("\\\n", " ")
  a100 = re.search(r"^a100=(\S+)$", script, re.M).group(1)
  # The capped phases' budget is the planner's A100-40GB target's.
  assert float(a100) * 1e9 == planner.target_device_bytes("a100-40gb")
  phases = [shlex.split(line.replace('"$a100"', a100))[1:]
            for line in script.splitlines() if line.startswith("phase ")]
  assert len(phases) >= 6
  parser = gpu_check.build_parser()
  for argv in phases:
    args = parser.parse_args(argv)
    assert args.preset in ("tiny", "moe-6.78b", "moe-47b"), argv
    assert set(args.optimizers.split(",")) <= {"skewadam", "adamw"}, argv


def test_gpu_check_table_sets_each_phase_beside_its_plan():
  from experiments import gpu_check
  tiers = {"backbone": {"direction": "orthogonal"}}
  plan = {"preset": "p", "optimizer": "skewadam", "batch": 2, "update_in_backward": False,
          "skewadam_tiers": tiers, "peak_bytes": 4e9, "target": "h200", "step_fingerprint": "ab"}
  other = dict(plan, skewadam_tiers={}, peak_bytes=9e9, step_fingerprint="cd")
  ran = {"preset": "p", "optimizer": "skewadam", "batch": 2, "update_in_backward": False,
         "skewadam_tiers": tiers, "status": "ok", "peak_bytes_in_use": 3.9e9,
         "xla": {"peak": 3.8e9}, "step_fingerprint": "ab", "compile_seconds": 1.0,
         "median_step_seconds": 0.5, "tokens_per_second": 100.0, "mfu": 0.25,
         "estimate": {"step_seconds": 0.4}}
  oom = dict(ran, status="out_of_memory", skewadam_tiers={}, xla={"peak": 9.9e9},
             step_fingerprint="xx")
  del oom["median_step_seconds"], oom["tokens_per_second"], oom["mfu"], oom["estimate"]
  rows = gpu_check.comparison_table([ran, oom], [other, plan]).splitlines()[2:]
  cells = [[c.strip() for c in row.split("|")[1:-1]] for row in rows]
  # ran: its own plan (not the library's), 3.8 / 4.0, the same program.
  assert cells[0][6:11] == ["3.900", "3.800", "4.000 (h200)", "0.9500", "yes"]
  assert cells[0][-3:] == ["0.250", "0.400", "1.25"]  # MFU, the estimate, measured / it
  # oom: no measured peak, matched to the library's plan, another program.
  assert cells[1][2] == "skewadam() (library)"
  assert cells[1][6:11] == ["-", "9.900", "9.000 (h200)", "1.1000", "no"]
  assert cells[1][-2:] == ["-", "-"]


def test_gpu_check_step_spread_leaves_the_first_step_out():
  from experiments import gpu_check
  spread = gpu_check.step_spread([10.0] + [float(i) for i in range(1, 22)])
  assert spread == {"steps": 21, "min": 1.0, "p10": 3.0, "median": 11.0, "p90": 19.0,
                    "max": 21.0}
  assert gpu_check.roofline_target("NVIDIA H100 80GB HBM3") == "h100-80gb"
  assert gpu_check.roofline_target("NVIDIA L4") is None


def test_tier_flags_become_skewadam_tier_configs():
  args = memory.build_parser().parse_args([
      "--expert-momentum", "int8", "--backbone-momentum", "fp32",
      "--backbone-second-moment", "exact", "--expert-direction", "orthogonal"])
  width = {"direction": "orthogonal", "orthogonal_scale": "width"}
  assert config_lib.tiers_from_args(args) == {
      "expert": {"momentum": "int8", **width},
      "backbone": {"momentum": "fp32", "second_moment": "exact", **width}}
  # The training command's default direction is the orthogonal one, with
  # skewadam_orthogonal's settings (rank-84 int8 expert momentum, width
  # scaling); Adam's direction, the library's, is left out of the tiers.
  args = memory.build_parser().parse_args(["--backbone-direction", "adam"])
  assert config_lib.tiers_from_args(args) == {"expert": {
      "direction": "orthogonal", "momentum": "lowrank", "lowrank_rank": 84,
      "lowrank_dtype": "int8", "orthogonal_scale": "width"}}


# --------------------------------------------------------------------------
# Past one device: --devices, collective bytes, FLOPs, TPU targets.
# --------------------------------------------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A while loop of 7 iterations with one all-reduce of f32[16] (64 bytes) in its
# body, the trip count left for the parser to find in the loop's condition.
LOOP_HLO = """HloModule loop

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[16]{0} get-tuple-element(%p), index=1
  %reduced = f32[16]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[16]{0}) tuple(%next, %reduced)
}

%cond (q: (s32[], f32[16])) -> pred[] {
  %q = (s32[], f32[16]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %limit = s32[] constant(7)
  ROOT %less = pred[] compare(%j, %limit), direction=LT
}

ENTRY %main (x0: f32[16]) -> f32[16] {
  %x0 = f32[16]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[16]{0}) tuple(%zero, %x0)
  %loop = (s32[], f32[16]{0}) while(%init), condition=%cond, body=%body
  ROOT %y = f32[16]{0} get-tuple-element(%loop), index=1
}
"""


def test_collective_bytes_multiply_loop_bodies_by_their_trip_count():
  report = hlo.collective_bytes(LOOP_HLO)
  assert report.bytes["all-reduce"] == 7 * 64 and report.counts["all-reduce"] == 7
  assert report.trip_counts == {"loop": 7} and report.assumed_trip_counts == []
  known = LOOP_HLO.replace("body=%body",
                           'body=%body, backend_config={"known_trip_count":{"n":"3"}}')
  assert hlo.collective_bytes(known).bytes["all-reduce"] == 3 * 64  # XLA's own count first
  unknown = LOOP_HLO.replace("constant(7)", "parameter(1)")
  report = hlo.collective_bytes(unknown, default_trip_count=4)
  assert report.bytes["all-reduce"] == 4 * 64 and report.assumed_trip_counts == ["loop"]
  assert hlo.array_bytes("(bf16[2,3]{1,0}, pred[5], token[])") == 17


def test_collective_bytes_of_known_collectives_on_8_cpu_devices():
  proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_collectives_worker.py")],
                        env=_subprocess.environment(devices=8), capture_output=True, text=True, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-4000:]
  result = json.loads(proc.stdout.strip().splitlines()[-1])
  shard, gathered = 8 * 128 * 4, 64 * 128 * 4  # f32[8,128] per device, f32[64,128] gathered
  assert result["known"]["bytes"] == {
      "all-reduce": 5 * shard, "all-to-all": 5 * shard, "all-gather": gathered,
      "reduce-scatter": gathered, "collective-permute": shard}
  assert result["known"]["trip_counts"] == [5] and result["known"]["assumed"] == []
  # The update-in-backward step shards cleanly: its stacked state follows
  # each slice's sharding with the layer axis unsplit, and 2 sharded steps
  # give the one-device parameters.
  uib_result = result["update_in_backward"]
  assert uib_result["misplaced"] == []
  # the group's axis (w_gate and w_up stacked, replicated), then the bank's own
  assert uib_result["expert_momentum_spec"] == ["None", "None", "expert", "None", "None"]
  assert uib_result["max_param_diff"] < 1e-5
  # Owner devices: the split stack's Newton–Schulz all-reduces its products; with
  # orthogonal_owner_axes each matrix is iterated whole on one device (resharded by an
  # all-to-all), nothing is all-reduced, and the update is the same.
  # Two [L, E, R, C] banks of one shape, stepped as a group of 2 a layer at a time: the
  # owners split the experts (the group's axis of 2 does not divide over 8).
  for case in ("owner_devices", "owner_devices_grouped"):
    owners = result[case]
    assert owners["plain"]["all-reduce"] > 0 and owners["plain"]["all-to-all"] == 0, case
    assert owners["owned"]["all-reduce"] == 0 and owners["owned"]["all-to-all"] > 0, case
    assert owners["max_update_diff"] < 1e-4 * owners["max_update"], case
  owners = result["owner_devices"]
  assert sum(owners["owned"].values()) < sum(owners["plain"].values()) / 2


def test_useful_flops_and_the_mesh_defaults():
  config = models.get_preset("moe-47b")
  # 6 x 13,554,159,616 params a token uses (input embedding excluded) x 16,384 tokens
  # + 6 x 32 layers x 8 x 2048^2 x 4096 for causal attention.
  assert planner.useful_flops(config, 8, 2048) == (6 * 13_554_159_616 * 8 * 2048
                                                   + 6 * 32 * 8 * 2048**2 * 4096)
  assert planner.default_mesh_shape(8, 8) == {"data": 1, "expert": 8}
  assert planner.default_mesh_shape(8, 64) == {"data": 1, "expert": 8}
  assert planner.mesh_shape(8, 8, "data=2") == {"data": 2, "expert": 4}
  assert planner.mesh_shape(8, 8, "expert=2") == {"data": 4, "expert": 2}
  with pytest.raises(ValueError, match="does not fit --devices 8"):
    planner.mesh_shape(8, 8, "data=3,expert=2")
  with pytest.raises(ValueError, match="does not divide the 4 experts"):
    planner.mesh_shape(8, 4, "data=1,expert=8")


@pytest.mark.gpu_compile
def test_devices_plan_of_tiny_on_the_gpu_target():
  # The update-in-backward step's sharding runs in _collectives_worker.py.
  _xla.require_gpu_compile()
  report = planner.plan("tiny", "skewadam", target="a100-40gb", devices=8, batch=4, seq=16,
                        mesh="data=2,expert=4", search_batch=False)
  assert report["devices"] == 8 and report["mesh"] == {"data": 2, "expert": 4}
  assert report["fsdp"] is False and report["layout"] == "given"
  assert report["warning"] is None and report["fits"]
  # Parameters and state are donated: one device's shards alias its outputs.
  xla = report["xla"]
  assert xla["alias"] == report["per_device_param_bytes"] + report["per_device_opt_state_bytes"]
  assert report["per_device_peak_bytes"] == report["peak_bytes"]
  assert report["per_device_param_bytes"] < report["param_bytes"]
  # Gradients of replicated parameters are all-reduced over data, inside the layer loops.
  assert report["collective_bytes"]["all-reduce"] > 0
  assert set(report["collective_loop_trip_counts"].values()) == {2}  # tiny's 2 layers
  # Devices that share a data shard repeat its dense work: the hardware does more.
  assert 0 < report["hardware_flops_efficiency"] < report["flops_efficiency"] < 1
  table = planner.markdown_devices_table([report]).splitlines()
  assert len(table) == 3 and "| 8 x a100-40gb, data=2 x expert=4 |" in table[2]


@pytest.mark.gpu_compile
def test_devices_plan_of_the_expert_parallel_layer_moves_tokens():
  _xla.require_gpu_compile()
  report = planner.plan("tiny", "skewadam", target="a100-40gb", devices=8, batch=8, seq=16,
                        moe_impl="expert_parallel", search_batch=False)
  assert report["moe_impl"] == "expert_parallel" and report["fits"]
  assert report["collective_bytes"]["all-to-all"] > 0
  # By default FSDP splits the backbone over both axes: its matrices are gathered.
  assert report["fsdp"] is True and report["collective_bytes"]["all-gather"] > 0
  # The batch is split over data x expert: no device repeats another's dense work.
  with pytest.raises(ValueError, match=r"data=2 x expert=4 \(expert parallelism\)"):
    planner.plan("tiny", "skewadam", target="a100-40gb", devices=8, batch=4, seq=16,
                 moe_impl="expert_parallel", search_batch=False)


def test_the_default_layout_is_data_parallel_fsdp_or_expert_parallel(monkeypatch):
  seen = []

  def fake_compile(config, *, batch, mesh, fsdp, **_):
    seen.append((mesh, fsdp))
    return {"xla": {"argument": 0, "output": 0, "alias": 0, "temp": 0, "peak": 1},
            "matmul_flops": 1, "device_matmul_flops": 1, "warning": None}
  monkeypatch.setattr(planner, "compile_step", fake_compile)
  report = planner.plan("tiny", "skewadam", target="a100-40gb", devices=8, batch=8, seq=16,
                        search_batch=False)
  assert seen[-1] == ({"data": 8, "expert": 1}, True)
  assert (report["mesh"], report["fsdp"], report["layout"]) == (
      {"data": 8, "expert": 1}, True, "default")
  assert "data=8 x expert=1, fsdp (default)" in planner.markdown_devices_table([report])
  planner.plan("tiny", "skewadam", target="a100-40gb", devices=8, batch=8, seq=16,
               moe_impl="expert_parallel", search_batch=False)
  # tiny's 4 experts; FSDP of the backbone over both axes (what fits moe-47b).
  assert seen[-1] == ({"data": 2, "expert": 4}, True)
  report = planner.plan("tiny", "skewadam", target="a100-40gb", devices=8, batch=8, seq=16,
                        fsdp=False, search_batch=False)
  assert seen[-1] == ({"data": 8, "expert": 1}, False) and report["layout"] == "given"
  # A mesh given without --fsdp is that mesh, replicated as before.
  planner.plan("tiny", "skewadam", target="a100-40gb", devices=8, batch=8, seq=16,
               mesh="expert=4", search_batch=False)
  assert seen[-1] == ({"data": 2, "expert": 4}, False)
  planner.plan("tiny", "skewadam", target="a100-40gb", devices=8, batch=8, seq=16,
               mesh="expert=4", fsdp=True, search_batch=False)
  assert seen[-1] == ({"data": 2, "expert": 4}, True)


def test_devices_batch_search_steps_by_the_data_size(monkeypatch):
  def fake_compile(config, *, batch, mesh, **_):
    assert batch % mesh["data"] == 0
    if batch >= 40:  # as XLA:TPU answers a buffer larger than the chip
      return {"xla": None, "out_of_memory": "RESOURCE_EXHAUSTED", "matmul_flops": 1,
              "device_matmul_flops": None, "warning": None}
    return {"xla": {"argument": 0, "output": 0, "alias": 0, "temp": 0, "peak": 10 + 3 * batch},
            "matmul_flops": 1, "device_matmul_flops": 1, "warning": None}
  monkeypatch.setattr(planner, "compile_step", fake_compile)
  report = planner.plan("tiny", "adamw", target="a100-40gb", devices=8, mesh="data=4", batch=4,
                        seq=16, device_memory_gb=100e-9, margin_gb=0)
  assert report["max_batch_that_fits"] == 28  # 10 + 3b <= 100: b <= 30, in steps of 4
  assert all(int(b) % 4 == 0 for b in report["peak_bytes_by_batch"])
  report = planner.plan("tiny", "adamw", target="a100-40gb", devices=8, mesh="data=4", batch=4,
                        seq=16, device_memory_gb=1000e-9, margin_gb=0)
  assert report["max_batch_that_fits"] == 36  # out of memory from 40 on
  report = planner.plan("tiny", "adamw", target="a100-40gb", devices=8, mesh="data=4", batch=40,
                        seq=16, device_memory_gb=1000e-9, search_batch=False)
  assert report["fits"] is False and report["xla"] is None and report["peak_bytes"] is None


def test_tpu_target_compiles_tiny_on_four_chips(monkeypatch):
  if not planner.tpu_compile_available():
    pytest.skip("libtpu (the tpu-compile extra) not installed")
  # What the planner sets for libtpu, undone after the test.
  for name, value in (("TPU_ACCELERATOR_TYPE", "v6e-4"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                      ("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"),
                      ("LIBTPU_INIT_ARGS", "--xla_tpu_no_crash_on_oom=true")):
    monkeypatch.setenv(name, value)
  report = planner.plan("tiny", "skewadam", target="tpu-v6e", devices=4, batch=4, seq=16,
                        search_batch=False)
  assert report["compiled_for"] == "tpu-v6e" and report["device_bytes"] == 32 * 10**9
  assert report["mesh"] == {"data": 4, "expert": 1} and report["fsdp"] and report["fits"]
  assert report["xla"]["alias"] > 0 and report["device_matmul_flops"] is None


def test_bad_devices_flags_fail_with_one_line(capsys):
  base = ["--preset", "tiny", "--seq-len", "16", "--no-search"]
  cases = [(["--devices", "8", "--mesh", "data=3,expert=2"], "does not fit --devices 8"),
           (["--devices", "8", "--batch-size", "3"], "--batch-size 3 does not split over the mesh's data=8"),
           (["--mesh", "data=2"], "--mesh and --fsdp need --devices"),
           (["--devices", "0"], "--devices must be >= 1"),
           (["--target", "tpu-v6e", "--devices", "3"], "not a tpu-v6e slice"),
           (["--target", "h100-40gb", "--devices", "8"], "unknown target 'h100-40gb'")]
  if not planner.tpu_compile_available():
    cases.append((["--target", "tpu-v5e"], "needs libtpu, the TPU compiler: pip install -e "
                                           "'.[tpu-compile]'"))
  for flags, message in cases:
    assert memory.main(base + flags) == 2, flags
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_the_h200_target_is_a_hopper_with_141_gb():
  assert planner.target_device_bytes("h200") == 141_000_000_000
  description = (planner.TARGET_DIR / planner.TARGETS["h200"]).read_text()
  assert "major: 9" in description and 'name: "NVIDIA H200"' in description


def _newton_schulz_flops(rows, cols):
  """Five quintic iterations on the smaller Gram side, by hand: X Xᵀ, A·A, (bA + cA²)·X."""
  r, c = min(rows, cols), max(rows, cols)
  return 5 * (2 * r * r * c + 2 * r ** 3 + 2 * r * r * c)


def test_the_orthogonalisation_is_its_own_line_with_its_flops_by_hand(capsys):
  default = config_lib.TrainConfig().skewadam_tiers()  # the training command's: orthogonal
  report = planner.plan("tiny", "skewadam", target="cpu", seq=16, search_batch=False,
                        skewadam_tiers=default)
  ortho = report["orthogonalisation"]
  params = steps_lib.abstract_params("tiny", jnp.bfloat16)
  axes = steps_lib.abstract_axes("tiny")
  plans = skewadam_jax.leaf_plans(params, **optimizers.skewadam_axes(axes, default),
                                  **optimizers.tier_configs(default))
  paths, leaves, _ = skewadam_jax.labels.flatten_with_paths(params)
  want_flops, want_matrices = 0, 0
  for leaf, plan in zip(leaves, plans):
    if plan.orthogonal:
      rows, cols = skewadam_jax.orthogonal.matrix_sides(leaf.shape, plan.axes)
      count = leaf.size // (rows * cols)
      want_flops += count * _newton_schulz_flops(rows, cols)
      want_matrices += count
  assert ortho["matrices"] == want_matrices > 0
  assert ortho["matmul_flops"] == want_flops
  assert ortho["matmul_flops"] < report["matmul_flops"]
  size, rows, cols = ortho["chunk"]
  assert ortho["leaf"] in paths and ortho["working_set_bytes"] >= 4 * size * rows * cols
  memory._print_report(report)  # pylint: disable=protected-access
  assert "orthogonalisation (Newton-Schulz" in capsys.readouterr().out
  adamw = planner.plan("tiny", "adamw", target="cpu", seq=16, search_batch=False)
  assert adamw["orthogonalisation"] is None
  adam_direction = planner.plan("tiny", "skewadam", target="cpu", seq=16, search_batch=False,
                                skewadam_tiers={})
  assert adam_direction["orthogonalisation"] is None


def test_the_orthogonalisation_through_the_factors_counts_the_small_iteration_by_hand():
  # The planner's own part (planner.plan calls it so), without compiling the whole step.
  tiers = config_lib.TrainConfig(expert_lowrank_orthogonalise="factors",
                                 expert_lowrank_rank=3).skewadam_tiers()
  params = steps_lib.abstract_params("tiny", jnp.bfloat16)
  axes = steps_lib.abstract_axes("tiny")
  ortho = orthogonal_cost.orthogonalisation(params, axes, tiers,
                                            sharding=planner.target_sharding("cpu")[0],
                                            matmul_flops=planner.matmul_flops)
  plans = skewadam_jax.leaf_plans(params, **optimizers.skewadam_axes(axes, tiers),
                                  **optimizers.tier_configs(tiers))
  want, experts = 0, 0
  for leaf, plan in zip(jax.tree.leaves(params), plans):
    if not plan.orthogonal:
      continue
    rows, cols = skewadam_jax.orthogonal.matrix_sides(leaf.shape, plan.axes)
    count = leaf.size // (rows * cols)
    if plan.lowrank_orthogonalise == "factors":
      # Pᵀ·x and P·O (rows x 3 times 3 x cols each), and the iteration on the 3 x cols matrix
      want += count * (2 * 2 * rows * 3 * cols + _newton_schulz_flops(3, cols))
      experts += count
    else:
      want += count * _newton_schulz_flops(rows, cols)
  assert experts > 0 and ortho["matmul_flops"] == want


def test_an_expert_sharded_mesh_chunks_a_bank_one_expert_a_shard():
  tiers = config_lib.TrainConfig(mesh="data=2,expert=4").skewadam_tiers()
  assert tiers["expert"]["orthogonal_chunk"] == 4 and tiers["backbone"]["orthogonal_chunk"] == 4
  assert "orthogonal_chunk" not in config_lib.TrainConfig(mesh="data=8").skewadam_tiers()["expert"]
  given = config_lib.TrainConfig(mesh="data=2,expert=4", orthogonal_chunk="all").skewadam_tiers()
  assert given["expert"]["orthogonal_chunk"] == "all"
  with pytest.raises(ValueError, match="--orthogonal-chunk must be auto, all or a positive"):
    config_lib.TrainConfig(orthogonal_chunk="0").validate()
