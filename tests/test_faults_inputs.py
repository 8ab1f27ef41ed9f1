"""The faults bench's bad inputs (``bench/faults_inputs.py``) as a test: every seeded bad
input gets its loader's one-line error.  (Its hostile messages are the cases of
``tests/test_geomesh_trust.py`` and ``tests/test_geomesh_identity.py``.)"""

from __future__ import annotations


def test_every_bad_input_is_a_one_line_error(tmp_path):
    """Catches a loader that lets a traceback (any other exception type) or a multi-line
    message through, for configs as train.py checks them, cluster files, region shapes,
    wire bytes and checkpoint files."""
    from bench.faults_inputs import bad_inputs

    tried, clean = bad_inputs(10, tmp_path)
    assert tried >= 30  # most draws are bad: a seed that drew few would test little
    assert clean == tried
