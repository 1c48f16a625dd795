"""Command-line flags shared by every command: an old spelling kept as a deprecated alias.

Standard library only, so that a command which sets the environment before JAX
starts (``experiments.gpu_check``) can build its parser without importing JAX.
"""

from __future__ import annotations

import argparse
import sys


class StoreWithDeprecatedAliases(argparse.Action):
  """argparse's ``store``, with a warning when the value comes under an old spelling.

  The first option string is the flag; ``deprecated`` lists the old spellings
  kept so that scripts written with them still run, each use saying which
  flag replaces it.

  Example:
    >>> parser = argparse.ArgumentParser()
    >>> _ = parser.add_argument("--batch-size", "--batch", type=int, deprecated=("--batch",),
    ...                         action=StoreWithDeprecatedAliases)
    >>> parser.parse_args(["--batch-size", "4"]).batch_size
    4
  """

  def __init__(self, option_strings, dest, *, deprecated=(), **kwargs):
    super().__init__(option_strings, dest, **kwargs)
    self.deprecated = tuple(deprecated)

  def __call__(self, parser, namespace, values, option_string=None):
    if option_string in self.deprecated:
      print(f"warning: {option_string} is deprecated; use {self.option_strings[0]} "
            f"(the spelling every command shares)", file=sys.stderr)
    setattr(namespace, self.dest, values)
