"""experiments/planning/hlo.py: what a compiled program moves, read from its HLO text."""

import jax
import jax.numpy as jnp
import optax
import pytest

from experiments import bench
from experiments.planning import hlo


def test_kernel_bytes_counts_as_xla_cost_analysis():
  """The HLO-text count is XLA:CPU's own bytes-accessed analysis, within 1 %."""
  params = bench.moe_tree(layers=1, experts=2, d_model=16, d_ff=24, vocab=64)
  grads = jax.tree.map(jnp.ones_like, params)
  for tx in (bench.optimizers_to_bench()["skewadam (default)"], optax.adamw(1e-3)):
    state = tx.init(params)
    compiled = jax.jit(bench._update_and_apply(tx), donate_argnums=(0, 1)).lower(  # pylint: disable=protected-access
        params, state, grads).compile()
    expected = bench._compiled_bytes(compiled)  # pylint: disable=protected-access
    assert hlo.kernel_bytes(compiled.as_text()) == pytest.approx(expected, rel=1e-2)


def test_kernel_bytes_of_a_hand_written_program():
  text = """HloModule m

ENTRY %main (p: f32[4,8], q: bf16[8]) -> (f32[4,8], u8[4]) {
  %p = f32[4,8]{1,0} parameter(0)
  %q = bf16[8]{0} parameter(1)
  %fusion = (f32[4,8]{1,0}, u8[4]{0}) fusion(%p, %q), kind=kLoop, calls=%fused_computation
  %get-tuple-element = f32[4,8]{1,0} get-tuple-element(%fusion), index=0
  %copy = f32[4,8]{1,0} copy(%get-tuple-element)
  %bitcast = f32[32]{0} bitcast(%copy)
  %get-tuple-element.1 = u8[4]{0} get-tuple-element(%fusion), index=1
  ROOT %tuple = (f32[32]{0}, u8[4]{0}) tuple(%bitcast, %get-tuple-element.1)
}
"""
  # fusion: reads 128 + 16 B, writes 128 + 4 B; copy: reads and writes 128 B.
  assert hlo.kernel_bytes(text) == (128 + 16 + 128 + 4) + (128 + 128)
