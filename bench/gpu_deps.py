"""The GPU check's install part: make every module it needs importable, from a
carried wheel folder, or stop in one line saying what to carry.

A GPU machine lent to this project has torch, transformers and the small
libraries, but no megatron-core and no internet (``bench/gpu_check.sh``).
This probes the imports in a fresh interpreter (the caller's ``PYTHONPATH``,
which ``gpu_check.sh`` starts with ``--target``); when one fails, or the wheel
folder holds a wheel not yet in ``--target`` (such as pytest-xdist), it
installs all of them with ``pip install --no-index --no-deps --target`` (the
environment itself is left alone) and probes again.
It also checks that CUDA is present unless ``--device cpu`` (the stand-in).
Writes ``--report`` (JSON: Python, versions, where megatron-core came from,
the wheels installed, the GPU) and exits 0, or prints one line and exits 2::

    python bench/gpu_deps.py --wheels .whl --target runs/gpu_check_pydeps --report install.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# import name -> distribution: what the check's parts import (megatron-core's own hard
# dependencies are torch, numpy and packaging)
NEEDED = {"megatron.core": "megatron-core", "torch": "torch", "numpy": "numpy",
          "packaging": "packaging", "transformers": "transformers", "tokenizers": "tokenizers",
          "sentencepiece": "sentencepiece", "einops": "einops", "psutil": "psutil",
          "yaml": "PyYAML", "safetensors": "safetensors", "tqdm": "tqdm", "pytest": "pytest"}
PINNED = "megatron-core==0.16.1"

_PROBE = r"""
import importlib, importlib.metadata as md, json, sys
out = {"python": sys.version.split()[0], "missing": {}, "versions": {}, "cuda": None, "gpu": None}
for mod, dist in json.loads(sys.argv[1]).items():
    try:
        m = importlib.import_module(mod)
    except Exception as e:  # ImportError, or a broken install failing inside its import
        out["missing"][mod] = f"{type(e).__name__}: {e}".splitlines()[0]
        continue
    try:
        out["versions"][dist] = md.version(dist)
    except md.PackageNotFoundError:
        out["versions"][dist] = getattr(m, "__version__", None)
    if mod == "megatron.core":
        out["megatron_core_path"] = m.__file__
if "torch" in out["versions"]:
    import torch
    out["cuda"] = torch.cuda.is_available()
    out["gpu"] = torch.cuda.get_device_name() if out["cuda"] else None
print(json.dumps(out))
"""


def probe() -> dict:
    """Import each module of :data:`NEEDED` in a fresh interpreter.

    Returns:
        ``{"python", "missing": {module: first line of its error}, "versions":
        {distribution: version}, "cuda": bool | None, "gpu": name | None,
        "megatron_core_path"}``.
    """
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(NEEDED)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def carry_hint(wheels: Path) -> str:
    """The command that makes the wheel folder for this machine's Python."""
    tag = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (f"pip download --no-deps --only-binary=:all: --python-version {tag} --implementation cp "
            f"--platform manylinux_2_28_x86_64 -d {wheels} {PINNED} pytest-xdist execnet")


def install(wheels: Path, target: Path) -> list[str]:
    """``pip install --no-index --no-deps --target`` every wheel in ``wheels``.

    Returns:
        The wheel file names installed.

    Raises:
        subprocess.CalledProcessError: pip refused (its output is on stderr).
    """
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    "--disable-pip-version-check", "--upgrade", "--target", str(target), *files],
                   check=True, stdout=sys.stderr, env={**os.environ, "PIP_ROOT_USER_ACTION": "ignore"})
    return [Path(f).name for f in files]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--wheels", type=Path, default=Path(".whl"), help="the carried wheel folder")
    p.add_argument("--target", type=Path, required=True, help="pip --target (first on PYTHONPATH)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: the stand-in, no CUDA needed")
    p.add_argument("--report", type=Path, required=True)
    args = p.parse_args(argv)
    found, installed = probe(), []
    wheels = sorted(args.wheels.glob("*.whl")) if args.wheels.is_dir() else []
    # a wheel's dist-info folder is named by the first two parts of its file name
    new = [w for w in wheels if not (args.target / ("-".join(w.name.split("-")[:2]) + ".dist-info")).is_dir()]
    if found["missing"] or new:  # e.g. pytest-xdist, carried to run the tests side by side
        if not wheels:
            names = ", ".join(NEEDED[m] for m in found["missing"])
            print(f"gpu_check: {names} not importable ({next(iter(found['missing'].values()))}) "
                  f"and {args.wheels}/ holds no wheel: carry {args.wheels}/ with the wheel(s) for "
                  f"Python {found['python']}, e.g. {carry_hint(args.wheels)}", file=sys.stderr)
            return 2
        try:
            installed = install(args.wheels, args.target)
        except subprocess.CalledProcessError as e:
            print(f"gpu_check: pip could not install the wheels of {args.wheels}/ (exit "
                  f"{e.returncode}, above): carry wheels for Python {found['python']}, e.g. "
                  f"{carry_hint(args.wheels)}", file=sys.stderr)
            return 2
        found = probe()
        if found["missing"]:
            mod, err = next(iter(found["missing"].items()))
            print(f"gpu_check: after installing {', '.join(installed)} from {args.wheels}/, "
                  f"{mod} still fails ({err}): add the wheel of {NEEDED[mod]} for Python "
                  f"{found['python']} to {args.wheels}/", file=sys.stderr)
            return 2
    if args.device == "cuda" and not found["cuda"]:
        print("gpu_check: torch sees no CUDA device (torch.cuda.is_available() is False): run it "
              "on the GPU machine, or GPU_CHECK_DEVICE=cpu for the CPU stand-in", file=sys.stderr)
        return 2
    from jobruntime.metrics import write_json_atomic

    found.pop("missing")
    write_json_atomic(args.report, {**found, "device": args.device, "wheels": str(args.wheels),
                                    "installed": installed})
    mc = found["versions"]["megatron-core"]
    print(f"gpu_check: megatron-core {mc} from {found['megatron_core_path']}"
          + (f" (installed {', '.join(installed)})" if installed else ""))
    if f"megatron-core=={mc}" != PINNED:
        print(f"gpu_check: warning: the project is tested on {PINNED}, not {mc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
