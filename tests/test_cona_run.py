"""CONA's run loop end to end: real mode on 4 gloo ranks (wall clock) and emulated mode.

Real mode starts tiny_gpt at DP1-PP4 (a pipeline bubble the cost model sees)
with DP4 and DP2-TP2 as candidates, so the controller must switch layouts at
the first decision; the run then has to finish with wall-clock metrics, the
measured switch in ``metrics.jsonl`` and a summary naming the chain.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.dist_utils import launch

COMMON = [
    "model.seq_length=64",
    "logging.wandb=disabled",
    "cona.enabled=true",
    "train.warmup_iters=2",
]


def _real(cache_dir, run_dir):
    import torch

    torch.set_num_threads(1)
    from cona.run import run
    from jobruntime.config import load_config

    cands = (
        "[{dp: 4, tp: 1, pp: 1, micro_batch_size: 2, global_batch_size: 16},"
        " {dp: 2, tp: 2, pp: 1, micro_batch_size: 2, global_batch_size: 16}]"
    )
    cfg = load_config(
        "tiny_gpt",
        [
            f"data.cache_dir={cache_dir}",
            *COMMON,
            "parallel.pp=4",
            "parallel.micro_batch_size=2",
            "parallel.global_batch_size=16",
            "train.iters=12",
            "train.eval_interval=6",
            "cona.decision_interval=4",
            "cona.horizon_steps=1000",
            f"cona.candidates={cands}",
        ],
    )
    return run(cfg, Path(run_dir))


def _emulated(cache_dir, run_dir):
    """The emulated run, then (same process) the probe's micro-batch norms by hand."""
    import torch

    torch.set_num_threads(1)  # the machine is shared: no OpenMP oversubscription
    from cona.run import run
    from jobruntime.config import load_config

    cfg = load_config(
        "tiny_gpt",
        [
            f"data.cache_dir={cache_dir}",
            *COMMON,
            "cona.clock=emulated",
            "cona.target_model=gpt3_1.3b",
            "cona.num_gpus=8",
            "cona.global_batch_sizes=[8,16]",
            "train.iters=16",
            "train.eval_interval=8",
            "cona.decision_interval=4",
        ],
    )
    summary, probe = run(cfg, Path(run_dir)), _probe_by_hand(cfg)
    probe["batch_switch"] = _forced_batch_switch(cfg)
    return summary, probe


def _forced_batch_switch(cfg):
    """An emulated job's loop: 2 steps at its start strategy, a switch to a candidate of
    another global batch, 2 more; each step's tokens, samples and proxy batch."""
    from cona.context import build_context
    from cona.run import Loop

    ctx = build_context(cfg)
    job = ctx.make_job()
    loop = Loop(job, cfg, budget_samples=10**9, eval_samples=10**9)
    other = next(c for c in ctx.candidates if c.global_batch_size != job.strategy.global_batch_size)
    for k in range(4):
        if k == 2:
            job.apply(other)
        loop.step()
    return [(r["tokens"], r["samples"], ctx.mapping.proxy_batch(r["global_batch_size"]))
            for r in loop.progress.records if r.get("event") == "step"]


def _probe_by_hand(cfg):
    """Probe norms of one step (dp=1, 4 micro-batches) and the same norms recomputed from
    separate forward/backward passes of each micro-batch alone and of all four."""
    import torch

    from cona.grad_stats import GradientNoiseScale
    from cona.job import build_datasets
    from cona.probe import GNSProbe
    from cona.state import build_trainer, restore, snapshot, strategy_config
    from cona.strategy import Strategy
    from jobruntime.data import GlobalBatchSampler
    from jobruntime.parallel import initialize_layout, set_seed

    c = strategy_config(cfg, Strategy(1, 1, 1, 2, 8), lr=cfg.train.lr, min_lr=cfg.train.min_lr)
    initialize_layout(c)
    set_seed(c.train.seed)
    trainer = build_trainer(c, 8)
    data = build_datasets(c, train_samples=64, val_samples=8)
    mbs = GlobalBatchSampler(
        data.train, global_batch_size=8, micro_batch_size=2, dp=1, dp_rank=0
    ).microbatches_at(0)
    state = snapshot(trainer)
    probe = GNSProbe(GradientNoiseScale())
    probe.attach(trainer)
    trainer.train_step(mbs)
    probe.detach()
    got = probe.last
    precond = _preconditioner_checks(trainer, mbs)
    restore(trainer, state)
    curvature = _curvature_checks(trainer, mbs)
    restore(trainer, state)
    online_precond = _preconditioned_probe_by_hand(trainer, mbs)
    restore(trainer, state)

    def sq_norm_after(batch):
        trainer.zero_grad()
        trainer._run_schedule(batch, forward_only=False)
        return sum(float(p.main_grad.double().pow(2).sum()) for p in trainer.module.parameters())

    with torch.enable_grad():
        want_small = sum(sq_norm_after(mbs[i : i + 1]) for i in range(len(mbs))) / len(mbs)
        want_big = sq_norm_after(mbs)
    return {"probe": got, "small": want_small, "big": want_big, "precond": precond,
            "online_precond": online_precond, "curvature": curvature}


def _curvature_checks(trainer, mbs):
    """cona.curvature on the real model: its float64 copy's loss beside the trainer's, its
    second difference of the loss along a direction beside the change of the trainer's
    own gradients along it (backward passes: another path), and whether a measurement
    leaves the weights and the RNG as they were."""
    import math

    import torch

    from cona.curvature import float64_probe, measure_curvature_stats
    from cona.probe import _grad, _is_counted

    before, rng = trainer.get_params(), torch.get_rng_state()
    stats = measure_curvature_stats(trainer, mbs[:2], mbs[2:], directions=2)
    after = trainer.get_params()
    unchanged = (all(torch.equal(before[k], after[k]) for k in before)
                 and torch.equal(rng, torch.get_rng_state()))
    probe = float64_probe(trainer, mbs)
    counted = {n: p for n, p in trainer.module.named_parameters() if _is_counted(p)}
    g = torch.Generator().manual_seed(0)
    v = {n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in counted.items()}
    quad = probe.quadratic_form(v)
    # the same form at steps 10x larger and smaller: the loss's higher orders and rounding
    by_step = [float64_probe(trainer, mbs, delta).quadratic_form(v) for delta in (1e-3, 1e-5)]
    h = 1e-3 * probe.theta_norm / math.sqrt(sum(float(x.pow(2).sum()) for x in v.values()))

    def along(sign: float) -> float:  # v . grad L(theta + sign h v), from the trainer
        trainer.set_params({n: before[n] + (sign * h * v[n]).float() if n in v else before[n]
                            for n in before})
        trainer.zero_grad()
        trainer._run_schedule(mbs, forward_only=False)
        return sum(float((_grad(p).double() * v[n]).sum()) for n, p in counted.items())

    by_grads = (along(1.0) - along(-1.0)) / (2 * h)
    trainer.set_params(before)
    trainer.zero_grad()
    return {"stats": stats, "unchanged": unchanged, "copy_loss": probe.loss0,
            "trainer_loss": trainer.evaluate([mbs]), "quad": quad, "by_grads": by_grads,
            "by_step": by_step}


def _preconditioned_probe_by_hand(trainer, mbs):
    """The ``newton`` probe (``P^(1/2) g``) over two steps from fresh optimizer state, and
    its second step's norms recomputed by hand: each micro-batch's gradient times
    ``P^(1/2)`` (taken before that step) alone, and of all four together."""
    import torch

    from cona.grad_stats import GradientNoiseScale
    from cona.probe import GNSProbe, _grad, _is_counted, adam_preconditioner
    from cona.state import restore, snapshot

    probe = GNSProbe(GradientNoiseScale(), definition="newton")
    probe.attach(trainer)
    trainer.train_step(mbs)
    first = probe.last  # no optimizer state before the first step: no estimate
    weights = adam_preconditioner(trainer, 0.5)
    state = snapshot(trainer)
    trainer.train_step(mbs)
    probe.detach()
    got = probe.last
    restore(trainer, state)
    params = [p for p in trainer.module.parameters() if _is_counted(p)]

    def weighted_sq_after(batch):
        trainer.zero_grad()
        trainer._run_schedule(batch, forward_only=False)
        return sum(float((_grad(p).double() * w).pow(2).sum()) for p, w in zip(params, weights))

    with torch.enable_grad():
        small = sum(weighted_sq_after(mbs[i : i + 1]) for i in range(len(mbs))) / len(mbs)
        big = weighted_sq_after(mbs)
    trainer.zero_grad()
    return {"first": first, "probe": got, "small": small, "big": big}


def _preconditioner_checks(trainer, mbs):
    """After one Adam step from zero state ``v_hat = g^2`` (the step's clipped gradient,
    still in the buffers), so ``P |g| = |g| / (|g| + eps)``: 1 to 1e-2 where ``|g| > 1e-6``.
    Also the direct measurement with a constant weight (scale-free) and with ``P``."""
    import torch

    from cona.direct_gns import measure_noise_scale
    from cona.probe import _grad, _is_counted, adam_preconditioner

    weights = adam_preconditioner(trainer)
    root = adam_preconditioner(trainer, 0.5)  # the newton definition's P^(1/2)
    root_err = max(float((r * r / w - 1).abs().max()) for r, w in zip(root, weights))
    grads = [_grad(p).detach().double().abs()
             for p in trainer.module.parameters() if _is_counted(p)]
    prod = torch.cat([(w * g)[g > 1e-6] for w, g in zip(weights, grads)])
    plain = measure_noise_scale(trainer, mbs)
    twice = measure_noise_scale(trainer, mbs, [torch.full_like(w, 2.0) for w in weights])
    with_p = measure_noise_scale(trainer, mbs, weights)
    half = len(weights) // 2
    mixed = measure_noise_scale(trainer, mbs, [torch.full_like(w, 1.0 if i < half else 3.0)
                                               for i, w in enumerate(weights)])
    try:
        measure_noise_scale(trainer, mbs, weights[:-1])
        short = None
    except ValueError as e:
        short = str(e)
    # After one step P ~ 1/|g| of this very batch and |P G|^2's estimate is negative here
    # (None); after a second, P averages two steps' gradients and it is positive.
    trainer.train_step(mbs)  # the caller restores the trainer afterwards
    weights = adam_preconditioner(trainer)
    with_p2 = measure_noise_scale(trainer, mbs, weights)
    # tr(P Sigma P) / |P G|^2 by hand: each micro-batch's gradient from its own backward
    # pass (main_grad), times P, flattened; McCandlish et al. 2018 App. A.1 written out
    params = [q for q in trainer.module.parameters() if _is_counted(q)]
    flat_p = torch.cat([w.double().flatten() for w in weights])
    rows = []
    for mb in mbs:
        trainer.zero_grad()
        trainer._run_schedule([mb], forward_only=False)
        rows.append(torch.cat([q.main_grad.double().flatten() for q in params]) * flat_p)
    trainer.zero_grad()
    pg = torch.stack(rows)  # [micro-batches, counted elements]
    b_small = int(next(iter(mbs[0].values())).shape[0])
    b_big = b_small * len(mbs)
    small_sq, big_sq = float(pg.pow(2).sum(1).mean()), float(pg.mean(0).pow(2).sum())
    g_sq = (b_big * big_sq - b_small * small_sq) / (b_big - b_small)
    trace = (small_sq - big_sq) / (1 / b_small - 1 / b_big)
    return {"min": float(prod.min()), "max": float(prod.max()), "count": prod.numel(),
            "plain": plain, "twice": twice, "with_p": with_p, "mixed": mixed, "short": short,
            "with_p2": with_p2, "with_p2_by_hand": trace / g_sq if g_sq > 0 else None,
            "with_p2_g_sq": g_sq, "root_err": root_err}


@pytest.fixture(scope="module")
def real(cache_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cona_real")
    summaries = launch(_real, 4, cache_dir, str(run_dir))
    return summaries, run_dir


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_real_mode_switches_and_logs_wall_clock(real):
    """Catches a real-mode loop that never acts on the controller, switches on some ranks
    only, or loses the switch's measured time: the run must leave DP1-PP4, every rank
    must report the same chain, and metrics.jsonl must hold the switch with its
    measured seconds and peak RSS and wall-clock step times."""
    summaries, run_dir = real
    s = summaries[0]
    assert s["clock"] == "wall" and s["switches"] >= 1
    assert s["chain"][0] == {"strategy": "dp1-tp1-pp4-mb2-gb16", "start_step": 0}
    assert s["chain"][1]["start_step"] == 4
    assert all(x["chain"] == s["chain"] for x in summaries)
    assert s["final_val_ppl"] is not None and s["samples"] == 12 * 16
    assert (s["device"], s["precision"]) == ("cpu", "float32")  # the last layout's model
    recs = _records(run_dir)
    switches = [r for r in recs if r.get("event") == "switch"]
    assert switches and switches[0]["switch_s"] > 0 and switches[0]["peak_rss_mib"] > 0
    steps = [r for r in recs if r.get("event") == "step"]
    assert len(steps) == 12 and all(r["clock"] == "wall" and r["step_s"] > 0 for r in steps)
    # the trainer's accumulated token count (carried across the switch) against the data
    # position: 16 sequences of 64 tokens per step
    assert [r["tokens"] for r in steps] == [r["samples"] * 64 for r in steps] == [
        k * 16 * 64 for k in range(1, 13)]
    assert s["tokens"] == 12 * 16 * 64
    assert any(r.get("event") == "decision" for r in recs)
    saved = json.loads((run_dir / "summary.json").read_text())
    # what a switch costs is what it took: the wall clock advanced by its cost, and the
    # controller holds exactly the measured costs (max over ranks) of the switches made
    for sw in switches:
        assert sw["time_s"] - sw["clock_before_s"] == pytest.approx(sw["cost_s"], abs=0.5)
        assert sw["cost_s"] >= sw["reshard_s"] > 0
    charged = s["switch_costs_charged"]
    assert sorted(charged["layout"] + charged["batch"]) == sorted(x["cost_s"] for x in switches)
    # before any switch, the layout cost the controller weighed was measured at start-up
    # (building the start layout), not the 30 s assumption
    first = next(r for r in recs if r.get("event") == "decision")
    assert first["switch"] and first["switch_cost_s"] == s["switch_costs_at_start"]["layout"] > 0
    assert saved["switches"] == s["switches"] and saved["clock"] == "wall"


@pytest.fixture(scope="module")
def emulated(cache_dir, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cona_emulated")
    ((summary, probe),) = launch(_emulated, 1, cache_dir, str(run_dir))
    return summary, probe, run_dir


def test_emulated_mode_uses_modelled_time(emulated):
    """Catches an emulated run that leaks wall time into the clock or mislabels it: the
    clock must be the sum of the target's modelled step times (GPT-3 1.3B on 8 A100)
    plus modelled switch costs, and the summary must say it is emulated."""
    s, _, run_dir = emulated
    assert s["clock"] == "emulated" and s["num_gpus"] == 8 and s["target_model"] == "gpt3_1.3b"
    from cona.emulated import EmulatedCluster
    from cona.strategy import Strategy
    from jobruntime.config import load_config

    cluster = EmulatedCluster(load_config("gpt3_1.3b").model, "A100-80GB", 8)
    steps = [r for r in _records(run_dir) if r.get("event") == "step"]
    modelled = sum(cluster.iter_s(Strategy.from_label(r["strategy"])) for r in steps)
    modelled += sum(x["cost_s"] for x in s["switch_log"])
    assert s["clock_s"] == pytest.approx(modelled, rel=1e-9)
    assert s["samples"] >= 16 * 8 and s["final_val_ppl"] is not None
    # tokens accumulate each step's own batch (the proxy batch of its strategy), through
    # batch switches: the trainer's count against the data position
    from cona.mapping import ProxyMapping

    mapping = ProxyMapping(**s["mapping"])
    prev = 0
    for r in steps:
        proxy = mapping.proxy_batch(r["global_batch_size"])
        assert r["tokens"] - prev == proxy * 64 and r["tokens"] == r["samples"] * 64, r["step"]
        prev = r["tokens"]
    assert s["tokens"] == prev
    assert all(r["gns"] is None or r["gns"] > 0 for r in steps)


def test_emulated_tokens_accumulate_through_a_batch_switch(emulated):
    """Catches token counts recomputed from the current batch (``step x batch x seq``):
    two steps at one proxy batch, a forced switch to another, two more; every step adds
    its own batch's tokens, and the trainer's count (carried by the switch) equals the
    data position times the sequence length."""
    _, probe, _ = emulated
    rows = probe["batch_switch"]
    assert len(rows) == 4 and rows[0][2] == rows[1][2] != rows[2][2] == rows[3][2]
    total = 0
    for tokens, samples, proxy in rows:
        total += proxy * 64
        assert tokens == total == samples * 64


def test_gns_probe_microbatch_norms_match_direct_computation(emulated):
    """Catches wrong wiring of the one-process GNS probe (wrong micro-batch read, a summed
    micro-batch gradient not divided by its loss tokens, norms after clipping): its small
    squared norm
    must equal the mean over the four micro-batches of separate backward passes, and its
    big one that of all four together (fp32 sums in different order: 1e-4 relative)."""
    _, probe, _ = emulated
    small, small_b, big, big_b = probe["probe"]
    assert (small_b, big_b) == (2, 8)
    assert small == pytest.approx(probe["small"], rel=1e-4)
    assert big == pytest.approx(probe["big"], rel=1e-4)
    assert small > big  # one micro-batch's gradient is noisier than the mean of four


def test_adam_preconditioner_and_preconditioned_noise_scale(emulated):
    """Catches a wrong Pollux preconditioner (Qiao et al. OSDI'21 Sec. 3.1): without
    Adam's bias correction ``P |g|`` would be 1/sqrt(1 - beta2) = 31.6 after one step,
    and a mis-matched parameter order would scatter it; it must be 1 within 1 %.  A
    constant weight must leave the noise scale unchanged (it is a ratio), unequal ones
    must change it; measured right after the step before ``Trainer.zero_grad`` existed,
    the first micro-batch's gradient counted twice (``param.grad`` aliased ``main_grad``)
    and the two read 17.0 and 14.9.  The preconditioned noise scale (after a second step,
    where its signal estimate is positive) must equal ``tr(P Sigma P) / |P G|^2`` computed
    by hand from each micro-batch's own backward pass (fp64 sums of the same fp32
    gradients in another order: 1e-6 relative); the test accepted any positive value.  A wrong number of weights must be refused."""
    _, probe, _ = emulated
    p = probe["precond"]
    assert p["count"] > 1000 and 0.99 <= p["min"] and p["max"] <= 1.0 + 1e-9
    assert p["plain"] is not None and p["twice"] == pytest.approx(p["plain"], rel=1e-9)
    assert p["with_p"] is None or p["with_p"] > 0  # None: |P G|^2's estimate not positive
    assert p["with_p2_g_sq"] > 0, "|P G|^2 not positive here: the check below would be vacuous"
    assert p["with_p2"] == pytest.approx(p["with_p2_by_hand"], rel=1e-6)
    assert p["mixed"] != pytest.approx(p["plain"], rel=1e-3)  # the weights are applied
    assert p["short"] is not None and "weights for" in p["short"]
    assert p["root_err"] < 1e-9  # newton's P^(1/2), squared, is P


def test_curvature_probe_on_the_real_model(emulated):
    """Catches a float64 copy loaded with other weights or another loss (its loss must be
    the trainer's within fp32 rounding), a second difference off the model's curvature
    (``v' H v`` must match the change of the trainer's own gradients along ``v``, a
    backward-pass path, within 0.5 %), a loss rounded to float32 on the way (megatron's
    cross entropy: the form then moved by 2 % at a tenth of the step and 400x at a
    hundredth, where it must stay within 0.1 % at ten times and a tenth of the step), and
    a measurement that leaves the weights or the RNG changed (cona/curvature.py)."""
    _, probe, _ = emulated
    c = probe["curvature"]
    assert c["unchanged"] and all(math.isfinite(x) for x in c["stats"])
    assert c["copy_loss"] == pytest.approx(c["trainer_loss"], rel=1e-5)
    assert abs(c["quad"]) > 0 and c["quad"] == pytest.approx(c["by_grads"], rel=0.005)
    assert c["by_step"] == pytest.approx([c["quad"]] * 2, rel=1e-3)


def test_gns_probe_preconditioned_norms_match_direct_computation(emulated):
    """Catches a preconditioned probe (``cona.gns_definition=newton``: ``P^(1/2) g``; the
    same path as ``pollux``'s ``P g`` at another power) that skips the weights, weights
    one micro-batch and not another, or makes up an estimate before Adam has state: no
    estimate on the first step; on the second, its squared norms equal those of
    ``P^(1/2)`` times each micro-batch's separate gradient and of all four's."""
    _, probe, _ = emulated
    p = probe["online_precond"]
    assert p["first"] is None
    small, small_b, big, big_b = p["probe"]
    assert (small_b, big_b) == (2, 8)
    assert small == pytest.approx(p["small"], rel=1e-4)
    assert big == pytest.approx(p["big"], rel=1e-4)
    # P^(1/2) is ~1/sqrt|g| after the first step: the weighted norms are far from the raw ones
    assert small != pytest.approx(probe["small"], rel=0.1)
