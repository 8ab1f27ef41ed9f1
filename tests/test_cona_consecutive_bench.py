"""``bench/cona_consecutive.py`` (the noise scale from consecutive steps against the
within-step one, along one run) and its rendered table."""

from __future__ import annotations

import pytest


def test_renderer_shows_spaced_points_and_the_medians():
    """Catches a table that misstates its JSON: evenly spaced points (every fifth of 10
    here: the 2nd, 4th, 6th, 8th and 10th), a ratio per row worked out
    by hand, a missing estimate shown as such, and the medians by phase."""
    from tools import render_results  # noqa: F401 - puts tools/ on the path its renderers use
    from tools.render_cona_probes import cona_consecutive

    pts = [{"step": 20 * (i + 1), "loss": 7.0 - 0.1 * i, "lr": 1e-3,
            "within_step": 10.0, "consecutive": 10.0 * (i + 1)} for i in range(10)]
    pts[3]["consecutive"] = None
    r = {"config": "tiny_gpt", "global_batch_size": 8, "micro_batch_size": 4, "steps": 200,
         "points": pts, "median_ratio": 5.5, "median_ratio_by_phase": {"warmup": 3.0,
                                                                       "after": None},
         "date": "2026-12-07T06:00:00Z", "commit": "abc1234", "machine": "2 CPU cores",
         "command": "python bench/cona_consecutive.py"}
    out = cona_consecutive(r)
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split(" | ")[0] for row in rows] == ["| 40", "| 80", "| 120", "| 160", "| 200"]
    assert rows[0].endswith("| 10.0 | 20.0 | 2.00x |") and rows[1].endswith("| — | — |")
    assert "Median ratio over the 10 recorded points: 5.50x (warmup 3.00x, after it —)" in out
    assert "docs/results/cona_consecutive.json" in out
    r["points"] = pts[:7] + pts[7:] + pts[:5]  # 15 points: still 5 rows, the last one last
    rows = [line for line in cona_consecutive(r).splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 5 and rows[-1].startswith("| 100 |")


def test_bench_needs_two_micro_batches_and_measures_both(cache_dir):
    """Catches a bench that compares nothing: one micro-batch per step (no within-step
    estimate) is refused with the fix named, and a short run records both estimates,
    positive, at every point."""
    from bench.cona_consecutive import measure

    with pytest.raises(ValueError, match=">= 2 micro-batches"):
        measure("tiny_gpt", [f"data.cache_dir={cache_dir}", "parallel.micro_batch_size=8"],
                steps=4, every=2)
    run = measure("tiny_gpt", [f"data.cache_dir={cache_dir}", "model.num_layers=2",
                               "model.seq_length=64"], steps=6, every=3)
    assert [x["step"] for x in run["points"]] == [3, 6]
    assert all(x["within_step"] > 0 and x["consecutive"] > 0 for x in run["points"])
