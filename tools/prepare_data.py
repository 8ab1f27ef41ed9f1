"""Tokenise a corpus into a Megatron indexed dataset that ``train.py`` reads directly.

Input: JSONL (``--text-key`` field, optionally .xz/.gz/.bz2), .txt files, a
folder of them, or a local Hugging Face dataset folder (``save_to_disk``) —
whatever :func:`jobruntime.documents.read_documents` reads.  Tokenizer: an
existing sentencepiece ``.model`` or Hugging Face ``tokenizer.json``
(``--tokenizer``), or a new sentencepiece model of ``--vocab-size`` trained on
the training documents (every ``--val-every``-th document is held out, as
``train.py`` holds it out for validation) and written to ``OUTPUT.model``.

Output: ``OUTPUT.bin`` / ``OUTPUT.idx`` (GPT: one sequence per document, ids
+ end-of-document; ``--family bert``: one sequence per non-empty line) and
``OUTPUT.json`` with the summary that is also printed (documents, tokens …).

Usage::

    python tools/prepare_data.py --input data/python-docs-3.11.jsonl.xz \\
        --output data/prepared/pydocs --vocab-size 8192
    python train.py --config tiny_gpt data.path=data/prepared/pydocs \\
        data.tokenizer=data/prepared/pydocs.model

Exit codes: 0 done, 2 bad input (message on stderr).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jobruntime.data import (
    DataError,
    read_documents,
    resolve_data_path,
    split_documents,
    tokenize_documents,
    write_indexed,
)
from jobruntime.metrics import json_text, write_json_atomic
from jobruntime.outputs import output_folder_error
from jobruntime.tokenizer import TokenizerError, check_specials, load_tokenizer, train_sentencepiece


def prepare(input_path: str, output: str, *, tokenizer: str | None = None, vocab_size: int = 8192,
            family: str = "gpt", text_key: str = "text", max_documents: int | None = None,
            val_every: int = 20, chunk: int = 256, progress: bool | None = None) -> dict:
    """Tokenise ``input_path`` into the indexed dataset ``output.{bin,idx}``.

    Args:
        tokenizer: sentencepiece ``.model`` / ``tokenizer.json``; ``None`` trains
            a sentencepiece model of ``vocab_size`` to ``output.model``.
        family: ``gpt`` (also for llama) or ``bert`` (sequences per line).
        chunk: documents tokenised per batch (the progress bar's step).
        progress: show a tqdm bar; ``None`` = only on a terminal.

    Returns:
        The summary: documents, sequences, tokens, train/val document counts,
        tokenizer path and vocabulary size, output prefix, seconds.

    Raises:
        DataError / TokenizerError: unreadable input or tokenizer; a corpus that leaves
            no validation (or no training) document at ``val_every``, refused before
            anything is written (:func:`jobruntime.data.split_documents`).
    """
    from tqdm import tqdm

    t0 = time.perf_counter()
    prefix = Path(output).absolute()
    docs = read_documents(resolve_data_path(input_path), text_key, max_documents)
    # refused before anything is written: a corpus without validation documents is one
    # that train.py refuses (and the tokenizer would be trained on every document)
    held = split_documents(len(docs), val_every, source=input_path, option="--val-every",
                           limit="--max-documents" if max_documents else None)
    if tokenizer is None:
        tok_path = Path(f"{prefix}.model")
        train_sentencepiece((d for d, h in zip(docs, held) if not h), vocab_size, tok_path)
    else:
        tok_path = Path(tokenizer).absolute()
    tok = load_tokenizer(tok_path)
    check_specials(tok, family)  # the ids tokenize_documents adds (eod; BERT: [SEP] ...)
    prefix.parent.mkdir(parents=True, exist_ok=True)  # only once the input is known good
    counts = {"sequences": 0, "tokens": 0}
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=len(docs), unit="doc", desc="tokenising", disable=not show, file=sys.stderr)

    def stream():  # a generator: write_indexed never holds all token ids at once
        for lo in range(0, len(docs), chunk):
            for seqs in tokenize_documents(docs[lo:lo + chunk], tok, family == "bert"):
                counts["sequences"] += len(seqs)
                counts["tokens"] += sum(len(s) for s in seqs)
                yield seqs
            bar.update(min(chunk, len(docs) - lo))

    write_indexed(stream(), prefix, tok.vocab_size)
    bar.close()
    summary = {
        "prefix": str(prefix), "family": family, "documents": len(docs), **counts,
        "train_documents": int((~held).sum()), "val_documents": int(held.sum()),
        "val_every": val_every, "tokenizer": str(tok_path), "vocab_size": tok.vocab_size,
        "input": str(input_path), "seconds": round(time.perf_counter() - t0, 2),
    }
    write_json_atomic(Path(f"{prefix}.json"), summary)
    return summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSONL / .txt / folder / saved HF dataset")
    p.add_argument("--output", required=True, help="output prefix (writes PREFIX.bin/.idx/.json)")
    p.add_argument("--tokenizer", default=None,
                   help="sentencepiece .model or HF tokenizer.json; default: train one")
    p.add_argument("--vocab-size", type=int, default=8192, help="for a trained tokenizer")
    p.add_argument("--family", choices=["gpt", "llama", "bert"], default="gpt",
                   help="bert stores one sequence per line (default gpt; llama = gpt)")
    p.add_argument("--text-key", default="text")
    p.add_argument("--max-documents", type=int, default=None)
    p.add_argument("--val-every", type=int, default=20,
                   help="held out of tokenizer training; match data.val_every of the job")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.max_documents is not None and args.max_documents < 1:
        p.error(f"--max-documents {args.max_documents} must be at least 1 (omit it for all)")
    if problem := output_folder_error(Path(args.output).absolute().parent, "--output's folder"):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        summary = prepare(args.input, args.output, tokenizer=args.tokenizer,
                          vocab_size=args.vocab_size, family="bert" if args.family == "bert" else "gpt",
                          text_key=args.text_key, max_documents=args.max_documents,
                          val_every=args.val_every, progress=False if args.no_progress else None)
    except (DataError, TokenizerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json_text(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
