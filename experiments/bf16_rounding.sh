#!/usr/bin/env bash
# bf16 parameters with and without stochastic rounding against fp32
# (docs/explanations/failure-behaviour.md): `small`, SkewAdam, 200 steps, seeds
# 0-2. Each run's summary.json and metrics.jsonl are kept in
# experiments/results/bf16-rounding/ (rewrites them: the committed results).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
OUT=experiments/results/bf16-rounding
for seed in 0 1 2; do
  # the library's skewadam() (Adam's direction), as these runs measured it
  COMMON=(--preset small --optimizer skewadam --steps 200 --warmup-steps 20 --seed "$seed"
          --backbone-direction adam --expert-direction adam --no-progress --ckpt-every 200)
  "$PYTHON" -m experiments.train "${COMMON[@]}" --out "$OUT/fp32-seed$seed"
  "$PYTHON" -m experiments.train "${COMMON[@]}" --param-dtype bfloat16 --out "$OUT/bf16-seed$seed"
  "$PYTHON" -m experiments.train "${COMMON[@]}" --param-dtype bfloat16 --stochastic-rounding \
      --out "$OUT/bf16-sr-seed$seed"
done
# The table (each row's validation perplexity per seed and mean) and the
# mechanism: the share of RMSNorm scale entries still exactly at their initial
# 1.0 after the 200 steps (their updates, about lr, are below half a bf16 step at
# 1.0 unless rounded stochastically), from each run's last checkpoint; written
# to rounding.json.
"$PYTHON" - "$OUT" <<'PY'
import json, pathlib, sys
import jax, numpy as np
import experiments  # noqa: F401  (a quiet JAX start)
from experiments.sample import load_run
out = pathlib.Path(sys.argv[1])
shares = {}
for run in sorted(p for p in out.iterdir() if p.is_dir()):
  params = load_run(run)[3]
  scales = [np.asarray(leaf, np.float32) for path, leaf in
            jax.tree_util.tree_flatten_with_path(params)[0] if "norm" in jax.tree_util.keystr(path)]
  flat = np.concatenate([s.ravel() for s in scales])
  shares[run.name] = {"norm_scale_entries": int(flat.size),
                      "share_exactly_1": float(np.mean(flat == 1.0))}
rows = {}
for name in ("fp32", "bf16", "bf16-sr"):
  ppl = [json.loads((out / f"{name}-seed{s}" / "summary.json").read_text())["val_ppl"]
         for s in range(3)]
  rows[name] = {"val_ppl_by_seed": ppl, "val_ppl_mean": float(np.mean(ppl)),
                "norm_scales_exactly_1_seed0": shares[f"{name}-seed0"]["share_exactly_1"]}
(out / "rounding.json").write_text(json.dumps({"rows": rows, "runs": shares}, indent=1) + "\n")
for name, row in rows.items():
  print(name, " ".join(f"{p:.2f}" for p in row["val_ppl_by_seed"]), f"mean {row['val_ppl_mean']:.2f}",
        f"norm scales at 1.0: {100 * row['norm_scales_exactly_1_seed0']:.1f} %")
PY
