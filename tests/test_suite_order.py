"""tests/conftest.py's ordering: the longest test files are collected first."""

import pathlib
from types import SimpleNamespace

from tests import conftest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_listed_file_exists():
  # A renamed file would silently fall back to collection order.
  missing = [path for path in conftest.LONGEST_FIRST if not (ROOT / path).is_file()]
  assert not missing


def test_listed_files_come_first_in_their_order_and_the_rest_keeps_its_own():
  names = ["tests/a_test.py::x", f"{conftest.LONGEST_FIRST[1]}::y", "tests/b_test.py::z",
           f"{conftest.LONGEST_FIRST[0]}::w", "tests/a_test.py::v"]
  items = [SimpleNamespace(nodeid=n) for n in names]
  conftest.pytest_collection_modifyitems(None, items)
  assert [i.nodeid for i in items] == [names[3], names[1], names[0], names[2], names[4]]
