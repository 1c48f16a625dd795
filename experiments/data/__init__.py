"""Text data pipeline: corpus loading, held-out split, byte-level BPE, batches.

Modules: :mod:`~experiments.data.corpus` (documents and the held-out split),
:mod:`~experiments.data.tokenizer` (byte-level BPE and its cache),
:mod:`~experiments.data.batches` (batches, the unigram baseline, the in-memory
pipeline), :mod:`~experiments.data.shards` (prepared corpora),
:mod:`~experiments.data.synthetic` (a generated corpus) and the command line
(``__main__``). Their public names are importable from here.

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

:func:`prepare_corpus` reads the files in blocks (:func:`iter_text`), holds
out the same documents :func:`split_documents` holds out in memory (one rule,
:data:`SPLIT_RULE`: :func:`held_out_names` of several documents,
:func:`cut_point` of one; a file of at most :data:`WHOLE_FILE_BYTES` is read
whole to find its works), trains the tokenizer on
the first ``--tokenizer-sample-mb`` million characters of training text (or
reuses a cached or given one), encodes in pieces cut at pre-tokenizer
boundaries (the same ids as encoding each document whole) and appends them to
``train-00000.bin``, ..., ``val-00000.bin``, ... (little-endian uint16 when the
vocabulary fits, else uint32). ``tokenizer.json`` and ``manifest.json``
(format version, split rule and counts, tokenizer hash, dtype, shards with
token counts and SHA-256, unigram baseline, fingerprint) are written last, the
manifest atomically. Memory is bounded by the sample size and the largest
file read whole (:data:`WHOLE_FILE_BYTES`), not by the corpus. :func:`open_prepared` checks the manifest (one-line
:class:`DataError` otherwise) and maps the shards with ``np.memmap``
(:class:`TokenShards`); :class:`TokenDataset` and :func:`eval_batches` take
them as they take an array and read only the windows they use, so batch
``step`` is still a pure function of ``(seed, step)``.
``python -m experiments.data generate --out PATH --gb 2`` writes a synthetic
corpus (resampled lines of the bundled one) to try it at scale.

Nothing here touches the network.
"""

from __future__ import annotations

from experiments.data.corpus import (
    REPO_ROOT,
    DEFAULT_CORPUS,
    DataError,
    Document,
    load_corpus,
    read_text,
    split_works,
    folder_files,
    split_documents,
    READ_BYTES,
    SPLIT_RULE,
    iter_text,
    held_out_names,
    cut_point,
    file_documents,
    unique_names,
    WHOLE_FILE_BYTES,
)
from experiments.data.tokenizer import (
    DEFAULT_CACHE_DIR,
    EOT_TOKEN,
    NUM_BYTES,
    CHUNK_CHARS,
    ENCODE_CHARS,
    tokenizer_cache_path,
    train_or_load_tokenizer,
    separator_id,
    encode_documents,
    stream_pieces,
    load_tokenizer_file,
)
from experiments.data.batches import (
    PreparedData,
    TokenDataset,
    eval_batches,
    unigram_perplexity,
    prepare_data,
)
from experiments.data.shards import (
    MANIFEST_NAME,
    TOKENIZER_NAME,
    PREPARED_FORMAT,
    PREPARED_VERSION,
    DEFAULT_SAMPLE_MB,
    DEFAULT_SHARD_TOKENS,
    progress_bar,
    prepare_corpus,
    TokenShards,
    PreparedCorpus,
    is_prepared_dir,
    open_prepared,
)
from experiments.data.synthetic import (
    generate_corpus,
)

__all__ = [
    "REPO_ROOT",
    "DEFAULT_CORPUS",
    "DataError",
    "Document",
    "load_corpus",
    "read_text",
    "split_works",
    "folder_files",
    "split_documents",
    "READ_BYTES",
    "SPLIT_RULE",
    "iter_text",
    "held_out_names",
    "cut_point",
    "file_documents",
    "unique_names",
    "WHOLE_FILE_BYTES",
    "DEFAULT_CACHE_DIR",
    "EOT_TOKEN",
    "NUM_BYTES",
    "CHUNK_CHARS",
    "ENCODE_CHARS",
    "tokenizer_cache_path",
    "train_or_load_tokenizer",
    "separator_id",
    "encode_documents",
    "stream_pieces",
    "load_tokenizer_file",
    "PreparedData",
    "TokenDataset",
    "eval_batches",
    "unigram_perplexity",
    "prepare_data",
    "MANIFEST_NAME",
    "TOKENIZER_NAME",
    "PREPARED_FORMAT",
    "PREPARED_VERSION",
    "DEFAULT_SAMPLE_MB",
    "DEFAULT_SHARD_TOKENS",
    "progress_bar",
    "prepare_corpus",
    "TokenShards",
    "PreparedCorpus",
    "is_prepared_dir",
    "open_prepared",
    "generate_corpus",
]
