"""MkDocs hook: the command-line reference is generated from the commands' own parsers.

``docs/reference/cli.md`` holds the marker ``<!-- commands -->``; each
``python -m experiments.NAME`` command's ``--help`` replaces it at build
time, so the reference cannot drift from the flags.
"""

import contextlib
import importlib
import io
import os
import pathlib
import re
import shlex
import sys

ROOT = str(pathlib.Path(__file__).resolve().parents[1])

MARKER = "<!-- commands -->"
# python -m experiments.NAME, in the order a newcomer meets them.
COMMANDS = ("train", "compare", "memory", "data", "sample", "schedules", "state_bytes",
            "parallel", "bench", "gpu_check", "step_time")


def command_reference(names=COMMANDS) -> str:
  """Markdown: one section per command, its description and its ``--help``."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if ROOT not in sys.path:  # the commands run from the checkout, not the installed library
    sys.path.insert(0, ROOT)
  sections = []
  for name in names:
    module = importlib.import_module(
        "experiments.data.__main__" if name == "data" else f"experiments.{name}")
    parser = module.build_parser()
    parser.prog = f"python -m experiments.{name}"
    sections.append(f"## `python -m experiments.{name}`\n\n{parser.description or ''}\n\n"
                    f"```text\n{parser.format_help()}```\n")
  return "\n".join(sections)


# ``<!-- output: python -m experiments.NAME ARGS -->``: replaced by what that
# command prints (a table it renders from results files), so a page shows the
# command's output, not a copy of it.
OUTPUT = re.compile(r"<!-- output: python -m experiments\.(\w+) ([^>]*?) -->")


def command_output(name: str, args: str) -> str:
  """What ``python -m experiments.NAME ARGS`` prints, run in this process from the checkout."""
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
  module = importlib.import_module(f"experiments.{name}")
  out = io.StringIO()
  cwd = os.getcwd()
  try:
    os.chdir(ROOT)  # the arguments are paths in the checkout
    with contextlib.redirect_stdout(out):
      code = module.main(shlex.split(args))
  finally:
    os.chdir(cwd)
  if code:
    raise RuntimeError(f"python -m experiments.{name} {args}: exit {code}")
  return out.getvalue().rstrip() + "\n"


def on_page_markdown(markdown, page, **kwargs):  # pylint: disable=unused-argument
  if MARKER in markdown:
    markdown = markdown.replace(MARKER, command_reference())
  return OUTPUT.sub(lambda m: command_output(m.group(1), m.group(2)), markdown)


def on_files(files, config, **kwargs):  # pylint: disable=unused-argument
  """The committed plots (experiments/results/**/*.png) served as assets/results/..."""
  from mkdocs.structure.files import File  # pylint: disable=import-outside-toplevel
  results = pathlib.Path(ROOT) / "experiments" / "results"
  for png in sorted(results.rglob("*.png")):
    uri = f"assets/results/{png.relative_to(results).as_posix()}"
    files.append(File.generated(config, uri, abs_src_path=str(png)))
  return files
