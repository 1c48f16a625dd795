"""The README: each snippet runs alone and prints what the README shows; its figures are the
results files'; CI runs its test command."""

import contextlib
import io
import json
import math
import pathlib
import re
import statistics

import pytest

from experiments import state_bytes
from experiments.planning import accounting
from experiments.studies import comparison, sweeps
from experiments.training import config as config_lib


ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "experiments" / "results"


def code_blocks(lang):
  return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def snippets_and_outputs():
  """Each python block with the ```text block right after it (its printed output)."""
  return re.findall(r"```python\n(.*?)```\s*```text\n(.*?)```", README, flags=re.S)


def test_every_python_block_has_its_output_shown():
  assert len(snippets_and_outputs()) == len(code_blocks("python")) >= 2


@pytest.mark.parametrize("index", range(len(snippets_and_outputs())))
def test_a_snippet_alone_prints_what_the_readme_shows(index):
  pytest.importorskip("flax")
  code, shown = snippets_and_outputs()[index]
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    exec(compile(code, f"README.md python block {index}", "exec"), {})  # pylint: disable=exec-used
  assert out.getvalue() == shown


def test_ci_runs_the_readme_test_command():
  test_command = code_blocks("bash")[1].strip()
  assert "pytest" in test_command
  ci = (ROOT / ".ci" / "run").read_text()
  assert test_command in ci.splitlines()


def _gb(path, key):
  return f"{json.loads((RESULTS / path).read_text())[key] / 1e9:.3f} GB"


def _ppl(row):
  return f"{row['val_ppl_mean']:.2f} ± {row['val_ppl_std']:.2f}"


def test_the_figures_at_a_glance_are_the_results_files():
  rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
          for line in README.split("## Results at a glance")[1].split("##")[0].splitlines()
          if line.startswith("| ") and not line.startswith("| measured")}
  state, peak, backward, h200, ppl, compile_time, _ = rows.values()  # the last: XLA:GPU
  assert state[:2] == [f"**{_gb('memory/skewadam.json', 'opt_state_bytes')}**",
                       _gb("memory/adamw.json", "opt_state_bytes")]
  skewadam = json.loads((RESULTS / "memory" / "skewadam.json").read_text())
  assert peak[:2] == [f"**{_gb('memory/skewadam.json', 'peak_bytes')}** (fits; largest batch "
                      f"{skewadam['max_batch_that_fits']})", _gb("memory/adamw.json", "peak_bytes")]
  assert skewadam["fits"] and (skewadam["batch"], skewadam["seq"]) == (1, 2048)
  layerwise = json.loads((RESULTS / "memory" / "skewadam-update-in-backward.json").read_text())
  card = json.loads((RESULTS / "memory" / "skewadam-update-in-backward-24gb.json").read_text())
  assert layerwise["skewadam_tiers"] == card["skewadam_tiers"] == skewadam["skewadam_tiers"]
  assert card["device_bytes"] == 24 * 10**9
  assert backward[:2] == [f"**{_gb('memory/skewadam-update-in-backward.json', 'peak_bytes')}** "
                          f"(largest batch {layerwise['max_batch_that_fits']}; "
                          f"{card['max_batch_that_fits']} on a 24 GB card)",
                          _gb("memory/adamw-update-in-backward.json", "peak_bytes")]
  big = json.loads((RESULTS / "memory"
                    / "moe-47b-h200-skewadam-orthogonal-update-in-backward.json").read_text())
  assert big["skewadam_tiers"] == skewadam["skewadam_tiers"] and big["fits"]
  assert h200[:2] == [
      f"**{big['peak_bytes'] / 1e9:.2f} GB** (fits; largest batch {big['max_batch_that_fits']})",
      f"{json.loads((RESULTS / 'memory' / 'moe-47b-h200-adamw-update-in-backward.json').read_text())['peak_bytes'] / 1e9:.2f} GB"]
  long = json.loads((RESULTS / "compare-long.json").read_text())
  by_name = {(r["optimizer"], r["config"].get("backbone_dir", "adam")
              if isinstance(r["config"], dict) else "adam"): r for r in long}
  # The default's row: rank-16 expert momentum on 0.3.0's defaults (expert_momentum.sh),
  # priced as the planner prices the default's step.
  default = next(r for r in json.loads((RESULTS / "expert-momentum.json").read_text())
                 if r["name"] == "lowrank-16")
  assert len(default["val_ppl"]) == 3
  assert skewadam["skewadam_tiers"]["expert"]["momentum"] == "lowrank"
  assert f"{default['opt_state_bytes_6p78b'] / 1e9:.3f}" == f"{skewadam['opt_state_bytes'] / 1e9:.3f}"
  assert ppl[:2] == [f"**{_ppl(default)}**", _ppl(by_name["adamw", "adam"])]
  text = " ".join(README.split())
  muon, adam = by_name["muon", "adam"], by_name["skewadam", "adam"]
  normalized, signs = by_name["skewadam", "normalized_orthogonal"], by_name["skewadam", "orthogonal"]
  assert signs["config"]["expert_m"] == "sign"
  safe_signs = json.loads((RESULTS / "safe-defaults-1600.json").read_text())[0]
  assert f"reached {_ppl(muon)} with {muon['opt_state_bytes_6p78b'] / 1e9:.3f} GB" in text
  assert f"(Adam's direction) {_ppl(adam)} with {adam['opt_state_bytes_6p78b'] / 1e9:.3f} GB" in text
  assert (f"orthogonal tiers {_ppl(normalized)} with "
          f"{normalized['opt_state_bytes_6p78b'] / 1e9:.3f} GB") in text
  assert (f"the default before rank 16, {_ppl(signs)} with "
          f"{signs['opt_state_bytes_6p78b'] / 1e9:.3f} GB ({_ppl(safe_signs)} on 0.3.0's") in text
  gap = default["val_ppl_mean"] - muon["val_ppl_mean"]
  assert f"On the rate alone the default tied Muon ({gap:.2f} above its mean, within" in text
  assert gap < min(default["val_ppl_std"], muon["val_ppl_std"])  # "within either spread"
  # The two finalists over every seed finalists.sh has: seeds 0 to 2 from the studies
  # (Muon at its tuned point: tune_more.sh, weight decay 0.2; the default:
  # expert_momentum.sh), then finalists.sh's seeds 3 and 4.
  val_ppl = lambda d: json.loads((RESULTS / d / "summary.json").read_text())["val_ppl"]  # noqa: E731
  first_three = lambda point: [val_ppl(f"{point}{s}") for s in ("", "-seed1", "-seed2")]  # noqa: E731
  more = lambda name: [val_ppl(f"finalists-runs/{d.name}") for d in sorted(  # noqa: E731
      (RESULTS / "finalists-runs").glob(f"{name}-seed*")) if (d / "summary.json").exists()]
  tuned_muon = first_three("tune-more-runs/muon-weight-decay-0.2")
  tuned_muon += more("muon")
  seeds = first_three("expert-momentum-runs/lowrank-16")
  seeds += more("lowrank")
  ppl_text = lambda xs: f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs):.2f}"  # noqa: E731
  assert f"Muon (weight decay 0.2: {ppl_text(tuned_muon)} over {len(tuned_muon)} seeds)" in text
  lead = statistics.mean(seeds) - statistics.mean(tuned_muon)
  spread = max(statistics.stdev(seeds), statistics.stdev(tuned_muon))
  standard_error = math.hypot(statistics.stdev(seeds) / math.sqrt(len(seeds)),
                              statistics.stdev(tuned_muon) / math.sqrt(len(tuned_muon)))
  assert (f"Muon at its tuned point leads the default by {lead:.2f}**, {lead / spread:.2f}× the "
          f"larger spread, {lead / standard_error:.2f} standard errors") in text
  assert f"(the default over {len(seeds)} seeds: {ppl_text(seeds)};" in text
  # the default with one of Muon's choices (muon_gap.sh, seeds 0 to 4), and without its clip
  muon_scale = first_three("muon-gap-runs/muon-scale")
  muon_scale += [val_ppl(f"muon-gap-runs/muon-scale-seed{s}") for s in (3, 4)]
  assert (f"do not close it ({ppl_text(muon_scale)} over 5 seeds, `muon-gap.md`), nor does the "
          f"update clip off ({val_ppl('tune-more-runs/lowrank-update-clip-off'):.2f} at seed 0)") in text
  # "do not close it": still behind Muon by more than 2 standard errors of the difference
  behind = statistics.mean(muon_scale) - statistics.mean(tuned_muon)
  assert behind > 2 * math.hypot(statistics.stdev(muon_scale) / math.sqrt(5),
                                 statistics.stdev(tuned_muon) / math.sqrt(len(tuned_muon)))
  decay_02 = first_three("tune-more-runs/lowrank-weight-decay-0.2")
  assert (f"the default did not (weight decay 0.2: {ppl_text(decay_02)} over 3 seeds, against "
          f"{ppl_text(seeds[:3])} at 0.1)") in text
  assert statistics.mean(decay_02) > statistics.mean(seeds[:3])  # "did not" move
  tuned_adamw = first_three("tune-more-runs/adamw-weight-decay-0.4")
  assert f"weight decay 0.4: {ppl_text(tuned_adamw)} over 3 seeds; still last)" in text
  assert statistics.mean(tuned_adamw) > statistics.mean(seeds)  # "still last"
  assert lead > 2 * spread  # "ordered": the comparison's rule
  assert (f"It chose this row ({_ppl(default)} at {default['opt_state_bytes_6p78b'] / 1e9:.3f} GB, "
          f"standard step {_gb('memory/skewadam.json', 'peak_bytes')})") in text
  assert f"Adam's direction in every tier, {_ppl(adam)} at" in text
  x5_rows = json.loads((RESULTS / "compare-x5.json").read_text())
  x5 = {r["optimizer"]: r["val_ppl_mean"] for r in x5_rows if r["config"] == "default"}
  x5_signs = next(r for r in x5_rows if isinstance(r["config"], dict)
                  and r["config"].get("backbone_dir") == "orthogonal")
  assert x5_signs["config"]["expert_m"] == "sign"
  x5_default = json.loads((RESULTS / "x5-safe-defaults.json").read_text())[0]
  assert x5_default["config"] == sweeps.default_config()
  assert (f"the default reaches {x5_default['val_ppl_mean']:.2f}, Muon {x5['muon']:.2f}, "
          f"the sign momentum {x5_signs['val_ppl_mean']:.2f}, AdamW {x5['adamw']:.2f}") in text
  # the second scale at 1600 steps (x5_long.sh): every contender over seeds 0 and 1
  x5_seeds = {name: [val_ppl(f"x5-long-runs/{name}"), val_ppl(f"x5-long-runs/{name}-seed1")]
              for name in ("muon", "lowrank", "muon-scale", "adamw")}
  assert (f"at 1600 steps (`x5-long.md`, seeds 0 and 1) Muon {ppl_text(x5_seeds['muon'])}, "
          f"the default with Muon's width scaling {ppl_text(x5_seeds['muon-scale'])}, the "
          f"default {ppl_text(x5_seeds['lowrank'])} and AdamW {ppl_text(x5_seeds['adamw'])}: "
          f"the order of `small`, at each seed") in text
  for seed in (0, 1):  # the order holds at each seed, not only on the means
    order = [x5_seeds[name][seed] for name in ("muon", "muon-scale", "lowrank", "adamw")]
    assert order == sorted(order)
  # where the gap is (muon_gap.sh): the default made Muon, and its two halves
  gap = {name: val_ppl(f"muon-gap-runs/{name}") for name in (
      "muon-like", "muon-like-seed1", "muon-scale-fp32-experts", "muon-scale-fp32-experts-seed1",
      "muon-like-lowrank",
      "muon-scale-sign", "muon-scale-sign-seed1")}
  muon = [val_ppl(f"tune-more-runs/muon-weight-decay-0.2{s}") for s in ("", "-seed1")]
  assert (f"reaches {gap['muon-like']:.2f} and {gap['muon-like-seed1']:.2f} at seeds 0 and 1 "
          f"(Muon: {muon[0]:.2f}, {muon[1]:.2f}), with only its expert momentum at fp32 "
          f"{gap['muon-scale-fp32-experts']:.2f} and {gap['muon-scale-fp32-experts-seed1']:.2f}, and with Muon's backbone but rank-16 "
          f"expert momentum {gap['muon-like-lowrank']:.2f}") in text
  assert (f"packed signs there do worse ({gap['muon-scale-sign']:.2f}, "
          f"{gap['muon-scale-sign-seed1']:.2f})") in text
  # the rank-16 momentum's bits a parameter at small and at moe-6.78b (state_bytes), and
  # rank 2, small's nearest share, against no expert momentum
  def expert_bits(flags, preset):  # state_bytes' expert bits a parameter for these flags
    tiers = config_lib.tiers_from_args(state_bytes.build_parser().parse_args(flags))
    return accounting.bits_per_param(
        accounting.state_bytes(preset, "skewadam", skewadam_tiers=tiers),
        accounting.params_by_tier(preset, skewadam_tiers=tiers))["expert"]

  def within_noise(xs, ys):  # the comparison's rule on two lists of seeds
    stats = lambda v: {"val_ppl_mean": statistics.mean(v), "val_ppl_std": statistics.stdev(v)}  # noqa: E731
    return comparison.ordering(stats(xs), stats(ys))[0] == "within noise"

  bits = {preset: expert_bits([], preset) for preset in ("small", "moe-6.78b")}  # the command's
  at_share = {name: [val_ppl(f"muon-gap-runs/{name}"), val_ppl(f"muon-gap-runs/{name}-seed1")]
              for name in ("muon-scale-rank-2", "muon-scale-none")}
  assert (f"the rank-16 momentum is {bits['small']:.2f} bits a parameter on `small`'s experts "
          f"but {bits['moe-6.78b']:.2f} on `moe-6.78b`'s") in text
  assert (f"level with no expert momentum ({ppl_text(at_share['muon-scale-rank-2'])} against "
          f"{ppl_text(at_share['muon-scale-none'])} at seeds 0 and 1)") in text
  # the closest row within the budget (muon_gap.sh's rank-42 bf16 factors), over the seeds
  # it has finished, against Muon's five, and its bits a parameter on small and moe-6.78b
  rank42 = [val_ppl(d.relative_to(RESULTS)) for d in sorted(
      (RESULTS / "muon-gap-runs").glob("muon-scale-rank-42-bf16*"))
      if re.fullmatch(r"muon-scale-rank-42-bf16(-seed\d+)?", d.name)  # its seeds, not its rates
      and (d / "summary.json").exists()]
  behind = statistics.mean(rank42) - statistics.mean(tuned_muon)
  error = math.hypot(statistics.stdev(rank42) / math.sqrt(len(rank42)),
                     statistics.stdev(tuned_muon) / math.sqrt(len(tuned_muon)))
  flags42 = ["--expert-lowrank-rank", "42", "--expert-lowrank-dtype", "bfloat16"]
  tiers42 = config_lib.tiers_from_args(state_bytes.build_parser().parse_args(flags42))
  bits42 = {preset: expert_bits(flags42, preset) for preset in ("small", "moe-6.78b")}
  state42 = accounting.state_bytes("moe-6.78b", "skewadam", skewadam_tiers=tiers42)["total"]
  assert (f"(`--expert-lowrank-dtype bfloat16`, {state42 / 1e9:.3f} GB) under Muon's scaling: "
          f"{ppl_text(rank42)} over {len(rank42)} seeds, {behind:.2f} behind Muon, "
          f"{behind / error:.2f} standard errors, within noise and ahead of Muon at "
          f"{sum(r < m for r, m in zip(rank42, tuned_muon))} of the {len(rank42)} seeds") in text
  assert within_noise(rank42, tuned_muon)
  assert state42 <= 1.29e9
  assert (f"({bits42['small']:.2f} bits a parameter there, {bits42['moe-6.78b']:.2f} at "
          "`moe-6.78b`)") in text
  # rank 42 in bf16's share of bytes at moe-6.78b, on small: rank 6 in bf16
  bits6 = expert_bits(["--expert-lowrank-rank", "6", "--expert-lowrank-dtype", "bfloat16"],
                      "small")
  assert abs(bits6 - bits42['moe-6.78b']) < 0.05  # the nearest rank to that share
  rank6 = [val_ppl(f"muon-gap-runs/muon-scale-rank-6-bf16{s}") for s in ("", "-seed1")]
  none = at_share["muon-scale-none"]
  assert (f"at that share on `small` (rank 6 in bfloat16) it gives {ppl_text(rank6)} at seeds 0 "
          "and 1, within noise of no expert momentum") in text
  assert within_noise(rank6, none)
  assert gap["muon-like"] < muon[0] and gap["muon-like-seed1"] < muon[1]
  assert gap["muon-scale-fp32-experts"] < muon[0] < gap["muon-like-lowrank"]
  assert gap["muon-scale-fp32-experts-seed1"] < muon[1]
  times = json.loads((RESULTS / "bench-runs" / "compile-time.json").read_text())["rows"]
  total = {name: r["trace_s"] + r["compile_s"] for name, r in times.items()}
  ratio = lambda rows, name: f"{rows[name]['total_ratio_to_adamw']:.2f}×"  # noqa: E731
  assert compile_time[:2] == [
      f"{total['skewadam']:.2f} s ({ratio(times, 'skewadam')} AdamW's, each leaf alone as the "
      f"default does on a CPU; **{ratio(times, 'skewadam, state stacked')}** with "
      "`group_leaves=\"stacked\"`, each group's state kept stacked (the default on a GPU); "
      f"grouped: {ratio(times, 'skewadam, leaves grouped')}, of which stacking and slicing "
      f"with no math {ratio(times, 'skewadam grouped, no math')}; "
      f"the same math by hand, no library: {ratio(times, 'the same math by hand')})",
      f"{total['optax.adamw']:.2f} s"]
  gpu = json.loads((RESULTS / "bench-runs" / "compile-time-a100.json").read_text())
  assert gpu["target"] == "a100-40gb" and gpu["warning"] is None
  total = {name: r["trace_s"] + r["compile_s"] for name, r in gpu["rows"].items()}
  stacked = "skewadam, state stacked"  # what the default does on a GPU
  assert (f"| {total[stacked]:.2f} s (**{ratio(gpu['rows'], stacked)}** AdamW's; leaves grouped, "
          "state leaf by leaf (`group_leaves=True`): "
          f"{ratio(gpu['rows'], 'skewadam, leaves grouped')}, of which stacking and "
          f"slicing with no math {ratio(gpu['rows'], 'skewadam grouped, no math')}; each leaf "
          f"alone {ratio(gpu['rows'], 'skewadam')}; by hand: "
          f"{ratio(gpu['rows'], 'the same math by hand')}) | {total['optax.adamw']:.2f} s |") in README


def test_the_readme_stays_short():
  assert README.count("\n") <= 250
