"""CONA's noise-scale probe at DP = 1: a step of one micro-batch split to measure it
(``"split"`` mode of :mod:`cona.probe`) against a step of two micro-batches, both at
TP = 2 on real gloo ranks against the single process, and at PP = 2 a step run as two
schedule calls (``"calls"`` mode) against the same single process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.dist_utils import launch

STEPS, EVERY = 6, 2  # split steps: the 1st, 3rd and 5th
GB = 4
OVERRIDES = ["model.num_layers=2", "model.hidden_size=128", "model.seq_length=64",
             f"parallel.global_batch_size={GB}", f"train.iters={STEPS}",
             "train.warmup_iters=2", "train.eval_interval=0", "logging.wandb=disabled"]


def _run(cache_dir, tp, mb, split_every=EVERY, evaluate=False, pp=1, definition="simple",
         one_call=False):
    """``STEPS`` steps of tiny_gpt at DP = 1, PP = ``pp``, TP = ``tp``, micro-batch ``mb``, from
    the seed, the probe attached and asked for each step's micro-batches (``evaluate``:
    a validation pass after each step, as a run's evaluations come between steps): its
    mode and reason, ``last`` after each step, its updates and each step's loss."""
    from cona.grad_stats import GradientNoiseScale
    from cona.probe import GNSProbe
    from cona.state import build_trainer
    from jobruntime.config import load_config
    from jobruntime.loop import build_data
    from jobruntime.parallel import initialize_layout, set_seed

    cfg = load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", *OVERRIDES,
                                   f"parallel.tp={tp}", f"parallel.pp={pp}",
                                   f"parallel.micro_batch_size={mb}"])
    topo = initialize_layout(cfg)
    set_seed(cfg.train.seed)
    trainer = build_trainer(cfg, GB)
    probe = GNSProbe(GradientNoiseScale(), definition=definition, split_every=split_every)
    probe.attach(trainer)
    data = build_data(cfg, topo, 0)
    lasts, losses, sizes, calls = [], [], [], []
    for _ in range(STEPS):
        mbs = probe.prepare(data.train.next())
        sizes.append([len(m["tokens"]) for m in mbs])
        calls.append(probe.schedule_calls)
        losses.append(trainer.train_step(mbs, 1 if one_call else probe.schedule_calls).loss)
        lasts.append(probe.last)
        if evaluate:
            trainer.evaluate(data.val_batches)
    out = {"mode": probe.mode, "no_estimate": probe.no_estimate, "last": lasts,
           "losses": losses, "updates": probe.estimator.num_updates, "sizes": sizes,
           "calls": calls}
    probe.detach()
    return out


def _reference(cache_dir):
    torch.set_num_threads(1)
    return {"mb2": _run(cache_dir, 1, 2), "split": _run(cache_dir, 1, GB, evaluate=True),
            "off": _run(cache_dir, 1, GB, split_every=0),
            "newton": _run(cache_dir, 1, GB, definition="newton")}


def _tp2(cache_dir):
    torch.set_num_threads(1)  # 2 ranks share 2 cores
    return {"mb2": _run(cache_dir, 2, 2), "split": _run(cache_dir, 2, GB)}


def _pp2(cache_dir):
    torch.set_num_threads(1)
    return {f"mb{mb}": _run(cache_dir, 1, mb, pp=2) for mb in (1, 2, GB)} | {
        "off": _run(cache_dir, 1, 2, pp=2, split_every=0),
        "one_call": _run(cache_dir, 1, 2, pp=2, one_call=True)}


@pytest.fixture(scope="module")
def results(cache_dir):
    (ref,) = launch(_reference, 1, cache_dir)
    return ref, launch(_tp2, 2, cache_dir)


@pytest.fixture(scope="module")
def pp2(cache_dir):
    return launch(_pp2, 2, cache_dir)


def test_one_microbatch_per_step_is_measured_on_split_steps(results):
    """Catches a probe blind at DP = 1 with one micro-batch per step (the old behaviour:
    no estimate, and the controller held at its global batch for the rest of the run) and
    a split that changes training or misreads its parts: every ``EVERY``-th step runs as
    two micro-batches of 2, trains as the layout of micro-batch 2 does (losses within
    1e-6: the same samples and gradient) and reads the same norms at ``B_small`` 2 (rel
    1e-6); the steps between run one micro-batch of 4 and add nothing, evaluations after
    every step included (one after a split step crashed the next step: the evaluation's
    forwards called the probe's hook).  With ``split_every=0`` the old rule stands: no
    estimate, and the reason names the setting."""
    ref, _ = results
    split, mb2, off = ref["split"], ref["mb2"], ref["off"]
    assert split["mode"] == "split" and split["no_estimate"] is None and mb2["mode"] == "microbatch"
    assert split["sizes"] == [[2, 2], [4]] * (STEPS // EVERY)
    assert split["losses"] == pytest.approx(mb2["losses"], abs=1e-6)
    assert split["updates"] == STEPS // EVERY and mb2["updates"] == STEPS
    for i in range(0, STEPS, EVERY):
        got, want = split["last"][i], mb2["last"][i]
        assert got[1::2] == want[1::2] == (2, GB)
        assert got[0] == pytest.approx(want[0], rel=1e-6) and got[2] == pytest.approx(want[2], rel=1e-6)
        assert split["last"][i + 1] == got  # the step between adds nothing
    assert off["mode"] is None and "cona.gns_split_every > 0" in off["no_estimate"]
    assert off["last"] == [None] * STEPS and off["updates"] == 0
    assert off["losses"] == pytest.approx(split["losses"], abs=1e-6)


def test_preconditioned_probe_splits_once_the_optimizer_has_state(results):
    """Catches a split step that costs time and measures nothing: a preconditioned noise
    scale (``newton``) has no preconditioner before the first optimizer step, so the
    first step runs whole and the next one is split (steps 2, 4, 6 here: three updates;
    splitting step 1 wasted it and delayed every later estimate by a step)."""
    newton = results[0]["newton"]
    assert newton["sizes"] == [[GB], [2, 2]] * (STEPS // EVERY)
    assert newton["updates"] == STEPS // EVERY and newton["last"][0] is None


@pytest.mark.parametrize("run", ["mb2", "split"])
def test_tp2_reads_the_single_process_norms(results, run):
    """Catches micro-batch norms of one TP shard taken for the model's (the probe summed
    them over the model-parallel group only for the global batch: at DP = 1, TP = 2 the
    small-batch norm was one rank's shard, about three quarters of it here, and the
    estimate garbage):
    at TP = 2 every step's norms match the single process's within 1e-4 relative (fp32
    reduction order between layouts), on both ranks alike."""
    ref, per_rank = results
    want = ref[run]["last"]
    for rank_out in per_rank:
        got = rank_out[run]["last"]
        assert [g is None for g in got] == [w is None for w in want]
        for g, w in zip(got, want):
            if w is not None:
                assert g[1::2] == w[1::2]
                assert g[0] == pytest.approx(w[0], rel=1e-4)
                assert g[2] == pytest.approx(w[2], rel=1e-4)
    assert per_rank[0][run]["last"] == per_rank[1][run]["last"]


def test_prepare_splits_into_two_parts_on_its_steps():
    """Catches a split that loses or reorders sequences, splits into more than two parts
    (a prime size split into single sequences made a split step far slower, and at
    PP > 1 one pipeline fill and drain per part) or splits on the wrong steps: two
    parts, sizes differing by at most one, concatenating to the original, only every
    ``split_every``-th step since attach; ``B_small`` of unequal parts is their
    harmonic mean (``E mean |G_i|^2 = |G|^2 + tr(Sigma) mean(1 / b_i)``)."""
    from cona.grad_stats import GradientNoiseScale
    from cona.probe import GNSProbe, _harmonic

    assert _harmonic([2, 2]) == 2 and _harmonic([4, 3]) == pytest.approx(24 / 7)
    with pytest.raises(ValueError, match="split_every"):
        GNSProbe(GradientNoiseScale(), split_every=-1)
    for size, want in ((6, [3, 3]), (7, [4, 3]), (2, [1, 1])):
        probe = GNSProbe(GradientNoiseScale(), split_every=3)
        probe.mode = "split"
        probe.trainer = SimpleNamespace(
            cfg=SimpleNamespace(parallel=SimpleNamespace(micro_batch_size=size)))
        mb = {"tokens": torch.arange(2 * size).reshape(size, 2), "loss_mask": torch.ones(size, 2)}
        got = [probe.prepare([mb]) for _ in range(4)]
        assert [len(g) for g in got] == [2, 1, 1, 2]
        assert [len(p["tokens"]) for p in got[0]] == want
        assert torch.equal(torch.cat([p["tokens"] for p in got[0]]), mb["tokens"])
        assert all(set(p) == set(mb) for p in got[0]) and got[1] == [mb]
        assert probe.schedule_calls == 1
    probe.mode = "calls"  # at PP > 1: two schedule calls of the micro-batches (5: 3 + 2)
    probe._steps = 0
    assert probe.prepare([mb] * 5) == [mb] * 5 and probe.schedule_calls == 2
    assert probe._sizes == [3 * 2, 2 * 2]  # sequences, micro-batches of 2


@pytest.mark.parametrize("mb", [1, 2, GB])
def test_pp2_split_steps_read_the_single_process_norms(results, pp2, mb):
    """Catches a probe blind at DP = 1 with PP > 1 (the old behaviour: 1F1B reads no
    gradient between backward passes, so no estimate, and the controller held at its
    global batch for the rest of the run) and a step run as schedule calls that trains
    differently or misreads them: at PP = 2 on 2 ranks, every ``EVERY``-th step runs as
    two schedule calls of 2 sequences each (two groups of two micro-batches of 1, one
    micro-batch of 2 each, or a micro-batch of 4 split in two), trains as the single
    process at micro-batch 2 does (losses within 1e-4: the gradients finalised once
    with every call's loss tokens; finalised per call, the first half's gradient would
    be scaled by the wrong count) and reads its norms (rel 1e-4; the tied embedding's
    two stages summed: read on one stage alone its norm is wrong); the steps between run
    in one call and add nothing, and both ranks read the same."""
    ref, _ = results
    want = ref["mb2"]
    for rank_out in pp2:
        got = rank_out[f"mb{mb}"]
        assert got["mode"] == "calls" and got["no_estimate"] is None
        assert got["calls"] == [2, 1] * (STEPS // EVERY)
        assert got["sizes"][0] == [min(mb, 2)] * (GB // min(mb, 2))
        assert got["losses"] == pytest.approx(want["losses"], abs=1e-4)
        assert got["updates"] == STEPS // EVERY
        for i in range(0, STEPS, EVERY):
            g, w = got["last"][i], want["last"][i]
            assert g[1::2] == w[1::2] == (2, GB)
            assert g[0] == pytest.approx(w[0], rel=1e-4) and g[2] == pytest.approx(w[2], rel=1e-4)
            assert got["last"][i + 1] == g
    assert pp2[0] == pp2[1]


def test_pp2_without_split_steps_names_the_setting(pp2):
    """Catches a silent fallback: with ``cona.gns_split_every=0`` at DP = 1, PP = 2 there
    is no estimate, the reason names the setting and the data-parallel fix, and every step
    runs in one call, training as the split run does."""
    off = pp2[0]["off"]
    assert off["mode"] is None and off["updates"] == 0 and off["calls"] == [1] * STEPS
    assert "pp=2" in off["no_estimate"] and "cona.gns_split_every > 0" in off["no_estimate"]
    assert "data-parallel" in off["no_estimate"]
    assert off["losses"] == pytest.approx(pp2[0]["mb2"]["losses"], abs=1e-6)


def test_pp2_step_run_in_one_call_updates_nothing(pp2):
    """Catches a silent zero noise scale: a caller that runs a step the probe asked to
    split into schedule calls in one call (``train_step`` without ``schedule_calls``)
    reads one part, whose norm is the global batch's; the probe must skip the update
    (it updated the estimator with a noise scale of 0), the step train as usual."""
    one = pp2[0]["one_call"]
    assert one["updates"] == 0 and one["last"] == [None] * STEPS
    assert one["losses"] == pytest.approx(pp2[0]["mb2"]["losses"], abs=1e-6)


def _unequal(cache_dir):
    """One process, one micro-batch of 3 split 2 + 1: each part's gradient and the whole
    batch's measured directly at the start weights (:func:`cona.direct_gns.microbatch_gradients`,
    no optimizer step), then the probe's reading of the split step from there; then a
    split step whose second part has no loss tokens."""
    from cona.direct_gns import microbatch_gradients
    from cona.grad_stats import GradientNoiseScale
    from cona.probe import GNSProbe, _halves
    from cona.state import build_trainer
    from jobruntime.config import load_config
    from jobruntime.loop import build_data
    from jobruntime.parallel import initialize_layout, set_seed

    torch.set_num_threads(1)
    cfg = load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", *OVERRIDES,
                                   "parallel.global_batch_size=3", "parallel.micro_batch_size=3"])
    topo = initialize_layout(cfg)
    set_seed(cfg.train.seed)
    trainer = build_trainer(cfg, 3)
    data = build_data(cfg, topo, 0)
    batch = data.train.next()

    def sq(grads):
        return sum(float(g.pow(2).sum()) for g in grads)

    parts = [sq(g) for g in microbatch_gradients(trainer, _halves(batch[0]))]
    whole = sq(next(microbatch_gradients(trainer, batch)))
    probe = GNSProbe(GradientNoiseScale(), split_every=1)
    probe.attach(trainer)
    mbs = probe.prepare(batch)
    sizes = [len(m["tokens"]) for m in mbs]
    trainer.train_step(mbs, probe.schedule_calls)
    read = probe.last
    mbs = probe.prepare(data.train.next())
    mbs[1]["loss_mask"] = torch.zeros_like(mbs[1]["loss_mask"])
    loss = trainer.train_step(mbs, probe.schedule_calls).loss
    return {"sizes": sizes, "direct": (sum(parts) / 2, whole), "read": read,
            "after_empty": probe.last, "updates": probe.estimator.num_updates, "loss": loss}


def test_unequal_parts_read_their_own_gradients(cache_dir):
    """Catches a split into unequal parts read at the wrong ``B_small`` or a part with no
    loss tokens read as a batch: a micro-batch of 3 splits 2 + 1, the probe's small- and
    big-batch norms equal each part's and the batch's gradient measured alone at the same
    weights (rel 1e-5), ``B_small`` is the harmonic mean 4/3 (the arithmetic 1.5 biases
    ``tr(Sigma)``), and a split step whose second part has no loss tokens adds no update
    (it read small == big: a noise scale of 0) and still trains."""
    import math

    (out,) = launch(_unequal, 1, cache_dir)
    assert out["sizes"] == [2, 1]
    small, small_batch, big, big_batch = out["read"]
    assert (small_batch, big_batch) == (pytest.approx(4 / 3), 3)
    assert small == pytest.approx(out["direct"][0], rel=1e-5)
    assert big == pytest.approx(out["direct"][1], rel=1e-5)
    assert out["updates"] == 1 and out["after_empty"] == out["read"]
    assert math.isfinite(out["loss"])
