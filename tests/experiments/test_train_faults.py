"""The training command's answers to bad data and flags: one line, no traceback."""

import functools
import pathlib
import subprocess
import sys

import pytest

from experiments import train as train_lib
from tests import _subprocess


REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bad_corpora(tmp_path_factory):
  root = tmp_path_factory.mktemp("bad")
  (root / "empty.txt").write_bytes(b"")
  (root / "latin1.txt").write_bytes("café au lait, the king and the queen".encode("latin-1"))
  (root / "short.txt").write_text("Too short. For one sequence.")
  (root / "no_text").mkdir()
  (root / "no_text" / "blank.txt").write_text("  \n")
  return root


@pytest.mark.parametrize("flags, message", [
    (["--data", "{bad}/empty.txt"], "{bad}/empty.txt: corpus is empty"),
    (["--data", "{bad}/latin1.txt"], "{bad}/latin1.txt: not valid UTF-8: byte 0xe9 at byte offset 3"),
    (["--data", "{bad}/short.txt"], "short.txt: the only document is too short to split"),
    (["--data", "{bad}/no_text"], "{bad}/no_text: folder contains no text files"),
    (["--data", "{bad}/missing.txt"], "{bad}/missing.txt: corpus path does not exist"),
    (["--optimizer", "sgd"], "unknown optimizer 'sgd'"),
    (["--lr", "-0.1"], "--lr must be > 0, got -0.1"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
    (["--lr", "inf"], "--lr must be finite, got inf"),
    (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["--batch-size", "two"], "argument --batch-size: invalid int value: 'two'"),
    (["--steps", "-5"], "--steps must be >= 1, got -5"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0 and finite, got -1.0"),
    (["--val-fraction", "0"], "--val-fraction must be in (0, 1), got 0.0"),
    (["--seq-len", "4096"], "--seq-len 4096 exceeds the preset's max_seq_len 32"),
    (["--param-dtype", "fp8"], "--param-dtype must be one of float32, bfloat16, got 'fp8'"),
    (["--stochastic-rounding"], "--stochastic-rounding needs bfloat16 parameters"),
    (["--skip-nonfinite", "-1"], "--skip-nonfinite must be >= 0, got -1"),
    (["--expert-momentum", "int4"], "Unknown momentum encoding 'int4'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_bad_data_and_flags_fail_with_one_line(capsys, tmp_path, cache_dir, bad_corpora,
                                               monkeypatch, flags, message):
  monkeypatch.setattr(train_lib, "train", functools.partial(train_lib.train, cache_dir=cache_dir))
  flags = [f.format(bad=bad_corpora) for f in flags]
  argv = ["--preset", "tiny", "--no-progress", "--out", str(tmp_path)] + flags
  assert train_lib.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and message.format(bad=bad_corpora) in err, err
  assert "\n" not in err and "Traceback" not in err


def test_command_line_reports_bad_input_without_traceback(tmp_path, bad_corpora):
  env = _subprocess.environment()
  proc = subprocess.run(
      [sys.executable, "-m", "experiments.train", "--preset", "tiny", "--no-progress",
       "--data", str(bad_corpora / "latin1.txt"), "--out", str(tmp_path)],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  assert "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      f"error: {bad_corpora / 'latin1.txt'}: not valid UTF-8: byte 0xe9 at byte offset 3 "
      "(invalid continuation byte)")
  assert proc.stdout == ""
