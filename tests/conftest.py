"""Shared fixtures: a small MoE-shaped parameter tree and its gradients."""

import os

# The tests run on the CPU. With the gpu-compile extra installed (.ci/run's
# environment for the gpu_compile tests), JAX would
# otherwise probe for CUDA at start-up (and the memory planner needs the CPU as
# the only runtime platform to compile for a GPU target).
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The suite's compile flags (tests/_xla.py); subprocesses inherit them.
from tests import _xla  # pylint: disable=wrong-import-position
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_xla.COMPILE_FLAGS}".strip()

# One persistent compilation cache for this run's processes (the xdist
# workers and every subprocess they start): many tests compile the same tiny
# train steps in separate processes. Fresh per run, so a cached executable
# never outlives the code that made it.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import tempfile  # pylint: disable=wrong-import-position
  _run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
  os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(
      tempfile.gettempdir(), f"skewadam-tests-xla-cache-{_run}")
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

# First, so JAX starts without the CUDA plugin's start-up lines (experiments.startup).
import experiments  # pylint: disable=wrong-import-position,unused-import
import skewadam_jax  # pylint: disable=wrong-import-position,unused-import
import jax  # pylint: disable=wrong-import-position
import jax.numpy as jnp
import numpy as np
import pytest

# Backbone, router and expert leaves, with 3-D and 4-D ([L, E, d_in, d_out]) banks.
SHAPES = {
    "embed": (16, 8),
    "final_norm": (8,),
    "layers": {
        "attn": {"qkv": (2, 8, 24)},
        "norm": (2, 8),
        "moe": {
            "router": {"kernel": (2, 8, 4)},
            "experts": {"w_up": (2, 4, 8, 6), "w_down": (2, 4, 6, 8)},
        },
    },
    "shared_bank": {"experts": (4, 8, 6)},
}


def _is_shape(x):
  return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def make_tree(seed, dtype=jnp.float32, scale=1.0):
  leaves, treedef = jax.tree.flatten(SHAPES, is_leaf=_is_shape)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return jax.tree.unflatten(treedef, [
      (scale * jax.random.normal(k, s)).astype(dtype) for k, s in zip(keys, leaves)])


@pytest.fixture(scope="session")
def params():
  return make_tree(0)


@pytest.fixture(scope="session")
def grad_seq():
  """25 steps of gradients with different scales per step."""
  return [make_tree(100 + i, scale=0.1 * (1 + i % 3)) for i in range(25)]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
  """A small generated corpus of three 'works': tokenizer training is instant."""
  root = tmp_path_factory.mktemp("corpus")
  rng = np.random.default_rng(0)
  words = ["thou", "art", "the", "king", "and", "queen", "of", "love", "night", "day"]
  for name in ("first", "second", "third"):
    text = "\n".join(" ".join(rng.choice(words, size=12)) + "." for _ in range(300))
    (root / f"{name}.txt").write_text(text)
  return str(root)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
  """A tokenizer cache shared by the tests that train on `corpus`."""
  return tmp_path_factory.mktemp("tokenizers")


# The test files that take longest (--durations on 2 cores), run first: xdist
# hands a worker whole files (--dist loadfile) in collection order, so a long
# file reached last would leave one worker finishing it alone.
LONGEST_FIRST = (
    "tests/experiments/test_parallel.py",  # an 8-device subprocess: about a minute
    "tests/experiments/test_memory.py",
    "tests/skewadam_jax/test_transform_table.py",
    "tests/models/test_layerwise.py",
    "tests/experiments/test_bench.py",
    "tests/experiments/test_train.py",
    "tests/experiments/training/test_steps.py",
)


def pytest_collection_modifyitems(config, items):
  del config
  rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable


def pytest_unconfigure(config):
  # The controller (not an xdist worker) removes the run's compilation cache.
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
  if (not hasattr(config, "workerinput") and "skewadam-tests-xla-cache-" in cache
      and os.path.isdir(cache)):
    import shutil  # pylint: disable=import-outside-toplevel
    shutil.rmtree(cache, ignore_errors=True)
