"""State bits a parameter by tier: ``accounting.params_by_tier`` and the command's second table."""

from __future__ import annotations

import jax

import models
from experiments import state_bytes
from experiments.planning import accounting


def _tiny():
  return models.get_preset("tiny")


def test_params_by_tier_counts_each_tier_by_hand():
  c = _tiny()
  counts = accounting.params_by_tier("tiny")
  # three expert matrices (gate, up, down) of d_model x d_ff per expert per layer
  assert counts["expert"] == c.num_layers * c.num_experts * 3 * c.d_model * c.d_ff
  assert counts["router"] == c.num_layers * c.d_model * c.num_experts
  total = sum(x.size for x in jax.tree.leaves(accounting.abstract_params("tiny")))
  assert counts["total"] == total == counts["backbone"] + counts["expert"] + counts["router"]


def _bits_table(out: str) -> dict[str, list[str]]:
  table = out.split("State bits a parameter")[1]
  rows = [line.strip("|").split("|") for line in table.splitlines() if line.startswith("| ")]
  return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows[1:]}


def test_bits_table_against_hand_computation(capsys):
  assert state_bytes.main(["--preset", "tiny", "--optimizers", "adamw,skewadam",
                           "--expert-momentum", "lowrank", "--expert-lowrank-rank", "4"]) == 0
  rows = _bits_table(capsys.readouterr().out)
  # AdamW: fp32 m and v for every parameter
  assert rows["adamw"] == ["64.00"] * 4
  # rank-4 factors P (d_model x 4) and Q (d_ff x 4) per expert matrix in the default
  # orthogonal expert tier's int8 codes, with a float32 step for each of Qᵀ's 4 rows, no v
  c = _tiny()
  expected = 8 * (4 * (c.d_model + c.d_ff) + 4 * 4) / (c.d_model * c.d_ff)
  assert rows["skewadam"][1] == f"{expected:.2f}"
  # the router tier keeps fp32 m and an exact v
  assert rows["skewadam"][2] == "64.00"
