"""Corpus → tokenizer → Megatron indexed dataset → megatron-core GPT/BERT datasets.

Input formats: what :func:`jobruntime.documents.read_documents` reads (JSONL, text
files, folders, saved Hugging Face datasets); a Megatron indexed dataset
(``PREFIX.bin``/``PREFIX.idx``) is used as is.

Tokenised corpora are cached as indexed datasets under ``data.cache_dir``,
keyed by the corpus, tokenizer and model family.  GPT datasets store one
sequence per document (tokens + end-of-document); BERT datasets store one
sequence per non-empty line, grouped into documents, as megatron-core's
``BERTMaskedWordPieceDataset`` expects.

The validation split holds out every ``val_every``-th *document* (never lines
shuffled across documents), by passing disjoint document indices to
megatron-core's ``GPTDataset`` / ``BERTMaskedWordPieceDataset``.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .config import DataConfig, ModelConfig
from .documents import DataError, is_indexed_prefix, read_documents, resolve_data_path
from .logging_utils import phase
from .tokenizer import (
    Tokenizer,
    TokenizerError,
    check_specials,
    corpus_fingerprint,
    load_tokenizer,
    train_sentencepiece,
)

log = logging.getLogger("jobruntime")


def val_document_mask(num_docs: int, val_every: int) -> np.ndarray:
    """Boolean mask over documents: True for every ``val_every``-th (held out)."""
    if val_every < 2:
        raise DataError(f"data.val_every must be >= 2, got {val_every}")
    idx = np.arange(num_docs)
    return (idx % val_every) == (val_every - 1)


def split_documents(num_docs: int, val_every: int, *, source: str | Path,
                    option: str = "data.val_every", limit: str | None = None) -> np.ndarray:
    """The held-out mask of a corpus of ``num_docs`` documents (:func:`val_document_mask`),
    refused where a split would be empty.

    Both users of the split call it: ``train.py`` (:func:`prepare_corpus`, which needs
    both splits: megatron's samplers loop forever on an empty one) and
    ``tools/prepare_data.py``, which calls it before it writes anything, so that it
    never leaves a corpus that ``train.py`` then refuses.

    Args:
        num_docs: documents in the corpus.
        val_every: every ``val_every``-th document (by position) is held out.
        source: the corpus, for the message.
        option: the setting that gave ``val_every`` (``data.val_every``,
            ``--val-every``), for the message.
        limit: the setting that capped the document count where one did
            (``data.max_documents``, ``--max-documents``), for the message.

    Returns:
        Boolean array of shape ``(num_docs,)``, True for a validation document.

    Raises:
        DataError: ``val_every < 2``, or no training or no validation document (fewer
            than ``val_every`` documents); the message names the counts and the setting
            to change.
    """
    if val_every < 2:
        raise DataError(f"{option} must be >= 2 (every {option.lstrip('-')}-th document is "
                        f"held out for validation), got {val_every}")
    held = val_document_mask(num_docs, val_every)
    n_val = int(held.sum())
    if n_val == 0 or n_val == num_docs:
        more = f" (raise {limit})" if limit else ""
        raise DataError(
            f"{source}: {num_docs} document(s) with {option}={val_every} leave "
            f"{num_docs - n_val} for training and {n_val} for validation; give at least "
            f"{val_every} documents{more} or lower {option} (>= 2)")
    return held


def tokenize_documents(docs: list[str], tokenizer: Tokenizer, bert: bool) -> list[list[list[int]]]:
    """Token sequences of each document, as the indexed dataset stores them.

    GPT: one sequence per document, its ids followed by ``tokenizer.eod``.
    BERT: one sequence per non-empty line (``[sep]`` for a document without tokens).
    """
    if bert:
        out = []
        for d in docs:
            lines = [ln for ln in d.splitlines() if ln.strip()]
            out.append([s for s in tokenizer.encode(lines) if s] or [[tokenizer.sep]])
        return out
    return [[ids + [tokenizer.eod]] for ids in tokenizer.encode(docs)]


def write_indexed(seqs_per_doc, prefix: Path, vocab_size: int) -> None:
    """Write an indexed dataset atomically (temp names, then rename both files).

    Args:
        seqs_per_doc: iterable (may be a generator) of documents, each a list
            of token sequences (see :func:`tokenize_documents`).
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    dtype = np.uint16 if vocab_size <= 65536 else np.int32
    tmp = Path(f"{prefix}.tmp{os.getpid()}")
    builder = IndexedDatasetBuilder(f"{tmp}.bin", dtype=dtype)
    for seqs in seqs_per_doc:
        flat = [t for s in seqs for t in s]
        builder.add_document(flat, [len(s) for s in seqs])
    builder.finalize(f"{tmp}.idx")
    os.replace(f"{tmp}.bin", f"{prefix}.bin")
    os.replace(f"{tmp}.idx", f"{prefix}.idx")


@dataclass
class Corpus:
    """A tokenised corpus ready for sampling.

    Attributes:
        tokenizer: the tokenizer used.
        prefix: indexed-dataset path prefix (``.bin``/``.idx``).
        train_docs / val_docs: document indices (int64 arrays) of each split.
    """

    tokenizer: Tokenizer
    prefix: Path
    train_docs: np.ndarray
    val_docs: np.ndarray


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _on_rank0(fn) -> None:
    """Run ``fn()`` on rank 0 while the other ranks wait; re-raise its input
    error on every rank (so no rank is left in a barrier that rank 0 skipped,
    and every rank exits with the same one-line error)."""
    error = None
    if _rank() == 0:
        try:
            fn()
        except (DataError, TokenizerError) as e:
            error = (type(e).__name__, str(e))
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [error]
        dist.broadcast_object_list(box, src=0)
        error = box[0]
    if error is not None:
        raise (TokenizerError if error[0] == "TokenizerError" else DataError)(error[1])


def prepare_corpus(data: DataConfig, model: ModelConfig) -> Corpus:
    """Tokenise ``data.path`` (cached) and split its documents.

    Rank 0 builds missing cache files while other ranks wait at a barrier.

    Raises:
        DataError / TokenizerError: missing files, unusable content.
    """
    src = resolve_data_path(data.path)
    cache = Path(data.cache_dir)
    if not cache.is_absolute():
        cache = Path.cwd() / cache
    bert = model.family == "bert"
    if is_indexed_prefix(src):
        if data.tokenizer == "auto":
            raise DataError(
                f"{src} is a tokenised indexed dataset: set data.tokenizer to the tokenizer "
                "file it was made with"
            )
        tokenizer = load_tokenizer(data.tokenizer)
        check_specials(tokenizer, model.family)
        prefix = src
    else:
        stat = src.stat()
        fp = corpus_fingerprint(src.resolve(), stat.st_size, stat.st_mtime, data.text_key,
                                data.max_documents, data.val_every)
        docs = None
        if data.tokenizer == "auto":
            tok_path = cache / f"spm2-{fp}-v{model.vocab_size}.model"

            def build_tokenizer():
                nonlocal docs
                if not tok_path.is_file():
                    with phase(log, "training a %d-token SentencePiece tokenizer on %s (once; "
                               "cached in %s)", model.vocab_size, src.name, cache):
                        docs = read_documents(src, data.text_key, data.max_documents)
                        held = val_document_mask(len(docs), data.val_every)
                        train_sentencepiece((d for d, h in zip(docs, held) if not h),
                                            model.vocab_size, tok_path)

            _on_rank0(build_tokenizer)
        else:
            tok_path = Path(data.tokenizer)
        tokenizer = load_tokenizer(tok_path)
        check_specials(tokenizer, model.family)
        kind = "bert" if bert else "gpt"
        prefix = cache / f"tokens-{fp}-{corpus_fingerprint(tok_path.resolve(), tok_path.stat().st_mtime)}-{kind}"

        def build_tokens():
            if not is_indexed_prefix(prefix):
                with phase(log, "tokenising %s (once; cached in %s)", src.name, cache):
                    corpus_docs = docs if docs is not None else read_documents(
                        src, data.text_key, data.max_documents)
                    prefix.parent.mkdir(parents=True, exist_ok=True)
                    write_indexed(tokenize_documents(corpus_docs, tokenizer, bert), prefix,
                                  tokenizer.vocab_size)

        _on_rank0(build_tokens)
    if tokenizer.vocab_size > model.vocab_size:
        raise DataError(
            f"tokenizer has {tokenizer.vocab_size} ids but model.vocab_size={model.vocab_size}; "
            "set model.vocab_size to at least the tokenizer's size"
        )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    n_docs = len(IndexedDataset(str(prefix)).document_indices) - 1
    # both splits non-empty: megatron's samplers would loop forever looking for tokens
    held = split_documents(n_docs, data.val_every, source=src,
                           limit="data.max_documents" if data.max_documents else None)
    return Corpus(tokenizer, prefix, np.flatnonzero(~held), np.flatnonzero(held))


def build_dataset(corpus: Corpus, model: ModelConfig, split: str, num_samples: int, seed: int,
                  cache_dir: str):
    """Build megatron-core's ``GPTDataset`` (gpt, llama) or ``BERTMaskedWordPieceDataset``.

    Args:
        split: ``"train"`` or ``"valid"``.
        num_samples: samples to draw (the dataset cycles epochs to reach it).

    Returns:
        A map-style dataset whose items are dicts of NumPy arrays of length
        ``model.seq_length``: ``tokens``, ``labels``, ``loss_mask``,
        ``position_ids`` (GPT) or ``text``, ``types``, ``labels``,
        ``padding_mask``, ``loss_mask`` (BERT).
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split

    indices = corpus.train_docs if split == "train" else corpus.val_docs
    sp = Split.train if split == "train" else Split.valid
    indexed = IndexedDataset(str(corpus.prefix))
    cache = str(Path(cache_dir).absolute() / "index_cache")
    # The corpora hold no padding: pad -1 (megatron's "no pad" value) keeps megatron
    # from treating a real id as padding (GPT: masking its loss; BERT: padding token
    # types and the mask with it, which only works for pad 0).  BERT's padding is
    # marked by that -1 and turned into 0/1 by _BertSample.
    tokenizer = copy.copy(corpus.tokenizer)
    tokenizer.pad = -1
    common = dict(
        random_seed=seed,
        sequence_length=model.seq_length,
        tokenizer=tokenizer,
        path_to_cache=cache,
        blend=([str(corpus.prefix)], None),
        split="1,0,0",  # unused: we pass document indices ourselves
    )
    if model.family == "bert":
        from megatron.core.datasets.bert_dataset import (
            BERTMaskedWordPieceDataset,
            BERTMaskedWordPieceDatasetConfig,
        )

        cfg = BERTMaskedWordPieceDatasetConfig(
            masking_probability=model.mask_prob,
            short_sequence_probability=0.0,
            masking_max_ngram=1,
            masking_do_full_word=False,
            masking_do_permutation=False,
            masking_use_longer_ngrams=False,
            masking_use_geometric_distribution=False,
            classification_head=True,  # sentence pairs; the NSP swap is undone (_BertSample)
            **common,
        )
        cls = BERTMaskedWordPieceDataset
    else:
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

        cfg = GPTDatasetConfig(
            reset_position_ids=False,
            reset_attention_mask=False,
            eod_mask_loss=False,
            create_attention_mask=False,
            **common,
        )
        cls = GPTDataset
    # Rank 0 writes the sample-index cache first; the others then read it.
    ds = None
    if _rank() == 0:
        ds = cls(indexed, str(corpus.prefix), indices, num_samples, sp, cfg)
    _barrier()
    if ds is None:
        ds = cls(indexed, str(corpus.prefix), indices, num_samples, sp, cfg)
    return _BertSample(ds) if model.family == "bert" else ds


class _BertSample:
    """megatron's BERT samples made into what this project's ``BertModel`` (masked LM,
    no binary head) trains on.

    * **Sentence pairs in document order.**  ``build_dataset`` asks megatron for
      ``[CLS] A [SEP] B [SEP]`` pairs (``classification_head=True``: at least two
      sentences a sample, filled to ``seq_length``, Devlin et al. 2019, Sec. 3.1), so
      padding is left only where a document ends early.  megatron swaps A and B in
      half of them as negatives for next-sentence prediction (``is_random``); without
      an NSP head a swap only scrambles the text, so it is undone here: positions
      are permuted back to A-then-B, token types re-assigned (0 for ``[CLS] A [SEP]``,
      1 for ``B [SEP]``), with ``labels`` and ``loss_mask`` carried along.
    * **Padding.**  megatron pads ``text``, ``types`` and ``padding_mask`` with the
      tokenizer's pad id, right only for pad 0; a ``[PAD]`` elsewhere (or missing)
      indexed the 2-row token-type embedding out of range.  The pad is written as
      -1 (see :func:`build_dataset`) and turned into ``padding_mask`` 1 on tokens,
      0 on padding, ``types`` 0 on padding.
    """

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, idx: int) -> dict:
        sample = dict(self.dataset[idx])
        pad = sample["padding_mask"] == -1  # [seq] bool; megatron wrote the pad id there
        sample["padding_mask"] = (~pad).astype(np.int64)
        sample["types"] = np.where(pad, 0, sample["types"])
        if sample.pop("is_random", 0):
            sample.update(_unswap_pair(sample))
        return sample


def _unswap_pair(sample: dict) -> dict:
    """Undo megatron's NSP swap: ``[CLS] B [SEP] A [SEP] pad`` -> ``[CLS] A [SEP] B [SEP] pad``.

    Positions (``n0`` = tokens of type 0, ``n1`` of type 1, padding excluded): 0 is
    ``[CLS]``, ``1..n0-2`` the first segment, ``n0-1`` its ``[SEP]``, ``n0..n0+n1-2``
    the second segment, ``n0+n1-1`` its ``[SEP]``.  Every per-position array of
    length ``seq`` is permuted; ``types`` is rebuilt.
    """
    live = sample["padding_mask"].astype(bool)
    n1 = int(((sample["types"] == 1) & live).sum())
    n0 = int(live.sum()) - n1
    seq = len(live)
    perm = np.concatenate([[0], np.arange(n0, n0 + n1 - 1), [n0 - 1], np.arange(1, n0 - 1),
                           np.arange(n0 + n1 - 1, seq)])
    out = {k: v[perm] for k, v in sample.items()
           if isinstance(v, np.ndarray) and v.shape == (seq,) and k != "types"}
    types = np.zeros(seq, dtype=sample["types"].dtype)
    types[n1 + 1:n0 + n1] = 1  # B (the old first segment) and the final [SEP]
    out["types"] = types
    return out


def collate(samples: list[dict]) -> dict[str, torch.Tensor]:
    """Stack a list of dataset items into ``[micro_batch, seq]`` tensors."""
    keys = [k for k, v in samples[0].items() if isinstance(v, (np.ndarray, torch.Tensor))]
    # host batches: the trainer moves them to the compute device
    return {k: torch.stack([torch.as_tensor(s[k]) for s in samples]) for k in keys}  # host


def synthetic_microbatch(model: ModelConfig, micro_batch_size: int,
                         generator: torch.Generator) -> dict[str, torch.Tensor]:
    """One micro-batch of uniformly random tokens, keyed as the datasets' items.

    For throughput benchmarks and tests that need no corpus.  Host tensors of
    shape ``[micro_batch_size, model.seq_length]``; GPT/Llama: ``tokens``,
    ``labels`` (next token), ``loss_mask`` (ones), ``position_ids``; BERT:
    ``text``, ``types`` (zeros), ``padding_mask`` (ones), ``labels``,
    ``loss_mask`` (``model.mask_prob`` of the positions).
    """
    b, s, v = micro_batch_size, model.seq_length, model.vocab_size
    tokens = torch.randint(0, v, (b, s), generator=generator)  # host
    if model.family == "bert":
        mask = (torch.rand(b, s, generator=generator) < model.mask_prob).float()  # host
        return {"text": tokens, "types": torch.zeros_like(tokens),
                "padding_mask": torch.ones_like(tokens), "labels": tokens, "loss_mask": mask}
    ones = torch.ones(b, s)  # host
    positions = torch.arange(s).expand(b, s)  # host
    return {"tokens": tokens, "labels": torch.roll(tokens, -1, dims=1), "loss_mask": ones,
            "position_ids": positions}


class GlobalBatchSampler:
    """Deterministic micro-batches of the global batch for one DP rank.

    Global batch ``k`` is samples ``[k*G, (k+1)*G)`` of the dataset (``G`` =
    global batch size); DP rank ``r`` takes the contiguous slice
    ``[r*G/dp, (r+1)*G/dp)`` of it, cut into micro-batches.  The same samples
    thus form step ``k`` in every layout, which makes TP/PP/DP runs comparable
    and a resumed run continue exactly (the position is ``consumed_samples``).
    """

    def __init__(self, dataset, *, global_batch_size: int, micro_batch_size: int, dp: int,
                 dp_rank: int, consumed_samples: int = 0):
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp, self.dp_rank = dp, dp_rank
        self.consumed_samples = consumed_samples

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // (self.micro_batch_size * self.dp)

    def microbatches_at(self, start: int) -> list[dict[str, torch.Tensor]]:
        """Micro-batches of this rank for the global batch starting at sample ``start``."""
        per_rank = self.global_batch_size // self.dp
        base = start + self.dp_rank * per_rank
        n = len(self.dataset)
        out = []
        for j in range(self.num_microbatches):
            lo = base + j * self.micro_batch_size
            out.append(collate([self.dataset[(lo + i) % n] for i in range(self.micro_batch_size)]))
        return out

    def next(self) -> list[dict[str, torch.Tensor]]:
        """This rank's micro-batches for the next global batch; advances the position."""
        mbs = self.microbatches_at(self.consumed_samples)
        self.consumed_samples += self.global_batch_size
        return mbs
