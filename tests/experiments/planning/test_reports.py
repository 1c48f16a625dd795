"""The planner's Markdown tables (experiments.planning.planner), on hand-made reports."""

from experiments.planning import planner

GB = planner.GB


def report(**changes):
  """A ``--devices`` report with the fields the table reads."""
  base = {"preset": "moe-47b", "optimizer": "skewadam", "target": "a100-40gb", "batch": 8,
          "devices": 8, "mesh": {"data": 1, "expert": 8}, "fsdp": False, "layout": "given",
          "update_in_backward": False, "moe_impl": "blocked",
          "per_device_param_bytes": 2 * GB, "per_device_opt_state_bytes": GB // 2,
          "peak_bytes": 30 * GB, "fits": True, "max_batch_that_fits": 40,
          "collective_bytes": {"all-gather": 49_065.7 * GB, "all-reduce": 0.004 * GB},
          "flops_efficiency": 0.62, "hardware_flops_efficiency": 0.076}
  return {**base, **changes}


def cells(row: str) -> list[str]:
  return [c.strip() for c in row.strip("|").split("|")]


def test_devices_table_row_says_step_layout_and_traffic():
  header, _, row = planner.markdown_devices_table([report()]).splitlines()
  row = dict(zip(cells(header), cells(row)))
  assert row["step"] == "standard"
  assert row["devices, mesh"] == "8 x a100-40gb, data=1 x expert=8"
  assert row["params + state per device"] == "2.50 GB"
  assert row["peak per device (batch)"] == "30.00 GB (8)"
  # MB-sized traffic stays visible beside TB-sized traffic.
  assert row["AG / RS / AR / A2A per device per step"] == "49,065.7 / 0.0 / 0.004 / 0.0 GB"
  assert row["FLOPs efficiency: step, hardware"] == "0.62, 0.076"


def test_devices_table_names_the_expert_parallel_moe_an_unsearched_batch_and_one_device():
  table = planner.markdown_devices_table([
      report(moe_impl="expert_parallel", update_in_backward=True, max_batch_that_fits=None),
      report(devices=1, mesh=None, batch=1, collective_bytes={})]).splitlines()
  parallel, single = cells(table[2]), cells(table[3])
  assert parallel[2] == "in backward, expert-parallel MoE" and parallel[7] == "not searched"
  assert single[3] == "one a100-40gb" and single[8] == "—"


def test_memory_table_names_each_tiers_settings_and_the_rest_tier():
  row = {"optimizer": "skewadam", "opt_state_bytes": GB, "peak_bytes": 30 * GB, "fits": True,
         "max_batch_that_fits": 12, "skewadam_tiers": {
             "expert": {"direction": "orthogonal"}, "orthogonal_rest_tier": "router"}}
  line = planner.markdown_table([row]).splitlines()[2]
  assert "expert: orthogonal, orthogonal_rest_tier: router" in line
  assert "1.00 GB" in line and "30.00 GB" in line


def test_memory_table_sets_matmul_flops_against_the_first_row_and_says_what_was_not_searched():
  base = {"optimizer": "skewadam", "opt_state_bytes": GB, "peak_bytes": 30 * GB, "fits": True}
  rows = [{**base, "max_batch_that_fits": 12, "grad_bytes": 13.55 * GB, "matmul_flops": 4e12},
          {**base, "max_batch_that_fits": None, "grad_bytes": 0.69 * GB, "matmul_flops": 7.08e12,
           "update_in_backward": True, "clip_mode": "stale"},
          {**base, "optimizer": "adamw", "max_batch_that_fits": 0}]
  cells = [[c.strip() for c in line.split("|")[1:-1]]
           for line in planner.markdown_table(rows).splitlines()[2:]]
  assert cells[0][3:] == ["13.55 GB", "30.00 GB", "yes", "12", "1.00×"]
  assert cells[1][1] == "skewadam()'s defaults, update in backward (stale clip)"
  assert cells[1][3:] == ["0.69 GB", "30.00 GB", "yes", "not searched", "1.77×"]
  assert cells[2][1:] == ["fp32 state", "1.00 GB", "—", "30.00 GB", "yes", "0", "—"]
