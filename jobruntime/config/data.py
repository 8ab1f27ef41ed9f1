"""The ``data`` section: corpus, tokenizer and cache."""

from __future__ import annotations

from dataclasses import dataclass

from .base import (
    _need,
)


@dataclass(kw_only=True)
class DataConfig:
    """Corpus, tokenizer and split."""

    path: str = "data/python-docs-3.11.jsonl.xz"
    """JSONL (``text`` field, optionally .xz/.gz), a .txt file or a folder of
    them, a local Hugging Face dataset folder (``save_to_disk``), or a Megatron
    indexed-dataset prefix (``PREFIX.bin``/``PREFIX.idx``).  Relative paths are
    resolved against the working directory, then the repository."""
    tokenizer: str = "auto"
    """``auto`` trains (once, cached) a sentencepiece model of
    ``model.vocab_size`` on the training documents; otherwise a path to a
    sentencepiece ``.model`` or a Hugging Face ``tokenizer.json``."""
    text_key: str = "text"
    """Field holding the document text in JSONL / HF datasets."""
    val_every: int = 20
    """Every ``val_every``-th document (by position) is held out for validation."""
    cache_dir: str = ".cache"
    """Where tokenizers and tokenized indexed datasets are cached."""
    max_documents: int | None = None
    """Read only the first N documents (quick tests)."""

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first out-of-range setting."""
        _need(self, "data", self.val_every >= 2, "val_every",
              "must be >= 2 (every val_every-th document is held out)")
        _need(self, "data", self.max_documents is None or self.max_documents > 0, "max_documents",
              "must be positive (or null for all)")
