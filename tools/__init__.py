"""Command-line tools around the job runtime: checkpoint conversion, data
preparation, run comparison and zero-shot evaluation (see ``docs/tools.md``)."""
