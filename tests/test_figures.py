"""The figure audit: every figure in the README's and the docs' prose is one the results
files hold (experiments/results/: JSON values in any usual rounding or unit, and the
numbers of its Markdown and JSONL files).

Code blocks (commands, printed output) are not prose and are not audited. A figure
no results file holds is listed in ``tests/figures_without_a_file.txt`` (``page: figure``):
history from earlier releases, hardware facts, the design brief's published claims and
runs whose folders were not committed. The list only shrinks: a new figure must come
from a results file, and an entry whose figure left its page must leave the list.
"""

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


def known_figures() -> set:
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
    elif path.suffix in (".md", ".jsonl"):
      known.update(m.group(0).rstrip(".,") for m in re.finditer(r"\d[\d,]*\.?\d*",
                                                                 path.read_text()))
  return known


def prose_figures() -> list[tuple[str, str]]:
  found = []
  for page in _pages.PAGES:
    fence = False
    for line in page.read_text().splitlines():
      if line.startswith("```") or line.lstrip().startswith("```"):
        fence = not fence
        continue
      if not fence:
        found += [(page.relative_to(ROOT).as_posix(), m.group(0)) for m in FIGURE.finditer(line)]
  return found


def allowed() -> list[tuple[str, str]]:
  entries = []
  for line in ALLOWED.read_text().splitlines():
    if line.strip() and not line.startswith("#"):
      page, figure = line.rsplit(": ", 1)
      entries.append((page, figure))
  return entries


def test_every_figure_comes_from_a_results_file_or_is_listed():
  known, listed = known_figures(), set(allowed())
  unsourced = sorted({f for f in prose_figures() if f[1] not in known} - listed)
  assert not unsourced, ("figures no results file holds (commit the file, or list them "
                         f"in {ALLOWED.name} with why): {unsourced[:20]}")


def test_the_list_holds_only_figures_still_on_their_pages():
  # (A listed figure that a new results file happens to hold may stay listed: a
  # coincidence of digits is not a source.)
  shown = set(prose_figures())
  stale = [entry for entry in allowed() if entry not in shown]
  assert not stale, f"entries to remove from {ALLOWED.name}: {stale[:20]}"


def test_the_audit_sees_the_figures():
  figures = prose_figures()
  assert len(figures) > 500
  assert ("README.md", "58.01") in figures and "58.01" in known_figures()
