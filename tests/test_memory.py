"""The memory planner: exact state bytes, XLA's analysis for a GPU target, the batch search."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import skewadam_jax
from experiments import memory
from experiments import planner
from experiments import optimizers


@pytest.mark.parametrize("optimizer", optimizers.OPTIMIZERS)
def test_planner_state_bytes_equal_a_real_state_on_tiny(optimizer):
  _, _, abstract, _ = planner.abstract_model("tiny", jnp.bfloat16)
  tx = planner.make_tx(optimizer, "tiny")
  planned = skewadam_jax.abstract_state_bytes_by_tier(tx, abstract)
  params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract)
  state = tx.init(params)
  assert planned["total"] == sum(x.nbytes for x in jax.tree.leaves(state))
  assert planned == skewadam_jax.state_bytes_by_tier(state)


def test_6p78b_state_bytes_without_allocating():
  live_before = sum(x.nbytes for x in jax.live_arrays())
  _, _, params, _ = planner.abstract_model("moe-6.78b", jnp.bfloat16)
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


def test_gpu_target_compile_of_tiny():
  if not planner.gpu_compile_available("a100-40gb"):
    pytest.skip("gpu-compile extra not installed (jax-cuda12-plugin, nvidia-cuda-nvcc-cu12): "
                "cannot compile for the A100 target here")
  _, _, params, _ = planner.abstract_model("tiny", jnp.bfloat16)
  state = jax.eval_shape(planner.make_tx("skewadam", "tiny").init, params)
  result = planner.compile_step("tiny", "skewadam", batch=2, seq=16, target="a100-40gb")
  assert result["warning"] is None
  check_analysis(result["xla"], skewadam_jax.tree_bytes((params, state)))


def test_cpu_compile_of_tiny_warns():
  _, _, params, _ = planner.abstract_model("tiny", jnp.bfloat16)
  state = jax.eval_shape(planner.make_tx("adamw", "tiny").init, params)
  result = planner.compile_step("tiny", "adamw", batch=2, seq=16, target="cpu")
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
  assert memory.main(["--preset", "tiny", "--optimizer", "skewadam", "--seq", "16",
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
  assert len(table) == 3 and table[2].startswith("| skewadam | defaults |")


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


def test_tier_flags_become_skewadam_tier_configs():
  import argparse  # pylint: disable=import-outside-toplevel
  args = argparse.Namespace(expert_momentum="int8", backbone_momentum="fp32",
                            backbone_second_moment="exact", router_second_moment=None)
  assert memory._parse_tiers(args) == {  # pylint: disable=protected-access
      "expert": {"momentum": "int8"},
      "backbone": {"momentum": "fp32", "second_moment": "exact"}}
