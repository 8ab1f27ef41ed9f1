"""Where the CONA bench's noise-scale growth happens: along the segment, or at its start.

``bench/cona_ttp.py`` reads its growth bar (and its time scale) from two ends: the warm
state's own probe and the trend of the segment's probes at the target's loss.  That
ratio is the same whether the noise scale rises along the segment or steps up between
the warm state and the segment's first probes and stays flat after.  This bench reads a
result's stored probes again (no training) and reports, per family
(:func:`bench.cona_reference.segment_growth`):

- the direct growth (the bar's) with its 95 % bootstrap interval two ways: probes
  resampled one at a time (the pairs bootstrap, as the run reported it before) and in
  moving blocks (Politis & White's block length: probes that share a loss spike are
  correlated);
- the growth along the segment's own probes (the trend at the target over the trend at
  the warm state's loss), with its interval;
- what Kaplan et al. 2020's ``B_crit(L)`` gives over the same loss range, beside the
  trend's exponent and Kaplan's.

Usage::

    python bench/cona_growth.py --from docs/results/cona_ttp.json

Prints one JSON object: ``{"families": {NAME: {"probes", "segment_samples", "direct",
"direct_interval", "direct_interval_pairs", "along", "along_interval", "kaplan", "slope",
"kaplan_slope", "warm_loss", "target_loss", "bootstrap_block", "warm_probe",
"first_probes"}}, "from": {"file", "date", "commit", "machine", "command"}, "date",
"commit", "machine", "command"}`` (growths are ratios, losses in nats per token, noise
scales in proxy sequences; ``first_probes``: the noise scale of the segment's first
probes, the step's size).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

FIRST_PROBES = 4  # the segment's first probes, reported beside the warm state's


def growth_from(result: dict) -> dict:
    """Per family of a ``bench/cona_ttp.py`` result, :func:`bench.cona_reference.
    segment_growth` of its reference's stored probes, the direct growth's pairs-bootstrap
    interval beside it, and the noise scale (proxy sequences) of the warm probe and the
    segment's first :data:`FIRST_PROBES` probes.

    Raises:
        ValueError: a family's reference holds no probes (a result from before the bench
            stored them) or too few to fit (:func:`cona.targets.fit_noise_scale`).
    """
    from bench.cona_reference import probe_noise_scale, segment_columns, segment_growth
    from cona.targets import trend_interval

    families = {}
    for name, m in result["models"].items():
        ref = m.get("reference") or {}
        probes = ref.get("noise_scale_probes")
        if not probes:
            raise ValueError(f"{name}'s reference stores no noise-scale probes; run "
                             "bench/cona_ttp.py again")
        end_loss = math.log(m["target_ppl"])
        phi0 = ref["noise_scale_warm_proxy"]
        pairs = trend_interval(*segment_columns(probes), end_loss)
        families[name] = {
            "probes": len(probes) - 1, "segment_samples": ref["segment_samples"],
            **segment_growth(probes, end_loss, phi0),
            "direct_interval_pairs": [v / phi0 for v in pairs],
            "warm_probe": phi0,
            "first_probes": [probe_noise_scale(p) for p in probes[1:1 + FIRST_PROBES]]}
    return families


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", type=Path, required=True,
                   help="a bench/cona_ttp.py result JSON")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    args = p.parse_args(argv)
    from jobruntime.metrics import publish_json

    try:
        result = json.loads(args.source.read_text())
        out = {"families": growth_from(result)}
    except (OSError, ValueError, KeyError) as e:
        p.error(f"cannot read the growth from {args.source}: {e}")
    source = args.source.resolve()
    out["from"] = {"file": str(source.relative_to(ROOT)) if source.is_relative_to(ROOT)
                   else str(args.source),
                   **{k: result.get(k) for k in ("date", "commit", "machine", "command")}}
    publish_json(out, args.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
