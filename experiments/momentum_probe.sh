#!/usr/bin/env bash
# For the tuning against Muon: what a compact expert momentum can keep, measured
# before a run is spent on a
# form (experiments/studies/momentum_probe.py): `small` at the default's settings with
# float32 expert momentum, 300 steps at seed 0, then each stacked expert matrix's
# momentum: the share a layer's mean over experts keeps (a momentum shared by the
# experts), the share rank-r factors per expert keep against one model-side subspace
# shared by the experts at equal bytes, and the Newton-Schulz update's size and
# direction outside the low-rank momentum's subspace, against float32's; then the
# gradients of the next 100 steps of that run, and each stored form (the library's
# encodings at the ranks the training runs measured, and the factors in int8 at rank 6
# and rank 42 in bfloat16's bytes: ranks 12 and 84) carried through them beside
# float32's momentum: its update's mean cosine with float32's after 30 steps. About
# 8 min on a 2-core CPU. Rewrites the committed experiments/results/momentum-probe.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
"$PYTHON" - <<'PY'
import json, pathlib
import experiments  # noqa: F401  (a quiet JAX start)
experiments.use_cpu_without_gpu()
from experiments.studies import momentum_probe
result = momentum_probe.probe(steps=300, seed=0, ranks=(6, 42))
gradients = momentum_probe.record_gradients(steps=300, count=100, seed=0)
result["fidelity"] = {"steps": "301 to 400, cosines from step 331", "b1": 0.9,
                      "by_form": momentum_probe.fidelity(gradients, burn_in=30)}
pathlib.Path("experiments/results/momentum-probe.json").write_text(json.dumps(result, indent=1) + "\n")
for name, leaf in result["leaves"].items():
  print(name, f"experts' mean keeps {leaf['energy_share_of_experts_mean']:.3f},",
        f"mean |cos| between experts {leaf['mean_abs_cosine_between_experts']:.3f}")
  for rank, row in leaf["ranks"].items():
    print(f"  rank {rank}: own factors keep {row['top_rank_energy_share']:.3f},",
          f"shared rank {row['shared_rank_at_equal_bytes']} keeps {row['shared_subspace_energy_share']:.3f};",
          "update's mean squared singular value inside/outside:",
          "fp32 %.2f/%.2f," % tuple(row["fp32_update_sq_singular_inside_outside"]),
          "low-rank %.2f/%.2f;" % tuple(row["lowrank_update_sq_singular_inside_outside"]),
          f"cosine with fp32's outside: low-rank {row['cosine_outside_lowrank_vs_fp32']:.2f},",
          f"no momentum {row['cosine_outside_gradient_update_vs_fp32']:.2f}")
for form, by_leaf in result["fidelity"]["by_form"].items():
  print(f"{form:>16}: update's cosine with float32's",
        " ".join(f"{v:.3f}" for v in by_leaf.values()))
PY
