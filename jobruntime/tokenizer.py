"""Tokenizers: a sentencepiece model (trained from the corpus, or loaded) or a
Hugging Face ``tokenizer.json``.

Both expose what megatron-core's GPT and BERT datasets read from a tokenizer
(``vocab_size``, ``eod``, ``pad``, ``cls``, ``sep``, ``mask``, ``inv_vocab``;
see ``megatron.core.datasets.gpt_dataset`` and ``bert_dataset``).  A special
token the file does not define is ``None`` — never another token standing in
for it (id 0 is an ordinary id: standard BERT vocabularies put ``[PAD]``
there); :func:`check_specials` names what a model family needs and lacks.
"""

from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

SPECIAL_PIECES = ("[CLS]", "[SEP]", "[MASK]")
# Special tokens each family needs: BERT's masked LM builds [CLS] A [SEP] B [SEP]
# and replaces tokens by [MASK]; GPT and Llama end every document with eod.
FAMILY_SPECIALS = {"bert": ("cls", "sep", "mask"), "gpt": ("eod",), "llama": ("eod",)}
_SPECIAL_NAMES = {"cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]", "eod": "end-of-text"}


class TokenizerError(ValueError):
    """The tokenizer file is missing or unusable; the message says what to do."""


class Tokenizer:
    """A tokenizer with the attributes megatron-core's datasets use.

    Attributes:
        vocab_size: number of ids the tokenizer can produce.
        eod: end-of-document id appended after each document (GPT).
        pad, cls, sep, mask: special ids (BERT masked LM).
        inv_vocab: ``{id: piece}`` for every id.

    Special ids are ``None`` where the tokenizer has no such token.
    """

    def __init__(self, encode_batch, id_to_piece, vocab_size, *, eod, pad, cls, sep, mask, kind,
                 source: str = ""):
        self._encode_batch = encode_batch
        # megatron-core datasets hash this into their cache keys
        self.unique_identifiers = {"class": f"Tokenizer-{kind}", "source": source,
                                   "vocab_size": vocab_size}
        self.vocab_size = vocab_size
        self.eod, self.pad, self.cls, self.sep, self.mask = eod, pad, cls, sep, mask
        self.kind = kind
        self.path: Path | None = None
        """The file it was loaded from (:func:`load_tokenizer`)."""
        self.inv_vocab = {i: id_to_piece(i) for i in range(vocab_size)}

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text (no special tokens added)."""
        return self._encode_batch(list(texts))

    # megatron's MegatronTokenizer spells these as properties too
    @property
    def eos(self) -> int:
        return self.eod


def check_specials(tok: Tokenizer, family: str) -> None:
    """Raise :class:`TokenizerError` (one line) if ``tok`` lacks a special token
    that ``family`` needs (:data:`FAMILY_SPECIALS`)."""
    missing = [_SPECIAL_NAMES[k] for k in FAMILY_SPECIALS[family] if getattr(tok, k) is None]
    if missing:
        where = f"'{tok.path}'" if tok.path else "the tokenizer"
        raise TokenizerError(
            f"tokenizer {where} has no {' / '.join(missing)} token, which the {family} family "
            "needs; use a tokenizer that defines it (data.tokenizer=auto trains one with [CLS], "
            "[SEP], [MASK] and </s>)"
        )


def _from_sentencepiece(model_proto: bytes, source: str = "") -> Tokenizer:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=model_proto)
    unk = sp.unk_id()
    ids = {}
    for piece in SPECIAL_PIECES:
        i = sp.piece_to_id(piece)  # unk for a piece the model lacks: that special is None
        ids[piece] = None if i == unk else i
    eod = sp.eos_id() if sp.eos_id() >= 0 else None
    pad = sp.pad_id() if sp.pad_id() >= 0 else None
    return Tokenizer(
        lambda texts: sp.encode(texts),
        sp.id_to_piece,
        sp.get_piece_size(),
        eod=eod,
        pad=pad,
        cls=ids["[CLS]"],
        sep=ids["[SEP]"],
        mask=ids["[MASK]"],
        kind="sentencepiece",
        source=source,
    )


def _from_hf_json(path: Path) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(path))
    vocab = tok.get_vocab(with_added_tokens=True)

    def find(*names):  # the id of the first name present (0 included), else None
        for n in names:
            if n in vocab:
                return vocab[n]
        return None

    size = max(vocab.values()) + 1
    return Tokenizer(
        lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)],
        lambda i: tok.id_to_token(i) or "",
        size,
        eod=find("<|end_of_text|>", "<|endoftext|>", "</s>", "[SEP]", "<eos>"),
        pad=find("[PAD]", "<pad>", "<|finetune_right_pad_id|>"),
        cls=find("[CLS]", "<s>", "<|begin_of_text|>"),
        sep=find("[SEP]", "</s>"),
        mask=find("[MASK]", "<mask>"),
        kind="hf",
        source=str(path),
    )


def train_sentencepiece(texts: Iterable[str], vocab_size: int, out: Path) -> Path:
    """Train a unigram sentencepiece model on ``texts`` and write it to ``out``.

    Specials: ``<pad>`` 0, ``<unk>`` 1, ``<s>`` 2, ``</s>`` 3 (end of document),
    then ``[CLS] [SEP] [MASK]`` for BERT.  Pad is 0 because megatron-core's BERT
    dataset pads token types and the padding mask with the pad id and feeds
    them to 2-row and boolean uses.  Written atomically.
    """
    import sentencepiece as spm

    def lines():
        for t in texts:
            for line in t.splitlines():
                if line.strip():
                    yield line

    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=lines(),
            model_writer=buf,
            vocab_size=vocab_size,
            model_type="unigram",
            input_sentence_size=400_000,
            shuffle_input_sentence=True,
            character_coverage=0.9999,
            user_defined_symbols=list(SPECIAL_PIECES),
            pad_id=0,
            unk_id=1,
            bos_id=2,
            eos_id=3,
            num_threads=min(4, os.cpu_count() or 1),
            minloglevel=2,
        )
    except RuntimeError as e:
        # e.g. "... Vocabulary size too high (4096). Please set it to a value <= 1873."
        why = str(e).strip().splitlines()[-1]
        why = why[why.find("Vocabulary size"):] if "Vocabulary size" in why else why
        fix = ("lower the vocabulary size (model.vocab_size; --vocab-size of "
               "tools/prepare_data.py) or give more text" if "too high" in why else
               "change the vocabulary size (model.vocab_size; --vocab-size of "
               "tools/prepare_data.py) as the message says")
        raise TokenizerError(
            f"could not train a {vocab_size}-piece sentencepiece tokenizer on this corpus "
            f"({why}); {fix}"
        ) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(out)
    return out


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a sentencepiece ``.model`` or a Hugging Face ``tokenizer.json``.

    Raises:
        TokenizerError: the file does not exist or cannot be parsed.
    """
    path = Path(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(
            f"tokenizer file '{path}' not found; set data.tokenizer (a tool's --tokenizer) to a sentencepiece "
            "'.model', a Hugging Face 'tokenizer.json', or 'auto' to train one"
        )
    try:
        if path.suffix == ".json":
            tok = _from_hf_json(path)
        else:
            tok = _from_sentencepiece(path.read_bytes(),
                                      corpus_fingerprint(path.resolve(), path.stat().st_mtime))
        tok.path = path
        return tok
    except TokenizerError:
        raise
    except Exception as e:  # parse errors from the libraries
        raise TokenizerError(f"tokenizer '{path}' could not be loaded: {e}") from None


def save_tokenizer_file(tok: Tokenizer, folder: Path) -> Path | None:
    """Copy the file ``tok`` was loaded from into ``folder`` as ``tokenizer.json``
    or ``tokenizer.model`` (atomically), so a run folder is self-contained and
    ``tools/convert_checkpoint.py mcore-to-hf`` can export it.  Returns the copy."""
    if tok.path is None:
        return None
    dst = folder / ("tokenizer.json" if tok.path.suffix == ".json" else "tokenizer.model")
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    tmp.write_bytes(tok.path.read_bytes())
    tmp.replace(dst)
    return dst


def corpus_fingerprint(*parts: object) -> str:
    """Short stable hash naming cached tokenizers and datasets."""
    return hashlib.sha1("|".join(map(str, parts)).encode()).hexdigest()[:12]
