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


def test_every_wrong_setting_of_a_valid_job_is_refused_before_the_heavy_imports(monkeypatch):
    """Catches a wrong setting of a valid job (a GeoMesh region in emulated mode, a
    target model that names a cluster file, a real-mode job launched with the wrong
    process count) that ``train.py``'s own check lets through to fail after the megatron
    import and the data, or never: each base passes, each wrong setting is a one-line
    ConfigError."""
    import pytest

    from bench.faults_inputs import CONFIG_BASES, WRONG_SETTINGS
    from jobruntime.config import ConfigError, load_config
    from train import check_config

    monkeypatch.delenv("GEOMESH_SECRET", raising=False)
    for base, overrides in CONFIG_BASES.items():
        check_config(load_config("tiny_gpt", overrides), 1, overrides)
        for wrong in WRONG_SETTINGS[base]:
            with pytest.raises(ConfigError) as e:
                check_config(load_config("tiny_gpt", overrides + wrong), 1, overrides + wrong)
            assert "\n" not in str(e.value) and str(e.value), (base, wrong, str(e.value))
