"""The documentation site's pages: every snippet runs on its own, the API and CLI references are complete.

The site itself is built with ``mkdocs build --strict`` by .ci/run (a broken
link or an unrenderable docstring fails it).
"""

import contextlib
import io
import pathlib
import re
import warnings

import pytest

import skewadam_jax
from tests import _pages

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
# Each python block, with the ```text block right after it (what it prints), if any.
SNIPPETS = [(page, block, shown) for page in PAGES for block, shown in re.findall(
    r"```python\n(.*?)```\n(?:\s*```text\n(.*?)```)?", page.read_text(), flags=re.S)]


@pytest.mark.parametrize("page, block, shown", SNIPPETS,
                         ids=[f"{p.relative_to(DOCS)}-{i}" for i, (p, _, _) in enumerate(SNIPPETS)])
def test_every_python_snippet_runs_on_its_own_and_prints_what_the_page_shows(page, block, shown):
  # A fresh namespace each: a snippet that leans on an earlier one fails here. The
  # library's warnings are errors: a page's example must not trigger one.
  out = io.StringIO()
  with warnings.catch_warnings(), contextlib.redirect_stdout(out):
    warnings.filterwarnings("error", module="skewadam_jax")
    exec(compile(block, str(page), "exec"), {})  # pylint: disable=exec-used
  assert out.getvalue() == shown, f"{page.relative_to(DOCS)} shows other output"


def test_there_are_snippets_to_run():
  assert len(SNIPPETS) >= 2


def test_the_api_reference_lists_every_public_name():
  listed = set(re.findall(r"^::: skewadam_jax\.(\w+)$", (DOCS / "reference" / "api.md").read_text(),
                          flags=re.M))
  assert listed == set(skewadam_jax.__all__)


def test_the_command_reference_covers_every_command():
  pytest.importorskip("flax")
  from docs import hooks  # pylint: disable=import-outside-toplevel
  from tests.experiments.test_layout import COMMANDS  # pylint: disable=import-outside-toplevel
  assert {f"experiments.{c}" for c in hooks.COMMANDS} == {
      "experiments." + c.replace(".__main__", "") for c in COMMANDS}
  text = hooks.command_reference(("train",))
  assert "--batch-size" in text and "--steps" in text


def test_every_page_is_in_the_navigation_and_linked_from_the_index():
  nav = (DOCS.parent / "mkdocs.yml").read_text().split("nav:")[1]
  pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
  listed = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", nav, flags=re.M))
  assert listed == pages
  index = (DOCS / "index.md").read_text()
  linked = set(re.findall(r"\]\(([\w/.-]+\.md)(?:#[\w-]+)?\)", index))
  assert linked == pages - {"index.md"}


def test_every_relative_link_in_the_docs_and_the_readme_finds_its_file():
  for page in _pages.PAGES:
    for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", page.read_text()):
      assert (page.parent / target).exists() or (
          page.is_relative_to(DOCS) and target.startswith("../assets/results/")
          and (DOCS.parent / "experiments" / "results" / target.split("assets/results/")[1]
               ).exists()), f"{page.relative_to(DOCS.parent)}: link to {target} finds nothing"


def test_no_results_table_is_retyped_in_the_docs():
  """A table a results file holds is included from it (``--8<-- "file:first:last"``), so
  the page shows what the command wrote; three of its rows typed in a page are a copy."""
  results = sorted((DOCS.parent / "experiments" / "results").rglob("*.md"))
  for page in DOCS.rglob("*.md"):
    lines = page.read_text().splitlines()
    for result in results:
      rows = [line for line in result.read_text().splitlines()
              if line.startswith("| ") and not line.startswith("|---")][1:]  # not the header
      for i in range(len(lines) - 2):
        assert not all(line in rows for line in lines[i:i + 3]), (
            f"{page.relative_to(DOCS)} line {i + 1} retypes rows of {result.name}: include them")
  included = set(re.findall(r'^--8<-- "([^":]+)', "\n".join(
      p.read_text() for p in DOCS.rglob("*.md")), flags=re.M))
  assert {"experiments/results/compare.md", "experiments/results/schedules.md"} <= included
  for path in included:
    assert (DOCS.parent / path).is_file(), path


def test_every_output_marker_renders_its_commands_table():
  pytest.importorskip("flax")
  from docs import hooks  # pylint: disable=import-outside-toplevel
  markers = [m for p in DOCS.rglob("*.md") for m in hooks.OUTPUT.finditer(p.read_text())]
  assert markers
  for marker in markers:
    output = hooks.command_output(marker.group(1), marker.group(2))
    tables = [line for line in output.splitlines() if line.startswith("|---")]
    assert tables and output.count("\n| ") >= 3, marker.group(0)  # at least one table


WRITES_RESULTS = re.compile(r"(--out|--runs|>)\s+experiments/results\b")


def test_a_documented_command_that_rewrites_the_results_says_so():
  """Copied from a page, such a command replaces committed results: a comment on its
  line or the one above must say ``rewrites the committed`` ..."""
  writers = 0
  for page in _pages.PAGES:
    for block in _pages.bash_blocks(page):
      lines = block.splitlines()
      for i, line in enumerate(lines):
        if "python -m experiments." in line and WRITES_RESULTS.search(line.split("#")[0]):
          writers += 1
          said = line + (lines[i - 1] if i else "")
          assert "rewrites the committed" in said, f"{page.name}: {line.strip()[:100]}"
  assert writers >= 4
