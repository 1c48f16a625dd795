#!/usr/bin/env bash
# #42: what else than the expert momentum separates the default from Muon at their
# tuned points (finalists.md: 58.67 against 57.27 over 5 seeds; on 0.3.0's defaults
# rank-16 momentum already matches fp32's, expert-momentum.md). Each row is the
# default at its tuned point (rank-16 expert momentum, rate 1.35e-2, warmup 160,
# weight decay 0.1) with one of Muon's choices taken over:
#   muon-scale  Muon's width scaling of the orthogonalised update (sqrt(max(1, cols /
#               rows)), `optax.contrib.muon`'s) in both tiers, at Muon's tuned rate and
#               weight decay (1.5e-2, 0.2), for which that scaling is tuned: the default's
#               scaling (RMS 0.2, Moonlight's) moves the matrices about 2.5x further a
#               step than Muon's at a like rate, while the Adam-direction leaves
#               (embeddings, unembedding, router, vectors) move alike in both, so the
#               balance between the two differs and one rate cannot restore it
#   exact-v     an exact second moment for the backbone's leaves in Adam's direction
#               (embeddings, unembedding; vectors have one already), as Muon's AdamW
#               part keeps, in place of the factored one: with a dense momentum it is
#               bounded, so it is not clipped either. 1.332 GB at moe-6.78b, just over
#               the budget: a measure of what the factored v costs, not a candidate
#   nesterov    Nesterov's momentum on the leaves in Adam's direction (embeddings,
#               unembedding, router, vectors), as Muon's AdamW part has it
#               (`optax.adamw(nesterov=True)`); the orthogonalised matrices have it in
#               both. Same state: a candidate
#   muon-like   the default made Muon by every setting the library has: Muon's scaling,
#               rate and weight decay (as muon-scale), fp32 momentum in both tiers, the
#               backbone's Adam-direction leaves in the router tier (fp32 m, exact v:
#               AdamW's moments, as Muon's AdamW part) and Nesterov there. What is left
#               is Muon's momentum on the matrices (0.95 against b1 = 0.9; Muon is flat
#               from 0.9 to 0.98, tune-more.md) and the first steps' bias correction: if
#               it reaches Muon, the gap is in the default's compressed state; if not, in
#               what is left. 27 GB at moe-6.78b: a measure, not a candidate
# and, as muon-like reached Muon at seed 0, the two halves of the default's compressed
# state, each a measure, to say which half holds the gap:
#   muon-like-lowrank        muon-like with the default's rank-16 expert momentum (the
#                            backbone as Muon's)
#   muon-scale-fp32-experts  muon-scale with fp32 expert momentum (the backbone as the
#                            default's: bf16 momentum, factored v, the clip)
# and, as the expert half held it at seed 0 (muon-scale-fp32-experts reached muon-like,
# and muon-like-lowrank did not), a full-rank expert momentum within the budget:
#   muon-scale-sign  muon-scale with the packed-sign expert momentum (1 bit an entry,
#                    row and column scales; 1.219 GB at moe-6.78b), which under the
#                    default's scaling carried little (attribution.md)
# and, as the signs were worse than rank 16 at both seeds, a weight on the part of the
# orthogonalised update that the rank-16 momentum does not carry (--expert-lowrank-complement
# λ: u <- P·Pᵀ·u + λ·(u - P·Pᵀ·u)). Outside the momentum's subspace the update is the
# current gradient's alone, orthogonalised to the same singular values as the averaged
# directions; fp32 momentum averages every direction. Same state (1.064 GB):
#   muon-scale-complement-0.5, muon-scale-complement-0.25  muon-scale with λ 0.5, 0.25
# (at small's 128 x 256 experts rank 16 is an eighth of the rows, at moe-6.78b's a
# sixty-fourth: a weight below 1 takes more of the update there)
# and, as both weights did worse, how much the rank-16 momentum carries under Muon's
# scaling at all (a measure, 0.349 GB of state at moe-6.78b):
#   muon-scale-none  muon-scale with no expert momentum (the update orthogonalises g_t)
# and, as rank 16 carries part of fp32's gain under Muon's scaling (57.80 against none's
# 59.66 and fp32's 56.74 at seed 0), a measure of what it carries at moe-6.78b's share of
# bytes (2026-12-05), with muon-scale-none's seed 1 beside it:
#   muon-scale-rank-2  muon-scale at rank 2, a measure: rank r's factors are
#                      r·(rows + cols) of an expert's rows·cols entries, 2.3 % of fp32's bytes
#                      at small's 128 x 256 for rank 2 against 2.7 % at moe-6.78b's
#                      1024 x 1400 for rank 16 (18.8 % at small for rank 16), so this row
#                      is what the default's momentum carries at moe-6.78b's share of bytes
#                      (0.75 bits a parameter against 0.87; `python -m experiments.state_bytes`)
# and, as rank 2 was level with none at seeds 0 and 1, the most the budget buys at that share:
#   muon-scale-rank-3  muon-scale at rank 3 (1.125 bits a parameter on small); at moe-6.78b
#                      the budget leaves the expert momentum 1.14 bits a parameter (1.29 GB
#                      less the 0.349 GB without it), rank 21 there. A measure
# and, as no form of about a bit a parameter at small's share carried anything, the same
# budget spent on more directions at half the bytes each (2026-12-05): factors stored in
# bfloat16 (--expert-lowrank-dtype bfloat16; the step computes in float32, the stored
# factors are rounded stochastically), so rank 2r costs rank r's float32 bytes at every
# preset (the share of bytes is the preset's own, not a proxy):
#   muon-scale-rank-42-bf16  rank 42 in bfloat16: 1.287 GB at moe-6.78b, the most the
#                            budget buys (as rank 21 in float32). A candidate
#   muon-scale-rank-32-bf16  rank 32 in bfloat16: the default's 1.064 GB (rank 16's float32
#                            bytes) at every preset, so beside muon-scale it says what half
#                            the precision and twice the rank do at equal bytes. A candidate
#   muon-scale-rank-6-bf16   rank 6 in bfloat16 (1.125 bits a parameter on small, as rank 3
#                            in float32): rank 42 in bfloat16's share of bytes at moe-6.78b,
#                            the budget's most, on small's matrices. A measure
# and, as rank 42 in bfloat16 was level with rank 16 in float32 at seeds 0 and 1 (so
# rank 32 between them and rank 6 below rank 3's level were not run), whether the
# low-rank form reaches fp32's result at all, and bfloat16 factors with it:
#   muon-scale-rank-128-bf16  rank 128 in bfloat16: every row of small's 128 x 256
#                             experts, so the subspace is the whole space and only the
#                             rounding differs from fp32 momentum (a control; 3 bytes a
#                             parameter on small)
#   muon-scale-rank-64-bf16   rank 64 in bfloat16: half the rows (a measure)
# (rank 128 was stopped at step 133: its QR of every expert at full rank took 5 s a step
# beside two other runs, two hours to finish; in its place, the rounding alone:)
#   muon-scale-rank-16-bf16   rank 16 in bfloat16: the default's rank, only the factors'
#                             rounding differs from muon-scale (a control, 0.706 GB at
#                             moe-6.78b)
# and muon-scale-rank-42-bf16-seed2: the budget's most, its mean at seeds 0 and 1 (57.88)
# the best within 1.29 GB there (rank 16: 57.92), over the 3 seeds the goal is stated at;
# and, as its 3 seeds (57.69) came within 0.24 of Muon's at the same seeds, its seeds 3
# and 4, decided before either ran and reported whatever they give, to set it beside
# Muon's five in finalists.md as muon-scale's five are;
# and muon-scale-rank-6-bf16 at seeds 0 and 1 after all (2026-12-05, decided before either
# ran and reported whatever they give): the candidate's form at the candidate's share of
# bytes at moe-6.78b (1.125 bits a parameter on small), beside rank 3 in float32 (59.45)
# and no expert momentum (59.30) at the same seeds, so the caveat on rank 42 is a
# measurement, not a guess;
# and, as rank 42 in bfloat16 is the best row within 1.29 GB over five seeds at Muon's
# point (rate and weight decay taken over, not tuned for it), the first coordinate of the
# tuning procedure the contenders had (quality page, "The procedure and the runs it
# took"), decided before either ran: its rate's two neighbours at seed 0
#   muon-scale-rank-42-bf16-lr-0.0075, muon-scale-rank-42-bf16-lr-0.03   (x0.5, x2)
# (58.79 and 60.11 against 58.50: the rate stays) and the next coordinate, the warmup,
# as the contenders had it (60 and 320 steps against 160), decided before either ran:
#   muon-scale-rank-42-bf16-warmup-60, muon-scale-rank-42-bf16-warmup-320
# (58.04 and 58.31 against 160's 58.50: both edges improve, so each goes one step
# further, as the procedure has it, decided before either ran:
#   muon-scale-rank-42-bf16-warmup-30, muon-scale-rank-42-bf16-warmup-640)
# (57.99 and 57.69: both edges improve again, each by less than the row's spread over
# five seeds. The coordinate stops there, at the longest warmup any contender had
# (AdamW's 640; a step further warms up over 80 % of the run), and its point moves to
# 640, its best at seed 0.) The third coordinate, the momentum (b1, which every tier
# shares, both ways as the contenders had it), at that point, decided before either ran:
#   muon-scale-rank-42-bf16-warmup-640-b1-0.95, muon-scale-rank-42-bf16-warmup-640-b1-0.85
# (60.34 and 58.50 against 57.69: worse both ways, so b1 stays 0.9.) The fourth, the
# weight decay's two neighbours (x0.5, x2 of Muon's 0.2) at that point, decided before
# either ran:
#   muon-scale-rank-42-bf16-warmup-640-wd-0.1, muon-scale-rank-42-bf16-warmup-640-wd-0.4
# (58.24 and 60.76 against 0.2's 57.69: worse both ways, so the weight decay stays 0.2.)
# The procedure ends at rate 1.5e-2, warmup 640, b1 0.9, weight decay 0.2; the point
# moved (warmup 640), so it gets seeds 1 and 2, decided before either ran:
#   muon-scale-rank-42-bf16-warmup-640-seed1, muon-scale-rank-42-bf16-warmup-640-seed2
# and, as its 3 seeds there (57.66 +- 0.28) came within Muon's spread of Muon's tuned
# 57.45 +- 0.26 and the rule made it the default, its seeds 3 and 4 at that point, to
# set it beside Muon's five in finalists.md as muon-scale-rank-42-bf16's five are
# (2026-12-06, decided before either ran and reported whatever they give):
#   muon-scale-rank-42-bf16-warmup-640-seed3, muon-scale-rank-42-bf16-warmup-640-seed4
# (58.65 and 57.96: over five seeds 57.92 +- 0.47, 0.65 behind Muon's 57.27 +- 0.56 and
# 0.38 behind this row's 10 % warmup over the same seeds, finalists.md)
# and, as the expert momentum's other forms were spent (2026-12-07), the one candidate of
# the issue's outside evidence that changes the direction, not the state: NorMuon's
# per-neuron normalisation of the orthogonalised update (--backbone-direction and
# --expert-direction normalized_orthogonal; 60.59 against the orthogonal tiers' 59.85
# with the packed-sign momentum and Adam's update RMS, compare-long.md, never tried with
# the low-rank momentum or Muon's width scaling) at the default's tuned point. Its
# per-neuron statistic costs 24 MB at moe-6.78b, so the factors drop to rank 41 to stay
# within 1.29 GB (1.289 GB). It keeps each matrix's Frobenius norm, so the rate is the
# orthogonal one. Decided before it ran, screened at seeds 0 and 1 as every row here is
# (against the tuned point's 57.69 and 57.37):
#   muon-scale-rank-41-bf16-normalized-warmup-640, muon-scale-rank-41-bf16-normalized-warmup-640-seed1
# (seed 0: 58.29, 0.60 behind; seed 1 registered after it, before it ran: 56.99, 0.38
# ahead. At seeds 0 and 1 57.64, 0.11 behind the tuned point's 57.53: not the best there,
# which sent rows on to seed 2 above, but level within the seed noise, so its seed 2, a
# measure, decided before it ran:
#   muon-scale-rank-41-bf16-normalized-warmup-640-seed2)
# (57.74: over seeds 0 to 2 57.67 +- 0.65, level with the tuned point's 57.66 +- 0.28 and
# 0.22 behind Muon's 57.45 +- 0.26, so it stops there: not tuned further, not a default)
# and, as the training command's rate for this direction under width scaling is twice the
# orthogonal one, never swept (optimizers.SKEWADAM_LR), the rate's two neighbours at seed 0,
# decided before either ran, to set that rate from a measurement:
#   muon-scale-rank-41-bf16-normalized-warmup-640-lr-0.0075, muon-scale-rank-41-bf16-normalized-warmup-640-lr-0.03
# (59.42 and 61.03 against 1.5e-2's 58.29: worse both ways, so the command's rate for it
# is now the orthogonal one, 1.5e-2, where it was twice that)
# and, as the momentum probe (momentum-probe.json) put low-rank factors in int8 (twice the
# rank for the same bytes) nearest float32's update of every form within the budget
# (0.807 to 0.842 at rank 84 against rank 42 in bfloat16's 0.635 to 0.657), that form,
# now in the library (--expert-lowrank-dtype int8: P's column scales moved into Q^T, whose
# rows keep a float32 scale; both rounded stochastically), at the default's tuned point:
# rank 84, 1.2885 GB at moe-6.78b (the most the budget buys; rank 85 is 1.2997 GB).
# Screened at seeds 0 and 1 as every row here is (against the tuned point's 57.69 and
# 57.37), decided before either ran:
#   muon-scale-rank-84-int8-warmup-640, muon-scale-rank-84-int8-warmup-640-seed1
# (57.43 and 56.90, ahead of the tuned point at both and of Muon's 57.69 and 57.17: at
# seeds 0 and 1 57.16 against the tuned point's 57.53, so it gets seed 2, decided before
# it ran and reported whatever it gives:
#   muon-scale-rank-84-int8-warmup-640-seed2)
# (57.60: over seeds 0 to 2 57.31 +- 0.37, 0.14 below Muon's tuned 57.45 +- 0.26, within
# the larger spread; not tuned by the procedure itself, and not the default: quality page)
# and, as it is the best row within 1.29 GB over seeds 0 to 2 at a point it took over, the
# contenders' procedure for it from that point (quality page, "The procedure and the runs it
# took"; 2026-12-06, decided before any ran and reported whatever they give), each
# coordinate's neighbours at seed 0 against its 57.43 there, in the procedure's order: the
# rate (x0.5, x2), the warmup (320: 640 is the longest any contender had, so one
# neighbour), b1 (0.95, 0.85), the weight decay (0.1, 0.4). A coordinate whose neighbour
# improves moves the point, and the coordinates after it are registered again at the new
# point, so the queue stops at a move (each result read before the next row starts):
#   muon-scale-rank-84-int8-warmup-640-lr-0.0075, muon-scale-rank-84-int8-warmup-640-lr-0.03
#   (57.92 and 59.91 against 57.43: worse both ways, so the rate stays 1.5e-2)
#   muon-scale-rank-84-int8-warmup-320
#   (56.53 against 640's 57.43: the edge improves, so the coordinate goes one step further,
#   to the contenders' next warmup, and on while an edge improves (60, then 30); the point
#   moves to the best of them, and the coordinates after it are run there, decided before
#   any ran: b1 (0.95, 0.85), then the weight decay (0.1, 0.4), then seeds 1 and 2 at
#   the point; b1 and the weight decay at 640 are not run)
#   muon-scale-rank-84-int8-warmup-160 (then muon-scale-rank-84-int8-warmup-60, -30 while
#   an edge improves); at the point W the warmup ends on, muon-scale-rank-84-int8-warmup-W
#   with -b1-0.95, -b1-0.85, -wd-0.1, -wd-0.4, then -seed1, -seed2
#   (160: 57.46 against 320's 56.53, worse, so the warmup ends on 320: the rows at 320
#   run next, in that order; b1 0.95: 58.53 and 0.85: 57.13, worse both ways, so b1 stays 0.9)
#   then the weight decay's edges one step further while an edge improves (registered
#   2026-12-06, before either weight decay's row finished): -wd-0.05 if 0.1 beats 56.53 and
#   0.4, -wd-0.8 if 0.4 beats 56.53 and 0.1; the point moves to the best of them and its
#   seeds 1 and 2 run there (POINT-seed1, -seed2); if neither improves, -seed1, -seed2 at 320
#   (0.1: 58.28 and 0.4: 59.07, worse both ways, so the weight decay stays 0.2 and the
#   procedure ends on warmup 320, -wd-0.05 and -wd-0.8 are not run: its seeds 1 and 2 run next)
#   muon-scale-rank-84-int8-warmup-320-seed1, muon-scale-rank-84-int8-warmup-320-seed2
#   (56.22 and 56.35: over seeds 0 to 2 56.37 +- 0.16, 1.08 below Muon's tuned
#   57.45 +- 0.26 and ahead of it at each seed; the rule picks it, the default since:
#   quality page)
#   then (2026-12-07, after its seed 0 at small-x5 came in 0.72 behind Muon's at warmup
#   320, where rank 42 at the commands' 10 % warmup was ahead of Muon at each of three
#   seeds; x5_long.sh), the default as the training command runs it, at that 10 % warmup,
#   over three seeds here, beside x5_long.sh's rank84-int8-warmup-160, so the two scales
#   are read at one point; decided before either ran, reported whatever they give:
#   muon-scale-rank-84-int8-warmup-160-seed1, muon-scale-rank-84-int8-warmup-160-seed2
#   (56.61 and 56.19: over seeds 0 to 2 56.75 +- 0.65, ahead of Muon's tuned 57.45 +- 0.26
#   at each seed, 1.07x the larger spread: within noise by the rule)
#   then (2026-12-08), as the rows orthogonalised through the rank-r factors
#   (-factors: 57.47 at rank 84 and 61.67 at rank 11 against 56.53 and 58.98 whole) take a
#   rank-r update, whose norm is sqrt(r / 128) of the whole matrix's at small's 128 x 256
#   experts (0.81 at rank 84, 0.29 at rank 11: a smaller step at the same rate), the same
#   rows with the update scaled back to the whole matrix's norm (factors_rms), seed 0:
#   muon-scale-rank-11-int8-warmup-320-factors_rms (61.47 against the factors' 61.67 and the whole
#   matrix's 58.98: the norm is not what the factors lose, the directions outside the subspace
#   are, so the rank-84 row, muon-scale-rank-84-int8-warmup-320-factors_rms, was not run)
# A row is POINT (seed 0) or POINT-seedN; ROWS picks them (empty: none, only the
# table). The default's seed 0 is its best of five (finalists.md), so a row is
# screened at seeds 0 and 1 before it gets seed 2 (muon-scale's seeds 3 and 4 were
# decided before its seed 2 finished, to set it beside the finalists' five seeds in
# finalists.md, which reads them from here). A rank-42 row takes about 14 min alone
# on this 2-core CPU and about 68 min beside another (two trainings thrash the two
# cores: rows train one after another, as ROWS does). A finished row is not trained
# again.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
RUNS=experiments/results/muon-gap-runs
source experiments/runs_folder.sh
runs_folder "$RUNS"
# shellcheck disable=SC2206
BASE=("${LONG_RUN[@]}" --no-progress --optimizer skewadam --lr 0.0135 --warmup-steps 160
      $RANK16_DEFAULT --expert-momentum lowrank)
# Muon's width scaling at Muon's rate and weight decay (muon-scale), and the rest of
# Muon's backbone state (fp32 momentum; AdamW's moments and Nesterov on the
# Adam-direction leaves), which the rows below combine
MUON_SCALE="--backbone-orthogonal-scale width --expert-orthogonal-scale width --lr 0.015 --weight-decay 0.2"
MUON_BACKBONE="--backbone-momentum fp32 --orthogonal-rest-tier router --nesterov on"
# the candidate: rank-42 expert momentum factors in bfloat16 under Muon's scaling
RANK42_BF16="$MUON_SCALE --expert-lowrank-rank 42 --expert-lowrank-dtype bfloat16"
# rank 84 in int8: the same bytes at moe-6.78b
RANK84_INT8="$RANK42_BF16 --expert-lowrank-rank 84 --expert-lowrank-dtype int8"
declare -A FLAGS=(
  [muon-scale]="$MUON_SCALE"
  [exact-v]="--backbone-second-moment exact"
  [nesterov]="--nesterov on"
  [muon-like]="$MUON_SCALE $MUON_BACKBONE --expert-momentum fp32"
  [muon-like-lowrank]="$MUON_SCALE $MUON_BACKBONE"
  [muon-scale-fp32-experts]="$MUON_SCALE --expert-momentum fp32"
  [muon-scale-sign]="$MUON_SCALE --expert-momentum sign"
  [muon-scale-complement-0.5]="$MUON_SCALE --expert-lowrank-complement 0.5"
  [muon-scale-complement-0.25]="$MUON_SCALE --expert-lowrank-complement 0.25"
  [muon-scale-none]="$MUON_SCALE --expert-momentum none"
  [muon-scale-rank-2]="$MUON_SCALE --expert-lowrank-rank 2"
  [muon-scale-rank-3]="$MUON_SCALE --expert-lowrank-rank 3"
  [muon-scale-rank-42-bf16]="$RANK42_BF16"
  [muon-scale-rank-32-bf16]="$MUON_SCALE --expert-lowrank-rank 32 --expert-lowrank-dtype bfloat16"
  [muon-scale-rank-6-bf16]="$MUON_SCALE --expert-lowrank-rank 6 --expert-lowrank-dtype bfloat16"
  [muon-scale-rank-128-bf16]="$MUON_SCALE --expert-lowrank-rank 128 --expert-lowrank-dtype bfloat16"
  [muon-scale-rank-64-bf16]="$MUON_SCALE --expert-lowrank-rank 64 --expert-lowrank-dtype bfloat16"
  [muon-scale-rank-16-bf16]="$MUON_SCALE --expert-lowrank-dtype bfloat16"
  [muon-scale-rank-42-bf16-lr-0.0075]="$RANK42_BF16 --lr 0.0075"
  [muon-scale-rank-42-bf16-lr-0.03]="$RANK42_BF16 --lr 0.03"
  [muon-scale-rank-42-bf16-warmup-60]="$RANK42_BF16 --warmup-steps 60"
  [muon-scale-rank-42-bf16-warmup-320]="$RANK42_BF16 --warmup-steps 320"
  [muon-scale-rank-42-bf16-warmup-30]="$RANK42_BF16 --warmup-steps 30"
  [muon-scale-rank-42-bf16-warmup-640]="$RANK42_BF16 --warmup-steps 640"
  [muon-scale-rank-42-bf16-warmup-640-b1-0.95]="$RANK42_BF16 --warmup-steps 640 --b1 0.95"
  [muon-scale-rank-42-bf16-warmup-640-b1-0.85]="$RANK42_BF16 --warmup-steps 640 --b1 0.85"
  [muon-scale-rank-42-bf16-warmup-640-wd-0.1]="$RANK42_BF16 --warmup-steps 640 --weight-decay 0.1"
  [muon-scale-rank-42-bf16-warmup-640-wd-0.4]="$RANK42_BF16 --warmup-steps 640 --weight-decay 0.4"
  [muon-scale-rank-41-bf16-normalized-warmup-640]="$RANK42_BF16 --warmup-steps 640 --expert-lowrank-rank 41 --backbone-direction normalized_orthogonal --expert-direction normalized_orthogonal"
  [muon-scale-rank-41-bf16-normalized-warmup-640-lr-0.0075]="$RANK42_BF16 --warmup-steps 640 --expert-lowrank-rank 41 --backbone-direction normalized_orthogonal --expert-direction normalized_orthogonal --lr 0.0075"
  [muon-scale-rank-84-int8-warmup-640]="$RANK84_INT8 --warmup-steps 640"
  [muon-scale-rank-84-int8-warmup-640-lr-0.0075]="$RANK84_INT8 --warmup-steps 640 --lr 0.0075"
  [muon-scale-rank-84-int8-warmup-640-lr-0.03]="$RANK84_INT8 --warmup-steps 640 --lr 0.03"
  [muon-scale-rank-84-int8-warmup-320]="$RANK84_INT8 --warmup-steps 320"
  [muon-scale-rank-84-int8-warmup-160]="$RANK84_INT8 --warmup-steps 160"
  [muon-scale-rank-84-int8-warmup-320-b1-0.95]="$RANK84_INT8 --warmup-steps 320 --b1 0.95"
  [muon-scale-rank-84-int8-warmup-320-b1-0.85]="$RANK84_INT8 --warmup-steps 320 --b1 0.85"
  [muon-scale-rank-84-int8-warmup-320-wd-0.1]="$RANK84_INT8 --warmup-steps 320 --weight-decay 0.1"
  [muon-scale-rank-84-int8-warmup-320-wd-0.4]="$RANK84_INT8 --warmup-steps 320 --weight-decay 0.4"
  [muon-scale-rank-84-int8-warmup-320-factors]="$RANK84_INT8 --warmup-steps 320 --expert-lowrank-orthogonalise factors"
  [muon-scale-rank-11-int8-warmup-320]="$RANK84_INT8 --warmup-steps 320 --expert-lowrank-rank 11"
  [muon-scale-rank-11-int8-warmup-320-factors]="$RANK84_INT8 --warmup-steps 320 --expert-lowrank-rank 11 --expert-lowrank-orthogonalise factors"
  [muon-scale-rank-84-int8-warmup-320-factors_rms]="$RANK84_INT8 --warmup-steps 320 --expert-lowrank-orthogonalise factors_rms"
  [muon-scale-rank-11-int8-warmup-320-factors_rms]="$RANK84_INT8 --warmup-steps 320 --expert-lowrank-rank 11 --expert-lowrank-orthogonalise factors_rms"
  [muon-scale-rank-41-bf16-normalized-warmup-640-lr-0.03]="$RANK42_BF16 --warmup-steps 640 --expert-lowrank-rank 41 --backbone-direction normalized_orthogonal --expert-direction normalized_orthogonal --lr 0.03"
)
for row in ${ROWS-}; do
  finished "$RUNS/$row" && continue
  # shellcheck disable=SC2086
  "$PYTHON" -m experiments.train "${BASE[@]}" ${FLAGS[$(row_point "$row")]} \
      --seed "$(row_seed "$row")" --out "$RUNS/$row"
done
# rewrites the committed experiments/results/muon-gap.md: the finished rows against
# the default's seed-0 run, then each point's mean and spread over its seeds
finished=$(finished_runs "$RUNS"/*/)
{
  if [ -n "$finished" ]; then
    "$PYTHON" -m experiments.compare --runs-table "$finished" \
        --baseline experiments/results/expert-momentum-runs/lowrank-16
    echo
  fi
  seed_means "$RUNS"
} > experiments/results/muon-gap.md
# The two candidates at the points the procedure ended on (rate 1.5e-2, b1 0.9, weight
# decay 0.2; rank 42 in bfloat16 at warmup 640, rank 84 in int8 at warmup 320; seeds 0
# to 2) as comparison rows (experiments.compare's form), so the rule
# (comparison.choose_default) can weigh them and compare --quick can read their rate
# (comparison.TUNED_RATES): the rule chose rank 42 in bfloat16 first, then rank 84 in
# int8, the training command's default since. Rewrites the committed
# experiments/results/muon-gap.json.
"$PYTHON" - <<'PY'
import json, pathlib, statistics
from experiments.studies import comparison, sweeps
from experiments.training import config as config_lib
runs = pathlib.Path("experiments/results/muon-gap-runs")
rows = []
for name, point in (("rank42-bf16", "muon-scale-rank-42-bf16-warmup-640"),
                    ("rank84-int8", "muon-scale-rank-84-int8-warmup-320")):
  summaries = [json.loads((runs / d / "summary.json").read_text())
               for d in (point, f"{point}-seed1", f"{point}-seed2")]
  saved = config_lib.TrainConfig(**config_lib.with_defaults(summaries[0]["config"]))
  ppl = [s["val_ppl"] for s in summaries]
  row = {"name": name, "optimizer": "skewadam", "lr": saved.lr,
         "warmup_steps": saved.warmup_steps, "seeds": [s["config"]["seed"] for s in summaries],
         "config": sweeps.resolve_entry("skewadam", {
             "expert_m": saved.expert_momentum, "expert_rank": saved.expert_lowrank_rank,
             "expert_dtype": saved.expert_lowrank_dtype,
             "backbone_scale": saved.backbone_orthogonal_scale,
             "expert_scale": saved.expert_orthogonal_scale, "wd": saved.weight_decay}),
         "val_ppl": ppl, "val_ppl_mean": statistics.mean(ppl),
         "val_ppl_std": statistics.stdev(ppl)}
  row["opt_state_bytes_6p78b"] = comparison.state_bytes_6p78b("skewadam",
                                                              comparison.row_tiers(row))
  rows.append(row)
pathlib.Path("experiments/results/muon-gap.json").write_text(json.dumps(rows, indent=1) + "\n")
PY
