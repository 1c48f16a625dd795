"""tests/_compile_log.py: the compile log's lines and its summary."""

import logging

import jax
import jax.numpy as jnp
import pytest

from tests import _compile_log


def test_a_compile_is_logged_beside_the_test_that_asked_for_it(tmp_path):
  x = jnp.ones(5)
  handler = _compile_log.CompileLog(tmp_path / "compiles-main.tsv")
  handler.test = "tests/x.py::test_y"
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  before = jax.config.jax_log_compiles
  jax.config.update("jax_log_compiles", True)
  try:
    def a_function_compiled_once(x):
      return jnp.tanh(x) * 3.0
    jax.jit(a_function_compiled_once)(x).block_until_ready()
  finally:
    jax.config.update("jax_log_compiles", before)
    logger.removeHandler(handler)
  rows = _compile_log.read(tmp_path)
  # Every compile in the window is the test's (an eager operation's too), the function's among them.
  assert {test for test, _, _ in rows} == {"tests/x.py::test_y"}
  seconds = [s for _, name, s in rows if name == "jit(a_function_compiled_once)"]
  assert len(seconds) == 1 and seconds[0] > 0


def test_the_summary_adds_seconds_and_counts_by_function_and_by_test():
  rows = [("t1", "jit(step)", 1.5), ("t2", "jit(step)", 0.5), ("t2", "jit(add)", 0.25)]
  text = _compile_log.summary(rows, top=1)
  lines = text.splitlines()
  assert lines[0] == "2.2 s in 3 compiles"
  # The top function: jit(step), 2.0 s in 2 compiles; the top test: t1, 1.5 s (t2 has 0.75).
  assert lines[lines.index("by function: seconds, compiles") + 1].split() == ["2.0", "2", "jit(step)"]
  assert lines[lines.index("by test: seconds, compiles") + 1].split() == ["1.5", "1", "t1"]
  assert len(lines) == 7  # and two blank lines between the parts


@pytest.mark.parametrize("line", ["Finished XLA compilation of jit(f) in 0.012 sec",
                                  "Finished XLA compilation of jit(<lambda>) in 1.5e-03 sec"])
def test_the_pattern_reads_jaxs_finished_lines(line):
  assert _compile_log.FINISHED.search(line)
