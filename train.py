r"""Train a model with megatron-core: an ordinary job, GeoMesh or CONA.

Usage::

    # the bundled demo: tiny_gpt on the bundled Python-docs corpus (CPU is fine)
    python train.py

    # a preset, with overrides (section.key=value, type-checked)
    python train.py --config model_configs/tiny_gpt.yaml train.iters=100 train.lr=1e-3

    # several processes on one machine (gloo on CPU, NCCL on GPU)
    torchrun --nproc-per-node 4 train.py --config tiny_llama parallel.tp=2 parallel.pp=2

    # several nodes (run on each node; see docs/gpu.md for a SLURM script)
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \
        --rdzv-endpoint $HEAD_NODE:29500 train.py --config gpt3_1.3b parallel.tp=8

Exit codes: 0 done, 2 bad input (config, data, tokenizer, checkpoint), with a
one-line message on stderr naming the problem and the fix; 3 the run was
interrupted by a lost process or region or by SIGTERM (one line on every rank; the
run folder is kept, with ``summary.json`` saying ``"interrupted": true`` once a step
was recorded, and the line says whether a checkpoint was committed to resume from
with ``--config DIR/config.yaml --run-dir DIR checkpoint.load=DIR/checkpoints``); 130
stopped by Ctrl-C (SIGINT): one line on rank 0 naming the step and the run folder,
whose ``summary.json`` says ``"interrupted": true``.

Output (stdout): a log line when each phase longer than a moment starts and
ends (tokenizer training and tokenising, on first use of a corpus; the model
build; checkpoints; the evaluation after training), a log line every 5 % of the
steps (on a terminal a progress bar instead, on stderr; ``logging.progress``),
then the results.  Warnings and errors go to stderr.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import signal
import sys
import time
from pathlib import Path


def parse_args(argv):
    help_text = __doc__.replace("``", "").replace("::\n", ":\n")  # the docstring's RST, as text
    p = argparse.ArgumentParser(description=help_text,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny_gpt", help="preset name or YAML file (default: tiny_gpt)")
    p.add_argument("--run-dir", default=None, help="output folder (default: runs/<preset>-<time>)")
    p.add_argument("overrides", nargs="*", help="section.key=value overrides (every key, its "
                   "default and range: docs/configuration.md)")
    args = p.parse_intermixed_args(argv)  # overrides may come before and after --run-dir
    if args.run_dir:  # --run-dir=~/x reaches here unexpanded: it made a folder named "~"
        args.run_dir = os.path.expanduser(args.run_dir)
    return args


def _error(message: str, code: int = 2) -> int:
    """Print ``error: message`` (rank 0) and return the exit code (2: bad input)."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr)
    return code


def check_config(cfg, world_size: int, overrides: list[str] | tuple[str, ...] = ()) -> None:
    """Every check that needs only the config and the cluster file, before the heavy imports
    and the data (they came 40 s late): each section's settings; that ``data.path``
    exists (:func:`jobruntime.documents.resolve_data_path`); a GeoMesh job against its
    cluster file (:func:`geomesh.fleet.job_check.check_job`: the workers' layouts, regions
    and process count come from it); otherwise the layout against ``world_size`` processes
    (CONA's emulated clock lays out the proxy itself); then no override the job would not
    read (:func:`jobruntime.config.check_overrides_used`, given the cluster's mode).

    Raises:
        ConfigError: the first problem, named, with the fix (ClusterError included).
    """
    cfg.validate_sections()
    from jobruntime.config import ConfigError, check_overrides_used
    from jobruntime.documents import DataError, resolve_data_path  # no torch

    try:
        resolve_data_path(cfg.data.path)
    except DataError as e:
        raise ConfigError(str(e)) from None
    mode = None  # a GeoMesh cluster's, once its file is read: some keys only real mode reads
    if cfg.geomesh.method != "none":
        from geomesh.fleet.job_check import check_job  # no torch

        mode = check_job(cfg, world_size).cluster.mode
    elif not (cfg.cona.enabled and cfg.cona.clock == "emulated"):
        cfg.parallel.validate(cfg.model, world_size)
    check_overrides_used(cfg, overrides, geomesh_mode=mode)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jobruntime.config import ConfigError, load_config

    # Config errors first: they need no megatron import (~10 s) and no data.
    try:
        cfg = load_config(args.config, args.overrides)
        world = os.environ.get("WORLD_SIZE", "1")
        if not world.isdigit():
            raise ConfigError(f"WORLD_SIZE={world!r} is not a process count; launch with "
                              "torchrun (it sets WORLD_SIZE) or unset it")
        check_config(cfg, int(world), args.overrides)
    except ConfigError as e:
        return _error(str(e))
    default = Path(f"runs/{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir = Path(args.run_dir) if args.run_dir else default
    from jobruntime.outputs import RunFolderError, claim_run_folder, output_folder_error

    if problem := output_folder_error(run_dir, "--run-dir"):
        return _error(problem)
    new_run_dir, folder = False, None
    if int(os.environ.get("RANK", "0")) == 0:  # the job's other ranks take rank 0's folder
        resume = cfg.checkpoint.load if cfg.checkpoint.load_optimizer else None
        try:
            folder = claim_run_folder(args.run_dir, default, resume_from=resume)
        except RunFolderError as e:
            return _error(str(e))
        run_dir, new_run_dir = folder.path, folder.created

    from jobruntime.faults import exit_ctrl_c, on_sigint

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where it is ignored
        signal.signal(signal.SIGINT, on_sigint)  # from here a Ctrl-C is one line, not tracebacks
    outcome: dict = {"started": time.time()}  # summary.json files older are not this run's
    try:
        return _run(cfg, run_dir, folder, new_run_dir, outcome)
    except KeyboardInterrupt:  # any phase, any job kind (plain, GeoMesh, CONA): one place
        exit_ctrl_c(functools.partial(_report_ctrl_c, cfg, run_dir, new_run_dir, outcome)
                    if folder is not None else None)  # the other ranks exit quietly


def _report_ctrl_c(cfg, run_dir: Path, created: bool, outcome: dict) -> None:
    """Rank 0 after a Ctrl-C: ``summary.json`` with ``"interrupted": true`` and what the
    records tell (steps, TTP, final val ppl: :func:`jobruntime.metrics.summary_from_records`),
    and one line.  A folder this run created that holds no training output is removed,
    as on a bad-input error; a finished run's summary is kept."""
    from jobruntime.faults import resume_command
    from jobruntime.outputs import RUN_OUTPUTS

    lead = "\n" if sys.stderr.isatty() else ""  # after the progress bar and the terminal's ^C
    if (partial := _write_partial_summary(cfg, run_dir, outcome)) is None:
        print(f"{lead}interrupted before the first step; {_keep_nothing(run_dir, created)}",
              file=sys.stderr)
        return
    steps = partial["steps"]
    held = ", ".join(n for n in (*RUN_OUTPUTS, "config.yaml") if (run_dir / n).exists())
    unit = "outer step" if cfg.geomesh.method != "none" else "step"
    resume = resume_command(run_dir)
    print(f"{lead}interrupted at {unit} {steps}; partial results in {run_dir} ({held})"
          + (f"; {resume}" if resume else ""), file=sys.stderr)


def _keep_nothing(run_dir: Path, created: bool) -> str:
    """A run stopped before it recorded anything: remove its folder if this run created
    it (as on bad input), and say so: ``nothing to keep[ (removed DIR)]``."""
    if created:
        shutil.rmtree(run_dir, ignore_errors=True)
    return f"nothing to keep{f' (removed {run_dir})' if created else ''}"


def _write_partial_summary(cfg, run_dir: Path, outcome: dict) -> dict | None:
    """Rank 0 of a run stopped before its end: ``summary.json`` with ``"interrupted":
    true`` and what the records tell (:func:`jobruntime.metrics.summary_from_records`),
    unless the run finished (``outcome`` holds its summary).  Returns that partial
    summary, or ``None`` where nothing was trained or saved yet (no summary written)."""
    from jobruntime.metrics import read_records, summary_from_records, write_json_atomic

    records = read_records(run_dir / "metrics.jsonl")
    finished = _finished(run_dir / "summary.json", outcome)
    if not finished and not records and not (run_dir / "checkpoints").is_dir():
        return None
    partial = summary_from_records(records, cfg.to_dict())
    if not finished:
        write_json_atomic(run_dir / "summary.json",
                          {"interrupted": True, **partial, "model": cfg.name})
    return partial


def _finished(summary: Path, outcome: dict) -> bool:
    """This run wrote its full ``summary.json``: ``outcome`` holds it, or it was stopped
    while closing wandb, before ``outcome`` did (a summary without ``interrupted``,
    written since the run started)."""
    if "summary" in outcome:
        return True
    try:
        return (summary.stat().st_mtime >= outcome.get("started", float("inf"))
                and "interrupted" not in json.loads(summary.read_text()))
    except (OSError, ValueError):
        return False


def _exit_interrupted(cfg, run_dir: Path, folder, outcome: dict, why: str) -> None:
    """A run stopped by a lost peer or SIGTERM: rank 0 (the one holding ``folder``) writes
    the partial ``summary.json``; every rank prints its line and exits 3
    (:func:`jobruntime.faults.exit_interrupted`).  A further SIGTERM (the launcher's,
    after a scheduler's) is ignored from here: it raised inside this handler, a traceback
    and exit 1.  Stopped before anything was recorded (e.g. while torch imports), a
    folder this run created is removed, as after a Ctrl-C, and the line says so instead
    of how to resume."""
    from jobruntime.faults import exit_interrupted

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = os.environ.get("RANK", "0")
    if folder is not None:
        try:
            if _write_partial_summary(cfg, run_dir, outcome) is None:
                exit_interrupted(f"[rank {rank}] {why}; stopped before the first step, "
                                 f"{_keep_nothing(run_dir, folder.created)}", advice=False)
        except OSError as e:  # a full disk: the exit line still says what happened
            print(f"warning: no partial summary.json in {run_dir} ({e})", file=sys.stderr)
    exit_interrupted(f"[rank {rank}] {why}")


def _on_sigterm(signum, frame) -> None:
    """SIGTERM handler, from the moment the run folder is claimed (the imports of torch and
    megatron-core included): raise :class:`jobruntime.faults.StopRequested`, which
    ``train.py`` reports in one line with exit 3 (torchrun stops the other ranks this way
    when one dies)."""
    from jobruntime.faults import StopRequested

    why = ("from the launcher, which stops every rank when it is stopped itself or when a "
           "rank fails; see the other ranks' errors, if any"
           if "TORCHELASTIC_RUN_ID" in os.environ  # set by torchrun for its workers
           else "sent by another process, e.g. a scheduler or timeout")
    raise StopRequested(f"stopped by signal {signum} ({why})")


def _run(cfg, run_dir: Path, folder, new_run_dir: bool, outcome: dict) -> int:
    """Everything after the run folder is claimed: imports, the job, the results."""
    from jobruntime.config import ConfigError
    from jobruntime.faults import (
        RunInterrupted,
        StopRequested,
        ctrl_c_pressed,
        note_run_dir,
        peer_lost,
        stop_signals_held,
    )
    from jobruntime.logging_utils import phase, setup_logging
    from jobruntime.outputs import RUN_OUTPUTS

    bad_input: tuple[type[Exception], ...] = (ConfigError,)  # the rest once imported
    signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        setup_logging(info_stream=sys.stdout)  # progress on stdout, problems on stderr
        if folder is not None:
            note_run_dir(run_dir)  # the other ranks learn rank 0's folder when training starts
        with (phase(logging.getLogger("jobruntime"), "loading torch and megatron-core"),
              stop_signals_held()):  # a stop raised inside an import breaks the import
            from jobruntime.checkpoint import CheckpointError
            from jobruntime.data import DataError
            from jobruntime.tokenizer import TokenizerError

            if cfg.geomesh.method != "none":
                from geomesh.run import run as run_job
            elif cfg.cona.enabled:
                from cona.run import run as run_job
            else:
                from jobruntime.loop import run as run_job
            if cfg.train.zero_shot_tasks:
                from tools.zero_shot import end_of_run_hook

        bad_input = (ConfigError, DataError, TokenizerError, CheckpointError)
        if cfg.train.zero_shot_tasks:  # an ordinary run's (JobConfig refuses it elsewhere)
            run_job = functools.partial(run_job, end_of_run=end_of_run_hook(
                cfg.train.zero_shot_tasks, cfg.model.family))
        # All ranks use rank 0's run_dir (see jobruntime.parallel.same_run_dir).
        summary = outcome["summary"] = run_job(cfg, run_dir)
    except bad_input as e:
        error = str(e)
    except (RunInterrupted, StopRequested) as e:  # every rank says it: any may be the one left
        _exit_interrupted(cfg, run_dir, folder, outcome, str(e))
    except RuntimeError as e:  # a collective whose peer died, in any job and any phase
        if (why := peer_lost(e)) is None:
            raise
        _exit_interrupted(cfg, run_dir, folder, outcome,
                          f"another process of this job was lost ({why})")
    else:
        error = None
    finally:
        # Not imported here: a Ctrl-C while torch imports left it half-initialised, and
        # importing it again raised in this block (a traceback and exit 1, not 130).
        # Without jobruntime.parallel imported no process group was made to shut down.
        parallel = sys.modules.get("jobruntime.parallel")
        if parallel is not None and not ctrl_c_pressed():  # else exit_ctrl_c exits: no
            parallel.shutdown()  # teardown with stopped peers
        if folder is not None:
            folder.release()
    if error is not None:
        # A folder this invocation created, still without any training output, holds only
        # what the setup wrote (config.yaml, tokenizer, wandb/): remove it.  Once a step
        # was logged or saved (e.g. a GeoMesh region lost mid-run) nothing is deleted.
        started = any((run_dir / name).exists() for name in RUN_OUTPUTS)
        if new_run_dir and not started and int(os.environ.get("RANK", "0")) == 0:
            shutil.rmtree(run_dir, ignore_errors=True)
        return _error(error)
    if int(os.environ.get("RANK", "0")) == 0:
        ttp = summary.get("ttp_s")
        print(f"results: {run_dir.resolve()}  (metrics.jsonl, summary.json, config.yaml"
              f"{', checkpoints/' if (run_dir / 'checkpoints').is_dir() else ''}"
              f"{', wandb/' if summary.get('wandb_dir') else ''})")
        ppl = summary.get("final_val_ppl")  # null in summary.json: no evaluation ran
        target = summary.get("target_ppl")
        at = summary.get("final_val_step")  # a resumed run that did not evaluate: an earlier one
        at = f" (at step {at})" if at is not None and at != summary.get("steps") else ""
        none = "none (no finite evaluation)" if summary.get("diverged_at_step") is not None \
            else "none (no evaluation)"
        print(f"final val ppl {f'{ppl:.1f}{at}' if ppl is not None else none}, "
              + (f"target {target:g}, time to target (TTP) "
                 f"{f'{ttp:,.1f} s' if ttp is not None else 'not reached'}"
                 f" ({summary.get('clock', 'wall')} clock)" if target is not None else "no target")
              + f", {summary.get('tokens') or 0:,} tokens")
        for zs in summary.get("zero_shot", []):
            print(f"zero-shot {zs['task']}: accuracy {zs['accuracy']:.3f}, "
                  f"accuracy_norm {zs['accuracy_norm']:.3f} (n={zs['n']})")
    if summary.get("diverged_at_step") is not None:  # a failed run, not a finished one
        return _error(f"the loss is not finite (NaN or inf) at step "
                      f"{summary['diverged_at_step']}: training stopped and those weights were "
                      "not saved; lower train.lr (or raise train.warmup_iters, lower "
                      "train.clip_grad) and start again, or resume from a checkpoint saved "
                      "before the loss rose", code=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
