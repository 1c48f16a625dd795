"""Corpora: documents read from files (plain or ``.xz``), and the held-out split of whole documents."""

from __future__ import annotations

import codecs
import dataclasses
import hashlib
import lzma
import os
import pathlib
import re
from typing import Iterator, Sequence




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



READ_BYTES = 1 << 22  # Bytes read from a file at a time.
SPLIT_RULE = (
    "documents are files (relative paths, in sorted order); a document is "
    "held out for validation when the first 8 bytes of the SHA-256 of its "
    "name, read as a big-endian integer and divided by 2**64, are below "
    "val_fraction (at least one document stays on each side: the lowest "
    "value is held out if none is, the highest kept if all are); a corpus of "
    "one file is cut at the first line start at or after the (1 - "
    "val_fraction) character point, the rest held out")




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
