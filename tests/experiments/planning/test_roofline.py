"""The roofline step-time estimate (experiments/planning/roofline.py), against hand counts."""

import jax
import jax.numpy as jnp
import pytest

from experiments.planning import planner, roofline

ROOF = roofline.Roofline("unit", peak_flops=1e12, memory_bandwidth=1e9,
                         interconnect_bandwidth=1e8)


def _text(fn, *args):
  return jax.jit(fn).lower(*args).compile().as_text()


def test_a_large_matmul_is_compute_bound():
  text = """ENTRY %main (a: bf16[4096,4096], b: bf16[4096,4096]) -> bf16[4096,4096] {
  %a = bf16[4096,4096]{1,0} parameter(0)
  %b = bf16[4096,4096]{1,0} parameter(1)
  ROOT %d = bf16[4096,4096]{1,0} dot(bf16[4096,4096]{1,0} %a, bf16[4096,4096]{1,0} %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}"""
  e = roofline.estimate(text, ROOF, kernel_overhead_s=1e-6)
  flops = 2 * 4096**3
  assert e.matmul_flops == flops and e.kernels == 1
  assert e.bytes == 3 * 4096 * 4096 * 2
  # 137 GFLOP at 1 TFLOP/s (0.137 s) against 100 MB at 1 GB/s (0.1 s).
  assert e.seconds == pytest.approx(flops / 1e12 + 1e-6)
  assert e.compute_seconds == pytest.approx(flops / 1e12) and e.memory_seconds == 0


def test_an_elementwise_kernel_is_memory_bound():
  text = """ENTRY %main (a: f32[1000000]) -> f32[1000000] {
  %a = f32[1000000]{0} parameter(0)
  ROOT %n = f32[1000000]{0} negate(f32[1000000]{0} %a)
}"""
  e = roofline.estimate(text, ROOF, kernel_overhead_s=0.0)
  assert e.bytes == 8_000_000 and e.seconds == pytest.approx(8e-3)


def test_slices_count_what_they_read_and_updates_what_they_write():
  text = """%fused (p0: f32[64,1000], p1: s32[]) -> f32[1,1000] {
  %p0 = f32[64,1000]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,1000]{1,0} dynamic-slice(f32[64,1000]{1,0} %p0, s32[] %p1, s32[] %z), dynamic_slice_sizes={1,1000}
}

%update (q0: f32[64,1000], q1: f32[1,1000], q2: s32[]) -> f32[64,1000] {
  %q0 = f32[64,1000]{1,0} parameter(0)
  %q1 = f32[1,1000]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[64,1000]{1,0} dynamic-update-slice(f32[64,1000]{1,0} %q0, f32[1,1000]{1,0} %q1, s32[] %q2, s32[] %z)
}

ENTRY %main (bank: f32[64,1000], i: s32[]) -> f32[64,1000] {
  %bank = f32[64,1000]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %row = f32[1,1000]{1,0} fusion(f32[64,1000]{1,0} %bank, s32[] %i), kind=kLoop, calls=%fused
  ROOT %put = f32[64,1000]{1,0} fusion(f32[64,1000]{1,0} %bank, f32[1,1000]{1,0} %row, s32[] %i), kind=kLoop, calls=%update
}"""
  e = roofline.estimate(text, ROOF, kernel_overhead_s=0.0)
  # The slice: 4 kB read + the index + 4 kB written; the update: 4 kB read and
  # written in place, plus its index (the bank is neither read nor copied whole).
  assert e.bytes == (4000 + 4 + 4000) + (4000 + 4 + 2 * 4000)
  assert e.kernels == 2


def test_a_loop_body_counts_once_per_trip():
  """Against the jaxpr count of the same scanned matmuls (planner.matmul_flops)."""
  def scanned(x, ws):
    return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]
  x = jnp.ones((64, 128), jnp.float32)
  ws = jnp.ones((7, 128, 128), jnp.float32)
  e = roofline.estimate(_text(scanned, x, ws), ROOF, kernel_overhead_s=1.0)
  assert e.matmul_flops == planner.matmul_flops(scanned, x, ws) == 7 * 2 * 64 * 128 * 128
  assert e.kernels >= 7  # at least the matmul on every trip
  assert e.overhead_seconds == e.kernels


def test_throughput_and_mfu():
  out = roofline.throughput(2.0, tokens=4096, useful_flops=1e12, target=ROOF, devices=2)
  assert out == {"step_seconds": 2.0, "tokens_per_second": 2048.0, "mfu": 0.25}


def test_known_targets_are_the_planners_gpu_targets():
  assert set(roofline.TARGETS) == {t for t, f in planner.TARGETS.items() if f}
