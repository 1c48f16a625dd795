"""Byte-level BPE: training on the training documents, the on-disk cache, encoding in safe pieces."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
from typing import Iterator, Sequence

import numpy as np

from experiments.training.metrics_log import write_atomically
from experiments.data.corpus import REPO_ROOT, DataError, Document


DEFAULT_CACHE_DIR = REPO_ROOT / ".cache" / "tokenizers"

EOT_TOKEN = "<|endoftext|>"
NUM_BYTES = 256
# ByteLevel maps byte b to a printable character; byte 0 becomes U+0100.
_NUL_BYTE_TOKEN = "\u0100"

# Bump when the tokenizer recipe changes, so old cache entries are not reused.
_TOKENIZER_RECIPE = {
    "recipe_version": 1,
    "model": "BPE",
    "pre_tokenizer": "ByteLevel(add_prefix_space=False, use_regex=True)",
    "decoder": "ByteLevel",
    "initial_alphabet": "all 256 bytes",
    "min_frequency": 2,
}
CHUNK_CHARS = 1 << 16

# A newline between two printable ASCII characters is always a boundary of
# the ByteLevel pre-tokenizer, so text may be cut right after it without
# changing the encoding (lets long documents be encoded in parallel).
_SAFE_CUT_RE = re.compile(r"(?<=[!-~])\n(?=[!-~])")
ENCODE_CHARS = 1 << 22  # Characters per encode_batch call.
# A piece is cut at a safe line end once it is this many times the piece size
# without one; then at a single space between two non-space characters (also
# a pre-tokenizer boundary), and failing that anywhere.
_MAX_PIECES_WITHOUT_CUT = 256
_SPACE_CUT_RE = re.compile(r"(?<=\S) (?=\S)")


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


def _chunks(text: str, size: int = CHUNK_CHARS) -> Iterator[str]:
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



def stream_pieces(texts: Iterator[str], piece_chars: int) -> Iterator[str]:
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



def load_tokenizer_file(path: str | os.PathLike):
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
