"""Text data pipeline: corpus loading, held-out split, byte-level BPE, batches.

The default corpus is the bundled complete works of Shakespeare
(``data/shakespeare.txt.xz``, see ``data/README.md``); any UTF-8 text file
(plain or ``.xz``) or folder of such files goes through the same path::

    data = prepare_data(vocab_size=4096)
    train = TokenDataset(data.train_tokens, seq_len=256, batch_size=32, seed=0)
    inputs, targets = train.batch_at(step)          # stateless, resumable
    for inputs, targets in eval_batches(data.val_tokens, 256, 32, 50):
      ...

Stages, each a small function that can be used on its own:

1. :func:`load_corpus` reads documents (a Shakespeare-style file is split into
   its works at the ``by William Shakespeare`` lines).
2. :func:`split_documents` holds out whole documents for validation.
3. :func:`train_or_load_tokenizer` trains a byte-level BPE tokenizer with HF
   ``tokenizers`` on the training documents only and caches it on disk.
4. :func:`encode_documents` turns documents into one int32 token stream.
5. :class:`TokenDataset` and :func:`eval_batches` cut it into batches.
6. :func:`unigram_perplexity` is the baseline every model must beat.

That path holds the corpus and its tokens in memory. A corpus of any size is
instead prepared once, streamed, into a folder of token shards::

    python -m experiments.data prepare --data PATH --out DIR [--vocab-size 4096]
    python -m experiments.train --data DIR ...

:func:`prepare_corpus` reads the files in blocks (:func:`iter_text`), decides
each file's side by the hash of its name (:data:`SPLIT_RULE`; each file is one
document, a one-file corpus is cut at a line start), trains the tokenizer on
the first ``--tokenizer-sample-mb`` million characters of training text (or
reuses a cached or given one), encodes in pieces cut at pre-tokenizer
boundaries (the same ids as encoding each document whole) and appends them to
``train-00000.bin``, ..., ``val-00000.bin``, ... (little-endian uint16 when the
vocabulary fits, else uint32). ``tokenizer.json`` and ``manifest.json``
(format version, split rule and counts, tokenizer hash, dtype, shards with
token counts and SHA-256, unigram baseline, fingerprint) are written last, the
manifest atomically. Memory is bounded by the sample and block sizes, not by
the corpus. :func:`open_prepared` checks the manifest (one-line
:class:`DataError` otherwise) and maps the shards with ``np.memmap``
(:class:`TokenShards`); :class:`TokenDataset` and :func:`eval_batches` take
them as they take an array and read only the windows they use, so batch
``step`` is still a pure function of ``(seed, step)``.
``python -m experiments.data generate --out PATH --gb 2`` writes a synthetic
corpus (resampled lines of the bundled one) to try it at scale.

Nothing here touches the network.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import hashlib
import itertools
import json
import lzma
import math
import os
import pathlib
import re
import sys
import time
from typing import Iterator, Sequence

import numpy as np

from experiments.metrics_log import write_atomically

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_CORPUS = REPO_ROOT / "data" / "shakespeare.txt.xz"
DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "tokenizers"

EOT_TOKEN = "<|endoftext|>"
NUM_BYTES = 256
# ByteLevel maps byte b to a printable character; byte 0 becomes U+0100.
_NUL_BYTE_TOKEN = "\u0100"
_XZ_MAGIC = b"\xfd7zXZ\x00"

# Bump when the tokenizer recipe changes, so old cache entries are not reused.
_TOKENIZER_RECIPE = {
    "recipe_version": 1,
    "model": "BPE",
    "pre_tokenizer": "ByteLevel(add_prefix_space=False, use_regex=True)",
    "decoder": "ByteLevel",
    "initial_alphabet": "all 256 bytes",
    "min_frequency": 2,
}
_CHUNK_CHARS = 1 << 16

# A work starts with its title line, a blank line and this marker line (the
# blank line is missing before one work, THE SONNETS).
_WORK_RE = re.compile(
    r"^(?P<title_line>[^\n]*)\n(?:[ \t]*\n)?"
    r"[ \t]*by William Shakespeare[ \t]*$",
    re.MULTILINE)
# The title is the upper-case run at the end of its line (it is often glued
# to the last line of the previous work, e.g. "[Exeunt.]HAMLET, ...").
_TITLE_TAIL_RE = re.compile(r"[A-Z0-9][A-Z0-9 ,;:'\-]*$")
# Some works end with an upper-case "THE END" that the next title is glued to.
_GLUED_END_RE = re.compile(r"THE END(?=[A-Z])")
# A newline between two printable ASCII characters is always a boundary of
# the ByteLevel pre-tokenizer, so text may be cut right after it without
# changing the encoding (lets long documents be encoded in parallel).
_SAFE_CUT_RE = re.compile(r"(?<=[!-~])\n(?=[!-~])")


class DataError(ValueError):
  """A corpus that cannot be used; the message names the offending path."""


@dataclasses.dataclass(frozen=True)
class Document:
  """One document of a corpus.

  Attributes:
    name: The work's title for a split Shakespeare-style file, else the file
      name (relative to the folder for folder input).
    text: The document's text.
  """
  name: str
  text: str

  def __repr__(self) -> str:
    return f"Document(name={self.name!r}, chars={len(self.text)})"


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedData:
  """Everything a training run needs from the data side.

  Attributes:
    tokenizer: The trained (or cached) ``tokenizers.Tokenizer``.
    train_tokens: int32 token stream of the training documents.
    val_tokens: int32 token stream of the held-out documents.
    vocab_size: The tokenizer's real vocabulary size (at most the requested
      one); every token id is below it.
    info: Split and size statistics (see :func:`prepare_data`).
  """
  tokenizer: object
  train_tokens: np.ndarray
  val_tokens: np.ndarray
  vocab_size: int
  info: dict


# ----------------------------------------------------------------- loading


def load_corpus(path: str | os.PathLike | None = None) -> list[Document]:
  """Loads a corpus as a list of documents.

  Args:
    path: A UTF-8 text file (plain, or xz-compressed with suffix ``.xz``), or a
      folder. ``None`` means the bundled Shakespeare corpus. For a folder,
      every non-hidden file below it (recursively, sorted by relative path)
      is read; empty or whitespace-only files are skipped.

  Returns:
    The documents. A file containing works in the Shakespeare layout (title
    line, usually a blank line, ``by William Shakespeare``) is split into
    its works,
    each named by its title; any text before the first work becomes a
    ``"<file> (preamble)"`` document. Any other file is one document named by
    its file name. Concatenating the texts of one file's documents gives the
    file back, except that Windows line ends become ``\\n`` and a leading
    byte-order mark is dropped.

  Raises:
    DataError: The path is missing, a file is not valid UTF-8 (the message
      gives the byte offset), an xz file is corrupt, the corpus holds no
      text, or a folder holds no text files.
  """
  path = pathlib.Path(DEFAULT_CORPUS if path is None else path)
  if not path.exists():
    raise DataError(f"{path}: corpus path does not exist")
  if path.is_dir():
    docs = _load_folder(path)
  else:
    text = read_text(path)
    if not text.strip():
      raise DataError(f"{path}: corpus is empty (no text)")
    docs = split_works(text, name=path.name)
  return _unique_names(docs)


def read_text(path: str | os.PathLike) -> str:
  """Reads one UTF-8 file, decompressing xz, with ``\\n`` line ends.

  Args:
    path: The file. It is treated as xz if its name ends in ``.xz`` or its
      content starts with the xz magic bytes.

  Returns:
    The decoded text (a leading UTF-8 byte-order mark is removed).

  Raises:
    DataError: The file cannot be read, is not valid UTF-8 or not a valid
      xz stream.
  """
  path = pathlib.Path(path)
  try:
    raw = path.read_bytes()
  except OSError as e:
    raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
  compressed = path.suffix == ".xz" or raw.startswith(_XZ_MAGIC)
  if compressed:
    try:
      raw = lzma.decompress(raw)
    except lzma.LZMAError as e:
      raise DataError(f"{path}: not a valid xz file ({e})") from None
  try:
    text = raw.decode("utf-8")
  except UnicodeDecodeError as e:
    where = "of the decompressed data " if compressed else ""
    raise DataError(
        f"{path}: not valid UTF-8: byte 0x{raw[e.start]:02x} at byte offset "
        f"{e.start} {where}({e.reason})") from None
  return text.removeprefix("\ufeff").replace("\r\n", "\n")


def split_works(text: str, name: str) -> list[Document]:
  """Splits a text in the Shakespeare layout into its works.

  A work starts at its title, found on the line above a
  ``by William Shakespeare`` line, or two above with a blank line between
  (the usual layout). The title is
  the upper-case run at the end of that line, since it is often glued to the
  previous work's last line (``[Exeunt.]HAMLET, PRINCE OF DENMARK``); a glued
  ``THE END`` (``THE ENDANTONY AND CLEOPATRA``) stays with the previous work.

  Args:
    text: The whole text.
    name: Name of the text, for a text without works and for a preamble.

  Returns:
    One document per work, named by its title; a text with no marker is a
    single document called ``name``. The documents' texts concatenate to
    ``text``.
  """
  starts, titles = [], []
  for match in _WORK_RE.finditer(text):
    offset, title = _title_in_line(match.group("title_line"))
    starts.append(match.start("title_line") + offset)
    titles.append(title or f"{name} work {len(titles) + 1}")
  if not starts:
    return [Document(name, text)]
  docs = []
  if text[:starts[0]].strip():
    docs.append(Document(f"{name} (preamble)", text[:starts[0]]))
  ends = starts[1:] + [len(text)]
  docs += [Document(t, text[s:e]) for t, s, e in zip(titles, starts, ends)]
  return docs


def _title_in_line(line: str) -> tuple[int, str]:
  """Returns (offset, title) of the title at the end of a title line."""
  match = _TITLE_TAIL_RE.search(line.rstrip())
  if match is None:  # Not upper case: the whole line is the title.
    return len(line) - len(line.lstrip()), line.strip()
  offset = match.start()
  glued = _GLUED_END_RE.match(line, offset)
  if glued is not None:
    offset = glued.end()
  return offset, line[offset:].strip()


def _folder_files(folder: pathlib.Path) -> list[pathlib.Path]:
  """Every non-hidden file below ``folder``, sorted by relative path."""
  return sorted(
      (p for p in folder.rglob("*")
       if p.is_file() and not any(
           part.startswith(".") for part in p.relative_to(folder).parts)),
      key=lambda p: p.relative_to(folder).as_posix())


def _load_folder(folder: pathlib.Path) -> list[Document]:
  files = _folder_files(folder)
  docs = []
  for file in files:
    text = read_text(file)
    if text.strip():
      docs += split_works(text, name=file.relative_to(folder).as_posix())
  if not docs:
    raise DataError(f"{folder}: folder contains no text files "
                    f"({len(files)} non-hidden files, none with text)")
  return docs


def _unique_names(docs: list[Document]) -> list[Document]:
  """Suffixes repeated names with ``#2``, ``#3``... so names are keys."""
  seen: dict[str, int] = {}
  out = []
  for doc in docs:
    seen[doc.name] = seen.get(doc.name, 0) + 1
    if seen[doc.name] > 1:
      doc = Document(f"{doc.name} #{seen[doc.name]}", doc.text)
    out.append(doc)
  return out


# ------------------------------------------------------------------ split


def split_documents(
    docs: Sequence[Document], val_fraction: float = 0.1,
) -> tuple[list[Document], list[Document]]:
  """Deterministic held-out split of whole documents.

  Rule (several documents): order the documents by the SHA-256 hex digest
  of their names (a fixed pseudo-random order, independent of their order
  in the corpus) and hold out the shortest prefix of that order whose
  character count is closest to ``val_fraction * total characters``: take
  documents one by one while the next one brings the count closer to the
  target (its first half still fits under it), and stop at the first that
  does not. If even the first one overshoots that much, the single document
  whose length is closest to the target is held out instead. At least one
  document stays on each side. The split depends only on the names, the
  lengths and ``val_fraction``.

  Rule (one document): the text is cut at the paragraph boundary (a blank
  line) nearest to the ``1 - val_fraction`` point; if there is none, at the
  nearest line end, else the nearest space, else exactly at that point. The
  parts are named ``"<name> (train part)"`` and ``"<name> (val part)"``.

  Args:
    docs: The documents (names must be unique).
    val_fraction: Target fraction of characters to hold out, in (0, 1).

  Returns:
    ``(train_docs, val_docs)``, each in the input order.

  Raises:
    DataError: No documents, or a single document too short to split.
    ValueError: ``val_fraction`` is not in (0, 1) or names repeat.
  """
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
  if not docs:
    raise DataError("split_documents: no documents to split")
  names = [d.name for d in docs]
  if len(set(names)) != len(names):
    raise ValueError("split_documents: document names must be unique")
  if len(docs) == 1:
    return _split_single(docs[0], val_fraction)
  val_names = _choose_val_names(docs, val_fraction)
  train = [d for d in docs if d.name not in val_names]
  val = [d for d in docs if d.name in val_names]
  return train, val


def _name_hash(name: str) -> str:
  return hashlib.sha256(name.encode("utf-8")).hexdigest()


def _choose_val_names(docs: Sequence[Document], val_fraction: float) -> set:
  total = sum(len(d.text) for d in docs)
  target = val_fraction * total
  ordered = sorted(docs, key=lambda d: _name_hash(d.name))
  chosen, val_chars = set(), 0
  for doc in ordered[:-1]:
    if val_chars + len(doc.text) / 2 > target:
      break
    chosen.add(doc.name)
    val_chars += len(doc.text)
  if not chosen:  # The first one overshoots: take the closest to target.
    best = min(ordered, key=lambda d: abs(len(d.text) - target))
    chosen.add(best.name)
  return chosen


def _split_single(doc: Document, val_fraction: float):
  text = doc.text
  target = round((1.0 - val_fraction) * len(text))
  first = len(text) - len(text.lstrip())  # Index of the first non-space.
  last = len(text.rstrip())  # One past the last non-space.
  cut = None
  for pattern in (r"\n[ \t]*\n\s*", r"\n", r" +"):
    ends = [m.end() for m in re.finditer(pattern, text)
            if first < m.end() < last]
    if ends:
      cut = min(ends, key=lambda e: abs(e - target))
      break
  if cut is None:
    cut = target
  if not text[:cut].strip() or not text[cut:].strip():
    raise DataError(
        f"{doc.name}: the only document is too short to split for validation")
  return ([Document(f"{doc.name} (train part)", text[:cut])],
          [Document(f"{doc.name} (val part)", text[cut:])])


# -------------------------------------------------------------- tokenizer


def tokenizer_cache_path(
    train_docs: Sequence[Document], vocab_size: int,
    cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """Where :func:`train_or_load_tokenizer` caches this tokenizer.

  The file name holds a SHA-256 of the training texts (in order), the vocab
  size and the tokenizer recipe, so any change gives a new file.

  Args:
    train_docs: The training documents.
    vocab_size: The requested vocabulary size.
    cache_dir: Cache folder; ``None`` means ``<repo>/.cache/tokenizers``.

  Returns:
    The JSON file's path (it may not exist yet).
  """
  digest = hashlib.sha256()
  digest.update(json.dumps(
      {"vocab_size": int(vocab_size), **_TOKENIZER_RECIPE},
      sort_keys=True).encode())
  for doc in train_docs:
    data = doc.text.encode("utf-8")
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)
  folder = pathlib.Path(DEFAULT_CACHE_DIR if cache_dir is None else cache_dir)
  return folder / f"bpe-{int(vocab_size)}-{digest.hexdigest()[:20]}.json"


def train_or_load_tokenizer(
    train_docs: Sequence[Document], vocab_size: int,
    cache_dir: str | os.PathLike | None = None):
  """Returns a byte-level BPE tokenizer, trained once and cached as JSON.

  The tokenizer is HF ``tokenizers`` BPE with the ByteLevel pre-tokenizer
  and decoder and all 256 bytes in its initial alphabet, so any text encodes
  and ``decode(encode(text).ids) == text``. With ``vocab_size >= 257`` it has
  one special token, ``<|endoftext|>`` (id 0), used as document separator,
  and up to ``vocab_size - 257`` merges (fewer if the corpus has fewer
  pairs seen at least twice). With ``vocab_size == 256`` it is pure
  byte-level with no special token (see :func:`separator_id`).

  Args:
    train_docs: Documents to learn the merges from (the training split only).
    vocab_size: Maximum vocabulary size, at least 256. The real size,
      ``tokenizer.get_vocab_size()``, never exceeds it.
    cache_dir: Cache folder (created if missing); ``None`` means
      ``<repo>/.cache/tokenizers``. The cache key is
      :func:`tokenizer_cache_path`; a hit loads the file without training.

  Returns:
    A ``tokenizers.Tokenizer``.

  Raises:
    ValueError: ``vocab_size < 256``.
  """
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top

  vocab_size = int(vocab_size)
  if vocab_size < NUM_BYTES:
    raise ValueError(
        f"vocab_size must be at least {NUM_BYTES} for a byte-level tokenizer "
        f"(every byte needs a token), got {vocab_size}")
  path = tokenizer_cache_path(train_docs, vocab_size, cache_dir)
  if path.is_file():
    try:
      return Tokenizer.from_file(str(path))
    except Exception:  # pylint: disable=broad-except
      pass  # A damaged cache entry: train again and overwrite it.
  tokenizer = _train_bpe(train_docs, vocab_size)
  write_atomically(path, tokenizer.to_str())
  return tokenizer


def _train_bpe(train_docs: Sequence[Document], vocab_size: int):
  """Trains the byte-level BPE tokenizer (no caching)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # pylint: disable=g-import-not-at-top,g-multiple-import

  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(
      add_prefix_space=False, use_regex=True)
  tokenizer.decoder = decoders.ByteLevel()
  specials = [EOT_TOKEN] if vocab_size > NUM_BYTES else []
  trainer = trainers.BpeTrainer(
      vocab_size=vocab_size,
      min_frequency=_TOKENIZER_RECIPE["min_frequency"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
      special_tokens=specials,
      show_progress=False)
  chunks = [c for doc in train_docs for c in _chunks(doc.text)]
  tokenizer.train_from_iterator(chunks, trainer, length=len(chunks))
  if tokenizer.get_vocab_size() > vocab_size:  # Never expected.
    raise RuntimeError(f"trained vocab {tokenizer.get_vocab_size()} exceeds "
                       f"the requested {vocab_size}")
  return tokenizer


def _chunks(text: str, size: int = _CHUNK_CHARS) -> Iterator[str]:
  """Cuts text into ~size pieces at pre-tokenizer boundaries.

  Encoding the pieces separately gives exactly the tokens of the whole text.
  """
  start = 0
  while len(text) - start > size:
    match = _SAFE_CUT_RE.search(text, start + size)
    if match is None:
      break
    yield text[start:match.end()]
    start = match.end()
  yield text[start:]


def separator_id(tokenizer) -> int:
  """Id of the token put between documents.

  ``<|endoftext|>`` when the tokenizer has it; a pure byte-level tokenizer
  (vocab 256) has no room for it and uses the NUL byte's token instead
  (NUL does not occur in normal text).

  Args:
    tokenizer: A tokenizer from :func:`train_or_load_tokenizer`.

  Returns:
    The separator's token id.
  """
  for token in (EOT_TOKEN, _NUL_BYTE_TOKEN):
    token_id = tokenizer.token_to_id(token)
    if token_id is not None:
      return token_id
  raise ValueError("tokenizer has neither <|endoftext|> nor a byte-level "
                   "token for the NUL byte")


def encode_documents(tokenizer, docs: Sequence[Document]) -> np.ndarray:
  """Encodes documents into one token stream.

  Long documents are cut at pre-tokenizer boundaries and all pieces are
  encoded with ``encode_batch`` (parallel, same ids as encoding each whole
  document).

  Args:
    tokenizer: A tokenizer from :func:`train_or_load_tokenizer`.
    docs: The documents, in order.

  Returns:
    1-D int32 array: the documents' tokens with :func:`separator_id` between
    consecutive documents (not before the first or after the last).
  """
  pieces, owners = [], []
  for i, doc in enumerate(docs):
    for chunk in _chunks(doc.text):
      pieces.append(chunk)
      owners.append(i)
  encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
  encodings = encode(pieces, add_special_tokens=False) if pieces else []
  sep = np.array([separator_id(tokenizer)], dtype=np.int32)
  parts = []
  for k, enc in enumerate(encodings):
    if k > 0 and owners[k] != owners[k - 1]:
      parts.append(sep)
    parts.append(np.asarray(enc.ids, dtype=np.int32))
  return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


# ---------------------------------------------------------------- batches


@dataclasses.dataclass(frozen=True, eq=False)
class TokenDataset:
  """Stateless training batches of random windows of a token stream.

  Batch ``step`` is drawn from a generator seeded with ``(seed, step)``:
  ``batch_size`` window starts uniform in ``[0, len(tokens) - seq_len - 1]``.
  There is no iterator state, so resuming at step N gives exactly the
  batches of an uninterrupted run.

  Attributes:
    tokens: 1-D integer token stream (the training split), or a
      :class:`TokenShards` over a prepared corpus's memory-mapped shards
      (only the windows drawn are read; same windows for the same tokens).
    seq_len: Tokens per row.
    batch_size: Rows per batch.
    seed: Non-negative integer seed.
  """
  tokens: np.ndarray
  seq_len: int
  batch_size: int
  seed: int = 0

  def __post_init__(self):
    tokens = _token_stream(self.tokens, "tokens")
    if self.seq_len < 1 or self.batch_size < 1:
      raise ValueError(f"seq_len and batch_size must be >= 1, got "
                       f"{self.seq_len} and {self.batch_size}")
    if tokens.size < self.seq_len + 1:
      raise DataError(f"only {tokens.size} tokens, need at least "
                      f"seq_len + 1 = {self.seq_len + 1}")
    if self.seed < 0:
      raise ValueError(f"seed must be non-negative, got {self.seed}")
    object.__setattr__(self, "tokens", tokens)

  def batch_at(self, step: int, rows: slice | None = None,
               ) -> tuple[np.ndarray, np.ndarray]:
    """The batch of training step ``step``, or some of its rows.

    Args:
      step: Non-negative step index.
      rows: Only these rows of the batch (e.g. the rows of one process's
        devices); the window starts of the whole batch are drawn first, so
        the rows are those of the full batch and nothing else is read.

    Returns:
      ``(inputs, targets)``, int32 arrays of shape ``[batch_size, seq_len]``
      (fewer rows with ``rows``) with ``targets[:, t] == inputs[:, t + 1]``
      (the next tokens).
    """
    if step < 0:
      raise ValueError(f"step must be non-negative, got {step}")
    rng = np.random.default_rng([int(self.seed), int(step)])
    starts = rng.integers(0, self.tokens.size - self.seq_len,
                          size=self.batch_size)
    if rows is not None:
      starts = starts[rows]
    return _windows(self.tokens, starts, self.seq_len)

  def batches(self, start_step: int = 0) -> Iterator[tuple[np.ndarray,
                                                             np.ndarray]]:
    """Yields ``batch_at(start_step)``, ``batch_at(start_step + 1)``, ..."""
    step = start_step
    while True:
      yield self.batch_at(step)
      step += 1

  def __iter__(self):
    return self.batches(0)


def _windows(tokens, starts: np.ndarray, seq_len: int):
  """Rows ``tokens[s : s + seq_len + 1]`` for each start, as (inputs, targets).

  ``tokens`` is an int32 array or a :class:`TokenShards` (which reads only
  these windows from its memory-mapped files).
  """
  window = tokens[starts[:, None] + np.arange(seq_len + 1)]
  return window[:, :-1], window[:, 1:]


def _token_stream(tokens, name: str):
  """A :class:`TokenShards` as it is, anything else as a 1-D int32 array."""
  if isinstance(tokens, TokenShards):
    return tokens
  array = np.asarray(tokens)
  if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
    raise ValueError(f"{name} must be a 1-D integer array, got "
                     f"shape {array.shape} dtype {array.dtype}")
  return array.astype(np.int32, copy=False)


def eval_batches(
    val_tokens: np.ndarray, seq_len: int, batch_size: int,
    max_batches: int | None = None, drop_remainder: bool = False,
) -> list[tuple[np.ndarray, np.ndarray]]:
  """Deterministic validation batches of non-overlapping windows.

  Window ``i`` has inputs ``val_tokens[i*seq_len : (i+1)*seq_len]`` and the
  next tokens as targets, so every token after the first is predicted at
  most once. If ``max_batches`` allows fewer windows than there are, the
  windows used are spread evenly over the whole stream (so every held-out
  document is sampled), in order.

  Args:
    val_tokens: 1-D integer token stream (the validation split), or a
      :class:`TokenShards` (only the windows used are read).
    seq_len: Tokens per row.
    batch_size: Rows per batch.
    max_batches: Cap on the number of batches (``None``: all windows).
    drop_remainder: Drop a last batch with fewer than ``batch_size`` rows
      (only happens without a cap or when the cap is not reached).

  Returns:
    A list of ``(inputs, targets)`` int32 pairs of shape ``[rows, seq_len]``.

  Raises:
    DataError: Fewer than ``seq_len + 1`` tokens.
  """
  tokens = _token_stream(val_tokens, "val_tokens")
  if seq_len < 1 or batch_size < 1:
    raise ValueError("seq_len and batch_size must be >= 1")
  num_windows = (tokens.size - 1) // seq_len
  if num_windows < 1:
    raise DataError(f"only {tokens.size} validation tokens, need at least "
                    f"seq_len + 1 = {seq_len + 1}")
  window_ids = np.arange(num_windows)
  if max_batches is not None and max_batches * batch_size < num_windows:
    if max_batches < 1:
      raise ValueError(f"max_batches must be >= 1, got {max_batches}")
    count = max_batches * batch_size
    window_ids = np.floor(np.arange(count) * (num_windows / count)).astype(
        np.int64)
  batches = []
  for i in range(0, window_ids.size, batch_size):
    ids = window_ids[i:i + batch_size]
    if drop_remainder and ids.size < batch_size:
      break
    batches.append(_windows(tokens, ids * seq_len, seq_len))
  return batches


# --------------------------------------------------------------- baseline


def unigram_perplexity(
    train_tokens: np.ndarray, val_tokens: np.ndarray, vocab_size: int,
) -> float:
  """Perplexity of an add-one-smoothed unigram model.

  ``p(t) = (count_train(t) + 1) / (len(train_tokens) + vocab_size)``;
  the result is ``exp(-mean(log p(t) for t in val_tokens))``. A language
  model that has learned anything must beat this by far.

  Args:
    train_tokens: Token ids the counts come from.
    val_tokens: Token ids to score (non-empty).
    vocab_size: Number of token ids; all ids must be below it.

  Returns:
    The perplexity, a float in ``[1, vocab_size + len(train_tokens)]``.
  """
  train = _token_ids(train_tokens, "train_tokens", vocab_size)
  val = _token_ids(val_tokens, "val_tokens", vocab_size)
  if val.size == 0:
    raise ValueError("val_tokens is empty")
  counts = np.bincount(train, minlength=vocab_size).astype(np.float64)
  log_p = np.log(counts + 1.0) - math.log(train.size + vocab_size)
  return float(np.exp(-log_p[val].mean()))


def _token_ids(tokens, name: str, vocab_size: int) -> np.ndarray:
  """Flattens to int64, checking the ids are integers in [0, vocab_size)."""
  arr = np.asarray(tokens).ravel()
  if arr.size == 0:
    return arr.astype(np.int64)
  if not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(f"{name} must hold integer ids, got dtype {arr.dtype}")
  if arr.min() < 0 or arr.max() >= vocab_size:
    raise ValueError(f"{name} has ids outside [0, {vocab_size})")
  return arr.astype(np.int64, copy=False)


# ------------------------------------------------------------ one call


def prepare_data(
    path: str | os.PathLike | None = None, vocab_size: int = 4096,
    cache_dir: str | os.PathLike | None = None,
    val_fraction: float = 0.1) -> PreparedData:
  """Loads, splits, tokenizes and encodes a corpus in one call.

  Args:
    path: Corpus file or folder (see :func:`load_corpus`); ``None`` is the
      bundled Shakespeare.
    vocab_size: Maximum vocabulary size (the model's), at least 256.
    cache_dir: Tokenizer cache folder; ``None`` means
      ``<repo>/.cache/tokenizers``.
    val_fraction: Fraction of characters held out (whole documents).

  Returns:
    A :class:`PreparedData`. ``info`` holds: ``path``, ``num_train_docs``,
    ``num_val_docs``, ``val_names``, ``train_chars``, ``val_chars``,
    ``val_char_fraction``, ``train_num_tokens``, ``val_num_tokens``,
    ``requested_vocab_size``, ``vocab_size``, ``separator_id``,
    ``tokenizer_path``, ``tokenizer_cache_hit``, ``unigram_val_perplexity``
    and ``seconds`` (time per stage).
  """
  seconds = {}
  tic = time.perf_counter()
  docs = load_corpus(path)
  train_docs, val_docs = split_documents(docs, val_fraction)
  seconds["load_and_split"] = time.perf_counter() - tic

  tic = time.perf_counter()
  tokenizer_path = tokenizer_cache_path(train_docs, vocab_size, cache_dir)
  cache_hit = tokenizer_path.is_file()
  tokenizer = train_or_load_tokenizer(train_docs, vocab_size, cache_dir)
  seconds["tokenizer"] = time.perf_counter() - tic

  tic = time.perf_counter()
  train_tokens = encode_documents(tokenizer, train_docs)
  val_tokens = encode_documents(tokenizer, val_docs)
  seconds["encode"] = time.perf_counter() - tic

  real_vocab = tokenizer.get_vocab_size()
  train_chars = sum(len(d.text) for d in train_docs)
  val_chars = sum(len(d.text) for d in val_docs)
  info = {
      "path": str(DEFAULT_CORPUS if path is None else path),
      "num_train_docs": len(train_docs),
      "num_val_docs": len(val_docs),
      "val_names": [d.name for d in val_docs],
      "train_chars": train_chars,
      "val_chars": val_chars,
      "val_char_fraction": val_chars / (train_chars + val_chars),
      "train_num_tokens": int(train_tokens.size),
      "val_num_tokens": int(val_tokens.size),
      "requested_vocab_size": int(vocab_size),
      "vocab_size": real_vocab,
      "separator_id": separator_id(tokenizer),
      "tokenizer_path": str(tokenizer_path),
      "tokenizer_cache_hit": cache_hit,
      "unigram_val_perplexity": unigram_perplexity(
          train_tokens, val_tokens, real_vocab),
      "seconds": seconds,
  }
  return PreparedData(tokenizer, train_tokens, val_tokens, real_vocab, info)


# ------------------------------------------------------- prepared corpora
#
# A corpus of any size is prepared once into a directory of token shards
# (``prepare_corpus``) and read back through ``np.memmap`` (``open_prepared``).
# Everything is streamed: the memory used depends on the read, piece, encode
# and tokenizer-sample sizes below, never on the corpus size.

MANIFEST_NAME = "manifest.json"
TOKENIZER_NAME = "tokenizer.json"
PREPARED_FORMAT = "skewadam-jax prepared corpus"
PREPARED_VERSION = 1
DEFAULT_SAMPLE_MB = 64
DEFAULT_SHARD_TOKENS = 1 << 28  # 512 MiB per uint16 shard.
_READ_BYTES = 1 << 22  # Bytes read from a file at a time.
_ENCODE_CHARS = 1 << 22  # Characters per encode_batch call.
# A piece is cut at a safe line end once it is this many times the piece size
# without one; then at a single space between two non-space characters (also
# a pre-tokenizer boundary), and failing that anywhere.
_MAX_PIECES_WITHOUT_CUT = 256
_SPACE_CUT_RE = re.compile(r"(?<=\S) (?=\S)")
_SHARD_DTYPES = {"uint16": "<u2", "uint32": "<u4"}
SPLIT_RULE = (
    "documents are files (relative paths, in sorted order); a document is "
    "held out for validation when the first 8 bytes of the SHA-256 of its "
    "name, read as a big-endian integer and divided by 2**64, are below "
    "val_fraction (at least one document stays on each side: the lowest "
    "value is held out if none is, the highest kept if all are); a corpus of "
    "one file is cut at the first line start at or after the (1 - "
    "val_fraction) character point, the rest held out")


def iter_text(path: str | os.PathLike, read_bytes: int = _READ_BYTES,
              on_bytes=None) -> Iterator[str]:
  """Streams one UTF-8 file (plain or xz) as :func:`read_text` would read it.

  Args:
    path: The file (xz when its name ends in ``.xz`` or it starts with the
      xz magic bytes).
    read_bytes: Bytes read from disk at a time (bounds the memory).
    on_bytes: Called with the number of bytes read from disk after each read
      (for a progress bar).

  Yields:
    Pieces of text whose concatenation is ``read_text(path)``: a leading
    byte-order mark dropped, ``\\r\\n`` turned into ``\\n``.

  Raises:
    DataError: As :func:`read_text`; an invalid byte is reported with its
      offset in the (decompressed) stream.
  """
  path = pathlib.Path(path)
  try:
    raw = open(path, "rb")  # pylint: disable=consider-using-with
  except OSError as e:
    raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
  with raw:
    compressed = path.suffix == ".xz" or raw.read(len(_XZ_MAGIC)) == _XZ_MAGIC
    raw.seek(0)
    stream = lzma.LZMAFile(raw) if compressed else raw
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, first, carry, disk = 0, True, "", 0
    while True:
      try:
        block = stream.read(read_bytes)
      except (lzma.LZMAError, EOFError) as e:
        raise DataError(f"{path}: not a valid xz file ({e})") from None
      except OSError as e:
        raise DataError(f"{path}: cannot read ({e.strerror or e})") from None
      if on_bytes is not None:
        on_bytes(raw.tell() - disk)
        disk = raw.tell()
      buffered = len(decoder.getstate()[0])
      try:
        text = decoder.decode(block, final=not block)
      except UnicodeDecodeError as e:
        where = "of the decompressed data " if compressed else ""
        raise DataError(
            f"{path}: not valid UTF-8: byte 0x{e.object[e.start]:02x} at byte "
            f"offset {offset - buffered + e.start} {where}({e.reason})"
        ) from None
      offset += len(block)
      text = carry + text
      # Hold back a final "\r": its "\n" may come with the next block.
      carry = "\r" if block and text.endswith("\r") else ""
      text = text[:len(text) - len(carry)].replace("\r\n", "\n")
      if first and text:
        text, first = text.removeprefix("\ufeff"), False
      if text:
        yield text
      if not block:
        return


def _stream_pieces(texts: Iterator[str], piece_chars: int) -> Iterator[str]:
  """Cuts streamed text into pieces of about ``piece_chars`` characters.

  The cuts are those of :func:`_chunks` on the whole text (the first safe
  line end at least ``piece_chars`` after the piece's start), so the pieces
  encode to exactly the tokens of the whole text. A stretch of
  ``_MAX_PIECES_WITHOUT_CUT`` pieces without a safe line end is cut before a
  single space between non-space characters (also exact) or, if there is
  none, at ``piece_chars`` (the only cut that may change the tokens).
  """
  pending, start = "", 0
  max_pending = _MAX_PIECES_WITHOUT_CUT * piece_chars
  for text in texts:
    pending = pending[start:] + text
    start = 0
    while len(pending) - start > piece_chars:
      match = _SAFE_CUT_RE.search(pending, start + piece_chars)
      if match is not None:
        cut = match.end()
      elif len(pending) - start <= max_pending:
        break  # Wait for more text: the cut may be in it.
      else:
        space = _SPACE_CUT_RE.search(pending, start + piece_chars)
        cut = space.start() if space else start + piece_chars
      yield pending[start:cut]
      start = cut
  if len(pending) > start:
    yield pending[start:]


def _hash_unit(name: str) -> float:
  """A document name's fixed pseudo-random value in [0, 1)."""
  digest = hashlib.sha256(name.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2**64


def held_out_names(names: Sequence[str], val_fraction: float) -> set:
  """The documents a prepared corpus holds out (see :data:`SPLIT_RULE`).

  Each document is decided by its own name, so the split of a streamed
  corpus needs no pass over its text and a document keeps its side when
  others are added or removed (except for the at-least-one-each-side rule).

  Args:
    names: The document names (at least two, unique).
    val_fraction: Target fraction held out, in (0, 1).

  Returns:
    The held-out names.
  """
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
  held = {n for n in names if _hash_unit(n) < val_fraction}
  if not held:
    held = {min(names, key=_hash_unit)}
  elif len(held) == len(names):
    held.remove(max(names, key=_hash_unit))
  return held


def generate_corpus(out: str | os.PathLike, total_bytes: int, *, seed: int = 0,
                    file_bytes: int = 8 << 20,
                    source: str | os.PathLike | None = None,
                    progress: bool = False) -> list[pathlib.Path]:
  """Writes a synthetic text corpus by resampling the lines of a real one.

  Lines of ``source`` (the bundled Shakespeare by default; blank lines and
  the ``by William Shakespeare`` markers left out) are drawn uniformly with
  a seeded generator, with a blank line after one in eight, into files
  ``part-00000.txt``, ... of ``file_bytes`` bytes (cut at a line end). It is
  text-like (real words and lines, so BPE merges and token counts are
  realistic) and reproducible, and nothing is downloaded. Memory is one
  file's text.

  Args:
    out: The folder to write (created; existing ``part-*.txt`` files are
      replaced).
    total_bytes: About how many bytes to write in all (within one line per
      file).
    seed: Seed of the generator.
    file_bytes: Bytes per file.
    source: The corpus whose lines are resampled.
    progress: Show a progress bar on stderr.

  Returns:
    The files written.
  """
  if total_bytes < 1 or file_bytes < 1:
    raise ValueError("total_bytes and file_bytes must be >= 1")
  lines = [line for line in read_text(DEFAULT_CORPUS if source is None
                                      else source).split("\n")
           if line.strip() and "by William Shakespeare" not in line]
  encoded = np.array([len(line.encode("utf-8")) + 1 for line in lines])
  rng = np.random.default_rng(seed)
  out = pathlib.Path(out)
  out.mkdir(parents=True, exist_ok=True)
  files, written = [], 0
  bar = _progress_bar(progress, total_bytes, "generate")
  while written < total_bytes:
    target = min(file_bytes, total_bytes - written)
    count = int(target / encoded.mean() * 1.1) + 16
    picks = rng.integers(len(lines), size=count)
    breaks = rng.random(count) < 0.125
    sizes = np.cumsum(encoded[picks] + breaks)
    keep = max(1, int(np.searchsorted(sizes, target, side="right")))
    text = "".join(lines[i] + ("\n\n" if b else "\n")
                   for i, b in zip(picks[:keep], breaks[:keep]))
    path = out / f"part-{len(files):05d}.txt"
    path.write_text(text, encoding="utf-8")
    files.append(path)
    size = len(text.encode("utf-8"))
    written += size
    bar.update(size)
  bar.close()
  return files


class _NoBar:
  """What is used of a tqdm bar, doing nothing."""

  def update(self, n=1):
    pass

  def close(self):
    pass


def _progress_bar(enabled: bool, total: int, desc: str):
  if not enabled:
    return _NoBar()
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top
  return tqdm(total=total, desc=desc, unit="B", unit_scale=True,
              dynamic_ncols=True, leave=True)


class _ShardWriter:
  """Appends one split's token ids to shard files of ``shard_tokens`` ids."""

  def __init__(self, folder: pathlib.Path, split: str, dtype: str,
               shard_tokens: int, vocab_size: int):
    self.folder, self.split, self.dtype = folder, split, dtype
    self.shard_tokens = shard_tokens
    self.counts = np.zeros(vocab_size, np.int64)  # For the unigram baseline.
    self.shards: list[dict] = []
    self.num_tokens = 0
    self.documents = 0
    self._file = None
    self._digest = None

  def write(self, ids: np.ndarray) -> None:
    if ids.size and ids.max() >= self.counts.size:
      raise DataError(f"token id {ids.max()} is outside the tokenizer's "
                      f"vocabulary of {self.counts.size}")
    self.counts += np.bincount(ids, minlength=self.counts.size)
    data = ids.astype(_SHARD_DTYPES[self.dtype])
    while data.size:
      if self._file is None:
        name = f"{self.split}-{len(self.shards):05d}.bin"
        self._file = open(self.folder / name, "wb")  # pylint: disable=consider-using-with
        self._digest = hashlib.sha256()
        self.shards.append({"file": name, "num_tokens": 0})
      shard = self.shards[-1]
      part = data[:self.shard_tokens - shard["num_tokens"]]
      self._file.write(part.tobytes())
      self._digest.update(part.tobytes())
      shard["num_tokens"] += part.size
      self.num_tokens += part.size
      data = data[part.size:]
      if shard["num_tokens"] == self.shard_tokens:
        self._finish_shard()

  def _finish_shard(self) -> None:
    self._file.close()
    self.shards[-1]["sha256"] = self._digest.hexdigest()
    self._file = None

  def close(self) -> None:
    if self._file is not None:
      self._finish_shard()


class _BatchEncoder:
  """Encodes text pieces in batches and appends the ids to their splits."""

  def __init__(self, tokenizer, encode_chars: int):
    self.encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    self.separator = np.array([separator_id(tokenizer)], np.int32)
    self.encode_chars = encode_chars
    self.pieces: list[tuple[_ShardWriter, bool, str]] = []
    self.chars = 0

  def add(self, writer: _ShardWriter, text: str, starts_document: bool):
    if starts_document:
      writer.documents += 1
    # The separator goes between documents of a split, never before its first.
    self.pieces.append((writer, starts_document and writer.documents > 1, text))
    self.chars += len(text)
    if self.chars >= self.encode_chars:
      self.flush()

  def flush(self) -> None:
    if not self.pieces:
      return
    encodings = self.encode([t for _, _, t in self.pieces],
                            add_special_tokens=False)
    parts: dict[int, tuple[_ShardWriter, list]] = {}
    for (writer, separated, _), encoding in zip(self.pieces, encodings):
      _, arrays = parts.setdefault(id(writer), (writer, []))
      if separated:
        arrays.append(self.separator)
      arrays.append(np.asarray(encoding.ids, np.int32))
    for writer, arrays in parts.values():
      writer.write(np.concatenate(arrays))
    self.pieces, self.chars = [], 0


@dataclasses.dataclass(frozen=True)
class _Part:
  """A stretch of one file that is one document of one split."""
  name: str
  file: pathlib.Path
  held_out: bool
  chars: tuple[int, int] | None = None  # [start, end) characters; None: all.


def _corpus_parts(path: pathlib.Path, val_fraction: float, read_bytes: int,
                  progress: bool) -> list[_Part]:
  """The documents of a streamed corpus and their sides (:data:`SPLIT_RULE`)."""
  if not path.exists():
    raise DataError(f"{path}: corpus path does not exist")
  if path.is_dir():
    files = _folder_files(path)
    if not files:
      raise DataError(f"{path}: folder contains no files")
    names = [f.relative_to(path).as_posix() for f in files]
    if len(files) > 1:
      held = held_out_names(names, val_fraction)
      return [_Part(n, f, n in held) for n, f in zip(names, files)]
    path = files[0]
  # One file: count its characters (a streamed pass), cut at a line start.
  bar = _progress_bar(progress, path.stat().st_size, "count")
  total = sum(len(t) for t in iter_text(path, read_bytes, bar.update))
  bar.close()
  target, seen, cut = round((1.0 - val_fraction) * total), 0, None
  for text in iter_text(path, read_bytes):
    if seen + len(text) >= target:
      newline = text.find("\n", max(target - 1 - seen, 0))
      if newline >= 0:
        cut = seen + newline + 1
        break
    seen += len(text)
  if cut is None or cut >= total:
    raise DataError(f"{path}: the only file has no line break after its "
                    f"{1 - val_fraction:.0%} point to cut validation at")
  name = path.name
  return [_Part(f"{name} (train part)", path, False, (0, cut)),
          _Part(f"{name} (val part)", path, True, (cut, total))]


def _part_text(part: _Part, read_bytes: int, on_bytes=None) -> Iterator[str]:
  """The text of one document, streamed."""
  texts = iter_text(part.file, read_bytes, on_bytes)
  if part.chars is None:
    yield from texts
    return
  start, end = part.chars
  seen = 0
  for text in texts:
    lo, hi = max(start - seen, 0), min(end - seen, len(text))
    if lo < hi:
      yield text[lo:hi]
    seen += len(text)


def _document_pieces(part: _Part, read_bytes: int, piece_chars: int,
                     on_bytes=None) -> Iterator[str]:
  """A document's pieces (:func:`_stream_pieces`); none if it is blank."""
  texts = _part_text(part, read_bytes, on_bytes)
  # Whitespace before the first text is kept but a blank document dropped,
  # as load_corpus skips blank files.
  blank = []
  for text in texts:
    blank.append(text)
    if text.strip():
      yield from _stream_pieces(itertools.chain(blank, texts), piece_chars)
      return


def _tokenizer_sample(parts: Sequence[_Part], sample_chars: int,
                      read_bytes: int, piece_chars: int) -> list[Document]:
  """The first ``sample_chars`` characters of the training documents.

  Whole pieces (cut as for encoding), so the sample ends at a pre-tokenizer
  boundary; one :class:`Document` per training document sampled.
  """
  docs, left = [], sample_chars
  for part in parts:
    if left <= 0:
      break
    if part.held_out:
      continue
    pieces = []
    for piece in _document_pieces(part, read_bytes, piece_chars):
      pieces.append(piece)
      left -= len(piece)
      if left <= 0:
        break
    if pieces:
      docs.append(Document(part.name, "".join(pieces)))
  return docs


def _check_output(out: pathlib.Path, overwrite: bool) -> None:
  """Refuses an ``out`` that is a file, or holds anything but a prepared
  corpus, or holds one and ``overwrite`` is not set."""
  if out.exists() and not out.is_dir():
    raise DataError(f"{out}: exists and is not a folder")
  if out.is_dir() and any(out.iterdir()):
    if not overwrite:
      raise DataError(f"{out}: folder is not empty (--overwrite replaces a "
                      "prepared corpus there)")
    if not is_prepared_dir(out):
      raise DataError(f"{out}: not a prepared corpus; refusing to overwrite")


def _clear_output(out: pathlib.Path) -> None:
  """Deletes a prepared corpus in ``out`` (checked by :func:`_check_output`)."""
  # The manifest first: a half-deleted folder must not look valid.
  (out / MANIFEST_NAME).unlink(missing_ok=True)
  for old in [*out.glob("train-*.bin"), *out.glob("val-*.bin"),
              out / TOKENIZER_NAME]:
    old.unlink(missing_ok=True)
  out.mkdir(parents=True, exist_ok=True)


def prepare_corpus(
    data: str | os.PathLike | None, out: str | os.PathLike, *,
    vocab_size: int = 4096, val_fraction: float = 0.1,
    tokenizer: str | os.PathLike | None = None,
    sample_mb: float = DEFAULT_SAMPLE_MB,
    cache_dir: str | os.PathLike | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False,
    progress: bool = True, read_bytes: int = _READ_BYTES,
    piece_chars: int = _CHUNK_CHARS, encode_chars: int = _ENCODE_CHARS,
) -> dict:
  """Tokenizes a corpus of any size into memory-mappable shards, streaming.

  Steps: list the files and decide the split (:data:`SPLIT_RULE`); train the
  byte-level BPE tokenizer (:func:`train_or_load_tokenizer`, cached) on the
  first ``sample_mb`` MB of training text, or load ``tokenizer``; encode
  every document in pieces (same ids as encoding it whole, with
  :func:`separator_id` between documents) and append the ids to
  ``train-00000.bin``, ... and ``val-00000.bin``, ... (little-endian uint16
  when the vocabulary fits, else uint32); copy the tokenizer to
  ``tokenizer.json``; write ``manifest.json`` last, atomically. A folder
  without a manifest is an unfinished prepare and is never read. Memory is
  bounded by the sample and the read and encode sizes, not the corpus.

  Args:
    data: Corpus file or folder (as :func:`load_corpus`, but each file is
      one document: the works of a Shakespeare-layout file are not split);
      ``None`` is the bundled corpus.
    out: The folder to write; it must be empty or missing, or hold a
      prepared corpus and ``overwrite`` be set.
    vocab_size: Maximum vocabulary size of a trained tokenizer.
    val_fraction: Target fraction held out, in (0, 1).
    tokenizer: A ``tokenizers`` JSON file to use instead of training one
      (``vocab_size`` is then ignored).
    sample_mb: Millions of characters of training text the tokenizer is
      trained on.
    cache_dir: Tokenizer cache; ``None`` means ``<repo>/.cache/tokenizers``.
    shard_tokens: Token ids per shard file.
    overwrite: Replace a prepared corpus in ``out``.
    progress: Progress bars on stderr.
    read_bytes, piece_chars, encode_chars: Bytes read at a time, characters
      per encoded piece and per ``encode_batch`` call (memory knobs).

  Returns:
    The manifest (also in ``out/manifest.json``).

  Raises:
    DataError: Bad corpus (as :func:`load_corpus`), a split without text,
      an unusable ``out`` or ``tokenizer``.
  """
  tic = time.perf_counter()
  source = pathlib.Path(DEFAULT_CORPUS if data is None else data)
  out = pathlib.Path(out)
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
  if shard_tokens < 1:
    raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
  if source.is_dir() and out.resolve().is_relative_to(source.resolve()):
    raise DataError(f"{out}: output folder is inside the corpus folder {source}")
  _check_output(out, overwrite)  # Before the long work: refuse early.
  parts = _corpus_parts(source, val_fraction, read_bytes, progress)

  if tokenizer is not None:  # Loaded before out is cleared: it may be in it.
    tok, tokenizer_source = _load_tokenizer_file(tokenizer), str(tokenizer)
    sample_chars = 0
  else:
    sample = _tokenizer_sample(parts, int(sample_mb * 1e6), read_bytes,
                               piece_chars)
    if not sample:
      raise DataError(f"{source}: the training documents hold no text")
    sample_chars = sum(len(d.text) for d in sample)
    cached = tokenizer_cache_path(sample, vocab_size, cache_dir).is_file()
    tok = train_or_load_tokenizer(sample, vocab_size, cache_dir)
    tokenizer_source = "cache" if cached else "trained"
    del sample
  real_vocab = tok.get_vocab_size()
  dtype = "uint16" if real_vocab <= 1 << 16 else "uint32"

  _clear_output(out)
  writers = {side: _ShardWriter(out, side, dtype, shard_tokens, real_vocab)
             for side in ("train", "val")}
  encoder = _BatchEncoder(tok, encode_chars)
  chars = {"train": 0, "val": 0}
  docs = {"train": 0, "val": 0}
  val_names = []
  files = {p.file for p in parts}
  bar = _progress_bar(progress, sum(
      p.file.stat().st_size for p in parts), "encode")
  for part in parts:
    side = "val" if part.held_out else "train"
    first = True
    for piece in _document_pieces(part, read_bytes, piece_chars, bar.update):
      encoder.add(writers[side], piece, starts_document=first)
      chars[side] += len(piece)
      first = False
    if not first:
      docs[side] += 1
      if part.held_out:
        val_names.append(part.name)
  encoder.flush()
  bar.close()
  for writer in writers.values():
    writer.close()
  for side, writer in writers.items():
    if not writer.num_tokens:
      raise DataError(f"{source}: the {side} split holds no text")

  tokenizer_text = tok.to_str()
  write_atomically(out / TOKENIZER_NAME, tokenizer_text)
  train_counts, val_counts = writers["train"].counts, writers["val"].counts
  log_p = (np.log(train_counts + 1.0)
           - math.log(writers["train"].num_tokens + real_vocab))
  unigram = math.exp(-float(val_counts @ log_p) / writers["val"].num_tokens)
  manifest = {
      "format": PREPARED_FORMAT,
      "version": PREPARED_VERSION,
      "source": {"path": str(source.resolve()), "files": len(files),
                 "bytes": sum(f.stat().st_size for f in files)},
      "split": {
          "rule": SPLIT_RULE, "val_fraction": val_fraction,
          "num_train_docs": docs["train"], "num_val_docs": docs["val"],
          "train_chars": chars["train"], "val_chars": chars["val"],
          "val_names": val_names,
      },
      "tokenizer": {
          "file": TOKENIZER_NAME,
          "sha256": hashlib.sha256(tokenizer_text.encode("utf-8")).hexdigest(),
          "vocab_size": real_vocab,
          "requested_vocab_size": None if tokenizer else int(vocab_size),
          "separator_id": separator_id(tok),
          "source": tokenizer_source,
          "sample_chars": sample_chars,
      },
      "dtype": dtype,
      "byte_order": "little",
      "splits": {side: {"num_tokens": w.num_tokens, "shards": w.shards}
                 for side, w in writers.items()},
      "unigram_val_perplexity": unigram,
      "seconds": round(time.perf_counter() - tic, 1),
  }
  manifest["fingerprint"] = _manifest_fingerprint(manifest)
  write_atomically(out / MANIFEST_NAME, json.dumps(manifest, indent=1) + "\n")
  return manifest


def _load_tokenizer_file(path: str | os.PathLike):
  from tokenizers import Tokenizer  # pylint: disable=g-import-not-at-top
  try:
    tok = Tokenizer.from_file(str(path))
  except Exception as e:  # pylint: disable=broad-except
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    raise DataError(f"{path}: not a tokenizers JSON file ({message})") from None
  try:
    separator_id(tok)
  except ValueError:
    raise DataError(f"{path}: tokenizer has neither <|endoftext|> nor a "
                    "byte-level NUL token to separate documents") from None
  return tok


def _manifest_fingerprint(manifest: dict) -> str:
  """16 hex digits naming the token ids: tokenizer, dtype, shards' hashes.

  Paths, timings and where the tokenizer came from are left out, so a moved
  or re-made copy of the same tokens keeps its fingerprint.
  """
  content = {
      "tokenizer_sha256": manifest["tokenizer"]["sha256"],
      "dtype": manifest["dtype"],
      "splits": {side: [(s["file"], s["num_tokens"], s["sha256"])
                        for s in split["shards"]]
                 for side, split in sorted(manifest["splits"].items())},
  }
  return hashlib.sha256(
      json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]


class TokenShards:
  """One split of a prepared corpus: its shard files as one token stream.

  The shards are opened with ``np.memmap`` (read-only); indexing with an
  integer array reads only those positions (a window crossing from one
  shard to the next is read from both) and returns int32. It has what
  :class:`TokenDataset` and :func:`eval_batches` use of an array: ``size``,
  ``len()``, ``dtype`` and ``[int array]``.

  Args:
    files: The shard files, in order.
    dtype: ``"uint16"`` or ``"uint32"`` (little-endian).
  """

  def __init__(self, files: Sequence[str | os.PathLike], dtype: str):
    self.files = [pathlib.Path(f) for f in files]
    self._maps = [np.memmap(f, dtype=_SHARD_DTYPES[dtype], mode="r")
                  for f in self.files if os.path.getsize(f)]
    lengths = [m.size for m in self._maps]
    self._starts = np.cumsum([0] + lengths)
    self.size = int(self._starts[-1])
    self.dtype = np.dtype(np.int32)

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index) -> np.ndarray:
    if isinstance(index, slice):
      index = np.arange(*index.indices(self.size))
    index = np.asarray(index)
    if not np.issubdtype(index.dtype, np.integer):
      raise TypeError("TokenShards takes integer-array or slice indices")
    flat = index.ravel()
    if flat.size and (flat.min() < 0 or flat.max() >= self.size):
      raise IndexError(f"token index out of range [0, {self.size})")
    out = np.empty(flat.shape, np.int32)
    shard = np.searchsorted(self._starts, flat, side="right") - 1
    for s in np.unique(shard):
      mask = shard == s
      out[mask] = self._maps[s][flat[mask] - self._starts[s]]
    return out.reshape(index.shape)

  def __repr__(self) -> str:
    return f"TokenShards({len(self.files)} files, {self.size} tokens)"


@dataclasses.dataclass(frozen=True, eq=False)
class PreparedCorpus:
  """A prepared corpus opened for reading (:func:`open_prepared`).

  It has what a training run uses of :class:`PreparedData`, with the token
  streams memory-mapped instead of in memory.

  Attributes:
    path: The folder.
    manifest: Its ``manifest.json``.
    train_tokens: The training split (:class:`TokenShards`).
    val_tokens: The validation split.
    vocab_size: The tokenizer's vocabulary size; every id is below it.
    fingerprint: 16 hex digits naming the token ids (from the manifest;
      checked when a run resumes).
    info: As :attr:`PreparedData.info`, from the manifest.
  """
  path: pathlib.Path
  manifest: dict
  train_tokens: TokenShards
  val_tokens: TokenShards
  vocab_size: int
  fingerprint: str
  info: dict

  @property
  def tokenizer(self):
    """The corpus's ``tokenizers.Tokenizer`` (loaded on each access)."""
    return _load_tokenizer_file(self.path / TOKENIZER_NAME)


def is_prepared_dir(path: str | os.PathLike | None) -> bool:
  """Whether ``path`` is a prepared corpus (or an unfinished one).

  True for a folder holding ``manifest.json`` or a ``train-00000.bin``
  shard; :func:`open_prepared` then says what is wrong with it, if anything.
  """
  if path is None:
    return False
  path = pathlib.Path(path)
  return path.is_dir() and ((path / MANIFEST_NAME).is_file()
                            or (path / "train-00000.bin").is_file())


_KIND_NAMES = {int: "an integer", float: "a number", str: "a string",
               list: "a list"}


def _field(manifest: dict, dotted: str, kind, where: pathlib.Path):
  """``manifest["a"]["b"]`` for ``"a.b"``, checked to be a ``kind``.

  A float field also takes an integer; no field takes a bool.
  """
  value = manifest
  for key in dotted.split("."):
    if not isinstance(value, dict) or key not in value:
      raise DataError(f"{where}: missing field {dotted!r}")
    value = value[key]
  kinds = (int, float) if kind is float else kind
  if not isinstance(value, kinds) or isinstance(value, bool):
    shown = repr(value) if len(repr(value)) < 40 else repr(value)[:37] + "..."
    raise DataError(f"{where}: field {dotted!r} is {shown}, not "
                    f"{_KIND_NAMES[kind]}")
  return value


def open_prepared(path: str | os.PathLike,
                  max_vocab_size: int | None = None) -> PreparedCorpus:
  """Opens a corpus written by :func:`prepare_corpus`, checking its manifest.

  Checked: the manifest is there, is JSON of this format and version, with
  the fields used; every shard exists and its size is its token count times
  the dtype's size; the tokenizer file's SHA-256 and the fingerprint match;
  the vocabulary fits ``max_vocab_size``. The shards' own SHA-256 (in the
  manifest) are not re-hashed here: that would read the whole corpus.

  Args:
    path: The folder.
    max_vocab_size: The model's vocabulary size, if any.

  Returns:
    A :class:`PreparedCorpus`.

  Raises:
    DataError: One line naming the file and what is wrong.
  """
  folder = pathlib.Path(path)
  where = folder / MANIFEST_NAME
  if not folder.is_dir():
    raise DataError(f"{folder}: prepared corpus folder does not exist")
  try:
    text = where.read_text(encoding="utf-8")
  except FileNotFoundError:
    raise DataError(f"{folder}: no {MANIFEST_NAME} (not a prepared corpus, or "
                    "its prepare did not finish)") from None
  except (OSError, UnicodeDecodeError) as e:
    raise DataError(f"{where}: cannot read ({e})") from None
  try:
    manifest = json.loads(text)
  except json.JSONDecodeError as e:
    raise DataError(f"{where}: not valid JSON ({e.msg} at line {e.lineno})"
                    ) from None
  if not isinstance(manifest, dict) or manifest.get("format") != PREPARED_FORMAT:
    raise DataError(f"{where}: not a prepared-corpus manifest "
                    f"(no \"format\": {PREPARED_FORMAT!r})")
  version = manifest.get("version")
  if version != PREPARED_VERSION:
    raise DataError(f"{where}: format version {version!r}; this code reads "
                    f"version {PREPARED_VERSION} (prepare the corpus again)")
  dtype = _field(manifest, "dtype", str, where)
  if dtype not in _SHARD_DTYPES:
    raise DataError(f"{where}: dtype {dtype!r} is not one of "
                    f"{', '.join(_SHARD_DTYPES)}")
  vocab = _field(manifest, "tokenizer.vocab_size", int, where)
  if vocab > np.iinfo(dtype).max + 1:
    raise DataError(f"{where}: vocabulary of {vocab} does not fit {dtype}")
  if max_vocab_size is not None and vocab > max_vocab_size:
    raise DataError(f"{folder}: vocabulary of {vocab} tokens exceeds the "
                    f"model's vocab_size {max_vocab_size} (prepare it with "
                    f"--vocab-size {max_vocab_size})")
  streams = {}
  for side in ("train", "val"):
    shards = _field(manifest, f"splits.{side}.shards", list, where)
    total = _field(manifest, f"splits.{side}.num_tokens", int, where)
    files = []
    for shard in shards:
      name = _field({"shard": shard}, "shard.file", str, where)
      count = _field({"shard": shard}, "shard.num_tokens", int, where)
      _field({"shard": shard}, "shard.sha256", str, where)
      file = folder / name
      if pathlib.Path(name).name != name:
        raise DataError(f"{where}: shard name {name!r} is not a file name")
      if not file.is_file():
        raise DataError(f"{file}: shard listed in the manifest is missing")
      expected = count * np.dtype(dtype).itemsize
      if file.stat().st_size != expected:
        raise DataError(
            f"{file}: {file.stat().st_size} bytes, but the manifest says "
            f"{count} {dtype} tokens ({expected} bytes)")
      files.append(file)
    if sum(s["num_tokens"] for s in shards) != total:
      raise DataError(f"{where}: the {side} shards hold "
                      f"{sum(s['num_tokens'] for s in shards)} tokens, the "
                      f"manifest says {total}")
    if total < 1:
      raise DataError(f"{where}: the {side} split is empty")
    streams[side] = TokenShards(files, dtype)
  tokenizer_file = folder / _field(manifest, "tokenizer.file", str, where)
  try:
    tokenizer_bytes = tokenizer_file.read_bytes()
  except OSError as e:
    raise DataError(f"{tokenizer_file}: cannot read ({e.strerror or e})"
                    ) from None
  digest = hashlib.sha256(tokenizer_bytes).hexdigest()
  if digest != _field(manifest, "tokenizer.sha256", str, where):
    raise DataError(f"{tokenizer_file}: SHA-256 {digest[:16]}... does not "
                    "match the manifest's (tokenizer replaced?)")
  fingerprint = _field(manifest, "fingerprint", str, where)
  if _manifest_fingerprint(manifest) != fingerprint:
    raise DataError(f"{where}: fingerprint {fingerprint} does not match the "
                    "manifest's contents (edited by hand?)")
  split = manifest.get("split", {})
  chars = (split.get("train_chars", 0), split.get("val_chars", 0))
  info = {
      "path": str(folder),
      "prepared": True,
      "num_train_docs": split.get("num_train_docs"),
      "num_val_docs": split.get("num_val_docs"),
      "val_names": split.get("val_names", []),
      "train_chars": chars[0],
      "val_chars": chars[1],
      "val_char_fraction": chars[1] / sum(chars) if sum(chars) else None,
      "train_num_tokens": streams["train"].size,
      "val_num_tokens": streams["val"].size,
      "requested_vocab_size": manifest["tokenizer"].get("requested_vocab_size"),
      "vocab_size": vocab,
      "separator_id": manifest["tokenizer"].get("separator_id"),
      "tokenizer_path": str(tokenizer_file),
      "unigram_val_perplexity": _field(manifest, "unigram_val_perplexity",
                                       float, where),
      "dtype": dtype,
      "fingerprint": fingerprint,
  }
  return PreparedCorpus(folder, manifest, streams["train"], streams["val"],
                        vocab, fingerprint, info)


def build_parser() -> argparse.ArgumentParser:
  """The ``python -m experiments.data`` command line: three subcommands."""
  parser = argparse.ArgumentParser(
      prog="python -m experiments.data", description=__doc__.splitlines()[0])
  commands = parser.add_subparsers(dest="command", required=True)
  info = commands.add_parser(
      "info", help="load, split and tokenize a corpus in memory; print its "
      "statistics as JSON (the default command)")
  info.add_argument("--path", default=None,
                    help="corpus file or folder (default: bundled)")
  info.add_argument("--vocab-size", type=int, default=4096)
  info.add_argument("--cache-dir", default=None)
  info.add_argument("--val-fraction", type=float, default=0.1)

  prepare = commands.add_parser(
      "prepare", help="tokenize a corpus of any size into memory-mapped "
      "shards plus a manifest (streamed, bounded memory)")
  prepare.add_argument("--data", default=None,
                       help="corpus file or folder (default: bundled)")
  prepare.add_argument("--out", required=True, help="folder to write")
  prepare.add_argument("--vocab-size", type=int, default=4096)
  prepare.add_argument("--val-fraction", type=float, default=0.1)
  prepare.add_argument("--tokenizer", default=None,
                       help="use this tokenizers JSON file instead of training")
  prepare.add_argument("--tokenizer-sample-mb", type=float,
                       default=DEFAULT_SAMPLE_MB,
                       help="train the tokenizer on the first this many million "
                       f"characters of training text (default {DEFAULT_SAMPLE_MB})")
  prepare.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                       help=f"token ids per shard (default {DEFAULT_SHARD_TOKENS})")
  prepare.add_argument("--cache-dir", default=None, help="tokenizer cache")
  prepare.add_argument("--overwrite", action="store_true",
                       help="replace a prepared corpus in --out")
  prepare.add_argument("--no-progress", action="store_true")

  generate = commands.add_parser(
      "generate", help="write a synthetic corpus by resampling the lines of "
      "the bundled one (for scale tests)")
  generate.add_argument("--out", required=True, help="folder to write")
  generate.add_argument("--gb", type=float, required=True,
                        help="size in GB (10**9 bytes)")
  generate.add_argument("--file-mb", type=float, default=8.0,
                        help="size of each file in MB (default 8)")
  generate.add_argument("--seed", type=int, default=0)
  generate.add_argument("--no-progress", action="store_true")
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Command line: ``info`` (default), ``prepare`` or ``generate``.

  Bad input prints one line ``error: ...`` and returns 2.
  """
  argv = list(sys.argv[1:] if argv is None else argv)
  if not argv or argv[0] not in ("info", "prepare", "generate", "-h", "--help"):
    argv.insert(0, "info")  # The command line before subcommands.
  args = build_parser().parse_args(argv)
  try:
    if args.command == "info":
      data = prepare_data(args.path, args.vocab_size, args.cache_dir,
                          args.val_fraction)
      print(json.dumps(data.info, indent=2))
    elif args.command == "generate":
      files = generate_corpus(args.out, int(args.gb * 1e9), seed=args.seed,
                              file_bytes=int(args.file_mb * 1e6),
                              progress=not args.no_progress)
      size = sum(f.stat().st_size for f in files)
      print(f"wrote {len(files)} files, {size:,} bytes, to {args.out}")
    else:
      manifest = prepare_corpus(
          args.data, args.out, vocab_size=args.vocab_size,
          val_fraction=args.val_fraction, tokenizer=args.tokenizer,
          sample_mb=args.tokenizer_sample_mb, cache_dir=args.cache_dir,
          shard_tokens=args.shard_tokens, overwrite=args.overwrite,
          progress=not args.no_progress)
      splits, split = manifest["splits"], manifest["split"]
      tok = manifest["tokenizer"]
      docs = split["num_train_docs"] + split["num_val_docs"]
      print(f"prepared {args.out}: {splits['train']['num_tokens']:,} train and "
            f"{splits['val']['num_tokens']:,} validation tokens "
            f"({manifest['dtype']}; {split['num_val_docs']} of {docs} documents "
            f"held out), vocabulary {tok['vocab_size']} ({tok['source']}), "
            f"{manifest['seconds']} s")
  except (ValueError, OSError) as err:
    print(f"error: {err}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
