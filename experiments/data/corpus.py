"""Corpora: documents read from files (plain or ``.xz``), and the held-out split of whole documents."""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import lzma
import os
import pathlib
import re
from typing import Iterable, Iterator, Sequence




REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_CORPUS = REPO_ROOT / "data" / "shakespeare.txt.xz"

_XZ_MAGIC = b"\xfd7zXZ\x00"

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
    docs = file_documents(text, path.name, path.stat().st_size)
  return unique_names(docs)


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


def folder_files(folder: pathlib.Path) -> list[pathlib.Path]:
  """Every non-hidden file below ``folder``, sorted by relative path."""
  return sorted(
      (p for p in folder.rglob("*")
       if p.is_file() and not any(
           part.startswith(".") for part in p.relative_to(folder).parts)),
      key=lambda p: p.relative_to(folder).as_posix())


def _load_folder(folder: pathlib.Path) -> list[Document]:
  files = folder_files(folder)
  docs = []
  for file in files:
    text = read_text(file)
    if text.strip():
      docs += file_documents(text, file.relative_to(folder).as_posix(), file.stat().st_size)
  if not docs:
    raise DataError(f"{folder}: folder contains no text files "
                    f"({len(files)} non-hidden files, none with text)")
  return docs


# A file up to this size on disk is read whole and split into its works
# (split_works); a larger one is one document, so that a corpus of any size
# can be streamed. The same rule in memory (load_corpus) and when prepared.
WHOLE_FILE_BYTES = 64 << 20


def file_documents(text: str, name: str, size: int) -> list[Document]:
  """One file's documents: its works if it is at most :data:`WHOLE_FILE_BYTES`
  on disk, else the whole file as one document named ``name``."""
  return split_works(text, name=name) if size <= WHOLE_FILE_BYTES else [Document(name, text)]


def unique_names(docs: list[Document]) -> list[Document]:
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

  The rule is :data:`SPLIT_RULE`, the one a prepared corpus is split by
  (:func:`held_out_names` for several documents, :func:`cut_point` for one):
  the same corpus has the same held-out documents in memory and prepared.
  The parts of a single document are named ``"<name> (train part)"`` and
  ``"<name> (val part)"``.

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
  val_names = held_out_names([(d.name, len(d.text)) for d in docs], val_fraction)
  train = [d for d in docs if d.name not in val_names]
  val = [d for d in docs if d.name in val_names]
  return train, val


def _name_hash(name: str) -> str:
  return hashlib.sha256(name.encode("utf-8")).hexdigest()


def held_out_names(lengths: Sequence[tuple[str, int]], val_fraction: float) -> set:
  """The documents held out of several (:data:`SPLIT_RULE`), in memory and prepared.

  Args:
    lengths: ``(name, characters)`` of each document (names unique, at
      least two documents).
    val_fraction: Target fraction of characters held out, in (0, 1).

  Returns:
    The held-out names.

  Example:
    >>> held_out_names([("a", 900), ("b", 60), ("c", 40)], 0.1)
    {'b'}
  """
  if not 0.0 < val_fraction < 1.0:
    raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
  lengths = list(lengths)
  target = val_fraction * sum(n for _, n in lengths)
  ordered = sorted(lengths, key=lambda item: _name_hash(item[0]))
  chosen, val_chars = set(), 0
  for name, chars in ordered[:-1]:
    if val_chars + chars / 2 > target:
      break
    chosen.add(name)
    val_chars += chars
  if not chosen:  # The first one overshoots: take the closest to target.
    chosen.add(min(ordered, key=lambda item: abs(item[1] - target))[0])
  return chosen


def cut_point(texts: Iterable[str], total: int, val_fraction: float) -> int | None:
  """Where a single document is cut (:data:`SPLIT_RULE`): the first line start at
  or after its ``(1 − val_fraction)`` character point, or ``None`` if there is none.

  Args:
    texts: The document's text in pieces (streamed, or ``[text]``).
    total: Its length in characters.
    val_fraction: Target fraction held out, in (0, 1).

  Example:
    >>> cut_point(["ab\ncd\nef\n"], 9, 0.5)
    6
  """
  target, seen = round((1.0 - val_fraction) * total), 0
  for text in texts:
    if seen + len(text) >= target:
      newline = text.find("\n", max(target - 1 - seen, 0))
      if newline >= 0:
        cut = seen + newline + 1
        return cut if cut < total else None
    seen += len(text)
  return None


def _split_single(doc: Document, val_fraction: float):
  cut = cut_point([doc.text], len(doc.text), val_fraction)
  if cut is None or not doc.text[:cut].strip() or not doc.text[cut:].strip():
    raise DataError(
        f"{doc.name}: the only document is too short to split for validation (it needs "
        f"a line break after its {1 - val_fraction:.0%} point, with text on both sides)")
  return ([Document(f"{doc.name} (train part)", doc.text[:cut])],
          [Document(f"{doc.name} (val part)", doc.text[cut:])])


READ_BYTES = 1 << 22  # Bytes read from a file at a time.
SPLIT_RULE = (
    "documents are files (relative paths, in sorted order; blank files skipped), "
    "except that a file of at most 64 MiB on disk in the Shakespeare layout is "
    "split into its works (named by their titles; repeated names get ' #2', ...); "
    "the documents are ordered by the SHA-256 hex digest of their names and the "
    "longest prefix of that order is held out whose next document would not bring "
    "the held-out characters closer to val_fraction of all (at least one "
    "document on each side; if even the first overshoots, the document whose "
    "length is closest to that target); a corpus of one document is cut at the "
    "first line start at or after the (1 - val_fraction) character point, the "
    "rest held out")




def iter_text(path: str | os.PathLike, read_bytes: int = READ_BYTES,
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



