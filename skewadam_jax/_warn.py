"""Warnings that point at the user's line.

The library warns from deep inside ``init`` and ``update``, which a user
reaches through ``optax.chain``, ``optax.inject_hyperparams`` or a ``jax.jit``
trace: a fixed ``stacklevel`` names one of those frames, not the user's call.
:func:`warn` names the first frame outside the library, optax, JAX, chex and
flax (what ``warnings.warn(skip_file_prefixes=...)`` does from Python 3.12).
"""

from __future__ import annotations

import os
import sys
import warnings

# Packages whose frames are never the user's call (those imported at the time).
_SKIPPED_PACKAGES = (__package__, "optax", "jax", "jaxlib", "chex", "flax")


def _skipped_prefixes() -> tuple[str, ...]:
  folders = []
  for name in _SKIPPED_PACKAGES:
    module = sys.modules.get(name)
    if getattr(module, "__file__", None):
      folders.append(os.path.dirname(os.path.abspath(module.__file__)) + os.sep)
  return tuple(folders)


def warn(message: str, category: type[Warning] = UserWarning) -> None:
  """``warnings.warn(message, category)`` attributed to the user's frame.

  Example:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...   warnings.simplefilter("always")
    ...   warn("a message")
    >>> caught[0].filename.endswith("_warn.py")  # the caller's, not this module's
    False
  """
  prefixes = _skipped_prefixes()
  # stacklevel 1 is this frame, 2 the caller of warn, and so on up.
  frame, level = sys._getframe(1), 2
  while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(prefixes):
    frame, level = frame.f_back, level + 1
  warnings.warn(message, category, stacklevel=level if frame is not None else 2)
