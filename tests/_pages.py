"""The pages a user reads (the README and the docs site's Markdown) and their shell blocks."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def bash_blocks(page: pathlib.Path) -> list[str]:
  """The page's ```bash blocks, each with its line continuations joined."""
  return [block.replace("\\\n", " ")
          for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)]
