"""The article's floor report (experiments/studies/article_floor.py) read from a run's metrics."""

import doctest
import json

from experiments.studies import article_floor


def test_doctests():
  result = doctest.testmod(article_floor)
  assert result.attempted > 0 and result.failed == 0


def test_the_table_reads_the_logged_steps_and_divides_by_the_rate(tmp_path):
  run = tmp_path / "skewadam_article-seed0"
  run.mkdir()
  lines = [{"step": 1, "lr": 0.0, "update_rms": 0.0, "floor_share": 0.99},
           {"step": 10, "lr": 4e-3, "update_rms": 2e-4, "floor_share": 0.9},
           {"step": 10, "val_ppl": 300.0},  # an evaluation line: no update_rms
           {"step": 100, "lr": 8e-3, "update_rms": 8e-4, "floor_share": 0.75}]
  (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + "\n{cut shor")
  table = article_floor.table([run], steps=(1, 10, 100, 400))
  assert table.splitlines()[2:] == [
      "| `skewadam_article-seed0` | 1 | 99.0% | – |",
      "| `skewadam_article-seed0` | 10 | 90.0% | 0.05 |",
      "| `skewadam_article-seed0` | 100 | 75.0% | 0.1 |"]
