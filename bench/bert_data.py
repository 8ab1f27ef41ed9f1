"""How often BERT batches are free of padding on a corpus (so SDPA can take its
no-mask, flash path: ``jobruntime.objective.bert_forward``).

Builds the preset's training and validation datasets exactly as ``train.py`` does
(megatron-core's ``BERTMaskedWordPieceDataset`` through ``jobruntime.data``) and
counts the samples and micro-batches without a padding position.  Prints one JSON
object; ``--out FILE`` also writes it (temp name, then rename):
``{"preset", "seq_length", "micro_batch_size", "samples", "splits": {SPLIT:
{"samples_unpadded", "microbatches_unpadded", "mean_padding_tokens"}}, "date",
"commit", "machine", "command"}`` (:func:`jobruntime.metrics.provenance`).

    python bench/bert_data.py [--config tiny_bert] [--samples 2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def padding_share(ds, samples: int, micro_batch_size: int) -> dict:
    """Shares of ``ds``'s first ``samples`` items (and of its consecutive micro-batches
    of ``micro_batch_size``) that hold no padding; mean padding tokens per sample."""
    pads = np.array([int((ds[i]["padding_mask"] == 0).sum()) for i in range(min(samples, len(ds)))])
    full = pads == 0
    n_mb = len(full) // micro_batch_size
    per_mb = full[:n_mb * micro_batch_size].reshape(n_mb, micro_batch_size).all(axis=1)
    return {"samples_unpadded": round(float(full.mean()), 4),
            "microbatches_unpadded": round(float(per_mb.mean()), 4),
            "mean_padding_tokens": round(float(pads.mean()), 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny_bert")
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("overrides", nargs="*", help="section.key=value")
    args = p.parse_args()
    from jobruntime.config import ConfigError, load_config
    from jobruntime.data import build_dataset, prepare_corpus
    from jobruntime.logging_utils import setup_logging
    from jobruntime.metrics import json_text, provenance, write_json_atomic
    from jobruntime.parallel import init_distributed, shutdown

    setup_logging()
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        p.error(str(e))
    if cfg.model.family != "bert":
        p.error(f"--config {args.config} is a {cfg.model.family} preset; give a BERT one")
    init_distributed()
    corpus = prepare_corpus(cfg.data, cfg.model)
    mbs = cfg.parallel.micro_batch_size
    splits = {split: padding_share(build_dataset(corpus, cfg.model, split, args.samples,
                                                 cfg.train.seed, cfg.data.cache_dir),
                                   args.samples, mbs)
              for split in ("train", "valid")}
    shutdown()
    report = {"preset": args.config, "data": cfg.data.path, "seq_length": cfg.model.seq_length,
              "micro_batch_size": mbs, "samples": args.samples, "splits": splits,
              **provenance()}
    print(json_text(report, indent=2))
    if args.out:
        write_json_atomic(Path(args.out), report)


if __name__ == "__main__":
    main()
