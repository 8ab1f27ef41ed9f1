"""Is the CONA bench's table the same on another machine?  Two runs of
``bench/cona_ttp.py`` at the same set-up, compared method by method.

Issue 23's bar: the same commit gives the same table on any 2-core machine, within the
seed spread the bench reports.  For each family both runs hold and each method, this
reports both runs' mean TTP over their seeds, their difference and the larger of the
two runs' seed standard deviations (the spread the table shows): ``within_seed_spread``
is ``|mean_b - mean_a| <= max(sd_a, sd_b)``.  Also the step dilation each run charged
and measured (``bench/cona_time_scale.py``): a run that measured its own scales every
TTP with it (switch costs, which are not dilated, aside), and CONA's ratios to the other
methods, which move with it only through the switch costs.

``--across-setups`` compares two set-ups on purpose (a change to the set-up, e.g. the
probes' size, with the warm states and everything else the same): the digests are
recorded, not required to match, and the report says so (``across_setups``).

Usage::

    python bench/cona_repro.py docs/results/cona_ttp.json runs/other/cona_ttp.json

Prints one JSON object: ``{"a": {"file", "date", "commit", "machine"}, "b": {...},
"models": {NAME: {"step_dilation": {"a", "b"}, "step_dilation_measured": {"a", "b"},
"methods": {METHOD: {"ttp_s": {"a", "b"}, "sd_s": {"a", "b"}, "b_over_a",
"b_over_a_at_equal_dilation", "diff_over_spread", "within_seed_spread"}},
"cona_ratios": {"a": {...}, "b": {...}}}},
"within_seed_spread": {"methods", "of"}, "date", "commit", "machine", "command"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _dilations(m: dict) -> tuple[float | None, float | None]:
    """``(charged, measured)``: the dilation a family's run charged, and the one it
    measured (the same where it charged its own)."""
    ts = m.get("time_scale") or {}
    return ts.get("step_dilation"), (ts.get("measured") or ts).get("step_dilation")


def compare_method(a: dict | None, b: dict | None, dilation_a_over_b: float | None) -> dict:
    """One method of one family in runs ``a`` and ``b`` (``models.F.methods.M`` records:
    ``ttp_s`` the mean over seeds, ``ttp_s_sd``); ``None`` fields where a run missed.
    ``b_over_a_at_equal_dilation``: ``b_over_a`` times the ratio of the dilations the
    runs charged, what it would be had both charged ``a``'s (approximately: switch
    costs are not dilated)."""
    ta, tb = (a or {}).get("ttp_s"), (b or {}).get("ttp_s")
    sa, sb = (a or {}).get("ttp_s_sd"), (b or {}).get("ttp_s_sd")
    spread = max((s for s in (sa, sb) if s is not None), default=None)
    both = ta is not None and tb is not None
    known = both and spread is not None  # one seed per run: no spread to judge by
    return {"ttp_s": {"a": ta, "b": tb}, "sd_s": {"a": sa, "b": sb},
            "b_over_a": tb / ta if both else None,
            "b_over_a_at_equal_dilation": tb / ta * dilation_a_over_b
            if both and dilation_a_over_b else None,
            "diff_over_spread": abs(tb - ta) / spread if known and spread > 0 else None,
            "within_seed_spread": abs(tb - ta) <= spread if known else None}


def compare(a: dict, b: dict, across_setups: bool = False) -> dict:
    """Runs ``a`` and ``b`` (two ``bench/cona_ttp.py`` JSONs) over their common families
    (module docstring); ``across_setups``: their set-ups may differ (each family records
    both digests).

    Raises:
        ValueError: the runs share no family, one is a quick run and the other not, or a
            family's recorded set-up digests differ (``time_scale.setup_digest``, in
            results made since it exists: another proxy, recipe or rule) and
            ``across_setups`` is not set.
    """
    if bool(a.get("quick")) != bool(b.get("quick")):
        raise ValueError("one run is --quick and the other is not: compare like with like")
    common = [f for f in a["models"] if f in b["models"]]
    if not common:
        raise ValueError(f"no common family: {sorted(a['models'])} vs {sorted(b['models'])}")
    models, inside, total = {}, 0, 0
    for f in common:
        ma, mb = a["models"][f], b["models"][f]
        da, db = ((m.get("time_scale") or {}).get("setup_digest") for m in (ma, mb))
        if da and db and da != db and not across_setups:
            raise ValueError(f"{f}: the runs were made on different set-ups (digests {da} "
                             f"and {db}): compare like with like")
        (ka, kma), (kb, kmb) = _dilations(ma), _dilations(mb)
        methods = {}
        for name in ma["methods"]:
            if name not in mb["methods"]:
                continue
            methods[name] = compare_method(ma["methods"][name], mb["methods"][name],
                                           ka / kb if ka and kb else None)
            ok = methods[name]["within_seed_spread"]
            if ok is not None:
                inside, total = inside + ok, total + 1
        models[f] = {"step_dilation": {"a": ka, "b": kb},
                     "step_dilation_measured": {"a": kma, "b": kmb},
                     "target_ppl": {"a": ma.get("target_ppl"), "b": mb.get("target_ppl")},
                     "setup_digest": {"a": da, "b": db},
                     "methods": methods,
                     "cona_ratios": {"a": ma.get("ratios"), "b": mb.get("ratios")}}
    return {"models": models, "within_seed_spread": {"methods": inside, "of": total},
            "across_setups": across_setups}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a", type=Path, help="a bench/cona_ttp.py result JSON")
    p.add_argument("b", type=Path, help="another run's, same set-up")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--across-setups", action="store_true",
                   help="compare two set-ups on purpose (module docstring)")
    args = p.parse_args(argv)
    from jobruntime.metrics import publish_json

    try:
        ra, rb = (json.loads(x.read_text()) for x in (args.a, args.b))
        report = compare(ra, rb, args.across_setups)
    except KeyError as e:
        p.error(f"cannot compare {args.a} and {args.b}: a result lacks the key {e} "
                "(is each a bench/cona_ttp.py JSON?)")
    except (OSError, ValueError) as e:
        p.error(f"cannot compare {args.a} and {args.b}: {e}")
    for key, path, r in (("a", args.a, ra), ("b", args.b, rb)):
        report[key] = {"file": str(path), **{k: r.get(k) for k in ("date", "commit", "machine",
                                                                    "command")}}
    publish_json(report, args.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
