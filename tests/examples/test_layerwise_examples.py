"""The layerwise step on Flax models that are not ours (examples/layerwise_{linen,nnx}.py).

Each example trains its model with the standard step (``optax.clip_by_global_norm``
then the optimizer) and with :func:`skewadam_jax.layerwise.layerwise_step`
(exact clipping) from the same start; the two must agree after 5 steps to
float32 round-off, and the script must print what its docstring says.
"""

import pytest

from tests import _examples

pytest.importorskip("flax")


@pytest.mark.parametrize("name", ["layerwise_linen", "layerwise_nnx"])
def test_the_flax_example_equals_its_standard_step_and_prints_it(name, capsys):
  example = _examples.load(name)
  result = example.compare(steps=5)
  assert min(result["grad_norms"]) > example.CLIP  # clipping was active at every step
  assert result["standard_losses"] == pytest.approx(result["layerwise_losses"], rel=1e-6)
  assert result["max_param_diff"] < 2e-6
  example.main()
  lines = capsys.readouterr().out.splitlines()
  losses = [[float(x) for x in line.split(":", 1)[1].split()]
            for line in lines if line.startswith("loss,")]
  # Printed to 4 decimals: round-off between the two steps can straddle a last digit.
  assert len(losses) == 2 and losses[0] == pytest.approx(losses[1], abs=1.5e-4)
  assert float(lines[-1].rsplit(":", 1)[1]) < 2e-6
  if name == "layerwise_linen":  # the stack keeps its layer axis at position 1
    assert result["stacked_kernel_shape"] == (example.WIDTH, example.LAYERS, example.HIDDEN)
