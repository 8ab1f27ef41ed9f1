"""Standard tokenizers: special ids at 0 are ids, missing specials are errors, BERT trains.

Hugging Face WordPiece ``tokenizer.json`` files like the standard BERT
vocabularies (``[PAD]`` 0, ``[UNK]`` 1, ``[CLS]`` 2, ``[SEP]`` 3, ``[MASK]`` 4)
and the same vocabulary with the specials moved to other ids.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jobruntime.tokenizer import TokenizerError, check_specials, load_tokenizer

REPO = Path(__file__).resolve().parent.parent
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
# the "other ids" layout: specials scattered over the vocabulary
MOVED = {"[PAD]": 1000, "[UNK]": 5, "[CLS]": 1999, "[SEP]": 42, "[MASK]": 7}
DOCS = 300


def _wordpiece(path: Path, *, moved: bool = False, drop: tuple[str, ...] = ()) -> Path:
    """A 2000-piece WordPiece tokenizer.json trained on the bundled corpus (first
    ``DOCS`` documents), specials first as in bert-base-uncased, or moved to ``MOVED``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    from jobruntime.data import read_documents

    docs = read_documents(REPO / "data/python-docs-3.11.jsonl.xz", limit=DOCS)
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(docs, trainers.WordPieceTrainer(vocab_size=2000, special_tokens=SPECIALS))
    vocab = tok.get_vocab()
    assert [vocab[s] for s in SPECIALS] == [0, 1, 2, 3, 4]
    if moved or drop:
        by_id = sorted(vocab, key=vocab.get)
        if moved:
            for special, new in MOVED.items():  # swap with the piece at the new id
                old = by_id.index(special)
                by_id[old], by_id[new] = by_id[new], by_id[old]
        vocab = {p: i for i, p in enumerate(p for p in by_id if p not in drop)}
        new_tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
        new_tok.normalizer, new_tok.pre_tokenizer = tok.normalizer, tok.pre_tokenizer
        tok = new_tok
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def tokenizers_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("wordpiece")
    return {"first": _wordpiece(root / "first.json"),
            "moved": _wordpiece(root / "moved.json", moved=True),
            "no_mask": _wordpiece(root / "no_mask.json", drop=("[MASK]",))}


def test_special_ids_at_zero_and_elsewhere_are_found(tokenizers_dir):
    """Catches `find(...) or fallback`: [PAD] at id 0 was taken as missing and replaced
    by [SEP], so megatron saw a pad colliding with another special."""
    first = load_tokenizer(tokenizers_dir["first"])
    assert (first.pad, first.cls, first.sep, first.mask) == (0, 2, 3, 4)
    moved = load_tokenizer(tokenizers_dir["moved"])
    assert (moved.pad, moved.cls, moved.sep, moved.mask) == (1000, 1999, 42, 7)
    for tok in (first, moved):
        check_specials(tok, "bert")
        check_specials(tok, "gpt")  # eod is [SEP] for a BERT vocabulary


def test_missing_mask_is_an_error_not_a_substitute(tokenizers_dir, tmp_path):
    """Catches a vocabulary without [MASK] silently masking with [SEP] (tokenizer.json)
    or <unk> (sentencepiece): the BERT family refuses it, naming the token."""
    import sentencepiece as spm

    tok = load_tokenizer(tokenizers_dir["no_mask"])
    assert tok.mask is None and tok.sep is not None
    with pytest.raises(TokenizerError, match=r"no \[MASK\] token, which the bert family needs"):
        check_specials(tok, "bert")
    check_specials(tok, "gpt")
    model = tmp_path / "plain.model"  # a sentencepiece model without BERT specials
    text = (REPO / "README.md").read_text().splitlines()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_prefix=str(model.with_suffix("")),
                                   vocab_size=200, minloglevel=2)
    sp = load_tokenizer(model)
    assert sp.mask is None and sp.cls is None and sp.eod is not None
    with pytest.raises(TokenizerError, match=r"\[CLS\] / \[SEP\] / \[MASK\]"):
        check_specials(sp, "bert")


def _bert_samples(tokenizers, cache_dir):
    """On one gloo rank (megatron's datasets need a process group): 256 BERT samples
    per tokenizer layout with the tokenizer's [CLS] and [SEP] ids, and the "first"
    layout's tokenised corpus as one stream of ids."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from jobruntime.config import load_config
    from jobruntime.data import build_dataset, prepare_corpus
    from jobruntime.parallel import init_distributed

    init_distributed()
    out = {}
    for layout in ("first", "moved"):
        cfg = load_config("tiny_bert", [f"data.tokenizer={tokenizers[layout]}",
                                        "model.vocab_size=2000", f"data.max_documents={DOCS}",
                                        f"data.cache_dir={cache_dir}"])
        corpus = prepare_corpus(cfg.data, cfg.model)
        ds = build_dataset(corpus, cfg.model, "train", 256, cfg.train.seed, cache_dir)
        out[layout] = ([ds[i] for i in range(min(len(ds), 256))], corpus.tokenizer.cls,
                       corpus.tokenizer.sep)
        if layout == "first":
            indexed = IndexedDataset(str(corpus.prefix))
            out["stream"] = np.concatenate([indexed[i] for i in range(len(indexed))])
    return out


@pytest.fixture(scope="module")
def bert_samples(tokenizers_dir, cache_dir):
    from tests.dist_utils import launch

    return launch(_bert_samples, 1, tokenizers_dir, cache_dir)[0]


@pytest.mark.parametrize("layout", ["first", "moved"])
def test_bert_samples_pad_with_type_0_and_mask_0(bert_samples, layout):
    """Catches megatron padding token types and the padding mask with the pad id: with
    [PAD] at 1000 the types held 1000 (out of the 2-row table) and the mask 1000
    (padding attended).  Every sample: types and mask in {0, 1}, mask 0 exactly on
    the padding after the last [SEP]."""
    samples, cls, sep = bert_samples[layout]
    padded = 0
    for s in samples:
        assert set(np.unique(s["types"])) <= {0, 1} and set(np.unique(s["padding_mask"])) <= {0, 1}
        n = int(s["padding_mask"].sum())
        assert s["padding_mask"][:n].all() and not s["padding_mask"][n:].any()
        assert s["text"][0] == cls and s["text"][n - 1] == sep
        assert not s["types"][n:].any()
        padded += n < len(s["text"])
    assert padded > 0  # the check saw padding


def _runs(stream: np.ndarray, part: np.ndarray) -> list[int]:
    """Every index at which ``part`` stands as a contiguous run of ``stream``."""
    hay, needle, size = stream.tobytes(), part.astype(stream.dtype).tobytes(), stream.itemsize
    out, at = [], hay.find(needle)
    while at != -1:
        if at % size == 0:  # aligned to whole ids
            out.append(at // size)
        at = hay.find(needle, at + 1)
    return out


def test_bert_samples_are_sentence_pairs_in_document_order(bert_samples):
    """Catches BERT samples of one segment ([CLS] A [SEP], at most seq - 1 tokens: every
    sample and so every batch was padded, so SDPA never took its no-mask path), and
    megatron's next-sentence swap kept without an NSP head (B before A in half of them).
    Each sample is [CLS] A [SEP] B [SEP] with types 0 then 1; A and B, masked tokens
    restored from the labels, are runs of the tokenised corpus with A before B (the
    truncation to seq - 3 may cut between them); most samples are unpadded."""
    samples, cls, sep = bert_samples["first"]
    stream = bert_samples["stream"]
    full = 0
    for s in samples:
        n = int(s["padding_mask"].sum())
        text = np.where(s["loss_mask"] == 1, s["labels"], s["text"])[:n].astype(np.int64)
        seps = np.flatnonzero(text == sep)
        assert text[0] == cls and len(seps) == 2 and seps[1] == n - 1
        types = s["types"][:n]
        assert not types[:seps[0] + 1].any() and types[seps[0] + 1:].all()
        seg_a, seg_b = text[1:seps[0]], text[seps[0] + 1:n - 1]
        # B follows A within one sample's reach (short runs recur: try every place of A)
        assert any(_runs(stream[a + len(seg_a):a + len(seg_a) + len(text)], seg_b)
                   for a in _runs(stream, seg_a)), (seg_a, seg_b)
        full += n == len(s["text"])
    assert full / len(samples) >= 0.75, full


def _train(*args):
    return subprocess.run([sys.executable, str(REPO / "train.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def bert_runs(tokenizers_dir, cache_dir, tmp_path_factory):
    """The issue's command, `train.py --config tiny_bert data.tokenizer=bert.json
    model.vocab_size=2000`, 3 steps with each layout; the "moved" run without
    evaluation (train.eval_interval=0)."""
    out = {}
    for layout, evals in (("first", ["train.eval_interval=3", "train.eval_iters=1"]),
                          ("moved", ["train.eval_interval=0"])):
        run = tmp_path_factory.mktemp("bert") / layout
        proc = _train("--config", "tiny_bert", "--run-dir", run,
                      f"data.tokenizer={tokenizers_dir[layout]}", "model.vocab_size=2000",
                      f"data.max_documents={DOCS}", f"data.cache_dir={cache_dir}", "train.iters=3",
                      "logging.wandb=disabled", *evals)
        out[layout] = (proc, run)
    return out


@pytest.mark.parametrize("layout", ["first", "moved"])
def test_bert_trains_with_wordpiece_tokenizer_json(bert_runs, layout):
    """Catches exit 1 with IndexError in the token-type embedding (specials at 0..4)
    and any failure with the specials elsewhere: 3 finite losses each."""
    proc, run = bert_runs[layout]
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and all(np.isfinite(r["loss"]) for r in records)


def test_console_and_summary_agree_without_evaluation(bert_runs):
    """Catches `final val ppl nan` on the console while summary.json says null."""
    proc, run = bert_runs["moved"]
    assert json.loads((run / "summary.json").read_text())["final_val_ppl"] is None
    assert "final val ppl none (no evaluation)" in proc.stdout and "nan" not in proc.stdout


def test_bert_without_mask_token_is_one_line_exit_2(tokenizers_dir, cache_dir, tmp_path):
    """A missing [MASK] is a one-line error naming it, and no run folder is left."""
    run = tmp_path / "run"
    proc = _train("--config", "tiny_bert", "--run-dir", run, f"data.tokenizer={tokenizers_dir['no_mask']}",
                  "model.vocab_size=2000", f"data.max_documents={DOCS}", f"data.cache_dir={cache_dir}",
                  "train.iters=3", "logging.wandb=disabled")
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "[MASK]" in lines[0], proc.stderr
    assert not run.exists()
