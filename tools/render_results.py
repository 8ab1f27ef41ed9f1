"""Render result tables in the README and docs/ from committed bench JSON.

A table in a Markdown page sits between two markers naming its result file
(``docs/results/<name>.json``), and optionally a view of it (``headline``: the
short form the README shows, where a result has one)::

    <!-- results: four_shape_cpu -->
    ...generated table...
    <!-- /results -->

``python tools/render_results.py`` rewrites every such block from its JSON;
``--check`` changes nothing and exits 1 naming each stale block (the test
suite runs it), so a number in the docs is always one a committed bench
output holds.  Each result file has one renderer here (``RENDERERS``) and may
have more views (``VIEWS``); a block naming a file or view without one, or a
missing file, is an error.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from render_cona import (  # noqa: E402
    cona_repro,
    cona_rerun,
    cona_setup,
    cona_ttp,
    cona_ttp_bars,
    cona_ttp_headline,
)
from render_cona_efficiency import cona_adam_memory, cona_efficiency  # noqa: E402
from render_cona_probes import (  # noqa: E402
    cona_calibrate,
    cona_consecutive,
    cona_growth,
    cona_probe_precision,
    cona_split_cost,
)
from render_gpu import h200_check, h200_check_headline  # noqa: E402
from render_gpu import ratio as _ratio  # noqa: E402
from results_source import source_line as _source  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results"
PAGES = ("README.md", "docs/*.md")
BLOCK = re.compile(r"(?P<open><!-- results: (?P<name>[\w.-]+)(?: (?P<view>[\w-]+))? -->\n)"
                   r"(?P<body>.*?)(?P<close><!-- /results -->)", re.S)


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def four_shape_cpu(r: dict) -> str:
    """Per region: layout, final plan, wall time, bytes, idle; then real vs emulated."""
    m, e = r["measured"], r["equality"]
    lines = ["| region (GPU profile) | tp/pp/dp | b_i | H_i | rounds, wall s | compute s | "
             "straggler idle s | WAN idle s | sent | received | final val ppl |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for x in m["regions"]:
        lay = x["layout"]
        lines.append(f"| {x['region']} ({x['gpu']}) | {lay['tp']}/{lay['pp']}/{lay['dp']} | "
                     f"{x['batch_size']} | {x['inner_steps']} | {x['rounds_wall_s']:.1f} | "
                     f"{x['compute_s']:.1f} | {x['straggler_idle_s']:.1f} | "
                     f"{x['wan_idle_s']:.1f} | {_mb(x['bytes_sent'])} | "
                     f"{_mb(x['bytes_received'])} | {x['final_val_ppl']:.2f} |")
    digest = m["regions"][0]["global_weights_sha256"][:12]
    same = "the same in every region" if m["same_digest"] else "NOT the same in every region"
    replans = m["regions"][0]["replans"]
    lines += ["", f"{len(m['regions'])} regions, {m['distinct_layouts']} distinct layouts, "
              f"{len(m.get('rounds', [])) or '?'} rounds, {replans} re-plan(s) from measured step "
              f"times (imbalance of the rounds' compute times: "
              f"{', '.join(f'{x:.2f}' for x in (r['imbalance'] for r in m.get('rounds', [])))}); "
              f"θ_global's canonical SHA-256 `{digest}…` {same}.  With re-planning off, "
              f"the same cluster emulated (one TP1 process per worker, same plan and data) "
              f"differs from every region by at most {e['max_abs_val_loss_diff']:.1e} nats in "
              f"validation loss and {e['max_abs_loss_diff']:.1e} in training loss over "
              f"{e['rounds']} rounds (TP/PP summation order; the clocks differ).",
              "", _source(r, "four_shape_cpu")]
    return "\n".join(lines) + "\n"


# What each fault scenario of bench/faults.py injects and what surviving means (text);
# every number in the table comes from the scenario's record.
FAULTS = {
    "worker_killed_in_train": ("worker killed after its inner steps", "SIGKILL"),
    "worker_killed_at_exchange": ("worker killed after the quorum, before the all-gather",
                                  "SIGKILL"),
    "worker_killed_before_commit": ("worker killed after the all-gather, before commit",
                                    "SIGKILL"),
    "worker_killed_in_checkpoint_save": ("worker killed inside a checkpoint save", "SIGKILL"),
    "store_host_killed": ("store host (worker 0, torchft's quorum store) killed", "SIGKILL"),
    "late_join": ("late join: worker killed, restarted, healed from a live peer", "SIGKILL"),
    "late_join_across_layouts": ("late join across layouts: a TP2 job (2 processes) killed, "
                                 "restarted, healed from the TP1 region", "SIGKILL"),
    "late_join_dp2_serves_pp2": ("late join across layouts: a PP2 job killed, restarted, "
                                 "healed from a DP2 region", "SIGKILL"),
    "late_join_compress_update": ("late join, `compress_update=true` (no outer momentum): a "
                                  "TP1 job healed from a TP2 region", "SIGKILL"),
    "region_lost_mixed_shapes": ("region lost in a TP1/TP2/PP2 cluster: a rank of the PP2 "
                                 "job killed", "SIGKILL"),
    "network_stall": ("network stall 2 x heartbeat", "SIGSTOP"),
    "worker_lost_fail_policy": ("worker lost, `on_worker_loss=fail`", "SIGKILL"),
    "store_host_lost_fail_policy": ("store host lost, `on_worker_loss=fail`", "SIGKILL"),
    "lighthouse_restart": ("lighthouse killed, restarted on its address", "SIGKILL"),
    "lighthouse_lost": ("lighthouse killed for good", "SIGKILL"),
    "straggler_replan": ("a 10x straggler, re-planning on", "slowdown"),
    "cona_switch_killed": ("CONA: rank 1 killed inside a layout switch", "SIGKILL"),
    "cona_resume_old_layout": ("CONA: resume the last checkpoint at the old layout", "resume"),
    "cona_resume_new_layout": ("CONA: resume the last checkpoint at the new layout", "resume"),
}


def _fault_result(x: dict) -> str:
    """The measured part of a scenario's row: detection, stall, re-plans, digests."""
    out = []
    if "detect_s" in x:
        out.append(f"stopped {x['detect_s']:.1f} s after the death"
                   + (f" (bound {x['bound_s']:.1f} s)" if "bound_s" in x else ""))
    if "stall_s" in x:
        out.append(f"restarted after {x['restart_after_s']:.1f} s; {x['rounds_lost']} round(s) "
                   f"lost; longest round {x['stall_s']:.1f} s over the median "
                   f"({x['median_round_s']:.1f} s)")
    if "replans" in x:
        dev = x["max_token_deviation"]
        out.append(f"{x['replans']} re-plans; round tokens {min(x['round_tokens']):,}-"
                   f"{max(x['round_tokens']):,} against a budget of {x['token_budget']:,} "
                   f"(max deviation {100 * dev:.1f} %)")
    if "seconds" in x:
        out.append(f"survivor stopped in {x['seconds']:.1f} s, checkpoints kept")
    if "same_digest" in x and (x["same_digest"] or not x["survived"]):
        # (jobs that stop by design, e.g. a lighthouse lost for good, leave no final digest)
        out.append("θ_global digests " + ("equal" if x["same_digest"] else "DIFFER"))
    if "layouts" in x:
        out.append("layouts " + ", ".join(x["layouts"]))
    return "; ".join(out)


def faults_quick(r: dict) -> str:
    """The fault table: every scenario survived or not, with its measured figures."""
    sm = r["summary"]
    lines = ["| fault (real processes) | injected | survived | result | exit codes | bytes lost |",
             "|---|---|---|---|---|---:|"]
    for x in r["scenarios"]:
        what, how = FAULTS.get(x["scenario"], (x["scenario"].replace("_", " "), ""))
        codes = ", ".join("killed" if c == -9 else str(c) for c in x.get("exit_codes", []))
        lines.append(f"| {what} | {how} | {'yes' if x['survived'] else '**no**'} | "
                     f"{_fault_result(x)} | {codes} | {x['bytes_lost']} |")
    kinds = {k["kind"]: k for k in sm.get("hostile_kinds", [])}
    lines += ["", f"{sm['faults_survived']} of {sm['faults_injected']} faults survived, "
              f"{sm['hostile_rejected']} of {sm['hostile_tried']} hostile messages rejected"
              + (f" ({kinds['forged_identity']['rejected']} forged identities, "
                 f"{kinds['lying_statistics']['rejected']} lying statistics among them; honest "
                 "workers blamed: "
                 f"{kinds['forged_identity']['honest_blamed']})" if len(kinds) == 2 else "")
              + f", {sm['clean_errors']} of {sm['bad_inputs_tried']} bad inputs a one-line "
              f"error, {sm['bytes_lost']} bytes lost; {sm['wall_s']:.0f} s wall.",
              "", _source(r, "faults_quick")]
    return "\n".join(lines) + "\n"


def _h200_table(r: dict) -> list[str]:
    """Ours against the Hugging Face eager peer of the same run, per preset."""
    lines = ["| preset | micro / global batch, seq | ours tokens/s | MFU | peak GiB | "
             "HF eager peer tokens/s | MFU | peak GiB | ours / peer |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for x in r["presets"]:
        o, p = x["ours"], x["hf_eager"]
        peer = (f"{p['tokens_per_s']:,} | {p['mfu']:.3f} | {p['peak_gib']:.1f} | "
                f"{_ratio(o['tokens_per_s'] / p['tokens_per_s'])}") if p else "not run | | |"
        lines.append(f"| {x['name']} | {x['micro_batch_size']} / {x['global_batch_size']}, "
                     f"{x['seq_length']} | {o['tokens_per_s']:,} | {o['mfu']:.3f} | "
                     f"{o['peak_gib']:.1f} | {peer} |")
    return lines


def _h200_against(r: dict) -> str:
    """Ours against the reference peers the issue's author measured on the same GPU type."""
    ref, names = r["reference_peer"]["tokens_per_s"], {x["preset"]: x for x in r["presets"]}
    return ("Ours against the reference peer tokens/s of the same GPU type measured by the "
            "issue's author (not in this run): " + "; ".join(
                f"{names[k]['name']} " + " and ".join(
                    f"{_ratio(names[k]['ours']['tokens_per_s'] / v)} the {kind} {v:,}"
                    for kind, v in peers.items()) for k, peers in ref.items()) + ".")


def h200(r: dict) -> str:
    """One H200: ours against the Hugging Face peer, the reference peer, the memory model."""
    lines = _h200_table(r) + [
        "", f"MFU: {r['mfu_definition']}, {r['peak_tflops_bf16']} TFLOP/s; peak: "
        f"`{r['peak_memory_definition']}`.  {_h200_against(r)}", "",
        "| preset | memory model (GiB) | measured peak (GiB) | error |", "|---|---:|---:|---:|"]
    for x in r["presets"]:
        m = x["memory_model"]
        lines.append(f"| {x['name']} | {m['estimated_gib']:.1f} | {x['ours']['peak_gib']:.1f} | "
                     f"{m['relative_error_pct']:+.1f} % |")
    lines += ["", f"Memory model: {r['memory_model_note']}.  Not measured: {r['not_measured']}.",
              "", f"*Measured {r['date']} on {r['machine']}, {r['software']}: `{r['command']}`; "
              f"{r['provenance']} (`docs/results/h200_2026-11-30.json`).*"]
    return "\n".join(lines) + "\n"


def h200_headline(r: dict) -> str:
    """The README's short form of :func:`h200`: the throughput table, the reference peers
    and the source."""
    return "\n".join(_h200_table(r) + [
        "", _h200_against(r), "",
        f"*Measured {r['date']} on {r['machine']}, {r['software']}; transcribed from the run's "
        "printed output (`docs/results/h200_2026-11-30.json`; MFU, the memory model and what "
        "was not measured: [docs/gpu.md](docs/gpu.md#measured-on-one-nvidia-h200)).*"]) + "\n"


def bert_data(r: dict) -> str:
    """How often BERT samples and micro-batches are free of padding, per split."""
    lines = [f"| {r['preset']}, sequence {r['seq_length']} | samples without padding | "
             f"micro-batches of {r['micro_batch_size']} without padding | mean padding tokens "
             "per sample |", "|---|---:|---:|---:|"]
    for split, x in r["splits"].items():
        lines.append(f"| {split} | {100 * x['samples_unpadded']:.2f} % | "
                     f"{100 * x['microbatches_unpadded']:.2f} % | {x['mean_padding_tokens']:.2f} |")
    return "\n".join(lines + ["", _source(r, "bert_data")]) + "\n"


def _ttp(row: dict) -> str:
    """``mean ± half-range s (n/m)``: the seeds that reached the target, of those run."""
    n, m = row["reached"], len(row["seeds"])
    if not n:
        return f"missed (0/{m})"
    if n == 1:
        return f"{row['ttp_s_mean']:,.0f} s ({n}/{m})"
    spread = (row["ttp_s_max"] - row["ttp_s_min"]) / 2
    return f"{row['ttp_s_mean']:,.0f} ± {spread:,.0f} s ({n}/{m})"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def geomesh_peers(r: dict) -> str:
    """GeoMesh against each peer row (bench/geomesh_peers.py): TTP mean ± half the
    seeds' range, its ratio to GeoMesh's, final val ppl at equal tokens, bytes per
    round, straggler and WAN idle."""
    rows = r["rows"]
    ref = next((x for x in rows if x["row"] == "geomesh"), None)
    lines = ["| method (row) | H | outer lr | momentum | codec | TTP (seeds reached) | "
             "TTP / GeoMesh's | final val ppl | bytes per round | straggler idle | WAN idle |",
             "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|"]
    for x in rows:
        ratio = "—"
        if ref is not None and ref["ttp_s_mean"] and x["ttp_s_mean"]:
            ratio = f"{x['ttp_s_mean'] / ref['ttp_s_mean']:.2f}x"
        lines.append(
            f"| {x['method']} (`{x['row']}`) | {x['H']} | {x['outer_lr']:g} | "
            f"{'ramp' if x['ramp'] else 'constant'} | {x['codec']} | {_ttp(x)} | {ratio} | "
            f"{x['final_val_ppl_mean']:.1f} | {_mb(x['bytes_per_outer_step'])} | "
            f"{_pct(x['straggler_idle_frac'])} | {_pct(x['wan_idle_frac'])} |")
    s = r["settings"]
    lines += ["", f"Emulated {s['cluster']} cluster, time and bytes of {s['target_model']}, "
              f"convergence of {s['proxy']}; {s['mode']} run: {s['inner_steps_per_run']} inner "
              f"steps per run whatever H (equal tokens), evaluated every "
              f"{s['eval_every_inner_steps']} inner steps (or every round when H is larger); "
              f"seeds {', '.join(map(str, s['seeds']))}; TTP interpolated at the crossing of the "
              "target, mean ± half the range over the seeds that reached it; bytes per round "
              "(H inner steps) summed over the workers." + (f"  {r['note']}" if r.get("note")
                                                             else ""),
              "", _source(r, _peers_file(r))]
    return "\n".join(lines) + "\n"


def _peers_file(r: dict) -> str:
    """The committed file a peers result sits in: the quick run's has its own name."""
    return "geomesh_peers_quick" if r["settings"]["mode"] == "quick" else "geomesh_peers"


def geomesh_peers_headline(r: dict) -> str:
    """The README's short form: GeoMesh and each other method's row with the lowest
    mean TTP (a row that missed the target ranks last), with the seeds behind each."""
    rows = r["rows"]
    ref = next(x for x in rows if x["row"] == "geomesh")
    best: dict[str, dict] = {}
    for x in rows:
        if x["method"] == "geomesh":
            continue
        key = (x["ttp_s_mean"] is None, x["ttp_s_mean"] or 0.0)
        if x["method"] not in best or key < best[x["method"]][0]:
            best[x["method"]] = (key, x)
    lines = ["| method (best row) | H | TTP, emulated (seeds reached) | vs GeoMesh | "
             "final val ppl | bytes per round | straggler idle | WAN idle |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for x in [ref, *(v[1] for v in best.values())]:
        ratio = (f"{x['ttp_s_mean'] / ref['ttp_s_mean']:.1f}x slower" if x is not ref and
                 x["ttp_s_mean"] else "—")
        lines.append(f"| {x['method']} (`{x['row']}`) | {x['H']} | {_ttp(x)} | {ratio} | "
                     f"{x['final_val_ppl_mean']:.1f} | {_mb(x['bytes_per_outer_step'])} | "
                     f"{_pct(x['straggler_idle_frac'])} | {_pct(x['wan_idle_frac'])} |")
    s = r["settings"]
    lines += ["", f"Emulated four-region cluster (H100, A100, V100, T4; Azure WAN), GPT-3 1.3B's "
              f"time and bytes, `{s['proxy']}` trained for {s['inner_steps_per_run']} inner steps "
              "per run (equal tokens for every method and H); all rows, the H sweep and the "
              "low-bit Streaming DiLoCo: [docs/geomesh.md](docs/geomesh.md#geomesh-against-its-peers)."
              + (f"  {r['note']}" if r.get("note") else ""),
              "", _source(r, _peers_file(r))]
    return "\n".join(lines) + "\n"


def geomesh_peers_tune(r: dict) -> str:
    """A ``--tune-lr`` run of bench/geomesh_peers.py: per row, TTP and final val ppl at
    each outer lr of the grid, the chosen one (best final val ppl) in bold."""
    best = r["best_lr"]
    lines = ["| row | outer lr | TTP, emulated | final val ppl |", "|---|---:|---:|---:|"]
    for x in r["rows"]:
        base = re.sub(r"_lr\d+(?:\.\d+)?", "", x["row"])  # as bench/geomesh_peers.py names it
        mark = "**" if best[base] == x["outer_lr"] else ""
        ttp = "missed" if x["ttp_s_mean"] is None else f"{x['ttp_s_mean']:,.0f} s"
        lines.append(f"| `{base}` | {mark}{x['outer_lr']:g}{mark} | {ttp} | "
                     f"{mark}{x['final_val_ppl_mean']:.1f}{mark} |")
    s = r["settings"]
    lines += ["", f"{s['mode']} runs ({s['inner_steps_per_run']} inner steps), seed "
              f"{', '.join(map(str, s['seeds']))}; {r.get('note') or ''}",
              "", _source(r, "geomesh_peers_tune")]
    return "\n".join(lines) + "\n"


def demo_cpu(r: dict) -> str:
    """bench/demo.py: the README demo's wall time at first use and again, the phases
    that took longer than 5 s, and its TTP and final perplexity."""
    runs = {x["name"]: x for x in r["runs"]}
    first, again = runs["first use"], runs["again"]

    def took(run: dict, start: str) -> float:  # a phase's seconds; its name ends in paths
        return sum(v for k, v in run["phases_s"].items() if k.startswith(start))

    s = again["summary"]
    ttp = "not reached" if s["ttp_s"] is None else f"{s['ttp_s']:,.0f} s"
    return (f"On {r['machine'].split(',')[0]} the demo took {first['wall_s'] / 60:.1f} min at "
            f"first use ({took(first, 'preparing the data'):.0f} s of it preparing the data, "
            f"the tokenizer's training included) and {again['wall_s'] / 60:.1f} min again; "
            f"it reached its target perplexity {s['target_ppl']:g} after {ttp} (TTP, wall "
            f"clock) and ended at validation perplexity {s['final_val_ppl']:.1f}.  A shared "
            f"or loaded machine takes longer.\n\n" + _source(r, "demo_cpu") + "\n")


RENDERERS: dict[str, Callable[[dict], str]] = {"four_shape_cpu": four_shape_cpu,
                                               "demo_cpu": demo_cpu,
                                               "faults_quick": faults_quick,
                                               "h200_2026-11-30": h200,
                                               "h200_2026-12-04": h200_check,
                                               "bert_data": bert_data,
                                               "geomesh_peers": geomesh_peers,
                                               "geomesh_peers_quick": geomesh_peers,
                                               "geomesh_peers_tune": geomesh_peers_tune,
                                               "cona_ttp": cona_ttp,
                                               "cona_ttp_gns": partial(cona_ttp, file="cona_ttp_gns"),
                                               "cona_efficiency": cona_efficiency,
                                               "cona_efficiency_curvature": partial(
                                                   cona_efficiency,
                                                   file="cona_efficiency_curvature"),
                                               "cona_growth": cona_growth,
                                               "cona_consecutive": cona_consecutive,
                                               "cona_split_cost": cona_split_cost,
                                               "cona_probe_precision": cona_probe_precision,
                                               "cona_adam_memory": cona_adam_memory,
                                               "cona_repro": cona_repro,
                                               "cona_rerun": cona_rerun,
                                               "cona_rerun_progress": partial(
                                                   cona_rerun, file="cona_rerun_progress"),
                                               "cona_setup_bert_large": partial(
                                                   cona_setup, file="cona_setup_bert_large"),
                                               "cona_repro_before": partial(
                                                   cona_repro, file="cona_repro_before"),
                                               "cona_repro_probes": partial(
                                                   cona_repro, file="cona_repro_probes"),
                                               "cona_repro_bf16": partial(
                                                   cona_repro, file="cona_repro_bf16"),
                                               "cona_ttp_quick": cona_ttp,
                                               **{f"cona_calibrate_bf16_{f}": partial(
                                                   cona_calibrate,
                                                   file=f"cona_calibrate_bf16_{f}")
                                                  for f in ("gpt3_1.3b", "llama3.2_1b")}}
VIEWS: dict[tuple[str, str], Callable[[dict], str]] = {
    ("h200_2026-11-30", "headline"): h200_headline,
    ("h200_2026-12-04", "headline"): h200_check_headline,
    ("geomesh_peers", "headline"): geomesh_peers_headline,
    ("cona_ttp", "headline"): cona_ttp_headline,
    ("cona_ttp", "bars"): cona_ttp_bars,
    ("cona_ttp_quick", "headline"): cona_ttp_headline}


def render(text: str) -> tuple[str, list[str]]:
    """``text`` with every result block regenerated, and the names of the blocks.

    Raises:
        ValueError: a block names a result without a renderer or a JSON file.
    """
    names = []

    def one(m: re.Match) -> str:
        name, view = m["name"], m["view"]
        renderer = VIEWS.get((name, view)) if view else RENDERERS.get(name)
        if renderer is None:
            raise ValueError(f"results block '{name}{' ' + view if view else ''}': no renderer "
                             "in tools/render_results.py")
        path = RESULTS / f"{name}.json"
        if not path.is_file():
            raise ValueError(f"results block '{name}': docs/results/{path.name} is missing")
        names.append(name)
        return m["open"] + renderer(json.loads(path.read_text())) + m["close"]

    return BLOCK.sub(one, text), names


def pages() -> list[Path]:
    return [p for pattern in PAGES for p in sorted(REPO.glob(pattern))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a page is stale")
    args = ap.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text()
        try:
            new, names = render(text)
        except ValueError as e:
            print(f"error: {page.relative_to(REPO)}: {e}", file=sys.stderr)
            return 2
        if new != text:
            stale.append(f"{page.relative_to(REPO)} ({', '.join(names)})")
            if not args.check:
                tmp = page.with_suffix(page.suffix + ".tmp")
                tmp.write_text(new)
                tmp.replace(page)
    if args.check and stale:
        print("error: stale result tables in " + "; ".join(stale)
              + ": run python tools/render_results.py", file=sys.stderr)
        return 1
    for s in stale:
        print(f"rendered {s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
