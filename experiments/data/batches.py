"""Token streams as batches: stateless training windows, evaluation batches, the unigram baseline, and the in-memory pipeline in one call."""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Iterator

import numpy as np

from experiments.data.corpus import DEFAULT_CORPUS, DataError, load_corpus, split_documents
from experiments.data.shards import TokenShards
from experiments.data.tokenizer import encode_documents, separator_id, tokenizer_cache_path
from experiments.data.tokenizer import train_or_load_tokenizer


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
