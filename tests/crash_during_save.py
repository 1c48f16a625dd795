"""Helper for tests/experiments/training/test_checkpoint.py: dies by SIGKILL in the middle of a save.

    python tests/crash_during_save.py DIR finalize   # killed just before the rename
    python tests/crash_during_save.py DIR external   # the test kills it mid-write

Saves a small state at step 1 (completely), prints ``saved 1``, then starts
saving a large state at step 2. In ``finalize`` mode it kills itself at the
last moment orbax gives it: everything is written to the temporary directory
and only the atomic rename is left. In ``external`` mode it just writes
(~128 MB), and the test sends SIGKILL as soon as the temporary directory
appears.
"""

import os
import pathlib
import signal
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
from orbax.checkpoint._src.path import atomicity  # pylint: disable=g-import-not-at-top

from experiments.training.checkpoint import Checkpointer  # pylint: disable=g-import-not-at-top


def main():
  directory, mode = sys.argv[1], sys.argv[2]
  ckpt = Checkpointer(directory)
  ckpt.save(1, {"w": jnp.full((8,), 1.0), "big": jnp.zeros((4,))}, {"note": "good"})
  print("saved 1", flush=True)
  if mode == "finalize":
    async def die(self):  # pylint: disable=unused-argument
      os.kill(os.getpid(), signal.SIGKILL)
    atomicity.AtomicRenameTemporaryPath.finalize = die
    big = jnp.ones((1 << 16,))
  else:
    big = jnp.ones((1 << 25,))  # 128 MB: long enough to be killed while writing
  ckpt.save(2, {"w": jnp.full((8,), 2.0), "big": big}, {"note": "partial"})
  print("saved 2", flush=True)  # never reached


if __name__ == "__main__":
  main()
