"""Compare training runs: a table of outcomes and validation-perplexity plots.

Reads each run directory's ``summary.json`` and ``metrics.jsonl`` (written by
:class:`jobruntime.metrics.MetricsWriter`).  Where one is missing, the run's
wandb offline log (``RUN/wandb/offline-run-*/run-*.wandb``) fills in; a path
may also be an ``offline-run-*`` folder itself.  A run without ``summary.json``
(interrupted) gets TTP, method and switches from its records and
``config.yaml`` (:func:`jobruntime.metrics.summary_from_records`: TTP interpolated
at the crossing of ``train.target_ppl``, as the runs compute it).  A run that did not
finish is marked in the run column: ``NAME (interrupted at step N)`` (no
``summary.json``, the partial one with ``"interrupted": true``, or an ordinary run
that stopped before ``train.iters`` with no target or time limit to explain it) or
``NAME (diverged at step N)`` (``diverged_at_step``: a loss that was not finite).
``--wandb-project`` adds the runs of an online wandb project (needs network access and
a login).

Table columns: run, method, clock (``wall`` or ``emulated``), TTP (clock
seconds to the target perplexity), final validation perplexity, tokens, and
the GeoMesh/CONA fields straggler idle, WAN idle (fractions of time, shown in
%), bytes per outer step and switches — ``-`` where a run does not have them.

Plots (matplotlib, Agg): validation perplexity against clock time and against
training tokens, one line per run: ``OUT/val_ppl_vs_time.png``,
``OUT/val_ppl_vs_tokens.png``; the table is also written as ``OUT/runs.csv``.

Usage::

    python tools/compare_runs.py runs/geomesh-* runs/diloco-* --out runs/comparison
"""

from __future__ import annotations

import argparse
import csv
import json
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from jobruntime.metrics import run_method, summary_from_records  # noqa: E402  (stdlib only)
from jobruntime.outputs import output_folder_error  # noqa: E402

COLUMNS = ("run", "method", "clock", "TTP (s)", "final ppl", "tokens", "straggler idle",
           "WAN idle", "bytes/outer step", "switches")


@dataclass
class Run:
    """One run's summary and metric records (``step``, ``tokens``, ``time_s``, ``val_ppl`` …)."""

    name: str
    summary: dict = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    source: str = "files"
    stopped: str | None = None  # how an unfinished run ended (:func:`stop_note`)


def _last_step(summary: dict, records: list[dict]):
    """The run's last step: the summary's ``steps``, else the last record's."""
    if isinstance(summary.get("steps"), int) and not isinstance(summary.get("steps"), bool):
        return summary["steps"]
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    return max(steps) if steps else "?"


def stop_note(summary: dict, records: list[dict], *, finished: bool, config: dict) -> str | None:
    """How a run that did not finish ended, for the table: ``"diverged at step N"``,
    ``"interrupted at step N"`` or ``"interrupted at step N of M"``; ``None`` for a
    finished run.

    Args:
        summary: what the run wrote at its end (``summary.json``, the wandb summary);
            ``{}`` where it wrote none.
        records: its ``metrics.jsonl`` records (for the last step where the summary has
            none).
        finished: whether the run wrote its final summary: a ``summary.json`` without
            ``"interrupted": true`` (``train.py`` writes that partial one on Ctrl-C,
            SIGTERM or a lost peer); a wandb summary with ``steps`` (a killed run's holds
            only wandb's own).
        config: the run's ``config.yaml`` (``{}`` where absent): a finished ordinary run
            with fewer steps than ``train.iters`` that no ``train.stop_at_target`` (target
            reached) or ``train.max_wall_s`` explains was stopped early too.
    """
    step = _last_step(summary, records)
    if summary.get("diverged_at_step") is not None:  # a loss that was not finite
        return f"diverged at step {summary['diverged_at_step']}"
    if not finished or summary.get("interrupted"):
        return f"interrupted at step {step}"
    train = config.get("train") or {}
    iters = train.get("iters")
    if (run_method(config) == "single" and isinstance(iters, int) and isinstance(step, int)
            and step < iters and train.get("max_wall_s") is None
            and not (train.get("stop_at_target") and summary.get("ttp_step") is not None)):
        return f"interrupted at step {step} of {iters}"
    return None


# ---------------------------------------------------------------------------
# wandb offline logs
# ---------------------------------------------------------------------------

_BLOCK = 32768
_HEADER = 7  # file header ":W&B" + magic (2) + version (1); record header crc (4) + len (2) + type (1)


def _wandb_records(path: Path):
    """Protobuf ``Record`` payloads of a ``.wandb`` file.

    The file is a LevelDB-style log: a 7-byte header, then 32 KiB blocks of
    chunks ``crc32 u32 | length u16 | type u8 | data`` with types FULL=1,
    FIRST=2, MIDDLE=3, LAST=4 (a record may span blocks).
    """
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path}: not a wandb transaction log")
    pos, pending = _HEADER, b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # block trailer padding
            pos += left
            continue
        _, length, kind = struct.unpack_from("<IHB", data, pos)
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0 and length == 0:  # zero padding at the end
            pos += _BLOCK - pos % _BLOCK if pos % _BLOCK else 0
            continue
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""


def read_wandb_offline(run_dir: Path) -> Run | None:
    """History and summary of the newest wandb offline run under ``run_dir`` (or ``run_dir``
    itself when it is an ``offline-run-*`` folder); ``None`` if there is none."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(run_dir.glob("run-*.wandb")) or sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    if not files:
        return None
    run = Run(name=run_dir.name, source="wandb-offline")
    for payload in _wandb_records(files[-1]):
        rec = pb.Record()
        try:
            rec.ParseFromString(payload)
        except Exception:  # a torn final record of a crashed run
            continue
        which = rec.WhichOneof("record_type")
        if which == "history":
            row = {}
            for item in rec.history.item:
                key = item.key or ".".join(item.nested_key)
                if item.value_json:
                    row[key] = json.loads(item.value_json)
            if "_step" in row and "step" not in row:
                row["step"] = row["_step"]
            run.records.append(row)
        elif which == "summary":
            for item in rec.summary.update:
                key = item.key or ".".join(item.nested_key)
                run.summary[key] = json.loads(item.value_json) if item.value_json else None
        elif which == "run" and rec.run.display_name:
            run.name = rec.run.display_name
    return run


def fetch_wandb_project(project: str) -> list[Run]:
    """Runs of an online wandb project (``entity/project`` or ``project``)."""
    import wandb

    out = []
    for r in wandb.Api().runs(project):
        records, summary = [dict(row) for row in r.scan_history()], dict(r.summary)
        out.append(Run(name=r.name, summary=summary, records=records, source="wandb-api",
                       stopped=stop_note(summary, records, finished="steps" in summary,
                                         config=dict(r.config))))
    return out


# ---------------------------------------------------------------------------
# Run directories
# ---------------------------------------------------------------------------


def load_run(path: str | Path) -> Run:
    """A run from its directory: files first, the wandb offline log for what is missing.

    Raises:
        FileNotFoundError: neither files nor a wandb offline log.
        ValueError: the files are not valid JSON objects (names the folder).
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: does not exist; give a run folder (runs/<preset>-<time>)")
    summary_f, metrics_f = path / "summary.json", path / "metrics.jsonl"
    run = Run(name=path.name)
    try:
        if summary_f.is_file():
            run.summary = json.loads(summary_f.read_text())
        if metrics_f.is_file():
            run.records = [json.loads(line) for line in metrics_f.read_text().splitlines()
                           if line.strip()]
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: summary.json or metrics.jsonl is not valid JSON in UTF-8 ({e}); "
                         "give a run folder written by train.py") from None
    if not isinstance(run.summary, dict) or not all(isinstance(r, dict) for r in run.records):
        raise ValueError(f"{path}: summary.json must hold an object and metrics.jsonl one object "
                         "per line; give a run folder written by train.py")
    if not run.summary or not run.records:
        wb = read_wandb_offline(path)
        if wb is None and not (run.summary or run.records):
            raise FileNotFoundError(f"{path}: no summary.json, metrics.jsonl or wandb offline run")
        if wb is not None:
            run.summary = run.summary or wb.summary
            run.records = run.records or wb.records
            run.source = "files+wandb" if (summary_f.is_file() or metrics_f.is_file()) else wb.source
    _check_numbers(path, run)
    config = _config(path)
    # finished: its own summary.json (not train.py's partial one), else a wandb summary
    # with the run's fields (what MetricsWriter.summary sets at the end)
    finished = summary_f.is_file() or "steps" in run.summary
    run.stopped = stop_note(run.summary, run.records, finished=finished, config=config)
    if not summary_f.is_file() and run.records:  # an interrupted run: what its records tell
        run.summary = {**summary_from_records(run.records, config), **run.summary}
    return run


def _config(path: Path) -> dict:
    """The run's resolved ``config.yaml`` (``{}`` if absent or unreadable: then no
    target, and the method is ``single``)."""
    import yaml

    try:
        config = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return config if isinstance(config, dict) else {}


# the values the table formats as numbers (summary.json keys; metrics.jsonl: val_ppl, tokens)
NUMERIC_KEYS = ("ttp_s", "final_val_ppl", "tokens", "straggler_idle_frac", "wan_idle_frac",
                "bytes_per_outer_step")


def _check_numbers(path: Path, run: Run) -> None:
    """Refuse a value the table formats as a number that is not one (names file and key)."""
    def bad(v) -> bool:
        return v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)))

    for key in NUMERIC_KEYS:
        if bad(run.summary.get(key)):
            raise ValueError(f"{path}/summary.json: {key}={run.summary[key]!r} is not a number; "
                             "give a run folder written by train.py")
    for i, r in enumerate(run.records, 1):
        for key in ("val_ppl", "tokens"):
            if bad(r.get(key)):
                raise ValueError(f"{path}/metrics.jsonl:{i}: {key}={r[key]!r} is not a number; "
                                 "give a run folder written by train.py")


def _final_ppl(run: Run):
    if run.summary.get("final_val_ppl") is not None:
        return run.summary["final_val_ppl"]
    vals = [r["val_ppl"] for r in run.records if r.get("val_ppl") is not None]
    return vals[-1] if vals else None


def _bytes(n) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000.0


def format_row(run: Run) -> dict[str, str]:
    """The table cells of one run (strings; ``-`` where a value is absent; the run's name
    followed by ``(interrupted at step N)`` or ``(diverged at step N)`` where it did not
    finish, :func:`stop_note`)."""
    s = run.summary

    def get(key, fmt):
        v = s.get(key)
        return "-" if v is None else fmt(v)

    final = _final_ppl(run)
    tokens = s.get("tokens", run.records[-1].get("tokens") if run.records else None)
    switches = s.get("switches")
    return {
        "run": run.name if run.stopped is None else f"{run.name} ({run.stopped})",
        "method": get("method", str) if "method" in s else get("mode", str),
        "clock": get("clock", str) if "clock" in s else (run.records[0].get("clock", "-") if run.records else "-"),
        "TTP (s)": get("ttp_s", lambda v: f"{v:.1f}"),
        "final ppl": "-" if final is None else f"{final:.2f}",
        "tokens": "-" if tokens is None else str(int(tokens)),
        "straggler idle": get("straggler_idle_frac", lambda v: f"{100 * v:.1f}%"),
        "WAN idle": get("wan_idle_frac", lambda v: f"{100 * v:.1f}%"),
        "bytes/outer step": get("bytes_per_outer_step", _bytes),
        "switches": "-" if switches is None else str(len(switches) if isinstance(switches, list) else switches),
    }


def format_table(rows: list[dict[str, str]]) -> str:
    """Fixed-width text table of ``rows`` (columns :data:`COLUMNS`)."""
    widths = {c: max(len(c), *(len(r[c]) for r in rows)) for c in COLUMNS}
    line = lambda cells: "  ".join(cells[c].ljust(widths[c]) for c in COLUMNS).rstrip()  # noqa: E731
    return "\n".join([line({c: c for c in COLUMNS}), line({c: "-" * widths[c] for c in COLUMNS}),
                      *(line(r) for r in rows)])


def plot_runs(runs: list[Run], out: Path) -> list[Path]:
    """Validation perplexity against clock time and tokens, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    clocks = {format_row(r)["clock"] for r in runs}
    paths = []
    for x_key, fname, label in (
        ("time_s", "val_ppl_vs_time.png", f"time (s, {'/'.join(sorted(clocks))} clock)"),
        ("tokens", "val_ppl_vs_tokens.png", "training tokens"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
        for run in runs:
            pts = [(r[x_key], r["val_ppl"]) for r in run.records
                   if r.get("val_ppl") is not None and r.get(x_key) is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", markersize=3, label=run.name)
        target = next((r.summary["target_ppl"] for r in runs if r.summary.get("target_ppl")), None)
        if target:
            ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:g}")
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("validation perplexity")
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / fname)
        plt.close(fig)
        paths.append(out / fname)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="*", help="run directories (or wandb offline-run-* folders)")
    p.add_argument("--wandb-project", default=None, help="also fetch this online wandb project")
    p.add_argument("--out", default="run_comparison", help="folder for plots and runs.csv")
    args = p.parse_args(argv)
    if problem := output_folder_error(args.out, "--out"):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    runs = []
    try:
        runs = [load_run(r) for r in args.runs]
        if args.wandb_project:
            runs += fetch_wandb_project(args.wandb_project)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # wandb API: network, login
        print(f"error: wandb project '{args.wandb_project}': {e}", file=sys.stderr)
        return 2
    if not runs:
        print("error: no runs given", file=sys.stderr)
        return 2
    rows = [format_row(r) for r in runs]
    if len({r["clock"] for r in rows} - {"-"}) > 1:
        print("warning: runs use different clocks (wall vs emulated); times are not comparable",
              file=sys.stderr)
    print(format_table(rows))
    out = Path(args.out)
    paths = plot_runs(runs, out)
    with open(out / "runs.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nplots: {', '.join(str(p) for p in paths)}; table: {out / 'runs.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
