"""The README's code runs, and CI runs the README's test command."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_blocks(lang):
  return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_python_snippets_run(capsys):
  blocks = code_blocks("python")
  assert len(blocks) >= 2
  namespace = {}
  for block in blocks:
    exec(compile(block, "README.md", "exec"), namespace)  # pylint: disable=exec-used
  assert "total" in capsys.readouterr().out


def test_ci_runs_the_readme_test_command():
  test_command = code_blocks("bash")[1].strip()
  assert "pytest" in test_command
  ci = (ROOT / ".ci" / "run").read_text()
  assert test_command in ci.splitlines()
