"""Healing across layouts: a region that (re)joins is healed from a live peer of another layout.

In process: the healing state of a TP2 worker (two ranks) in canonical form
(:func:`geomesh.exchange.region.to_canonical`) is cut into a TP1 worker's and a PP2
worker's shards (:func:`geomesh.exchange.region.from_canonical`); reference: the whole
tensors.  End to end (``slow``): ``bench/faults.py``'s late-join scenarios
across layouts and a lost region of a mixed-shape cluster, real processes.
"""

from __future__ import annotations

import json

import pytest
import torch

from geomesh.exchange.region import from_canonical, to_canonical
from geomesh.wire.canonical import Shard

# two canonical tensors: a column-split weight (TP dim 0) and a replicated layer norm
WHOLE = {"w": torch.arange(24.0).view(6, 4), "ln": torch.tensor([1.0, 2.0, 3.0, 4.0])}


def _tp2(rank: int) -> dict[str, Shard]:
    """Rank ``rank`` of a TP2 worker: half the rows of ``w``; ``ln`` replicated (tp = rank)."""
    return {"lw": Shard("w", (6, 4), (3 * rank, 0), (3, 4)),
            "lln": Shard("ln", (4,), (0,), (4,), (0, rank, 0))}


def _state(layout: dict[str, Shard], momentum: bool) -> dict:
    """A heal_state-like state of one rank: the outer state and the inner AdamW moments
    (bf16, as a worker sends them) by local name, the rest shared."""
    mine = {n: WHOLE[s.key][s.box].clone() for n, s in layout.items()}
    return {"round": 3, "outer": {"lr": 0.7, "step": 3, "params": mine,
                                  "momentum_buffer": {n: -t for n, t in mine.items()} if momentum
                                  else {}},
            "inner": {"step": 9.0, "exp_avg": {n: (2 * t).bfloat16() for n, t in mine.items()},
                      "exp_avg_sq": {n: (t / 4).bfloat16() for n, t in mine.items()}}}


def _served(momentum: bool) -> dict:
    """What a serving TP2 leader sends: both ranks' canonical pieces merged (region._serve)."""
    states = [to_canonical(_state(_tp2(r), momentum), _tp2(r)) for r in range(2)]
    out = states[0]
    for sec, part in (("outer", "params"), ("outer", "momentum_buffer"), ("inner", "exp_avg"),
                      ("inner", "exp_avg_sq")):
        out[sec][part].update(states[1][sec][part])
    return out


def test_tp2_state_heals_a_tp1_and_a_pp_worker_exactly():
    """Catches pieces addressed by local name or local offsets (a TP1 joiner would get
    half a weight) and a replicated tensor sent twice: the TP1 joiner's shards equal
    the whole tensors (the inner AdamW moments too: a heal without them started the
    joiner's Adam from zero), a joiner holding only ``ln`` gets exactly it, and the
    non-tensor state passes unchanged."""
    served = _served(momentum=True)
    assert sorted(served["outer"]["params"]) == ["ln@0", "w@0,0", "w@3,0"]
    tp1 = {"w_local": Shard("w", (6, 4), (0, 0), (6, 4)), "ln_local": Shard("ln", (4,), (0,), (4,))}
    got = from_canonical(served, tp1)
    assert torch.equal(got["outer"]["params"]["w_local"], WHOLE["w"])
    assert torch.equal(got["outer"]["momentum_buffer"]["ln_local"], -WHOLE["ln"])
    assert sorted(served["inner"]["exp_avg"]) == ["ln@0", "w@0,0", "w@3,0"]
    assert torch.equal(got["inner"]["exp_avg"]["w_local"], 2 * WHOLE["w"])  # exact in bf16
    assert torch.equal(got["inner"]["exp_avg_sq"]["ln_local"], WHOLE["ln"] / 4)
    assert got["inner"]["step"] == 9.0
    assert got["round"] == 3 and got["outer"]["lr"] == 0.7 and got["outer"]["step"] == 3
    stage = from_canonical(served, {"x": Shard("ln", (4,), (0,), (4,))})  # a PP stage: ln only
    assert list(stage["outer"]["params"]) == ["x"]
    assert torch.equal(stage["outer"]["params"]["x"], WHOLE["ln"])


def test_state_without_outer_momentum_heals():
    """Catches a heal that needs outer momentum buffers (``compress_update=true``
    keeps the momentum in the workers, so the outer optimizer has none; the old
    code raised KeyError in the server's torchft quorum thread, and ValueError in
    the joiner): the empty buffers go through both ways as empty."""
    served = _served(momentum=False)
    assert served["outer"]["momentum_buffer"] == {}
    got = from_canonical(served, {"w_local": Shard("w", (6, 4), (0, 0), (6, 4))})
    assert got["outer"]["momentum_buffer"] == {}
    assert torch.equal(got["outer"]["params"]["w_local"], WHOLE["w"])


def test_pieces_that_miss_a_shard_are_refused():
    """Catches a heal that loads zeros where a piece is missing: one TP2 rank's
    pieces alone do not cover a TP1 shard; refused naming the tensor."""
    half = to_canonical(_state(_tp2(0), True), _tp2(0))
    with pytest.raises(ValueError, match="'w'"):
        from_canonical(half, {"w_local": Shard("w", (6, 4), (0, 0), (6, 4))})


def _serve_after_heal() -> tuple[dict, dict]:
    """One process: a region's leader that received a heal in this call and not yet
    applied it, asked to serve: what it serves, and what it received."""
    import torch.distributed as dist

    from geomesh.exchange.region import RegionMembership
    from jobruntime.parallel import init_distributed

    class _Leader:
        def set_state_fns(self, save, load):
            self.save = save

    init_distributed()
    leader = _Leader()
    region = RegionMembership(leader, {}, contributes=True, cluster=None, worker=0,
                              policy="continue")
    region.set_state_fns(lambda: _state({}, False), lambda st: None)  # its own: round 3
    healed = {"round": 7, "outer": {"lr": 0.7, "step": 7, "params": {}, "momentum_buffer": {}}}
    region._stash(healed)  # torchft's load callback, earlier in the same leader call
    served = leader.save()
    dist.barrier()
    return served, healed


def test_a_region_serves_the_state_it_healed_from_until_it_applies_it():
    """Catches a stale heal served: a region healed in one attempt of an exchange (the
    state is applied only when the leader's call returns) and, its all-gather failed,
    was asked in the next attempt's quorum to heal a new joiner: it served its own
    state, the one the heal replaces (round 3 where the run was at round 7)."""
    from tests.dist_utils import launch

    (res,) = launch(_serve_after_heal, 1)
    served, healed = res
    assert served == healed


# -- end to end: bench/faults.py's scenarios ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("scenario", ["late_join_across_layouts", "late_join_dp2_serves_pp2",
                                      "late_join_compress_update"])
def test_late_join_heals_across_layouts(scenario, cache_dir, tmp_path):
    """Catches a joiner that cannot load a peer's healing state of another layout
    (local names, local shards), a serving job whose other ranks do not answer
    its leader's state request (a hang), and a healed region whose outer state
    differs (its later outer steps drift): the region killed after round 1 and
    restarted heals from the live region of another layout (TP1 serves a TP2
    job; a DP2 job serves a PP2 job; a TP2 job serves a TP1 one with
    ``compress_update``, whose outer optimizer holds no momentum: the old code
    raised KeyError in the server's quorum thread), and every job ends with the same
    ``global_weights_sha256`` (bit-identical θ_global; the independent reference
    is the survivor, which never healed) after all rounds, exit 0.  Also catches a
    healed worker whose inner LR schedule lags the others' by a round (it was set to
    the healed round's start, which the others had trained: 34 of 36 steps at the end,
    where every job's expected scale said 36), and one whose run totals restart at the
    heal (its summary counted the tokens since it rejoined: 5,120 where the survivor's
    run trained 5,664)."""
    from bench.faults import SCENARIOS, geomesh

    res = geomesh(tmp_path, cache_dir, scenario, 12, **SCENARIOS[scenario])
    print(json.dumps(res))  # the bench's record (pytest -s shows it)
    assert res["exit_codes"][0] == 0 and res["exit_codes"][-1] == 0, res
    assert res["same_digest"] and res["survived"] and res["bytes_lost"] == 0, res
    healed = (tmp_path / scenario / "re1.log").read_text(errors="replace")
    assert "healed from a live peer" in healed, healed[-3000:]
    assert _schedule_positions(tmp_path / scenario / "re1") == _schedule_positions(
        tmp_path / scenario / "re1", expected=True)
    survivor, healed = (json.loads((tmp_path / scenario / d / "summary.json").read_text())
                        for d in ("w0", "re1"))
    assert healed["tokens"] == survivor["tokens"] and healed["outer_steps"] == survivor["outer_steps"]


@pytest.mark.slow
def test_a_region_healed_without_a_membership_change_replans_with_the_others(cache_dir, tmp_path):
    """Catches a healed region that re-plans from its own start-up plan and an empty
    measurement history: restarted within the heartbeat (it heals, the quorum never
    changes) with ``geomesh.replan=true``, its plans parted from the survivor's at the
    next re-plan (b_i [9, 7] against [1, 7]), each region's guard then rejected the
    other's messages and both trained alone to exit 0 with different weights.  Both
    must end with the same ``global_weights_sha256`` and the same re-plans."""
    from bench.faults import geomesh

    name = "quick_restart_replan"
    res = geomesh(tmp_path, cache_dir, name, 8, fault=(1, "train@2"), rejoin=True,
                  slowdown=[8.0, 3.0], heartbeat_s=20.0, overrides=("geomesh.replan=true",))
    print(json.dumps(res))
    assert res["exit_codes"][0] == 0 and res["exit_codes"][-1] == 0, res
    assert res["same_digest"] and res["survived"], res
    survivor, healed = (json.loads((tmp_path / name / d / "summary.json").read_text())
                        for d in ("w0", "re1"))
    assert healed["replans"] == survivor["replans"] and healed["plan"] == survivor["plan"]


def _schedule_positions(run_dir, expected: bool = False) -> dict:
    """Each local worker's inner LR schedule position in every rank's last checkpoint of
    ``run_dir``: what its trainer stepped, or (``expected``) what every job's
    :class:`geomesh.worker.LrScale` holds for it (the guard's expected update scale)."""
    last = sorted((run_dir / "checkpoints").glob("outer_*"))[-1]
    out = {}
    for f in sorted(last.glob("rank*.pt")):
        st = torch.load(f, map_location="cpu", weights_only=False)
        for i, w in st["workers"].items():
            out[(f.name, int(i))] = st["lr_scale"]["done"][int(i)] if expected \
                else w["scheduler"]["num_steps"]
    assert out, last
    return out


@pytest.mark.slow
def test_lost_region_in_a_mixed_shape_cluster(cache_dir, tmp_path):
    """Catches survivors that stop or drift apart when a multi-process region dies
    (a rank of the PP2 job killed, its torchrun tears the job down): with
    ``on_worker_loss=continue`` the TP1 and TP2 regions finish every round, exit 0,
    and hold the same ``global_weights_sha256``."""
    from bench.faults import SCENARIOS, geomesh

    name = "region_lost_mixed_shapes"
    res = geomesh(tmp_path, cache_dir, name, 6, **SCENARIOS[name])
    print(json.dumps(res))
    assert res["exit_codes"][:2] == [0, 0] and res["exit_codes"][2] != 0, res
    assert res["same_digest"] and res["survived"] and res["bytes_lost"] == 0, res


# -- in process: what a heal takes, on an emulated run's loops ----------------------------


def _heal_in_process(cache_dir: str, root: str) -> dict:
    """Loop ``a`` trains; its heal state is taken in round 1's exchange (where torchft
    serves it), sent through the wire format and loaded into a fresh loop ``b`` whose
    error-feedback residuals hold something stale."""
    import torch

    torch.set_num_threads(1)
    from pathlib import Path

    import yaml

    from geomesh.context import build_context
    from geomesh.exchange.heal_payload import pack_state, unpack_state
    from geomesh.feedback import LocalMomentum
    from geomesh.fleet.cluster import CLUSTERS_DIR
    from geomesh.state import heal_state, load_heal
    from geomesh.sync import OuterLoop
    from jobruntime.config import load_config
    from tests.test_geomesh_run import OVERRIDES

    root = Path(root)
    raw = yaml.safe_load((CLUSTERS_DIR / "two_worker.yaml").read_text())
    raw["slowdown"] = {"worker": "h100-eastus", "factor": 4, "from_round": 1}  # re-plans
    cluster = root / "slow.yaml"
    cluster.write_text(yaml.safe_dump(raw))
    cfg = [f"data.cache_dir={cache_dir}", f"geomesh.cluster={cluster}", "geomesh.method=geomesh",
           *OVERRIDES, "geomesh.outer_steps=4", "geomesh.error_feedback=true"]
    ctx = build_context(load_config("tiny_gpt", cfg), root / "a")
    a, served = OuterLoop(ctx), {}
    exchange = a.exchange

    def serving(rnd, drain):
        if rnd.r == 1:
            served["state"] = unpack_state(pack_state(heal_state(a)))
            served["steps"] = _positions(a)
            served["history"] = {n: list(v) for n, v in a.history.items()}
        return exchange(rnd, drain)

    def _positions(loop) -> list:
        """Each worker's step, its scheduler's position and the LR its next step takes."""
        return [(w.trainer.step, w.trainer.scheduler.num_steps,
                 w.trainer.optimizer.param_groups[0]["lr"]) for w in loop.workers.values()]

    a.exchange = serving
    a.run()
    ctx.close()
    ctx = build_context(load_config("tiny_gpt", cfg), root / "b")
    b = OuterLoop(ctx)
    for fb in b.feedback.values():
        fb.residuals = {"stale": torch.ones(3)}
    b.local_mom = {i: LocalMomentum() for i in b.workers}  # compress_update's, stale too
    for lm in b.local_mom.values():
        lm.buffers = {"stale": torch.ones(3)}
    load_heal(b, served["state"])
    out = {"steps": _positions(b), "served": served["steps"],
           "residuals": [len(fb.residuals) for fb in b.feedback.values()] +
                        [len(lm.buffers) for lm in b.local_mom.values()],
           "plan": (b.plan.to_dict(), served["state"]["plan"]),
           "planner_current_is_plan": ctx.planner.current is b.plan,
           "history": b.history, "served_history": served["history"],
           "replans": (a.replans, served["state"]["replans"]),
           "tokens": (b.stats.tokens, served["state"]["stats"]["scalars"]["tokens"])}
    ctx.close()
    return out


def test_a_heal_takes_the_others_position_plan_and_totals(cache_dir, tmp_path):
    """Catches a heal that leaves the healed worker behind or apart (each found in real
    runs): its inner LR schedule one round behind the others' (it was set to the healed
    round's start, which the others had trained), its planner at its own start-up plan
    and its step-time history empty (its next re-plan parted from the others'), the
    run's totals at 0, and error-feedback residuals of another point of the run (a
    restart that loaded a checkpoint) added to its next message."""
    from tests.dist_utils import launch

    (out,) = launch(_heal_in_process, 1, cache_dir, str(tmp_path))
    assert out["replans"][0] >= 1  # the run re-plans (the history matters)
    assert out["steps"] == out["served"]  # trainer step, scheduler position, LR
    assert out["planner_current_is_plan"] and out["plan"][0] == out["plan"][1]
    assert out["history"] == out["served_history"] and out["history"]
    assert out["tokens"][0] == out["tokens"][1] > 0
    assert out["residuals"] == [0, 0, 0, 0]


def _first_round_after_heal(cache_dir: str, root: str) -> dict:
    """Loop ``a`` (emulated ``two_worker``, warmup 2: peak LR from round 1) trains 4
    rounds; its heal state of round 1 goes through the wire format into a fresh loop
    ``b`` (zero AdamW moments, as a region that joins new).  Worker 0 of ``b`` then
    trains round 2 from ``a``'s θ_global on ``a``'s samples.  Returns worker 0's
    ``‖Δ_0‖`` and mean inner loss of that round in ``a`` and in ``b``."""
    import copy
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    from geomesh.context import build_context
    from geomesh.exchange.heal_payload import pack_state, unpack_state
    from geomesh.fleet.cluster import CLUSTERS_DIR
    from geomesh.state import heal_state, load_heal
    from geomesh.sync import OuterLoop
    from jobruntime.config import load_config
    from tests.test_geomesh_run import OVERRIDES

    root = Path(root)
    cfg = load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", "geomesh.method=geomesh",
                                   f"geomesh.cluster={CLUSTERS_DIR / 'two_worker.yaml'}",
                                   *OVERRIDES, "geomesh.outer_steps=4", "geomesh.replan=false"])
    ctx = build_context(cfg, root / "a")
    a, got = OuterLoop(ctx), {}
    w0, exchange, train_round = a.workers[0], a.exchange, a.workers[0].train_round

    def norm(res) -> float:
        return sum(float(d.norm() ** 2) for d in res.delta.values()) ** 0.5

    def serving(rnd, drain):
        if rnd.r == 1:
            got["state"] = unpack_state(pack_state(heal_state(a)))
        return exchange(rnd, drain)

    def recorded(theta, step, start):
        res = train_round(theta, step, start)
        if a.r == 2:
            got["round"] = (copy.deepcopy(theta), step, start)
            got["a"] = (norm(res), res.loss)
        return res

    a.exchange, w0.train_round = serving, recorded
    a.run()
    ctx.close()
    ctx = build_context(cfg, root / "b")
    b = OuterLoop(ctx)
    load_heal(b, got["state"])
    res = b.workers[0].train_round(*got["round"])
    ctx.close()
    return {"a": got["a"], "b": (norm(res), res.loss)}


def test_a_healed_worker_trains_its_first_round_like_the_live_one(cache_dir, tmp_path):
    """Catches a heal without the inner optimizer's state: a region that joins new
    trained its first round with zero AdamW moments at the others' (peak) LR.  Adam's
    first step from zero moves every coordinate by the full LR, so its pseudo-gradient
    was 2.4x the live region's in a real two-region run (and a loss of ~10 was
    reported for that round in a break-test, 6.7 before and after).  Healed with the
    peer's moments, the same worker from the same θ_global on the same samples trains
    the same round: ``‖Δ_0‖`` and its mean loss within 1% (the moments travel in bf16,
    relative error 2^-9; the old code's ``‖Δ_0‖`` here was 1.82 against 1.50)."""
    from tests.dist_utils import launch

    (out,) = launch(_first_round_after_heal, 1, cache_dir, str(tmp_path))
    print(json.dumps(out))
    (norm_a, loss_a), (norm_b, loss_b) = out["a"], out["b"]
    assert norm_b == pytest.approx(norm_a, rel=0.01), out
    assert loss_b == pytest.approx(loss_a, rel=0.01), out


@pytest.mark.slow
def test_a_region_restarted_with_its_resume_command_heals_in_its_own_folder(cache_dir, tmp_path):
    """Catches docs that give a restart command the run refuses: docs/geomesh.md said a
    lost region "restarted with the same command" joins, but the same ``--run-dir``
    holds its results and is refused (break-test helper); the tested restarts used a
    new folder.  The documented command, the same one with ``checkpoint.load`` of its
    own checkpoints, loads its round-3 checkpoint, heals from the live region to the
    round the run is at, ends on the survivor's ``global_weights_sha256`` with the
    run's tokens, and keeps one history in its folder (every round once)."""
    from bench.faults import geomesh

    name = "resume_command"
    # the survivor slower than the victim: it still runs when the restarted job is back
    res = geomesh(tmp_path, cache_dir, name, 6, fault=(1, "train@3"), rejoin="resume",
                  slowdown=[25.0, 1.0])
    print(json.dumps(res))
    assert res["exit_codes"][0] == 0 and res["exit_codes"][-1] == 0, res
    assert res["same_digest"] and res["survived"], res
    text = (tmp_path / name / "w1_resumed.log").read_text(errors="replace")
    assert "healed from a live peer" in text, text[-3000:]
    survivor, healed = (json.loads((tmp_path / name / d / "summary.json").read_text())
                        for d in ("w0", "w1"))
    assert healed["tokens"] == survivor["tokens"] and healed["outer_steps"] == 6
    steps = [json.loads(x)["step"] for x in
             (tmp_path / name / "w1" / "metrics.jsonl").read_text().splitlines()
             if '"step"' in x and '"val_loss"' not in x]
    assert steps == sorted(set(steps)), steps
