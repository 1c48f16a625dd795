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

Nothing here touches the network.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import lzma
import math
import os
import pathlib
import re
import tempfile
import time
from typing import Iterator, Sequence

import numpy as np

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


def _load_folder(folder: pathlib.Path) -> list[Document]:
  files = sorted(
      (p for p in folder.rglob("*")
       if p.is_file() and not any(
           part.startswith(".") for part in p.relative_to(folder).parts)),
      key=lambda p: p.relative_to(folder).as_posix())
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
  _atomic_write(path, tokenizer.to_str())
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


def _atomic_write(path: pathlib.Path, text: str) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      f.write(text)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared.
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise


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
    tokens: 1-D integer token stream (the training split).
    seq_len: Tokens per row.
    batch_size: Rows per batch.
    seed: Non-negative integer seed.
  """
  tokens: np.ndarray
  seq_len: int
  batch_size: int
  seed: int = 0

  def __post_init__(self):
    tokens = np.asarray(self.tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f"tokens must be a 1-D integer array, got "
                       f"shape {tokens.shape} dtype {tokens.dtype}")
    if self.seq_len < 1 or self.batch_size < 1:
      raise ValueError(f"seq_len and batch_size must be >= 1, got "
                       f"{self.seq_len} and {self.batch_size}")
    if tokens.size < self.seq_len + 1:
      raise DataError(f"only {tokens.size} tokens, need at least "
                      f"seq_len + 1 = {self.seq_len + 1}")
    if self.seed < 0:
      raise ValueError(f"seed must be non-negative, got {self.seed}")
    object.__setattr__(self, "tokens", tokens.astype(np.int32, copy=False))

  def batch_at(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """The batch of training step ``step``.

    Args:
      step: Non-negative step index.

    Returns:
      ``(inputs, targets)``, int32 arrays of shape ``[batch_size, seq_len]``
      with ``targets[:, t] == inputs[:, t + 1]`` (the next tokens).
    """
    if step < 0:
      raise ValueError(f"step must be non-negative, got {step}")
    rng = np.random.default_rng([int(self.seed), int(step)])
    starts = rng.integers(0, self.tokens.size - self.seq_len,
                          size=self.batch_size)
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


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int):
  window = tokens[starts[:, None] + np.arange(seq_len + 1)]
  return window[:, :-1], window[:, 1:]


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
    val_tokens: 1-D integer token stream (the validation split).
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
  tokens = np.asarray(val_tokens).astype(np.int32, copy=False)
  if tokens.ndim != 1:
    raise ValueError(f"val_tokens must be 1-D, got shape {tokens.shape}")
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


def main(argv: Sequence[str] | None = None) -> None:
  """Command line: prepares a corpus and prints ``info`` as JSON."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--path", default=None,
                      help="corpus file or folder (default: bundled)")
  parser.add_argument("--vocab-size", type=int, default=4096)
  parser.add_argument("--cache-dir", default=None)
  parser.add_argument("--val-fraction", type=float, default=0.1)
  args = parser.parse_args(argv)
  data = prepare_data(args.path, args.vocab_size, args.cache_dir,
                      args.val_fraction)
  print(json.dumps(data.info, indent=2))


if __name__ == "__main__":
  main()
