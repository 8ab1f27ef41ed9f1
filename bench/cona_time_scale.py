"""The CONA bench's time scale, measured once per set-up and committed.

Rule 4 of ``bench/cona_ttp.py`` turns the reference's directly measured noise-scale range
into the span of the target's training one run stands for, and so into the step dilation
(:func:`cona.targets.time_scale`).  The rule is continuous, but steep in the range's end
(below: 11 % more noise scale there gave 34 % more dilation), and that end is read along a run
whose trajectory is not the same on two machines: float sums in another order drift
apart over hundreds of steps.  Measured on two 2-core machines at the same set-up:

- GPT-3 1.3B's proxy: the reference's first 22 probes agreed within 2 %, its last (at
  the target's crossing, one evaluation later on one machine) read 69.4 and 32.6, and
  the dilation came out 65.8 and 49.1;
- Llama-3.2-1B's proxy, whose loss spikes after its warmup: the runs parted in the
  spike, and the dilation came out 33.1 and 8.2.

Every TTP on the emulated clock scales with the dilation, so the bench's table moved
with the machine (CONA's ratios to the recipe and the best static on GPT-3 agreed to
two digits).  A time scale is a unit, not a result, so it is measured once, on a recorded
commit and machine, and committed (:data:`CALIBRATION`, written from a full bench run by
``python bench/cona_time_scale.py --from RESULT.json``); the bench then charges that
dilation on every machine, and still measures its own and reports it beside the one it
used (``time_scale.measured``).  An entry holds for the set-up it was measured on,
named by :func:`setup_digest`; a set-up without an entry (another proxy, recipe,
batch ratio, probe count, or BERT, never run in full) is measured as before, and the
result says so (``time_scale.calibration`` is ``None``, ``calibration_miss`` why).

Usage::

    python bench/cona_time_scale.py --from docs/results/cona_ttp.json  # rewrite CALIBRATION

Prints the calibration it writes (one JSON object: ``{"families": {NAME: {"setup_digest",
"step_dilation", "target_tokens_per_run", "target_loss_range",
"critical_batch_tokens_range", "noise_scale_warm_proxy", "noise_scale_target_proxy",
"segment_samples", "probes", "source"}}, "from": {"file", "date", "commit", "machine",
"command"}, "date", "commit", "machine", "command"}``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CALIBRATION = ROOT / "docs" / "results" / "cona_time_scale.json"
# what the reference's run and its probes depend on (the rest of the config -- the
# controller's settings, the emulated GPU and cluster, caches, logging -- does not)
SETUP_SECTIONS = ("model", "train", "data", "parallel")
SETUP_CONA = ("batch_ratio", "target_model", "eval_clock", "ttp_resolution")
SETUP_SETTINGS = ("probe_microbatches", "probe_density", "val_sequences", "quick_segment",
                  "warm_steps")
NOT_SETUP = {("data", "cache_dir"), ("train", "target_ppl")}
# an entry's keys (cona.targets.time_scale's record: step_dilation in target steps per
# proxy step, target_tokens_per_run in tokens, the ranges in nats/token and tokens)
ENTRY_KEYS = ("setup_digest", "step_dilation", "target_tokens_per_run", "target_loss_range",
              "critical_batch_tokens_range", "source")
FROM_KEYS = ("file", "date", "commit", "machine", "command")


def setup_digest(family: str, cfg, settings: dict) -> str:
    """A hex digest of what ``family``'s time scale depends on: its config's
    :data:`SETUP_SECTIONS` (less :data:`NOT_SETUP`), the cona keys :data:`SETUP_CONA`,
    the target model's config (its parameters and sequence length enter the rule), the
    bench settings :data:`SETUP_SETTINGS`, the target fraction and the rule's version
    (:data:`cona.targets.TARGET_FRACTION`, :data:`cona.targets.TIME_SCALE_RULE`).
    ``cfg``: the family's config (``bench.cona_ttp.family_config``); its target and
    dilation do not enter."""
    from cona.targets import TARGET_FRACTION, TIME_SCALE_RULE
    from jobruntime.config import load_config

    conf = dataclasses.asdict(cfg)
    blob = {s: {k: v for k, v in conf[s].items() if (s, k) not in NOT_SETUP}
            for s in SETUP_SECTIONS}
    blob["cona"] = {k: conf["cona"][k] for k in SETUP_CONA}
    target = cfg.cona.target_model
    blob["target"] = dataclasses.asdict(load_config(target).model) if target else None
    blob["settings"] = {k: settings.get(k) for k in SETUP_SETTINGS}
    blob["family"], blob["target_fraction"] = family, TARGET_FRACTION
    blob["rule"] = TIME_SCALE_RULE
    text = json.dumps(blob, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def load_calibration(path: Path = CALIBRATION) -> dict:
    """The committed calibration at ``path`` (module docstring); ``{"families": {}}``
    where the file does not exist.

    Raises:
        ValueError: the file is not JSON, not a calibration (no ``families`` object), or
            an entry or its ``from`` lacks a key (:data:`ENTRY_KEYS`,
            :data:`FROM_KEYS`); the message names the file and how to write it anew.
    """
    if not path.exists():
        return {"families": {}}
    fix = "write it anew: python bench/cona_time_scale.py --from RESULT.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read a CONA time-scale calibration ({e}); {fix}") \
            from e
    if not isinstance(data, dict) or not isinstance(data.get("families"), dict):
        raise ValueError(f"{path} is not a CONA time-scale calibration (no 'families'); {fix}")
    missing = [k for k in FROM_KEYS if k not in (data.get("from") or {})]
    missing += [f"{name}.{k}" for name, e in data["families"].items() for k in ENTRY_KEYS
                if not isinstance(e, dict) or k not in e]
    if missing:
        raise ValueError(f"{path}: the calibration lacks {', '.join(missing)}; {fix}")
    return data


def _repo_path(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it (what a result records)."""
    path = path.resolve()
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def _own(measured: dict, digest: str, why: str) -> dict:
    """This run's own time scale ``measured``, labelled: not calibrated, and ``why``."""
    return {**measured, "setup_digest": digest, "calibration": None, "calibration_miss": why}


def choose_time_scale(family: str, digest: str, measured: dict,
                      calibration: dict | None = None, path: Path = CALIBRATION) -> dict:
    """The time scale ``family``'s run charges: the calibration's where it holds an entry
    for set-up ``digest``, else ``measured`` (this run's :func:`cona.targets.time_scale`).

    Args:
        calibration: the calibration (default: :func:`load_calibration` of ``path``).
        path: the file it was read from, which the result names.

    Returns:
        the calibrated entry's ``step_dilation``, ``target_tokens_per_run``,
        ``target_loss_range``, ``critical_batch_tokens_range`` and ``source``, with
        ``calibration`` (``file`` and ``from``: the run it was measured in, its date,
        commit, machine and command) and ``measured`` (this run's own, for comparison);
        or ``measured`` with ``calibration`` ``None`` and ``calibration_miss`` (why).
        Both with ``setup_digest``.
    """
    cal = load_calibration(path) if calibration is None else calibration
    entry = cal["families"].get(family)
    if entry is None or entry.get("setup_digest") != digest:
        why = (f"no entry for {family}" if entry is None else
               f"{family}'s entry was measured on another set-up (digest "
               f"{entry.get('setup_digest')}, this run {digest})")
        logging.getLogger("cona").warning(
            "time scale measured in this run, not calibrated: %s; it moves between machines "
            "(bench/cona_time_scale.py)", why)
        return _own(measured, digest, why)
    return {**{k: entry[k] for k in ENTRY_KEYS}, "setup_digest": digest,
            "calibration": {"file": _repo_path(path), "from": cal["from"]},
            "measured": measured}


def pick_time_scale(family: str, cfg, settings: dict, measured: dict) -> dict:
    """What ``bench/cona_ttp.py``'s rule 4 charges for ``family``: ``measured`` in a
    quick run (its shallow segment is no set-up a calibration holds) or under
    ``settings["time_scale"] == "measured"`` (both labelled in ``calibration_miss``),
    else :func:`choose_time_scale` at :func:`setup_digest`."""
    digest = setup_digest(family, cfg, settings)
    if settings.get("quick_segment"):
        return _own(measured, digest, "a quick run measures its own")
    if settings.get("time_scale", "calibrated") == "measured":
        return _own(measured, digest, "--time-scale measured")
    return choose_time_scale(family, digest, measured)


def calibration_from(result: dict, result_file: str, settings: dict) -> dict:
    """A calibration from a full ``bench/cona_ttp.py`` result: per family with a measured
    time scale, that time scale and the reference's noise-scale range, keyed by the
    set-up digest of today's config for the family.  The result's set-up must be today's:
    its recorded digest (``time_scale.setup_digest``, in results made since the digest
    exists) must equal it; an older result's recorded proxy, overrides, warm steps,
    probes and batch ratio must.

    Raises:
        ValueError: the result is a quick run, holds no family with a measured time
            scale, or a family's recorded set-up differs from today's (the message names
            the field).
    """
    from bench.cona_ttp import MODELS, family_config
    from cona.mapping import BATCH_RATIO

    if result.get("quick"):
        raise ValueError(f"{result_file} is a --quick run; calibrate from a full run")
    families = {}
    for name, m in result["models"].items():
        ts = m.get("time_scale") or {}
        measured = ts.get("measured", ts)  # a calibrated run keeps its own beside
        if "error" in measured or not measured.get("target_tokens_per_run"):
            continue
        spec, ref = MODELS[name], m["reference"]
        recorded = {"proxy": (m["proxy"], spec["proxy"]),
                    "proxy_overrides": (m["proxy_overrides"], spec.get("overrides", [])),
                    "probe_microbatches": (ref["probe_microbatches"],
                                           settings["probe_microbatches"]),
                    "batch_ratio": (m["mapping"]["ratio"], BATCH_RATIO)}
        cfg = family_config(name, spec, settings, None)
        digest = setup_digest(name, cfg, settings)
        recorded["warm_steps"] = (ref["warm_steps"], cfg.train.warmup_iters)
        if "setup_digest" in ts:
            recorded["setup_digest"] = (ts["setup_digest"], digest)
        for field, (then, now) in recorded.items():
            if then != now:
                raise ValueError(f"{result_file}: {name}'s {field} was {then!r}, today's "
                                 f"set-up has {now!r}; run the bench again and calibrate "
                                 "from that run")
        families[name] = {
            "setup_digest": digest, **{k: measured[k] for k in ENTRY_KEYS[1:]},
            "noise_scale_warm_proxy": ref["noise_scale_warm_proxy"],
            "noise_scale_target_proxy": ref["noise_scale_target_proxy"],
            "segment_samples": ref["segment_samples"],
            "probes": len(ref["noise_scale_probes"])}
    if not families:
        raise ValueError(f"{result_file} holds no family with a measured time scale")
    return {"families": families,
            "from": {"file": result_file,
                     **{k: result.get(k) for k in ("date", "commit", "machine", "command")}}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", type=Path, required=True,
                   help="a full bench/cona_ttp.py result JSON")
    p.add_argument("--out", type=Path, default=CALIBRATION, help=f"default {CALIBRATION}")
    args = p.parse_args(argv)
    from bench.cona_ttp import FULL
    from jobruntime.metrics import json_text, provenance, write_json_atomic

    try:
        result = json.loads(args.source.read_text())
        cal = calibration_from(result, _repo_path(args.source),
                               dict(FULL, gpu="A100-80GB", num_gpus=64))
    except (OSError, ValueError, KeyError) as e:
        p.error(f"cannot calibrate from {args.source}: {e}")
    cal.update(provenance(argv))
    write_json_atomic(args.out, cal)
    print(json_text(cal, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
