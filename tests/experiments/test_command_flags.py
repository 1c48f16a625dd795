"""One set of flag names: every command spells a setting as the training command does.

Each command (``python -m experiments.NAME``) exposes ``build_parser()``. A
flag whose destination is a :class:`~experiments.training.config.TrainConfig` field
must be that field's flag (``--batch-size`` for ``batch_size``; older
spellings such as the planner's ``--batch`` stay as aliases), and a flag
string means the same setting in every command that has it.
"""

import dataclasses
import importlib
import re
import shlex

import pytest

from experiments.training.config import TrainConfig
from tests import _pages
from tests.experiments.test_layout import COMMANDS as COMMAND_MODULES

# The commands (python -m experiments.data is the data package's __main__).
COMMANDS = sorted(COMMAND_MODULES)
FIELDS = {f.name for f in dataclasses.fields(TrainConfig)}


def _actions():
  for name in COMMANDS:
    parser = importlib.import_module(f"experiments.{name}").build_parser()
    for action in parser._actions:  # pylint: disable=protected-access
      if action.option_strings:
        yield name, action


@pytest.fixture(scope="module")
def actions():
  return list(_actions())


def test_every_training_setting_has_the_training_flag_in_every_command(actions):
  wrong = [(name, a.option_strings) for name, a in actions
           if a.dest in FIELDS and "--" + a.dest.replace("_", "-") not in a.option_strings]
  assert not wrong


def test_a_flag_means_one_setting_in_every_command(actions):
  dests = {}
  for name, action in actions:
    for option in action.option_strings:
      dests.setdefault(option, {})[name] = action.dest
  conflicts = {o: d for o, d in dests.items() if len(set(d.values())) > 1}
  assert not conflicts


@pytest.mark.parametrize("command", ["memory", "gpu_check"])
def test_old_spellings_still_work_and_say_they_are_deprecated(command, capsys):
  parser = importlib.import_module(f"experiments.{command}").build_parser()
  args = parser.parse_args(["--batch", "4", "--seq", "128"])
  assert (args.batch_size, args.seq_len) == (4, 128)
  err = capsys.readouterr().err
  assert "--batch is deprecated; use --batch-size" in err
  assert "--seq is deprecated; use --seq-len" in err
  args = parser.parse_args(["--batch-size", "4", "--seq-len", "128"])
  assert (args.batch_size, args.seq_len) == (4, 128) and not capsys.readouterr().err


def test_the_docs_spell_no_deprecated_flag():
  old = [(p.name, line) for p in _pages.PAGES for block in _pages.bash_blocks(p)
         for line in block.splitlines() if re.search(r"--(batch|seq)(\s|=|$)", line)]
  assert not old


def documented_commands():
  """Each ``python -m experiments.X ...`` line of the README's and the docs' bash blocks."""
  found = []
  for page in _pages.PAGES:
    for block in _pages.bash_blocks(page):
      # The block's own variables (COMMON="..."), expanded as the shell would;
      # a loop's variable ($i) reads as 0.
      variables = dict(re.findall(r"^\s*(\w+)=\"([^\"]*)\"", block, flags=re.M))
      for line in block.splitlines():
        match = re.search(r"python -m experiments\.(\w+)(.*)", line)
        if not match:
          continue
        text = re.sub(r"\$\{?(\w+)\}?", lambda m: variables.get(m.group(1), "0"),
                      match.group(2))
        words = shlex.split(text, comments=True)
        for end in ("&&", "||", ";", "&", "|", ">", ">>", "2>"):
          words = words[:words.index(end)] if end in words else words
        module = "data.__main__" if match.group(1) == "data" else match.group(1)
        found.append(pytest.param(module, words,
                                  id=f"{page.name}: {match.group(1)} {' '.join(words)}"[:90]))
  return found


@pytest.mark.parametrize("command, words", documented_commands())
def test_every_documented_command_line_parses(command, words):
  """A command the README or the docs show, followed literally, is accepted by its parser."""
  parser = importlib.import_module(f"experiments.{command}").build_parser()
  if not any("--config" in a.option_strings for a in parser._actions):  # pylint: disable=protected-access
    parser.add_argument("--config")  # as parse_with_config_file adds it
  try:
    parser.parse_args(words)
  except SystemExit as exit_:
    if exit_.code:
      raise AssertionError(f"python -m experiments.{command} {' '.join(words)}: "
                           "its parser refuses it") from None


def test_the_docs_show_commands():
  assert len(documented_commands()) >= 20
