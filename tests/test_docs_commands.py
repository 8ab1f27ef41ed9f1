"""The commands in the README and docs/ work as written (parsed, not run).

Every ``bash`` block of README.md and docs/*.md is split into commands.  A
``train.py`` command (``python`` or ``torchrun``) must parse with train.py's own
argument parser, load its preset with its overrides, pass the section checks and
the layout check for the launched world size, and, for GeoMesh, the method checks
and its cluster file.  A tool, bench or ``python -m geomesh.*`` command may use only
options that the script defines.  Nothing is trained.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"```bash\n(.*?)```", re.S)
# Placeholders a reader replaces with their own files (said so next to the command).
PLACEHOLDERS = ("FILE.yaml", "ckpt/llama1b/config.yaml")


def _blocks(page: Path) -> list[str]:
    """The page's bash blocks; for ``train.py``, the usage part of the docstring that
    ``--help`` prints."""
    if page.suffix == ".py":
        text = page.read_text()
        return [text[text.index("Usage::"):text.index("Exit codes")]]
    return FENCE.findall(page.read_text())


def _commands(page: Path) -> list[list[str]]:
    """Each shell command of the page's bash blocks, as argv (continuations joined,
    comments dropped, split at ``&&``, ``;``, ``&``, ``|`` and redirections)."""
    out = []
    for block in _blocks(page):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            lex = shlex.shlex(line, posix=True, punctuation_chars=True)
            lex.whitespace_split, lex.commenters = True, "#"
            argv: list[str] = []
            for tok in list(lex) + [";"]:
                if tok in ("&&", ";", "&", "|", "||", ">", ">>"):
                    if argv:
                        out.append(argv)
                    argv = [] if tok not in (">", ">>") else ["<redirect>"]
                elif argv[:1] != ["<redirect>"]:
                    argv.append(tok)
                else:
                    argv = []
    return out


def _script(argv: list[str]) -> tuple[str | None, list[str], int]:
    """(script path or ``-m`` module, its arguments, world size) of a python/torchrun
    command; ``(None, [], 0)`` for anything else."""
    if not argv:
        return None, [], 0
    if argv[0] == "python" and argv[1:2] == ["-m"]:
        return argv[2], argv[3:], 1
    if argv[0] == "python" and len(argv) > 1 and argv[1].endswith(".py"):
        return argv[1], argv[2:], 1
    if argv[0] in ("torchrun", "srun"):
        i = argv.index("torchrun") + 1 if argv[0] == "srun" else 1
        world, nodes = 1, 1
        while i < len(argv) and not argv[i].endswith(".py"):
            if argv[i] == "--nproc-per-node":
                world = int(argv[i + 1])
            if argv[i] == "--nnodes" and argv[i + 1].isdigit():
                nodes = int(argv[i + 1])
            i += 1
        return (argv[i], argv[i + 1:], world * nodes) if i < len(argv) else (None, [], 0)
    return None, [], 0


def _all() -> list[tuple[str, list[str]]]:
    return [(p.relative_to(REPO).as_posix(), argv) for p in [*PAGES, REPO / "train.py"]
            for argv in _commands(p)]


def test_train_help_keeps_its_line_breaks():
    """Catches ``train.py --help`` printing a continued command as one broken line: in
    a plain (not raw) docstring a backslash before a newline joins the lines."""
    import train

    assert train.__doc__.count("\\\n") >= 1
    assert max(len(line) for line in train.__doc__.splitlines()) <= 100


def test_the_pages_have_commands():
    """Catches a splitter that finds nothing (and so checks nothing)."""
    scripts = {_script(argv)[0] for _, argv in _all()}
    assert {"train.py", "tools/convert_checkpoint.py", "tools/zero_shot.py",
            "geomesh.launch_local", "bench/geomesh_ttp.py"} <= scripts


def test_train_commands_load_and_validate(monkeypatch, tmp_path):
    """Catches a documented train.py or launcher command with a renamed or mistyped key,
    a value out of range, a layout that does not fit its world size (a converted TP=2
    config on one process), an unknown cluster or region, a region shape or layout
    schedule the run would refuse, a GeoMesh setting the method refuses, or an override of
    a feature the command leaves off: all that
    ``train.py`` checks before its heavy imports (:func:`train.check_config`)."""
    import math

    import train
    from geomesh.fleet.cluster import load_cluster
    from geomesh.fleet.job_check import job_worker_shape
    from jobruntime.config import load_config
    from jobruntime.documents import DataError, resolve_data_path

    monkeypatch.setenv("GEOMESH_SECRET", "0" * 64)  # the launcher makes one per run
    secret = tmp_path / "secret"  # a page's geomesh.secret_file: its command makes one
    secret.write_text("0" * 64)
    corpus = tmp_path / "corpus.jsonl"  # stands for a data.path that is not here
    corpus.write_text('{"text": "a document"}\n')

    checked = 0
    for page, argv in _all():
        script, args, world = _script(argv)
        if any(p in " ".join(args) for p in PLACEHOLDERS):
            continue
        if script not in ("train.py", "geomesh.launch_local"):
            continue
        try:
            if script == "train.py":
                ns = train.parse_args(args)
                cfg = load_config(ns.config, overrides := ns.overrides)
            else:  # the launcher gives its overrides to every region's train.py
                cluster = args[args.index("--cluster") + 1]
                overrides = [a for a in args if "=" in a and not a.startswith("--")]
                cfg = load_config("tiny_gpt", overrides := [
                    "geomesh.method=geomesh", f"geomesh.cluster={cluster}",
                    "geomesh.region=West Europe", *overrides])
                world = math.prod(job_worker_shape(load_cluster(cluster), "West Europe"))
            if cfg.geomesh.secret_file:
                cfg.geomesh.secret_file = str(secret)
            try:  # a corpus of the user's (/data/pile.jsonl) or of an earlier command's
                resolve_data_path(cfg.data.path)
            except DataError:
                cfg.data.path = str(corpus)
            train.check_config(cfg, world, overrides)
        except Exception as e:  # name the page and the command
            raise AssertionError(f"{page}: {' '.join(argv)}: {e}") from e
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("page,argv", [x for x in _all() if _script(x[1])[0] not in
                                       (None, "train.py", "pytest")],
                         ids=lambda x: x if isinstance(x, str) else " ".join(x)[:60])
def test_tool_commands_use_existing_options(page, argv):
    """Catches a documented tool, bench or launcher command with an option the script
    does not define (renamed or never existed), or a script that does not exist."""
    script, args, _ = _script(argv)
    path = REPO / (script.replace(".", "/") + ".py" if not script.endswith(".py") else script)
    assert path.is_file(), (page, script)
    source = path.read_text()
    for opt in (a.split("=")[0] for a in args if a.startswith("--")):
        assert f'"{opt}"' in source, (page, script, opt)


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_resolve():
    """Catches a link in the README or docs/ to a file that does not exist or to a
    section (``#anchor``) that no heading of the target page makes, e.g. after a
    heading is renamed."""
    link = re.compile(r"\]\(([^)\s]+)\)")
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in link.findall(text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), (page.name, target)
            if anchor:
                prose = re.sub(r"```.*?```", "", dest.read_text(), flags=re.S)
                heads = {_slug(h) for h in re.findall(r"^#+ (.*)$", prose, re.M)}
                assert anchor in heads, (page.name, target, sorted(heads))
