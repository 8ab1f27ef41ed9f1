"""The provenance line every rendered result table ends with (``tools/render_results.py``)."""


def source_line(r: dict, name: str) -> str:
    """Date, commit, machine and command of a bench JSON ``r`` (``provenance`` of
    :mod:`jobruntime.metrics`), and its file ``docs/results/<name>.json``."""
    return (f"*Measured {r['date'][:10]} at `{r['commit']}` on {r['machine']}: "
            f"`{r['command']}` (`docs/results/{name}.json`).*")
