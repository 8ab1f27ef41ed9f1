"""Raw documents from the user's data path: JSONL with a text field (optionally
``.xz``/``.gz``/``.bz2``), plain ``.txt``/``.md``/``.rst`` files (one document per file), a
folder of those, or a local Hugging Face dataset folder (``save_to_disk``).
:mod:`jobruntime.data` tokenises what this module reads.
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path

from .config import REPO_ROOT


class DataError(ValueError):
    """The data path or its content is unusable; the message says how to fix it."""


_OPENERS = {".xz": lzma.open, ".gz": gzip.open, ".bz2": bz2.open}


def resolve_data_path(path: str) -> Path:
    """Resolve ``path`` against the working directory, then the repository root; an
    absolute path as it is.

    A Megatron indexed-dataset prefix resolves when ``PREFIX.bin`` and ``PREFIX.idx`` exist.

    Raises:
        DataError: nothing exists at either place, or a ``PREFIX.bin`` without its
            ``PREFIX.idx``.
    """
    if not path.strip():
        raise DataError("data.path is empty; set it to a JSONL/.txt file, a folder, a saved "
                        "HF dataset or a .bin/.idx prefix")
    given = Path(path)
    bases = (Path.cwd(), REPO_ROOT) if not given.is_absolute() else (Path("/"),)
    for base in bases:
        p = base / given
        if p.suffix in (".bin", ".idx") and p.is_file():  # an indexed dataset's own file
            prefix = p.with_suffix("")
            raise DataError(f"data.path={path} names one file of an indexed dataset; give its "
                            f"prefix, data.path={prefix}, with {prefix}.bin and {prefix}.idx "
                            "beside each other")
        if p.exists() or is_indexed_prefix(p):
            return p
        if Path(f"{p}.bin").is_file():
            raise DataError(f"{p}.bin has no {p}.idx beside it; copy both files of the "
                            "indexed dataset (tools/prepare_data.py writes them together)")
    raise DataError(
        f"data file '{path}' not found{_where_not_found(given, bases)}; "
        "set data.path (--input of tools/prepare_data.py) to a JSONL/.txt file, a folder, a saved "
        "HF dataset or a .bin/.idx prefix"
    )


def _where_not_found(given: Path, bases: tuple[Path, ...]) -> str:
    """Where a missing data path was looked for (a relative one), or what of an absolute
    one's folder is missing (``""`` where only the file is)."""
    if not given.is_absolute():
        return f" (looked in {' and '.join(dict.fromkeys(str(b) for b in bases))})"
    folder = next((p for p in given.parents if p.exists()), None)  # the deepest that exists
    if folder is not None and not folder.is_dir():
        return f" ({folder} is not a folder)"
    return "" if folder == given.parent else f" (no folder {given.parent})"


def is_indexed_prefix(path: Path) -> bool:
    return Path(f"{path}.bin").is_file() and Path(f"{path}.idx").is_file()


def _unreadable(path: Path, e: Exception) -> DataError:
    what = ("is not UTF-8 text" if isinstance(e, UnicodeDecodeError)
            else f"could not be read ({type(e).__name__}: {e})")
    return DataError(f"{path} {what}; give UTF-8 text, optionally compressed as .xz/.gz/.bz2 "
                     "(a truncated or corrupt archive gives this error too)")


def _read_jsonl(path: Path, text_key: str, limit: int | None) -> list[str]:
    opener = _OPENERS.get(path.suffix, open)
    docs = []
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or text_key not in obj:
                raise DataError(
                    f"{path}:{lineno}: no '{text_key}' field; set data.text_key (--text-key) "
                    "to the field holding the document text"
                )
            if not isinstance(obj[text_key], str):
                raise DataError(
                    f"{path}:{lineno}: '{text_key}' is {type(obj[text_key]).__name__}, not a "
                    "string; fix the line or set data.text_key (--text-key) to the text field"
                )
            docs.append(obj[text_key])
            if limit and len(docs) >= limit:
                break
    return docs


def read_documents(path: Path, text_key: str = "text", limit: int | None = None) -> list[str]:
    """Read documents (strings) from a JSONL/text file, a folder or a saved HF dataset.

    Raises:
        DataError: unknown format, malformed JSON, missing text field, no documents.
    """
    if path.is_dir():
        if (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            import datasets

            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds["train"] if "train" in ds else next(iter(ds.values()))
            if text_key not in ds.column_names:
                raise DataError(f"{path}: HF dataset has no '{text_key}' column ({ds.column_names})")
            docs = list(ds[text_key][:limit] if limit else ds[text_key])
        else:
            docs = []
            for f in sorted(path.rglob("*")):
                if f.is_file():
                    docs.extend(read_documents(f, text_key, None))
            docs = docs[:limit] if limit else docs
    else:
        suffixes = [s for s in path.suffixes if s not in _OPENERS]
        kind = suffixes[-1] if suffixes else ""
        if kind in (".jsonl", ".json", ".txt", ".md", ".rst"):
            try:
                if kind in (".jsonl", ".json"):
                    docs = _read_jsonl(path, text_key, limit)
                else:
                    with _OPENERS.get(path.suffix, open)(path, "rt", encoding="utf-8") as f:
                        docs = [f.read()]
            except (UnicodeDecodeError, OSError, EOFError, lzma.LZMAError) as e:
                raise _unreadable(path, e) from None
        else:
            raise DataError(
                f"{path}: unknown data format; use .jsonl (optionally .xz/.gz), .txt, a folder, "
                "a saved HF dataset or a Megatron .bin/.idx prefix"
            )
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise DataError(f"{path}: no non-empty documents found")
    return docs
