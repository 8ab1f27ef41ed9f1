"""Generate ``docs/configuration.md`` from the configuration dataclasses.

Every section of :class:`jobruntime.config.JobConfig` and every key in it, with
its type, default, range and docstring, read from the code itself: types from
the annotations, defaults from a default-constructed config, docstrings from
the string that follows each field in ``jobruntime/config/``, and the range
from ``Literal`` choices and from the rules the validators state
(``need(..., "key", "must be ...")`` and ``check_preset(value, "section.key")`` calls and
``ConfigError`` messages of the
form ``section.key=... must ...`` in ``jobruntime/config/`` and
``geomesh/fleet/job_check.py``).

``python tools/config_reference.py`` rewrites the page; ``--check`` exits 1
when it is stale (the test suite runs it).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import re
import sys
import typing
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(REPO))
PAGE = REPO / "docs" / "configuration.md"
CONFIG_SOURCES = tuple(sorted((REPO / "jobruntime" / "config").glob("*.py")))  # one per section
SOURCES = (*CONFIG_SOURCES, REPO / "geomesh" / "fleet" / "job_check.py")
_RULE = re.compile(r"\b(model|parallel|train|data|checkpoint|logging|geomesh|cona)\.(\w+|\{\})"
                   r"(?:=\S*)? (must [^;:(]+)")


def _field_docs(tree: ast.Module) -> dict[str, dict[str, str]]:
    """``{class name: {field: docstring}}`` from the string after each annotated field."""
    out: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs = out.setdefault(node.name, {})
        body = node.body
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and \
                    isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant) and \
                    isinstance(b.value.value, str):
                docs[a.target.id] = " ".join(b.value.value.split())
    return out


@functools.cache
def _constants() -> dict[str, int | float]:
    """Module-level numeric constants of the config modules (``MAX_GLOBAL_BATCH``), which
    a rule's f-string may name: their values, not a placeholder, go into the page."""
    import importlib

    out: dict[str, int | float] = {}
    for path in CONFIG_SOURCES:
        module = importlib.import_module(f"jobruntime.config.{path.stem}")
        out.update({k: v for k, v in vars(module).items()
                    if k.isupper() and isinstance(v, int | float) and not isinstance(v, bool)})
    return out


def _text(node: ast.AST) -> str:
    """The literal text of a string or f-string (placeholders as ``{}``, a config
    module's named constant as its value)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        consts = _constants()

        def part(v: ast.AST) -> str:
            if isinstance(v, ast.Constant):
                return v.value
            name = getattr(getattr(v, "value", None), "id", None)
            return str(consts[name]) if name in consts else "{}"

        return "".join(part(v) for v in node.values)
    return ""


def _rules(trees: list[ast.Module]) -> dict[tuple[str, str], list[str]]:
    """``{(section, key): [rule, ...]}`` stated by the validators."""
    rules: dict[tuple[str, str], list[str]] = {}

    def add(section: str, key: str, rule: str) -> None:
        rule = re.sub(r",? got …$", "", " ".join(rule.replace("{}", "…").split()).rstrip(" ,."))
        if rule and rule not in rules.setdefault((section, key), []):
            rules[(section, key)].append(rule)

    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef):
                section = None  # need(ok, key, rule) closures name their section in _need
                for sub in ast.walk(node):
                    if isinstance(sub, ast.Call) and getattr(sub.func, "id", "") == "_need" \
                            and len(sub.args) >= 5:
                        section = _text(sub.args[1]) or section
                for sub in ast.walk(node):
                    if not isinstance(sub, ast.Call):
                        continue
                    name = getattr(sub.func, "id", "")
                    if name == "need" and len(sub.args) == 3 and section:
                        add(section, _text(sub.args[1]), _text(sub.args[2]))
                    elif name == "_need" and len(sub.args) >= 5:
                        add(_text(sub.args[1]), _text(sub.args[3]), _text(sub.args[4]))
                    elif name == "check_preset" and len(sub.args) == 2 and \
                            _text(sub.args[1]).count(".") == 1:
                        from jobruntime.config.loading import PRESET_RULE

                        add(*_text(sub.args[1]).split("."), PRESET_RULE)
            loop = []  # for name in ("a", "b"): ... ConfigError(f"section.{name} must ...")
            if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple):
                loop = [_text(e) for e in node.iter.elts]
            for sub in ast.walk(node) if loop else [node]:
                if isinstance(sub, ast.Call) and getattr(sub.func, "id", "") == "ConfigError":
                    text = "".join(_text(a) for a in sub.args)
                    for m in _RULE.finditer(text):
                        for key in (loop if m[2] == "{}" else [m[2]]):
                            add(m[1], key, m[3])
    return rules


def _type(hint) -> str:
    if typing.get_origin(hint) is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in typing.get_args(hint))
    s = str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return f"`{s}`"


def render() -> str:
    """The whole page."""
    from jobruntime.config import JobConfig

    trees = [ast.parse(p.read_text()) for p in SOURCES]
    docs = {k: v for tree in trees[:len(CONFIG_SOURCES)] for k, v in _field_docs(tree).items()}
    rules = _rules(trees)
    job = JobConfig()
    lines = ["# Configuration reference", "",
             "Every key a job takes, as `section.key=value` on the command line of "
             "`train.py` (or in a preset under `model_configs/`).  `train.py` refuses an "
             "override the job would not read, e.g. a `cona.*` key without "
             "`cona.enabled=true` or `train.iters` in a GeoMesh run (whose length is "
             "`geomesh.outer_steps`); the message names the setting that would count, and "
             "`jobruntime/config/unused.py` lists the rules.  Generated from "
             "`jobruntime/config/` by `python tools/config_reference.py`; do not edit by "
             "hand (a test fails when this page is stale).", ""]
    for section in dataclasses.fields(JobConfig):
        value = getattr(job, section.name)
        if not dataclasses.is_dataclass(value):
            continue
        cls = type(value)
        hints = typing.get_type_hints(cls)
        lines += [f"## `{section.name}`", "", " ".join((cls.__doc__ or "").split()), "",
                  "| key | type | default | range | description |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = getattr(value, f.name)
            rule = "; ".join(rules.get((section.name, f.name), [])) or "—"
            doc = docs.get(cls.__name__, {}).get(f.name, "").replace("|", "\\|")
            lines.append(f"| `{f.name}` | {_type(hints[f.name])} | `{default!r}` | {rule} | "
                         f"{doc} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.is_file() or PAGE.read_text() != text:
            print("error: docs/configuration.md is stale: run python tools/config_reference.py",
                  file=sys.stderr)
            return 1
        return 0
    tmp = PAGE.with_suffix(".md.tmp")
    tmp.write_text(text)
    tmp.replace(PAGE)
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
