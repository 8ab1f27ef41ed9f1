"""Parameter counts and training FLOPs per token of the full-size presets.

Each model is built with megatron-core on the meta device (no weight memory),
so this runs on a laptop.  Prints one JSON object:
``{"models": {NAME: {"params", "params_padded", "analytic_params",
"flops_per_token", "build_s"}}}``.

    python bench/model_sizes.py [--models gpt3_1.3b llama3.2_1b bert_large]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", nargs="+", default=["gpt3_1.3b", "llama3.2_1b", "bert_large"])
    args = p.parse_args()
    from jobruntime.logging_utils import setup_logging

    setup_logging()
    from jobruntime.config import load_config
    from jobruntime.flops import flops_per_token, num_params
    from jobruntime.metrics import json_text
    from jobruntime.model import meta_parameter_count
    from jobruntime.parallel import initialize_layout, shutdown

    out = {}
    for name in args.models:
        cfg = load_config(name)
        initialize_layout(cfg)
        t0 = time.perf_counter()
        counts = meta_parameter_count(cfg)
        out[name] = {
            **counts,
            "analytic_params": num_params(cfg.model),
            "flops_per_token": flops_per_token(cfg.model),
            "build_s": round(time.perf_counter() - t0, 3),
        }
    shutdown()
    print(json_text({"models": out}, indent=2))


if __name__ == "__main__":
    main()
