"""Output folders named on a command line: refuse, with the flag and the fix, a path that
can never be a folder, before anything is computed or written."""

from __future__ import annotations

from pathlib import Path


def output_folder_error(path: str | Path, flag: str) -> str | None:
    """Why ``path`` cannot be used (or created) as a folder, else ``None``.

    A folder cannot be created where the path, or the nearest existing folder above it,
    is a file (``mkdir`` would raise ``FileExistsError`` / ``NotADirectoryError`` only
    after the work was done).

    Args:
        path: the folder (it need not exist).
        flag: the command-line flag or config key that named it, for the message.
    """
    path = Path(path)
    for q in (path, *path.absolute().parents):
        if not q.exists():
            continue
        if q.is_dir():
            return None
        if q == path:
            return f"{flag} {path} is a file; give a folder (it is created if missing)"
        return f"{flag} {path} lies under {q}, which is a file; give a folder path"
    return None


def refuse_output_folder(parser, path: str | Path | None, flag: str = "--out") -> None:
    """``parser.error`` (exit 2, usage and one line) if ``path`` cannot be a folder
    (:func:`output_folder_error`): for benches, before a run whose report would be lost."""
    if path is not None and (problem := output_folder_error(path, flag)):
        parser.error(problem)
