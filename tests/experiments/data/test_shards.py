"""Prepared corpora (experiments/data/): streamed prepare, memory-mapped
shards, batches, manifest checks, and exact resume of a training run on one.

Every prepare here uses tiny read, piece, encode and shard sizes, so the
streaming paths (several reads per file, pieces cut mid-file, several encode
calls and shards) run on a corpus of a few hundred kB.
"""

import copy
import json
import lzma
import pathlib
import shutil

import jax
import numpy as np
import pytest

import models
from experiments import data
from experiments.data import __main__ as data_command
from experiments.training import mesh as mesh_lib
from experiments import train as train_lib
from experiments.training import run as training
from experiments.training.checkpoint import CheckpointError

SMALL = dict(read_bytes=1000, piece_chars=500, encode_chars=3000, shard_tokens=20_000,
             progress=False)
TINY = dict(preset="tiny", batch_size=4, seq_len=32, eval_batches=2, log_every=1,
            warmup_steps=2, steps=4, ckpt_every=4, eval_every=100)


def _write_corpus(root: pathlib.Path, seed: int) -> pathlib.Path:
  """Generated files plus the awkward ones: BOM and CRLF, xz, one long line, blank."""
  data.generate_corpus(root, 150_000, seed=seed, file_bytes=10_000)
  words = np.random.default_rng(seed).choice(["thou", "art", "fair,", "my", "love."],
                                             size=40_000)
  extra = root / "extra"
  extra.mkdir()
  (extra / "windows.txt").write_bytes(
      "\ufeffFirst line\r\nsecond line\r\n\r\nthird".encode() * 50)
  # 200k characters without a line break: cut at single spaces.
  (extra / "one-line.txt.xz").write_bytes(lzma.compress(" ".join(words).encode()))
  (extra / "blank.txt").write_text(" \n\t\n")
  return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  return _write_corpus(tmp_path_factory.mktemp("raw"), seed=0)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
  """A BPE vocabulary of 320 (so the tokens depend on where the text is cut)."""
  out = tmp_path_factory.mktemp("prepared") / "corpus"
  manifest = data.prepare_corpus(corpus, out, vocab_size=320, sample_mb=0.05,
                                 cache_dir=tmp_path_factory.mktemp("tok"), **SMALL)
  return out, manifest


@pytest.fixture(scope="module")
def tiny_prepared(tmp_path_factory):
  """Vocabulary 256, for the tiny preset."""
  root = tmp_path_factory.mktemp("tiny")
  data.generate_corpus(root / "raw", 120_000, seed=1, file_bytes=12_000)
  out = root / "prepared"
  data.prepare_corpus(root / "raw", out, vocab_size=256, cache_dir=root / "tok", **SMALL)
  return out


def test_shards_hold_exactly_the_in_memory_encoding(corpus, prepared):
  out, manifest = prepared
  opened = data.open_prepared(out)
  tokenizer = opened.tokenizer
  docs = data.load_corpus(corpus)  # Each file is one document here too.
  val_names = set(manifest["split"]["val_names"])
  # The in-memory rule, on the same documents (the blank file skipped by both).
  assert val_names == {d.name for d in data.split_documents(docs, 0.1)[1]}
  train = data.encode_documents(tokenizer, [d for d in docs if d.name not in val_names])
  val = data.encode_documents(tokenizer, [d for d in docs if d.name in val_names])
  np.testing.assert_array_equal(opened.train_tokens[:], train)
  np.testing.assert_array_equal(opened.val_tokens[:], val)
  assert manifest["split"]["num_train_docs"] + manifest["split"]["num_val_docs"] == len(docs)
  assert manifest["unigram_val_perplexity"] == pytest.approx(
      data.unigram_perplexity(train, val, opened.vocab_size), rel=1e-9)


def test_manifest_records_format_split_tokenizer_and_shards(corpus, prepared):
  out, manifest = prepared
  assert json.loads((out / "manifest.json").read_text()) == manifest
  assert manifest["format"] == data.PREPARED_FORMAT and manifest["version"] == 1
  assert manifest["dtype"] == "uint16" and manifest["byte_order"] == "little"
  assert manifest["split"]["rule"] == data.SPLIT_RULE
  assert manifest["source"]["files"] == len(list(corpus.rglob("*.*")))
  tok = manifest["tokenizer"]
  assert tok["vocab_size"] <= 320 and tok["source"] == "trained"
  # Trained on the first 0.05 M characters, in whole pieces.
  assert 50_000 <= tok["sample_chars"] < 50_000 + SMALL["piece_chars"] * 2
  train = manifest["splits"]["train"]
  assert len(train["shards"]) >= 3  # 20k-token shards: the streams cross files.
  assert [s["file"] for s in train["shards"]] == [
      f"train-{i:05d}.bin" for i in range(len(train["shards"]))]
  assert sum(s["num_tokens"] for s in train["shards"]) == train["num_tokens"]
  for shard in train["shards"]:
    assert (out / shard["file"]).stat().st_size == 2 * shard["num_tokens"]
  assert sorted(p.name for p in out.iterdir()) == sorted(
      ["manifest.json", "tokenizer.json"]
      + [s["file"] for split in manifest["splits"].values() for s in split["shards"]])


def test_batches_are_a_pure_function_of_seed_and_step(prepared):
  out, _ = prepared
  opened, again = data.open_prepared(out), data.open_prepared(out)
  in_memory = opened.train_tokens[:]
  mapped = data.TokenDataset(opened.train_tokens, seq_len=64, batch_size=8, seed=3)
  reopened = data.TokenDataset(again.train_tokens, seq_len=64, batch_size=8, seed=3)
  array = data.TokenDataset(in_memory, seq_len=64, batch_size=8, seed=3)
  for step in (0, 1, 977):
    inputs, targets = mapped.batch_at(step)
    assert inputs.dtype == np.int32 and inputs.shape == (8, 64)
    for other in (reopened, array):
      np.testing.assert_array_equal(inputs, other.batch_at(step)[0])
      np.testing.assert_array_equal(targets, other.batch_at(step)[1])
    rows = mapped.batch_at(step, rows=slice(2, 6))
    np.testing.assert_array_equal(rows[0], inputs[2:6])
  assert not np.array_equal(mapped.batch_at(0)[0], mapped.batch_at(1)[0])
  # Windows that cross a shard boundary read both shards.
  boundary = opened.manifest["splits"]["train"]["shards"][0]["num_tokens"]
  np.testing.assert_array_equal(opened.train_tokens[np.arange(boundary - 5, boundary + 5)],
                                in_memory[boundary - 5:boundary + 5])
  for a, b in zip(data.eval_batches(opened.val_tokens, 64, 4, max_batches=3),
                  data.eval_batches(opened.val_tokens[:], 64, 4, max_batches=3)):
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_streamed_text_is_read_text(corpus, tmp_path):
  for path in (corpus / "extra" / "windows.txt", corpus / "extra" / "one-line.txt.xz"):
    for read_bytes in (1, 7, 1 << 20):
      assert "".join(data.iter_text(path, read_bytes)) == data.read_text(path)
  bad = tmp_path / "bad.txt"
  bad.write_bytes(b"x" * 1000 + b"caf\xe9 au lait")
  with pytest.raises(data.DataError) as streamed:
    list(data.iter_text(bad, read_bytes=64))
  with pytest.raises(data.DataError) as whole:
    data.read_text(bad)
  assert str(streamed.value) == str(whole.value)
  assert "byte 0xe9 at byte offset 1003" in str(streamed.value)


def test_one_file_corpus_is_cut_at_a_line_start(tmp_path):
  text = "".join(f"line {i} of the only file\n" for i in range(3000))
  (tmp_path / "only.txt").write_text(text)
  manifest = data.prepare_corpus(tmp_path / "only.txt", tmp_path / "out", vocab_size=256,
                                 cache_dir=tmp_path / "tok", **SMALL)
  split = manifest["split"]
  assert split["val_names"] == ["only.txt (val part)"]
  cut = split["train_chars"]
  assert text[cut - 1] == "\n" and cut >= 0.9 * len(text) > cut - 30
  opened = data.open_prepared(tmp_path / "out")
  expected = data.encode_documents(opened.tokenizer, [data.Document("v", text[cut:])])
  np.testing.assert_array_equal(opened.val_tokens[:], expected)


@pytest.mark.parametrize("layout", ["works", "works-in-a-folder", "one-document"])
def test_prepared_and_in_memory_hold_out_the_same_text(tmp_path, layout):
  """One rule: a corpus prepared holds out exactly the text load_corpus + split_documents do."""
  bundled = data.read_text(data.DEFAULT_CORPUS)[:400_000]  # the first works
  if layout == "works":
    source = tmp_path / "plays.txt"
    source.write_text(bundled)
  elif layout == "works-in-a-folder":  # titles repeat across the files: ' #2' names
    source = tmp_path / "folder"
    (source / "b").mkdir(parents=True)
    (source / "a.txt").write_text(bundled[:250_000])
    (source / "b" / "c.txt").write_text(bundled)
    (source / "b" / "blank.txt").write_text("\n  \n")
  else:
    source = tmp_path / "only.txt"
    source.write_text("".join(f"line {i} of the only file\n" for i in range(3000)))
  docs = data.load_corpus(source)
  train, val = data.split_documents(docs, 0.1)
  manifest = data.prepare_corpus(source, tmp_path / "out", vocab_size=256,
                                 cache_dir=tmp_path / "tok", **SMALL)
  assert manifest["split"]["val_names"] == [d.name for d in val]
  assert manifest["split"]["num_train_docs"] == len(train)
  assert manifest["split"]["val_chars"] == sum(len(d.text) for d in val)
  if layout != "one-document":
    assert len(docs) >= 3 and manifest["split"]["num_val_docs"] >= 1
  opened = data.open_prepared(tmp_path / "out")
  np.testing.assert_array_equal(opened.val_tokens[:],
                                data.encode_documents(opened.tokenizer, val))
  np.testing.assert_array_equal(opened.train_tokens[:],
                                data.encode_documents(opened.tokenizer, train))


def test_a_file_too_large_to_read_whole_is_one_document(tmp_path, monkeypatch):
  text = data.read_text(data.DEFAULT_CORPUS)[:200_000]
  (tmp_path / "c").mkdir()
  for name in ("x.txt", "y.txt"):
    (tmp_path / "c" / name).write_text(text)
  assert len(data.load_corpus(tmp_path / "c")) > 2  # read whole: split into works
  for module in (data.corpus, data.shards):
    monkeypatch.setattr(module, "WHOLE_FILE_BYTES", 1000)
  assert [d.name for d in data.load_corpus(tmp_path / "c")] == ["x.txt", "y.txt"]
  manifest = data.prepare_corpus(tmp_path / "c", tmp_path / "out", vocab_size=256,
                                 cache_dir=tmp_path / "tok", **SMALL)
  assert manifest["split"]["num_train_docs"] + manifest["split"]["num_val_docs"] == 2


def test_held_out_names_take_the_hash_ordered_prefix_nearest_the_target():
  lengths = [(f"doc-{i}", 100 + i % 7) for i in range(400)]
  held = data.held_out_names(lengths, 0.1)
  total = sum(n for _, n in lengths)
  held_chars = sum(n for name, n in lengths if name in held)
  assert abs(held_chars - 0.1 * total) <= 110 / 2
  # A prefix of the hash order, independent of the input order.
  ordered = sorted(name for name, _ in lengths)
  ordered.sort(key=lambda n: __import__("hashlib").sha256(n.encode()).hexdigest())
  assert held == set(ordered[:len(held)])
  assert data.held_out_names(lengths[::-1], 0.1) == held
  for pair in ([("a", 5), ("b", 5)], [("x", 1), ("y", 100)]):
    assert len(data.held_out_names(pair, 0.1)) == 1
    assert len(data.held_out_names(pair, 0.999)) == 1


def test_prepare_refuses_to_overwrite_by_accident(corpus, prepared, tmp_path):
  out, _ = prepared
  with pytest.raises(data.DataError, match="folder is not empty"):
    data.prepare_corpus(corpus, out, vocab_size=256, **SMALL)
  (tmp_path / "notes.txt").write_text("mine")
  with pytest.raises(data.DataError, match="not a prepared corpus; refusing"):
    data.prepare_corpus(corpus, tmp_path, vocab_size=256, overwrite=True, **SMALL)
  with pytest.raises(data.DataError, match="inside the corpus folder"):
    data.prepare_corpus(corpus, corpus / "prepared", vocab_size=256, **SMALL)


def test_reusing_the_tokenizer_gives_the_same_tokens_and_fingerprint(corpus, prepared,
                                                                     tmp_path):
  out = _copy(prepared, tmp_path)
  again = data.prepare_corpus(corpus, out, tokenizer=out / "tokenizer.json", overwrite=True,
                              **SMALL)
  assert again["tokenizer"]["source"] == str(out / "tokenizer.json")
  assert again["tokenizer"]["sample_chars"] == 0
  assert again["fingerprint"] == prepared[1]["fingerprint"]
  assert again["splits"] == prepared[1]["splits"]


def _copy(prepared, tmp_path):
  out = tmp_path / "copy"
  shutil.copytree(prepared[0], out)
  return out


def _edit_manifest(out, change):
  manifest = json.loads((out / "manifest.json").read_text())
  change(manifest)
  (out / "manifest.json").write_text(json.dumps(manifest))


def _set(path, value):
  def change(manifest):
    *keys, last = path
    target = manifest
    for key in keys:
      target = target[key]
    target[last] = value
  return change


BAD_MANIFESTS = {
    "missing": (lambda out: (out / "manifest.json").unlink(),
                "{out}: no manifest.json (not a prepared corpus, or its prepare did not finish)"),
    "not json": (lambda out: (out / "manifest.json").write_text("{\"format\": "),
                 "{out}/manifest.json: not valid JSON (Expecting value at line 1)"),
    "version": (lambda out: _edit_manifest(out, _set(["version"], 2)),
                "{out}/manifest.json: format version 2; this code reads version 1"),
    "no field": (lambda out: _edit_manifest(out, lambda m: m.pop("dtype")),
                 "{out}/manifest.json: missing field 'dtype'"),
    "dtype": (lambda out: _edit_manifest(out, _set(["dtype"], "int8")),
              "{out}/manifest.json: dtype 'int8' is not one of uint16, uint32"),
    "truncated shard": (
        lambda out: (out / "val-00000.bin").write_bytes((out / "val-00000.bin").read_bytes()[:-2]),
        "{out}/val-00000.bin: "),
    "missing shard": (lambda out: (out / "train-00001.bin").unlink(),
                      "{out}/train-00001.bin: shard listed in the manifest is missing"),
    "counts": (lambda out: _edit_manifest(out, _set(["splits", "val", "num_tokens"], 5)),
               "{out}/manifest.json: the val shards hold"),
    "tokenizer": (lambda out: (out / "tokenizer.json").write_text("{}"),
                  "{out}/tokenizer.json: SHA-256"),
    "fingerprint": (lambda out: _edit_manifest(
        out, lambda m: m["splits"]["train"]["shards"][0].update(sha256="0" * 64)),
                    "{out}/manifest.json: fingerprint"),
}


@pytest.mark.parametrize("case", sorted(BAD_MANIFESTS))
def test_bad_manifest_is_one_line_error(prepared, tmp_path, case):
  out = _copy(prepared, tmp_path)
  damage, message = BAD_MANIFESTS[case]
  damage(out)
  with pytest.raises(data.DataError) as err:
    data.open_prepared(out)
  assert message.format(out=out) in str(err.value) and "\n" not in str(err.value)


def test_vocabulary_larger_than_the_model_is_refused(prepared):
  with pytest.raises(data.DataError, match=r"vocabulary of \d+ tokens exceeds the model's "
                     r"vocab_size 256 \(prepare it with --vocab-size 256\)"):
    data.open_prepared(prepared[0], max_vocab_size=256)


@pytest.mark.parametrize("case", ["missing", "truncated shard", "vocab"])
def test_train_command_exits_2_with_one_line(prepared, tiny_prepared, tmp_path, capsys, case):
  extra = []
  if case == "vocab":  # a 320-token corpus for a model told to have 256
    out, message = prepared[0], "exceeds the model's vocab_size 256"
    extra = ["--vocab-size", "256"]
  else:
    out = _copy((tiny_prepared,), tmp_path)
    damage, message = BAD_MANIFESTS[case]
    damage(out)
    message = message.format(out=out)
  argv = ["--preset", "tiny", "--no-progress", "--data", str(out), "--out", str(tmp_path / "run"),
          *extra]
  assert train_lib.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("error: ") and message in err, err
  assert "\n" not in err and "Traceback" not in err


def test_the_models_vocabulary_follows_the_prepared_corpus(corpus, tmp_path, capsys):
  # `data prepare` with its defaults, then `train --preset tiny --data PREP`.
  prep = tmp_path / "prep"
  assert data_command.main(["prepare", "--data", str(corpus), "--out", str(prep),
                    "--cache-dir", str(tmp_path / "tok"), "--no-progress"]) == 0
  vocab = data.open_prepared(prep).vocab_size
  assert vocab > models.get_preset("tiny").vocab_size  # the preset's would not hold it
  out = tmp_path / "run"
  assert train_lib.main(["--preset", "tiny", "--data", str(prep), "--out", str(out),
                         "--steps", "2", "--batch-size", "2", "--seq-len", "16",
                         "--warmup-steps", "1", "--eval-batches", "1", "--sample-tokens", "0",
                         "--no-progress"]) == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["config"]["vocab_size"] == vocab and np.isfinite(summary["val_ppl"])


def test_data_command_prepares_and_reports_errors(corpus, tmp_path, capsys):
  argv = ["prepare", "--data", str(corpus / "extra"), "--out", str(tmp_path / "out"),
          "--vocab-size", "256", "--cache-dir", str(tmp_path / "tok"), "--no-progress"]
  assert data_command.main(argv) == 0
  assert capsys.readouterr().out.startswith(f"prepared {tmp_path / 'out'}: ")
  assert data_command.main(argv) == 2
  err = capsys.readouterr().err.strip()
  assert err == f"error: {tmp_path / 'out'}: folder is not empty (--overwrite replaces a " \
      "prepared corpus there)"


def test_a_mesh_batch_reads_each_devices_rows_once(prepared):
  # One device here: one range, all rows. With several processes each reads
  # only the ranges of its own devices (checked by hand with two processes).
  dataset = data.TokenDataset(data.open_prepared(prepared[0]).train_tokens, 16, 4, seed=0)
  reads = []

  def read_rows(rows):
    reads.append((rows.start, rows.stop))
    return dataset.batch_at(5, rows=rows)

  mesh = mesh_lib.make_mesh(devices=jax.devices()[:1])
  inputs, targets = mesh_lib.batch_from_rows(read_rows, (4, 16), mesh_lib.batch_sharding(mesh))
  assert reads == [(0, 4)]
  np.testing.assert_array_equal(inputs, dataset.batch_at(5)[0])
  np.testing.assert_array_equal(targets, dataset.batch_at(5)[1])


# ----------------------------------------------------------- training on one


@pytest.fixture(scope="module")
def tiny_run(tiny_prepared):
  """One Run on the prepared corpus: its steps compile once."""
  return training.Run(train_lib.TrainConfig(data=str(tiny_prepared), **TINY))


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  jax.tree.map(np.testing.assert_array_equal, a, b)


def test_resume_on_a_prepared_corpus_is_exact(tmp_path, tiny_run, tiny_prepared):
  assert tiny_run.data_fingerprint == data.open_prepared(tiny_prepared).fingerprint
  config = tiny_run.config
  full = train_lib.train(config, tmp_path / "full", progress=False, run=tiny_run)
  assert np.isfinite(full["val_ppl"])
  assert full["unigram_ppl"] == tiny_run.data.info["unigram_val_perplexity"]
  train_lib.train(config, tmp_path / "cut", stop_after=2, progress=False, run=tiny_run)
  resumed = train_lib.train(config, tmp_path / "cut", resume=True, progress=False,
                            run=tiny_run)
  _assert_trees_equal(resumed.params, full.params)
  _assert_trees_equal(resumed.opt_state, full.opt_state)
  # Another corpus at the same path (another fingerprint) is refused on resume.
  other = copy.copy(tiny_run)
  other.data_fingerprint = "0123456789abcdef"
  with pytest.raises(CheckpointError, match="data_fingerprint"):
    train_lib.train(config, tmp_path / "full", resume=True, progress=False, run=other)
