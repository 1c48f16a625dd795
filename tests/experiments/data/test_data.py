"""Tests for experiments/data/: corpus, split, tokenizer, batches, baseline."""

import lzma
import math
import os
import re

import numpy as np
import pytest

from experiments import data

EXPECTED_TITLES = [
    "ALL'S WELL THAT ENDS WELL", "ANTONY AND CLEOPATRA", "AS YOU LIKE IT",
    "THE COMEDY OF ERRORS", "THE TRAGEDY OF CORIOLANUS", "CYMBELINE",
    "HAMLET, PRINCE OF DENMARK", "KING HENRY IV, THE FIRST PART",
    "KING HENRY IV, SECOND PART", "THE LIFE OF KING HENRY V",
    "KING HENRY VI, FIRST PART",
    "HISTORY OF KING HENRY THE SIXTH, SECOND PART",
    "THE HISTORY OF KING HENRY THE SIXTH, THIRD PART",
    "THE LIFE OF HENRY THE EIGHTH", "KING JOHN", "JULIUS CAESAR",
    "THE TRAGEDY OF KING LEAR", "A LOVER'S COMPLAINT", "LOVE'S LABOUR'S LOST",
    "MACBETH", "MEASURE FOR MEASURE", "THE MERCHANT OF VENICE",
    "THE MERRY WIVES OF WINDSOR", "A MIDSUMMER NIGHT'S DREAM",
    "MUCH ADO ABOUT NOTHING", "OTHELLO, THE MOOR OF VENICE",
    "THE PASSIONATE PILGRIM", "PERICLES PRINCE OF TYRE",
    "THE PHOENIX AND THE TURTLE", "THE RAPE OF LUCRECE",
    "THE TRAGEDY OF KING RICHARD THE SECOND",
    "THE LIFE AND DEATH OF KING RICHARD III", "ROMEO AND JULIET",
    "THE SONNETS", "THE TAMING OF THE SHREW", "THE TEMPEST",
    "THE LIFE OF TIMON OF ATHENS", "THE TRAGEDY OF TITUS ANDRONICUS",
    "THE HISTORY OF TROILUS AND CRESSIDA", "TWELFTH NIGHT; OR, WHAT YOU WILL",
    "THE TWO GENTLEMEN OF VERONA", "THE WINTER'S TALE",
]
EXPECTED_VAL_10 = [
    "ALL'S WELL THAT ENDS WELL", "A LOVER'S COMPLAINT", "THE SONNETS",
    "THE TAMING OF THE SHREW", "THE TWO GENTLEMEN OF VERONA",
]

UNICODE_SAMPLES = [
    "", "a", " leading and trailing  ", "tabs\tand\r\nwindows\nlines\n\n\n",
    "héllo wörld — “quotes” ½ €", "日本語のテキスト、中文文本", "emoji 🤖🎭👩‍👩‍👧",
    "combining e\u0301 and zero\u200bwidth", "\x00\x01\x7f control \x1b[0m",
    "Ω≈ç√∫ ﷽ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "'s 're 've 'll 'd ''' \"\" 123 4.5e6",
]


def _lorem(n_words, seed):
  """Deterministic English-like text with paragraphs."""
  rng = np.random.default_rng(seed)
  words = ("the king queen lord speak thou thee hath doth love night day "
           "sword crown fair good my lady sir exit enter noble heart").split()
  out = []
  for i in range(n_words):
    out.append(words[rng.integers(len(words))])
    out.append("\n\n" if i % 60 == 59 else "\n" if i % 9 == 8 else " ")
  return "".join(out)


def _random_unicode(rng, length):
  codes = rng.integers(0, 0x2FFFF, size=length)
  return "".join(chr(c) for c in codes if not 0xD800 <= c <= 0xDFFF)


@pytest.fixture(scope="module")
def bundled_docs():
  return data.load_corpus()


@pytest.fixture(scope="module")
def tiny_docs():
  return [data.Document(f"doc{i}", _lorem(800 + 300 * i, seed=i))
          for i in range(8)]


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_docs, tmp_path_factory):
  return data.train_or_load_tokenizer(
      tiny_docs, 320, tmp_path_factory.mktemp("tok"))


# ------------------------------------------------------------ bundled


def test_bundled_corpus_splits_into_42_titled_works(bundled_docs):
  assert len(bundled_docs) == 42
  assert bundled_docs[0].name == "ALL'S WELL THAT ENDS WELL"
  assert [d.name for d in bundled_docs] == EXPECTED_TITLES
  raw = lzma.decompress(data.DEFAULT_CORPUS.read_bytes()).decode("utf-8")
  assert len(raw) == 5_057_198
  assert "".join(d.text for d in bundled_docs) == raw
  for doc in bundled_docs:
    lines = doc.text.split("\n")
    assert lines[0] == doc.name
    assert "by William Shakespeare" in lines[1:3]


def test_bundled_titles_not_glued_to_previous_work(bundled_docs):
  for prev, doc in zip(bundled_docs, bundled_docs[1:]):
    last_line = prev.text.rstrip("\n").split("\n")[-1]
    assert not re.search(r"[.\]}'][A-Z]{2,}|END[A-Z]", last_line), last_line
    assert doc.name not in last_line


def test_bundled_split_holds_out_whole_works(bundled_docs):
  train, val = data.split_documents(bundled_docs, 0.1)
  assert [d.name for d in val] == EXPECTED_VAL_10
  assert len(train) + len(val) == 42
  assert set(train).isdisjoint(val)
  assert all(d in bundled_docs for d in train + val)  # Whole, unchanged.
  val_chars = sum(len(d.text) for d in val)
  assert 0.07 < val_chars / 5_057_198 < 0.13
  again = data.split_documents(list(reversed(bundled_docs)), 0.1)
  assert sorted(d.name for d in again[1]) == sorted(EXPECTED_VAL_10)


# ------------------------------------------------------------ loading


def _write_works(path):
  text = ("Produced by someone.\n\nFIRST PLAY\n\nby William Shakespeare\n\n"
          "Act one, with a word.\n[Exeunt.]SECOND PLAY, OR WHAT\n\n"
          "by William Shakespeare\n\nSome text.\n\nTHE ENDTHE THIRD\n"
          "by William Shakespeare\n\nEnd text.\n")
  path.write_text(text)
  return text


def test_shakespeare_layout_split_and_names(tmp_path):
  text = _write_works(tmp_path / "works.txt")
  docs = data.load_corpus(tmp_path / "works.txt")
  assert [d.name for d in docs] == [
      "works.txt (preamble)", "FIRST PLAY", "SECOND PLAY, OR WHAT",
      "THE THIRD"]
  assert docs[2].text.startswith("SECOND PLAY, OR WHAT\n")
  assert docs[1].text.endswith("[Exeunt.]")
  assert docs[2].text.endswith("THE END")
  assert "".join(d.text for d in docs) == text


def test_single_file_and_xz_input(tmp_path):
  text = "Line one.\r\nLine two, caf\u00e9.\n"
  (tmp_path / "plain.txt").write_bytes(b"\xef\xbb\xbf" + text.encode())
  (tmp_path / "packed.txt.xz").write_bytes(lzma.compress(text.encode()))
  plain = data.load_corpus(tmp_path / "plain.txt")
  packed = data.load_corpus(tmp_path / "packed.txt.xz")
  expected = text.replace("\r\n", "\n")
  assert plain == [data.Document("plain.txt", expected)]
  assert packed == [data.Document("packed.txt.xz", expected)]


def test_folder_input_sorted_recursive(tmp_path):
  (tmp_path / "b.txt").write_text("bee")
  (tmp_path / "a").mkdir()
  (tmp_path / "a" / "z.md").write_text("zed")
  (tmp_path / "a" / "y.xz").write_bytes(lzma.compress(b"why"))
  (tmp_path / "empty.txt").write_text("  \n")
  (tmp_path / ".hidden").mkdir()
  (tmp_path / ".hidden" / "x.bin").write_bytes(b"\xff\xfe")
  _write_works(tmp_path / "c.txt")
  docs = data.load_corpus(tmp_path)
  assert [d.name for d in docs] == [
      "a/y.xz", "a/z.md", "b.txt", "c.txt (preamble)", "FIRST PLAY",
      "SECOND PLAY, OR WHAT", "THE THIRD"]
  assert [d.text for d in docs[:3]] == ["why", "zed", "bee"]


def test_repeated_names_are_made_unique(tmp_path):
  for sub in ("x", "y"):
    (tmp_path / sub).mkdir()
    _write_works(tmp_path / sub / "w.txt")
  names = [d.name for d in data.load_corpus(tmp_path)]
  assert len(set(names)) == len(names) == 8
  assert "FIRST PLAY #2" in names


def _error_message(path):
  with pytest.raises(data.DataError) as info:
    data.load_corpus(path)
  message = str(info.value)
  assert isinstance(info.value, ValueError)
  assert str(path) in message
  assert "\n" not in message
  return message


def test_errors_name_the_path(tmp_path):
  assert "does not exist" in _error_message(tmp_path / "missing.txt")

  (tmp_path / "empty.txt").write_text("")
  assert "empty" in _error_message(tmp_path / "empty.txt")
  (tmp_path / "blank.txt").write_text(" \n\n\t")
  assert "empty" in _error_message(tmp_path / "blank.txt")

  (tmp_path / "latin1.txt").write_bytes(b"caf\xe9 au lait")
  message = _error_message(tmp_path / "latin1.txt")
  assert "UTF-8" in message and "offset 3" in message

  (tmp_path / "bad.xz").write_bytes(lzma.compress(b"ok\x80"))
  message = _error_message(tmp_path / "bad.xz")
  assert "UTF-8" in message and "offset 2" in message
  (tmp_path / "corrupt.xz").write_bytes(b"not xz at all")
  assert "xz" in _error_message(tmp_path / "corrupt.xz")

  (tmp_path / "nothing").mkdir()
  assert "no text files" in _error_message(tmp_path / "nothing")
  (tmp_path / "blanks").mkdir()
  (tmp_path / "blanks" / "a.txt").write_text("\n")
  assert "no text files" in _error_message(tmp_path / "blanks")


def test_error_in_folder_names_the_file(tmp_path):
  (tmp_path / "good.txt").write_text("fine")
  (tmp_path / "sub").mkdir()
  (tmp_path / "sub" / "bad.txt").write_bytes(b"0123456789\xff")
  message = _error_message(tmp_path / "sub" / "bad.txt")
  with pytest.raises(data.DataError, match="offset 10") as info:
    data.load_corpus(tmp_path)
  assert str(tmp_path / "sub" / "bad.txt") in str(info.value)
  assert message == str(info.value)


# -------------------------------------------------------------- split


def test_split_whole_documents_deterministic(tiny_docs):
  train, val = data.split_documents(tiny_docs, 0.2)
  assert train and val
  assert sorted(train + val, key=lambda d: d.name) == list(tiny_docs)
  total = sum(len(d.text) for d in tiny_docs)
  largest = max(len(d.text) for d in tiny_docs)
  val_chars = sum(len(d.text) for d in val)
  assert abs(val_chars - 0.2 * total) <= largest / 2
  shuffled = [tiny_docs[i] for i in np.random.default_rng(0).permutation(8)]
  assert ({d.name for d in data.split_documents(shuffled, 0.2)[1]}
          == {d.name for d in val})


def test_split_degenerate_two_documents():
  big, small = data.Document("big", "x " * 900), data.Document("s", "y " * 60)
  train, val = data.split_documents([big, small], 0.1)
  assert (train, val) == ([big], [small])
  train, val = data.split_documents([big, small], 0.9)
  assert len(train) == 1 and len(val) == 1


def test_split_single_document_at_the_first_line_start_after_its_point():
  text = _lorem(3000, seed=7)
  train, val = data.split_documents([data.Document("one", text)], 0.1)
  assert [d.name for d in train + val] == ["one (train part)", "one (val part)"]
  assert train[0].text + val[0].text == text
  cut = len(train[0].text)
  point = round(0.9 * len(text))
  assert text[cut - 1] == "\n" and cut >= point and "\n" not in text[point - 1:cut - 1]


def test_split_single_line_document_and_errors():
  with pytest.raises(data.DataError, match="needs a line break after its 50% point"):
    data.split_documents([data.Document("l", "ab " * 50)], 0.5)
  with pytest.raises(data.DataError, match="too short"):
    data.split_documents([data.Document("x", "x")], 0.1)
  with pytest.raises(ValueError, match="val_fraction"):
    data.split_documents([data.Document("x", "x y")], 1.0)
  with pytest.raises(data.DataError):
    data.split_documents([], 0.1)


# ---------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_arbitrary_unicode(tiny_tokenizer):
  rng = np.random.default_rng(0)
  samples = UNICODE_SAMPLES + [_random_unicode(rng, 200) for _ in range(20)]
  for text in samples:
    ids = tiny_tokenizer.encode(text).ids
    assert tiny_tokenizer.decode(ids) == text


def test_tokenizer_vocab_size_respected(tiny_docs, tiny_tokenizer, tmp_path):
  assert tiny_tokenizer.get_vocab_size() == 320
  assert data.separator_id(tiny_tokenizer) == 0
  big = data.train_or_load_tokenizer(tiny_docs[:1], 100_000, tmp_path)
  assert 257 < big.get_vocab_size() < 100_000  # Fewer merges than asked.
  eot_only = data.train_or_load_tokenizer(tiny_docs, 257, tmp_path)
  assert eot_only.get_vocab_size() == 257
  pure = data.train_or_load_tokenizer(tiny_docs, 256, tmp_path)
  assert pure.get_vocab_size() == 256
  assert pure.token_to_id(data.EOT_TOKEN) is None
  text = "any text \u00e9\U0001F916"
  assert len(pure.encode(text).ids) == len(text.encode("utf-8"))
  assert pure.decode([data.separator_id(pure)]) == "\x00"
  with pytest.raises(ValueError, match="at least 256"):
    data.train_or_load_tokenizer(tiny_docs, 255, tmp_path)


def test_tokenizer_cache_hit_does_not_retrain(tiny_docs, tmp_path,
                                              monkeypatch):
  path = data.tokenizer_cache_path(tiny_docs, 300, tmp_path)
  assert not path.exists()
  first = data.train_or_load_tokenizer(tiny_docs, 300, tmp_path)
  assert path.is_file()
  mtime = path.stat().st_mtime_ns

  def fail(*args):
    raise AssertionError("retrained despite a cache hit")

  monkeypatch.setattr(data.tokenizer, "_train_bpe", fail)
  second = data.train_or_load_tokenizer(tiny_docs, 300, tmp_path)
  assert second.to_str() == first.to_str()
  assert path.stat().st_mtime_ns == mtime
  assert os.listdir(tmp_path) == [path.name]
  # Any change of text or vocab size is a different cache entry.
  assert data.tokenizer_cache_path(tiny_docs, 301, tmp_path) != path
  changed = [data.Document("doc0", tiny_docs[0].text + "!")] + tiny_docs[1:]
  assert data.tokenizer_cache_path(changed, 300, tmp_path) != path


def test_encode_documents_separators_and_chunking(tiny_docs, tiny_tokenizer):
  tokens = data.encode_documents(tiny_tokenizer, tiny_docs[:3])
  assert tokens.dtype == np.int32 and tokens.ndim == 1
  sep = data.separator_id(tiny_tokenizer)
  assert np.count_nonzero(tokens == sep) == 2
  pieces = np.split(tokens, np.flatnonzero(tokens == sep))
  texts = [tiny_tokenizer.decode(p[p != sep].tolist()) for p in pieces]
  assert texts == [d.text for d in tiny_docs[:3]]
  # Cutting at pre-tokenizer boundaries never changes the ids.
  text = "\n".join(d.text for d in tiny_docs) + " " + UNICODE_SAMPLES[4]
  chunks = list(data.tokenizer._chunks(text, size=500))  # pylint: disable=protected-access
  assert len(chunks) > 10 and "".join(chunks) == text
  chunked = [i for c in chunks for i in tiny_tokenizer.encode(c).ids]
  assert chunked == tiny_tokenizer.encode(text).ids


# ------------------------------------------------------------ batches


def test_batch_shapes_and_shift():
  ds = data.TokenDataset(np.arange(1000), seq_len=16, batch_size=4, seed=3)
  inputs, targets = ds.batch_at(0)
  assert inputs.shape == targets.shape == (4, 16)
  assert inputs.dtype == targets.dtype == np.int32
  np.testing.assert_array_equal(targets, inputs + 1)
  np.testing.assert_array_equal(np.diff(inputs, axis=1), 1)  # Contiguous.
  assert inputs.min() >= 0 and targets.max() <= 999


def test_batches_deterministic_and_resumable():
  tokens = np.random.default_rng(0).integers(0, 50, size=5000)
  ds = data.TokenDataset(tokens, seq_len=8, batch_size=3, seed=1)
  same = data.TokenDataset(tokens.copy(), seq_len=8, batch_size=3, seed=1)
  other_seed = data.TokenDataset(tokens, seq_len=8, batch_size=3, seed=2)
  for step in (0, 7, 12345):
    np.testing.assert_array_equal(ds.batch_at(step)[0], same.batch_at(step)[0])
  assert not np.array_equal(ds.batch_at(0)[0], ds.batch_at(1)[0])
  assert not np.array_equal(ds.batch_at(0)[0], other_seed.batch_at(0)[0])
  run = [b for _, b in zip(range(10), ds)]
  resumed = [b for _, b in zip(range(4), same.batches(start_step=6))]
  for a, b in zip(run[6:], resumed):
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_batches_errors():
  with pytest.raises(data.DataError, match="need at least"):
    data.TokenDataset(np.arange(8), seq_len=8, batch_size=1)
  with pytest.raises(ValueError, match="1-D integer"):
    data.TokenDataset(np.zeros((4, 4), np.int32), seq_len=2, batch_size=1)
  with pytest.raises(ValueError, match="step"):
    data.TokenDataset(np.arange(9), seq_len=8, batch_size=1).batch_at(-1)


def test_eval_batches_non_overlapping():
  tokens = np.arange(1001)
  batches = data.eval_batches(tokens, seq_len=10, batch_size=4)
  assert len(batches) == 25
  inputs = np.concatenate([b[0] for b in batches])
  targets = np.concatenate([b[1] for b in batches])
  np.testing.assert_array_equal(inputs.ravel(), np.arange(1000))
  np.testing.assert_array_equal(targets, inputs + 1)
  assert inputs.dtype == np.int32

  capped = data.eval_batches(tokens, seq_len=10, batch_size=4, max_batches=3)
  assert len(capped) == 3 and all(b[0].shape == (4, 10) for b in capped)
  starts = np.concatenate([b[0][:, 0] for b in capped])
  assert np.all(np.diff(starts) >= 10) and starts[-1] >= 900  # Spread out.
  again = data.eval_batches(tokens, seq_len=10, batch_size=4, max_batches=3)
  for a, b in zip(capped, again):
    np.testing.assert_array_equal(a[0], b[0])

  ragged = data.eval_batches(np.arange(71), seq_len=10, batch_size=4)
  assert [b[0].shape[0] for b in ragged] == [4, 3]
  assert len(data.eval_batches(np.arange(71), 10, 4, drop_remainder=True)) == 1
  with pytest.raises(data.DataError, match="need at least"):
    data.eval_batches(np.arange(10), seq_len=10, batch_size=1)


# ----------------------------------------------------------- baseline


def test_unigram_perplexity_hand_computed():
  # p(0) = (2 + 1) / (3 + 3) = 1/2, p(2) = (0 + 1) / 6 = 1/6.
  ppl = data.unigram_perplexity([0, 0, 1], [0, 2], vocab_size=3)
  assert ppl == pytest.approx(math.sqrt(2 * 6))
  assert data.unigram_perplexity([], [1, 2, 3], 7) == pytest.approx(7.0)
  with pytest.raises(ValueError, match="outside"):
    data.unigram_perplexity([0], [3], vocab_size=3)


# ----------------------------------------------------------- end to end


def test_prepare_data_tiny_folder(tmp_path):
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(6):
    (corpus / f"part{i}.txt").write_text(_lorem(500 + 100 * i, seed=10 + i))
  first = data.prepare_data(corpus, vocab_size=300, cache_dir=tmp_path / "c")
  info = first.info
  assert not info["tokenizer_cache_hit"]
  assert info["num_train_docs"] + info["num_val_docs"] == 6
  assert info["num_val_docs"] == len(info["val_names"]) >= 1
  assert first.vocab_size == first.tokenizer.get_vocab_size() <= 300
  assert first.train_tokens.dtype == first.val_tokens.dtype == np.int32
  assert first.train_tokens.max() < first.vocab_size
  assert info["val_num_tokens"] == first.val_tokens.size > 0
  assert 1.0 < info["unigram_val_perplexity"] < first.vocab_size
  second = data.prepare_data(corpus, vocab_size=300, cache_dir=tmp_path / "c")
  assert second.info["tokenizer_cache_hit"]
  np.testing.assert_array_equal(first.val_tokens, second.val_tokens)


def test_prepare_data_bundled_corpus(tmp_path_factory, bundled_docs):
  prepared = data.prepare_data(
      vocab_size=512, cache_dir=tmp_path_factory.mktemp("bundled"))
  info = prepared.info
  assert info["num_train_docs"] == 37 and info["num_val_docs"] == 5
  assert info["val_names"] == EXPECTED_VAL_10
  assert info["train_chars"] + info["val_chars"] == 5_057_198
  assert prepared.vocab_size == 512
  assert np.count_nonzero(prepared.val_tokens == 0) == 4  # Separators.
  first_val = next(d for d in bundled_docs if d.name == EXPECTED_VAL_10[0])
  head = prepared.tokenizer.decode(prepared.val_tokens[:2000].tolist())
  assert first_val.text.startswith(head) and len(head) > 2000
  assert 100 < info["unigram_val_perplexity"] < 512
  assert info["seconds"]["tokenizer"] + info["seconds"]["encode"] < 30
