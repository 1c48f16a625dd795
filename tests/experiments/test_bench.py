"""The benchmark's bookkeeping: rows, bytes moved per parameter, JSON shape."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import bench


@pytest.fixture(scope="module")
def result():
  params = bench.moe_tree(layers=1, experts=2, d_model=16, d_ff=24, vocab=64)
  return bench.bench_updates(params, repeats=1, rounds=2)


def test_rows_cover_every_optimizer_with_ratios(result):
  names = [r["optimizer"] for r in result["rows"]]
  assert names == list(bench.optimizers_to_bench())
  adamw = next(r for r in result["rows"] if r["optimizer"] == "optax.adamw")
  assert adamw["ratio_to_adamw"] == 1.0
  for r in result["rows"]:
    assert r["update_ms"] > 0 and r["gbps"] > 0 and r["ratio_to_adamw"] > 0
    low, high = r["ratio_range"]
    assert low <= r["ratio_to_adamw"] <= high
    assert r["page_faults_per_update"] >= 0
    # XLA reads and writes at least the parameters and gradients.
    assert r["compiled_bytes_per_param"] >= 12
  assert result["copy_gbps"] > 0 and result["rounds"] == 2


def test_bytes_moved_per_parameter(result):
  rows = {r["optimizer"]: r for r in result["rows"]}
  # fp32: read params, grads, m, v (16 B); write params, m, v (12 B). The step
  # count adds a few bytes over the whole tree.
  assert rows["optax.adamw"]["bytes_per_param"] == pytest.approx(28.0, abs=1e-2)
  assert rows["optax.adamw"]["state_bytes_per_param"] == pytest.approx(8.0, abs=1e-2)
  # SkewAdam moves less than AdamW whenever its state is smaller.
  assert rows["skewadam (default)"]["bytes_per_param"] < rows["optax.adamw"]["bytes_per_param"]


def test_command_json(capsys):
  assert bench.main(["--layers", "1", "--experts", "2", "--d-model", "16", "--d-ff", "24",
                     "--vocab", "64", "--repeats", "1", "--rounds", "1", "--skip-train-step",
                     "--json"]) == 0
  out = json.loads(capsys.readouterr().out)
  assert {"copy_gbps", "rows", "num_params"} <= set(out)
  assert out["num_params"] < 50_000
  assert {"optimizer", "update_ms", "bytes_per_param", "gbps", "ratio_to_adamw"} <= set(
      out["rows"][0])


@pytest.mark.gpu_compile  # and on the CPU: the GPU rows where the compiler is installed
def test_update_temp_bytes_on_tiny():
  from experiments.planning import planner
  gpu = "skewadam, as on a GPU"  # tiny's attention matrices are a stacked group there
  result = bench.update_temp_bytes("tiny", rows=(gpu, "adamw"))
  assert set(result["temp_bytes"]) == {gpu, "adamw"}
  assert all(isinstance(v, int) and v >= 0 for v in result["temp_bytes"].values())
  # AdamW reads params (bf16), grads and fp32 m, v and writes params, m, v: 22 B.
  assert result["kernel_bytes_per_param"]["adamw"] >= 22 - 1e-6
  assert (result["warning"] is None) == planner.gpu_compile_available("a100-40gb")


def test_cli_reexecutes_under_the_tuned_allocator(monkeypatch):
  calls = []
  monkeypatch.setattr(bench.os, "execve", lambda *a: calls.append(a))
  monkeypatch.setattr(bench, "main", lambda argv: 0)
  for key in bench.CPU_MALLOC_ENV:
    monkeypatch.delenv(key, raising=False)
  assert bench.malloc_setting() == "system"
  bench._cli(["--json"])  # pylint: disable=protected-access
  if bench.sys.platform.startswith("linux"):
    [(exe, args, env)] = calls
    assert args[1:] == ["-m", "experiments.bench", "--json"] and exe == bench.sys.executable
    assert all(env[k] == v for k, v in bench.CPU_MALLOC_ENV.items())
  calls.clear()
  bench._cli(["--system-malloc"])  # pylint: disable=protected-access
  for key, value in bench.CPU_MALLOC_ENV.items():
    monkeypatch.setenv(key, value)
  assert bench.malloc_setting() == "tuned"
  bench._cli(["--json"])  # pylint: disable=protected-access
  assert not calls


def test_markdown_lists_every_train_step_with_its_ratio(result):
  train = {"tokens_per_s": {"skewadam": 900.0, "adamw": 1000.0, "skewadam orthogonal": 500.0},
           "step_time_ratio_to_adamw": {"skewadam": 1000 / 900, "adamw": 1.0,
                                        "skewadam orthogonal": 2.0}}
  text = bench.markdown(result, train)
  assert "| skewadam orthogonal | 500 | 2.00 |" in text and "| adamw | 1,000 | 1.00 |" in text


def test_the_train_step_result_renders_with_its_machine_and_load(tmp_path, capsys):
  saved = {"tokens_per_s": {"adamw": 1000.0, "muon": 800.0},
           "step_time_ratio_to_adamw": {"adamw": 1.0, "muon": 1.25}, "steps_per_round": 10,
           "rounds": 3, "machine": "AMD EPYC, 2 cores", "load_average": [1.5, 1.0, 0.5],
           "date": "2026-12-07"}
  (tmp_path / "t.json").write_text(json.dumps(saved))
  assert bench.main(["--render", str(tmp_path / "t.json")]) == 0
  out = capsys.readouterr().out
  assert out.startswith("Machine: AMD EPYC, 2 cores (load average 1.50, 1.00, 0.50), 2026-12-07")
  assert "| muon | 800 | 1.25 |" in out


@pytest.mark.gpu_compile  # and on the CPU: XLA:GPU's row where the compiler is installed
def test_compile_times_of_a_per_expert_tree():
  tree = bench.per_expert_tree(layers=2, experts=2, d_model=8, d_ff=16, vocab=16)
  assert len(jax.tree.leaves(tree)) == 2 * (2 * 3 + 1) + 1
  labels = jax.tree.leaves(bench.skewadam_jax.label_fn("hf")(tree))
  assert labels.count("expert") == 12 and labels.count("router") == 2
  targets = ["cpu"] + (["a100-40gb"] if bench.planner.gpu_compile_available("a100-40gb") else [])
  for target in targets:  # XLA:CPU, and XLA:GPU without a GPU where the extra is installed
    result = bench.compile_times(tree, rounds=1, target=target)
    assert result["leaves"] == 15 and set(result["rows"]) == {
        "optax.adamw", "skewadam", "skewadam, leaves grouped", "the same math by hand",
        "skewadam's outputs, no math", "skewadam grouped, no math", "skewadam, state stacked",
        "skewadam_orthogonal"}
    assert (result["target"], result["warning"]) == (target, None)
    assert result["rows"]["optax.adamw"]["total_ratio_to_adamw"] == 1.0
    for row in result["rows"].values():
      assert row["trace_s"] > 0 and row["compile_s"] > 0 and row["hlo_lines"] > 100


def test_the_stacking_row_is_the_grouped_library_with_the_outputs_rows_no_math():
  # Same-shaped expert leaves in groups (w1 and w3 of both experts, the two w2),
  # a router and an embedding: the grouped library's stacking and slicing around no math gives outputs_only's
  # arrays (gradients doubled, state plus one), placeholders passed through.
  tree = bench.per_expert_tree(layers=1, experts=2, d_model=8, d_ff=16, vocab=16)
  params = jax.tree.map(lambda s: jax.random.normal(jax.random.key(0), s.shape), tree)
  # scale_by_skewadam alone: skewadam()'s weight decay and rate would follow either.
  grouped = bench.skewadam_jax.scale_by_skewadam(
      param_labels=bench.skewadam_jax.label_fn("hf"), group_leaves=True)
  state = jax.tree.map(lambda x: x + 1 if x.dtype != jnp.bool_ else x, grouped.init(params))
  stacked = bench.stacking_only_update(grouped)
  plain = bench.outputs_only_update(grouped)
  got, want = stacked.update(params, state, params), plain.update(params, state, params)
  groups = bench.skewadam_jax.transform.leaf_groups(
      bench.skewadam_jax.leaf_plans(params, param_labels=bench.skewadam_jax.label_fn("hf")),
      jax.tree.leaves(params))
  assert sorted(len(g) for g in groups) == [1, 1, 2, 4]  # it did stack
  for a, b, before in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(
      (params, state))):
    if a.dtype == jnp.bool_:
      np.testing.assert_array_equal(a, before)  # a placeholder, passed through
    else:
      np.testing.assert_array_equal(a, b)


def test_the_hand_written_floor_is_the_librarys_expert_math():
  tree = bench.per_expert_tree(layers=1, experts=2, d_model=8, d_ff=16, vocab=16)
  params = jax.tree.map(lambda s: jax.random.normal(jax.random.key(0), s.shape), tree)
  library = bench.skewadam_jax.skewadam(1e-3, param_labels=bench.skewadam_jax.label_fn("hf"),
                                        clip_threshold=1.0)
  by_hand = bench.hand_written_update()
  states = [library.init(params), by_hand.init(params)]
  for step in range(3):
    grads = jax.tree.map(lambda p, k=jax.random.key(step + 1): jax.random.normal(k, p.shape),
                         params)
    (ours, states[0]), (theirs, states[1]) = (
        tx.update(grads, s, params) for tx, s in zip((library, by_hand), states))
    for expert in range(2):
      for name in ("w1", "w2", "w3"):
        path = ("layer_0", "block_sparse_moe", "experts", str(expert), name, "kernel")
        a, b = ours, theirs
        for key in path:
          a, b = a[key], b[key]
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7, err_msg=f"{path} step {step}")


def test_outputs_only_update_writes_every_array_of_the_state():
  tree = {"w": jnp.ones((2, 8)), "b": jnp.ones((8,))}
  tx = bench.outputs_only_update(bench.skewadam_jax.skewadam(1e-3))
  state = tx.init(tree)
  updates, new = tx.update(tree, state, tree)
  np.testing.assert_array_equal(updates["w"], 2 * tree["w"])
  for old, fresh in zip(jax.tree.leaves(state), jax.tree.leaves(new)):
    assert fresh.shape == old.shape and fresh.dtype == old.dtype
    assert not np.array_equal(np.asarray(fresh), np.asarray(old))


def test_render_prints_a_saved_results_tables(tmp_path, capsys):
  saved = {"num_params": 1000, "copy_gbps": 50.0, "malloc": "tuned", "rows": [
      {"optimizer": "optax.adamw", "update_ms": 2.0, "ratio_to_adamw": 1.0,
       "ratio_range": [1.0, 1.0], "state_bytes_per_param": 8.0, "bytes_per_param": 28.0,
       "gbps": 14.0, "fraction_of_copy_bw": 0.28, "compiled_bytes_per_param": None,
       "page_faults_per_update": 0.0}],
      "train_step": {"tokens_per_s": {"adamw": 1234.0}, "step_time_ratio_to_adamw": {"adamw": 1.0}}}
  path = tmp_path / "bench.json"
  path.write_text(json.dumps(saved))
  assert bench.main(["--render", str(path)]) == 0
  out = capsys.readouterr().out
  assert "1,000 parameters (fp32), copy bandwidth 50.0 GB/s" in out
  assert "| optax.adamw | 2.0 | 1.00 (1.00–1.00) | 8.00 | 28.0 | 14.0 | 28 % | n/a | 0 |" in out
  assert "| adamw | 1,234 | 1.00 |" in out and out.rstrip().endswith("allocator: tuned")


def test_grouping_cost_times_both_ways_and_renders(tmp_path, capsys):
  result = bench.grouping_step_times(repeats=1, rounds=1, sizes=((1, 8, 16), (1, 16, 16)))
  assert [r["leaf_entries"] for r in result["rows"]] == [128, 256]
  for row in result["rows"]:
    assert row["leaves"] == 8 * 3 + 2
    assert row["alone_ms"] > 0 and row["grouped_ms"] > 0
    assert row["grouped_over_alone"] == pytest.approx(row["grouped_ms"] / row["alone_ms"])
    assert row["stacked_over_alone"] == pytest.approx(row["stacked_ms"] / row["alone_ms"])
  path = tmp_path / "grouping.json"
  path.write_text(json.dumps({**result, "backend": "cpu", "machine": "m", "date": "d"}))
  assert bench.main(["--render", str(path)]) == 0
  out = capsys.readouterr().out
  row = result["rows"][0]
  assert (f"| 128 | 26 | {row['alone_ms']:.1f} | {row['grouped_ms']:.1f} | "
          f"{row['grouped_over_alone']:.2f} | {row['stacked_ms']:.1f} | "
          f"{row['stacked_over_alone']:.2f} |") in out
