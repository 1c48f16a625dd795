"""The recommended optimizers' jitted updates return on XLA:CPU (#81's deadlock).

jaxlib 0.10.2's batched LAPACK QR deadlocked XLA:CPU's intra-op pool when
several ran at once, as the low-rank expert momentum's did leaf by leaf.
:func:`skewadam_jax.encodings.orthonormal_columns` factors one matrix at a
time on the CPU; these tests hold it there.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from skewadam_jax import encodings
from tests import _subprocess

# What one case may take: each compiles in 2-5 s alone on the 2-core machine.
CASE_LIMIT_S = 60


def test_orthonormal_columns_is_lapacks_qr_bit_for_bit():
  x = jax.random.normal(jax.random.key(0), (2, 3, 12, 5))
  q = jax.jit(encodings.orthonormal_columns)(x)
  want = jax.jit(lambda x: jnp.linalg.qr(x)[0])(x)
  np.testing.assert_array_equal(np.asarray(q), np.asarray(want))
  np.testing.assert_array_equal(
      np.asarray(encodings.orthonormal_columns(x[0, 0])), np.asarray(jnp.linalg.qr(x[0, 0])[0]))


def test_first_jitted_updates_return_on_the_cpu():
  # tests/_no_hang_worker.py: the smallest deadlocking program through the library's
  # QR, then the recommended optimizers on #81's tree and on four unscanned expert
  # banks, each layout, in one child process without the suite's XLA flags (a
  # user's compile), so a hang is a timeout here and not a stuck suite.
  cases = ["many-batched-qrs", "user-tree/skewadam_orthogonal",
           "user-tree/skewadam_orthogonal/leaf-by-leaf", "four-banks/skewadam_orthogonal",
           "four-banks/skewadam_orthogonal/leaf-by-leaf", "four-banks/skewadam"]
  try:
    out = subprocess.run([sys.executable, str(_subprocess.ROOT / "tests" / "_no_hang_worker.py"),
                          *cases], env=_subprocess.environment(XLA_FLAGS=""),
                         capture_output=True, text=True, timeout=CASE_LIMIT_S * len(cases))
  except subprocess.TimeoutExpired as e:
    done = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    finished = [line.split()[0] for line in done.splitlines()]
    stuck = next(case for case in cases if case not in finished)
    pytest.fail(f"{stuck}: did not return on XLA:CPU (finished before it: {finished})")
  assert out.returncode == 0, out.stderr[-2000:]
  seconds = dict(line.split() for line in out.stdout.splitlines())
  assert list(seconds) == cases
  slow = {case: s for case, s in seconds.items() if float(s) > CASE_LIMIT_S}
  assert not slow, f"over {CASE_LIMIT_S} s: {slow}"
