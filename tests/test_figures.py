"""The figure audit: every figure in the README's and the docs' prose is one the results
files hold (experiments/results/: JSON values in any usual rounding or unit, and the
numbers of its Markdown and JSONL files).

Code (blocks and inline spans: commands, shapes, printed output) is not prose and is not
audited. A figure
no results file holds is listed in ``tests/figures_without_a_file.txt``, one of two ways:

* ``page: figure = EXPRESSION``: derived from figures the results files hold (a
  difference, a ratio) or from plain integers (``1 + 4/256``). The test evaluates it:
  every decimal number in it must be a results figure, and its value, rounded as the
  page rounds, must be the figure.
* ``page: figure | KIND: why``: not a result. KIND is ``setting`` (a default, a
  coefficient, a version, a paper's id), ``cited`` (another document's figure, named),
  ``history`` (an earlier release's or investigation's measurement whose files were
  not kept, said so on its page), ``printed`` (a command's output that a page shows
  verbatim) or ``uncommitted`` (a current run whose files were not committed: the
  backlog, to commit or re-run).

The entries that are no result only shrink: a new figure must come from a results file
(or be derived from its figures), and an entry whose figure left its page must leave the
list.
"""

import functools
import json
import pathlib
import re
import subprocess

from tests import _pages

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
ALLOWED = ROOT / "tests" / "figures_without_a_file.txt"
# A figure: a number with a decimal point or thousands separators (counts, sizes,
# perplexities, ratios); plain small integers (steps, seeds, layers) are not audited.
FIGURE = re.compile(r"(?<![\w.])\d{1,3}(?:,\d{3})+(?:\.\d+)?|(?<![\w.])\d+\.\d+")
SCALES = (1, 1e-9, 1e-6, 1e-12, 1e2, 1e-3)  # as is, GB, MB, TFLOP, percent, thousands


def results_files() -> list[pathlib.Path]:
  """The committed files under experiments/results (``git ls-files``; every file there
  outside a git checkout): a run's ignored leftovers (tokenizers, checkpoints) are not
  results, and their numbers must not vouch for a figure."""
  try:
    listed = subprocess.run(["git", "ls-files", "-z", "experiments/results"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    return [ROOT / p for p in listed if p]
  except (OSError, subprocess.CalledProcessError):
    return [p for p in RESULTS.rglob("*") if p.is_file()]


@functools.cache  # every test reads the same committed files and pages
def known_figures() -> frozenset:
  known = set()

  def add(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      return
    for scale in SCALES:
      for digits in range(4):
        known.add(f"{value * scale:.{digits}f}")
        known.add(f"{value * scale:,.{digits}f}")

  def walk(node):
    if isinstance(node, dict):
      for value in node.values():
        walk(value)
    elif isinstance(node, list):
      for value in node:
        walk(value)
    else:
      add(node)

  for path in results_files():
    if path.suffix == ".json":
      walk(json.loads(path.read_text()))
    elif path.suffix == ".jsonl" and path.name != "metrics.jsonl":
      # Records (a real-GPU check's phases): their values, scaled like a report's.
      for line in path.read_text().splitlines():
        if line.strip():
          walk(json.loads(line))
    elif path.suffix in (".md", ".jsonl", ".log"):
      known.update(m.group(0).rstrip(".,") for m in re.finditer(r"\d[\d,]*\.?\d*",
                                                                 path.read_text()))
  return frozenset(known)


def prose_text(line: str, in_code: bool) -> tuple[str, bool]:
  """The prose of one line, outside inline code spans (which may run on from the line
  before), and whether a span is still open at its end."""
  prose, parts = [], line.split("`")
  for i, part in enumerate(parts):
    if i:
      in_code = not in_code
    if not in_code:
      prose.append(part)
  return " ".join(prose), in_code


@functools.cache
def prose_figures() -> tuple[tuple[str, str], ...]:
  found = []
  for page in _pages.PAGES:
    fence = in_code = False
    for line in page.read_text().splitlines():
      if line.startswith("```") or line.lstrip().startswith("```"):
        fence = not fence
        continue
      if fence:
        continue
      if not line.strip():  # a code span never crosses a paragraph
        in_code = False
      prose, in_code = prose_text(line, in_code)
      found += [(page.relative_to(ROOT).as_posix(), m.group(0)) for m in FIGURE.finditer(prose)]
  return tuple(found)


KINDS = ("setting", "cited", "history", "printed", "uncommitted")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def allowed() -> list[tuple[str, str, str]]:
  """(page, figure, how): ``how`` is ``= EXPRESSION`` or ``| KIND: why``."""
  entries = []
  for line in ALLOWED.read_text().splitlines():
    if line.strip() and not line.startswith("#"):
      page, rest = line.split(": ", 1)
      figure, how = re.match(r"(\S+)\s*(.*)", rest).groups()
      entries.append((page, figure, how))
  return entries


def derived_value(expression: str, known: set) -> float:
  """The value of a derived entry's expression, after checking that its decimal numbers
  are results figures."""
  for number in NUMBER.findall(expression):
    if ("." in number or "," in number) and number not in known:
      raise AssertionError(f"{number} in '{expression}' is in no results file")
  if not re.fullmatch(r"[\d,.\s()+\-*/]+", expression):
    raise AssertionError(f"'{expression}' is not plain arithmetic")
  return eval(expression.replace(",", ""))  # pylint: disable=eval-used  # digits and operators only


def test_every_listed_figure_is_derived_correctly_or_says_why_it_has_no_file():
  known, wrong = known_figures(), []
  for page, figure, how in allowed():
    if how.startswith("="):
      digits = len(figure.split(".")[1]) if "." in figure else 0
      value = derived_value(how[1:].strip(), known)
      if f"{value:,.{digits}f}".replace(",", "") != figure.replace(",", ""):
        wrong.append(f"{page}: {figure} but {how[1:].strip()} = {value:.6g}")
    elif not re.match(rf"\| ({'|'.join(KINDS)}): \S", how):
      wrong.append(f"{page}: {figure}: say '= EXPRESSION' or '| KIND: why' ({KINDS})")
  assert not wrong, wrong


def test_every_figure_comes_from_a_results_file_or_is_listed():
  known, listed = known_figures(), {(p, f) for p, f, _ in allowed()}
  unsourced = sorted({f for f in prose_figures() if f[1] not in known} - listed)
  assert not unsourced, ("figures no results file holds (commit the file, or list them "
                         f"in {ALLOWED.name} with why): {unsourced[:20]}")


def test_the_list_holds_only_figures_still_on_their_pages():
  # (A listed figure that a new results file happens to hold may stay listed: a
  # coincidence of digits is not a source.)
  shown = set(prose_figures())
  stale = [(p, f) for p, f, _ in allowed() if (p, f) not in shown]
  assert not stale, f"entries to remove from {ALLOWED.name}: {stale[:20]}"


def test_the_audit_sees_the_figures():
  figures = prose_figures()
  assert len(figures) > 400
  assert ("README.md", "56.37") in figures and "56.37" in known_figures()
