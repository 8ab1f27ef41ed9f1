"""Result tables in the README and docs/ are rendered from committed bench JSON."""

from __future__ import annotations

import json

import pytest

from tools import render_results


def test_rendered_tables_are_current():
    """Catches a number edited by hand or a bench JSON re-committed without
    re-rendering: every results block of every page equals what
    tools/render_results.py writes from docs/results/."""
    assert render_results.main(["--check"]) == 0


def test_blocks_name_a_renderer_and_a_committed_file(tmp_path, monkeypatch):
    """Catches a block whose table has no source: an unknown result name and a
    missing JSON file are errors, a known one renders its numbers."""
    with pytest.raises(ValueError, match="no renderer"):
        render_results.render("<!-- results: nope -->\nx\n<!-- /results -->\n")
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    with pytest.raises(ValueError, match="is missing"):
        render_results.render("<!-- results: four_shape_cpu -->\n<!-- /results -->\n")
    src = render_results.REPO / "docs" / "results" / "four_shape_cpu.json"
    data = json.loads(src.read_text())
    data["measured"]["regions"][0]["final_val_ppl"] = 123.456
    (tmp_path / "four_shape_cpu.json").write_text(json.dumps(data))
    out, names = render_results.render("<!-- results: four_shape_cpu -->\nold\n<!-- /results -->\n")
    assert names == ["four_shape_cpu"] and "123.46" in out and "old" not in out
