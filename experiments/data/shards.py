"""Prepared corpora: a corpus of any size streamed once into token shards and a manifest, read back through ``np.memmap``."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
import os
import pathlib
import time
from typing import Iterator, Sequence

import numpy as np

from experiments.training.metrics_log import write_atomically
from experiments.data.corpus import DEFAULT_CORPUS, READ_BYTES, SPLIT_RULE, DataError, Document
from experiments.data.corpus import WHOLE_FILE_BYTES, cut_point, file_documents, folder_files
from experiments.data.corpus import held_out_names, iter_text, read_text, unique_names
from experiments.data.tokenizer import CHUNK_CHARS, ENCODE_CHARS, load_tokenizer_file, separator_id
from experiments.data.tokenizer import stream_pieces, tokenizer_cache_path, train_or_load_tokenizer


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
_SHARD_DTYPES = {"uint16": "<u2", "uint32": "<u4"}


class _NoBar:
  """What is used of a tqdm bar, doing nothing."""

  def update(self, n=1):
    pass

  def close(self):
    pass


def progress_bar(enabled: bool, total: int, desc: str):
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
  chars: tuple[int, int]  # [start, end) characters of the file's text
  whole: bool  # the file is read whole (WHOLE_FILE_BYTES), else streamed


class _WholeFiles:
  """The text of the file last read whole: a pass meets a file's parts one after another."""

  def __init__(self, on_bytes=None):
    self.file, self.text, self.on_bytes = None, "", on_bytes

  def text_of(self, file: pathlib.Path) -> str:
    if file != self.file:
      self.file, self.text = file, read_text(file)
      if self.on_bytes is not None:
        self.on_bytes(file.stat().st_size)
    return self.text


def _corpus_parts(path: pathlib.Path, val_fraction: float, read_bytes: int,
                  progress: bool) -> list[_Part]:
  """The documents of a streamed corpus and their sides (:data:`SPLIT_RULE`).

  The documents are :func:`~experiments.data.corpus.load_corpus` 's, found in
  one counting pass (a file up to ``WHOLE_FILE_BYTES`` read whole, a larger
  one streamed), and split by the rule :func:`split_documents` applies in
  memory.
  """
  if not path.exists():
    raise DataError(f"{path}: corpus path does not exist")
  files = folder_files(path) if path.is_dir() else [path]
  if path.is_dir() and not files:
    raise DataError(f"{path}: folder contains no files")
  bar = progress_bar(progress, sum(f.stat().st_size for f in files), "count")
  parts = []
  for file in files:
    name = file.relative_to(path).as_posix() if path.is_dir() else file.name
    size = file.stat().st_size
    if size <= WHOLE_FILE_BYTES:
      text = read_text(file)
      bar.update(size)
      if not text.strip():
        continue
      start = 0
      for doc in file_documents(text, name, size):
        parts.append(_Part(doc.name, file, False, (start, start + len(doc.text)), True))
        start += len(doc.text)
    else:
      total, blank = 0, True
      for text in iter_text(file, read_bytes, bar.update):
        total += len(text)
        blank = blank and not text.strip()
      if not blank:
        parts.append(_Part(name, file, False, (0, total), False))
  bar.close()
  if not parts:
    raise DataError(f"{path}: folder contains no text files ({len(files)} non-hidden "
                    "files, none with text)" if path.is_dir() else
                    f"{path}: corpus is empty (no text)")
  names = unique_names([Document(p.name, "") for p in parts])
  parts = [dataclasses.replace(p, name=d.name) for p, d in zip(parts, names)]
  if len(parts) > 1:
    held = held_out_names([(p.name, p.chars[1] - p.chars[0]) for p in parts], val_fraction)
    return [dataclasses.replace(p, held_out=p.name in held) for p in parts]
  (part,) = parts
  start, end = part.chars
  cut = cut_point(_part_text(part, read_bytes, whole=_WholeFiles()), end - start, val_fraction)
  if cut is None:
    raise DataError(f"{path}: the only document has no line break after its "
                    f"{1 - val_fraction:.0%} point to cut validation at")
  return [dataclasses.replace(part, name=f"{part.name} (train part)", chars=(start, start + cut)),
          dataclasses.replace(part, name=f"{part.name} (val part)", held_out=True,
                              chars=(start + cut, end))]


def _part_text(part: _Part, read_bytes: int, on_bytes=None, *,
               whole: _WholeFiles) -> Iterator[str]:
  """The text of one document, streamed (``whole`` holds the file last read whole)."""
  start, end = part.chars
  if part.whole:
    yield whole.text_of(part.file)[start:end]
    return
  seen = 0
  for text in iter_text(part.file, read_bytes, on_bytes):
    lo, hi = max(start - seen, 0), min(end - seen, len(text))
    if lo < hi:
      yield text[lo:hi]
    seen += len(text)


def _document_pieces(part: _Part, read_bytes: int, piece_chars: int,
                     on_bytes=None, *, whole: _WholeFiles) -> Iterator[str]:
  """A document's pieces (:func:`stream_pieces`); none if it is blank."""
  texts = _part_text(part, read_bytes, on_bytes, whole=whole)
  # Whitespace before the first text is kept but a blank document dropped,
  # as load_corpus skips blank files.
  blank = []
  for text in texts:
    blank.append(text)
    if text.strip():
      yield from stream_pieces(itertools.chain(blank, texts), piece_chars)
      return


def _tokenizer_sample(parts: Sequence[_Part], sample_chars: int,
                      read_bytes: int, piece_chars: int) -> list[Document]:
  """The first ``sample_chars`` characters of the training documents.

  Whole pieces (cut as for encoding), so the sample ends at a pre-tokenizer
  boundary; one :class:`Document` per training document sampled.
  """
  docs, left, whole = [], sample_chars, _WholeFiles()
  for part in parts:
    if left <= 0:
      break
    if part.held_out:
      continue
    pieces = []
    for piece in _document_pieces(part, read_bytes, piece_chars, whole=whole):
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
    progress: bool = True, read_bytes: int = READ_BYTES,
    piece_chars: int = CHUNK_CHARS, encode_chars: int = ENCODE_CHARS,
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
    tok, tokenizer_source = load_tokenizer_file(tokenizer), str(tokenizer)
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
  files = folder_files(source) if source.is_dir() else [source]  # blank ones too
  bar = progress_bar(progress, sum(f.stat().st_size for f in {p.file for p in parts}), "encode")
  whole = _WholeFiles(bar.update)
  for part in parts:
    side = "val" if part.held_out else "train"
    first = True
    for piece in _document_pieces(part, read_bytes, piece_chars, bar.update, whole=whole):
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
    return load_tokenizer_file(self.path / TOKENIZER_NAME)


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
