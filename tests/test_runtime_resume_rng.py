"""A resumed multi-process run draws what the uninterrupted one draws (dropout on);
TP peers draw alike after a resume or a CONA switch from another layout.

Each rank's generators differ: a PP stage advances past the earlier stages' draws
when it builds its layers.  Checkpoints kept the RNG in common state, which
``dist_checkpointing`` saves from rank 0 alone, so every rank resumed with rank 0's
generators (and each save logged, from every other rank, a "common state dict
differs" warning several kilobytes long).
"""

from __future__ import annotations

import pytest

from tests.dist_utils import launch
from tests.test_runtime_parallel import SMALL, _cfg, _train

STEPS, SAVE_AT = 4, 2


def _runs(cache_dir, ckpt):
    """On 2 ranks at PP=2 with dropout 0.1: the losses of an uninterrupted run, and of
    a run resumed from its step-``SAVE_AT`` checkpoint."""
    import torch

    torch.set_num_threads(1)
    cfg = lambda: _cfg("tiny_gpt", cache_dir, f"train.iters={STEPS}", *SMALL,  # noqa: E731
                       "parallel.pp=2", "model.dropout=0.1")
    whole = _train(cfg(), STEPS, save_at=SAVE_AT, save_to=ckpt)[0]
    resumed = _train(cfg(), STEPS, load=ckpt)[0]
    return whole, resumed


def test_resume_draws_each_ranks_own_dropout(cache_dir, tmp_path):
    """Catches every rank resumed with rank 0's generators: the last stage's dropout
    masks then differ from the uninterrupted run's and the loss after the resume moves
    (by ~1e-2 here); with each rank's own generators it is the same loss (reduction
    order alike: the same layout)."""
    per_rank = launch(_runs, 2, cache_dir, str(tmp_path / "ckpt"))
    for whole, resumed in per_rank:
        assert len(resumed) == STEPS - SAVE_AT
        assert resumed == pytest.approx(whole[SAVE_AT:], abs=1e-6), (whole, resumed)


def _across_layouts(cache_dir, ckpt):
    """On 2 ranks: a PP=2 run with dropout 0.1 saved at step 2 and resumed at TP=2 for
    2 steps; the largest difference of a replicated (not TP-sharded) parameter between
    the TP peers.  Then each rank's default generator set apart and
    :func:`jobruntime.parallel.share_tp_generators` called: whether they agree."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from jobruntime.parallel import share_tp_generators

    torch.set_num_threads(1)
    cfg = lambda *o: _cfg("tiny_gpt", cache_dir, f"train.iters={STEPS}", *SMALL,  # noqa: E731
                          "model.dropout=0.1", *o)
    _train(cfg("parallel.pp=2"), SAVE_AT, save_at=SAVE_AT, save_to=ckpt)
    ps.destroy_model_parallel()
    _, trainer = _train(cfg("parallel.tp=2"), STEPS, load=ckpt)
    drift = 0.0
    for p in trainer.module.parameters():
        if not getattr(p, "tensor_model_parallel", False):
            both = [torch.zeros_like(p) for _ in range(2)]
            dist.all_gather(both, p.detach().contiguous())
            drift = max(drift, (both[0] - both[1]).abs().max().item())
    torch.manual_seed(100 + dist.get_rank())
    share_tp_generators()
    states = [None, None]
    dist.all_gather_object(states, torch.get_rng_state())
    return drift, bool(torch.equal(states[0], states[1]))


def test_resume_at_another_layout_keeps_tp_peers_alike(cache_dir, tmp_path):
    """Catches each rank's saved generators restored at another layout (same process
    count): the PP=2 stages' generators differ, so as TP=2 peers their dropout masks
    outside TP regions differed and replicated parameters drifted apart (2.8e-3 after
    two steps, measured); they must stay identical.  Also catches a
    ``share_tp_generators`` (what a CONA layout switch calls) that leaves TP peers'
    default generators apart."""
    for drift, shared in launch(_across_layouts, 2, cache_dir, str(tmp_path / "ckpt")):
        assert drift == 0.0
        assert shared


def _switched(cache_dir):
    """On 2 ranks: a PP=2 run with dropout 0.1, 2 steps, switched in memory to TP=2
    (:func:`cona.switch.switch_layout`, what a CONA layout switch runs), 2 more steps;
    the largest difference of a replicated (not TP-sharded) parameter between the TP
    peers."""
    import types

    import torch
    import torch.distributed as dist

    from cona.state import build_trainer, strategy_config
    from cona.strategy import Strategy
    from cona.switch import switch_layout
    from jobruntime.loop import build_data
    from jobruntime.parallel import initialize_layout, set_seed

    torch.set_num_threads(1)
    cfg = _cfg("tiny_gpt", cache_dir, f"train.iters={STEPS}", *SMALL, "model.dropout=0.1",
               "parallel.pp=2")
    gb = cfg.parallel.global_batch_size
    topo = initialize_layout(cfg)
    set_seed(cfg.train.seed)
    job = types.SimpleNamespace(trainer=build_trainer(cfg, gb))
    data = build_data(cfg, topo, 0)
    for _ in range(SAVE_AT):
        job.trainer.train_step(data.train.next())
    new_cfg = strategy_config(cfg, Strategy(1, 2, 1, cfg.parallel.micro_batch_size, gb),
                              lr=cfg.train.lr, min_lr=cfg.train.min_lr)
    topo, _ = switch_layout(job, new_cfg, reference_batch=gb, seed=cfg.train.seed)
    assert (topo.tp, topo.pp) == (2, 1)
    data = build_data(new_cfg, topo, data.train.consumed_samples)
    for _ in range(STEPS - SAVE_AT):
        job.trainer.train_step(data.train.next())
    drift = 0.0
    for p in job.trainer.module.parameters():
        if not getattr(p, "tensor_model_parallel", False):
            both = [torch.zeros_like(p) for _ in range(2)]
            dist.all_gather(both, p.detach().contiguous())
            drift = max(drift, (both[0] - both[1]).abs().max().item())
    return drift


def test_switch_from_pp_to_tp_keeps_tp_peers_alike(cache_dir):
    """Catches a CONA layout switch that leaves each rank its own generators: the PP=2
    stages drew apart while building their layers, so as TP=2 peers their dropout masks
    outside TP regions differ and replicated parameters drift apart; with
    ``share_tp_generators`` in :func:`cona.switch.switch_layout` they stay identical."""
    for drift in launch(_switched, 2, cache_dir):
        assert drift == 0.0


def _portable() -> tuple[list[str], bool, bool]:
    """One process, seeded: the places in :func:`rng_state` that hold a NumPy array;
    whether a tracker state of another device kind (a CUDA Philox state, 16 bytes) left
    the tracker as it was; whether a dropout draw under the tracker still works."""
    import torch
    from megatron.core import tensor_parallel

    from jobruntime.config import load_config
    from jobruntime.parallel import (
        init_distributed,
        initialize_layout,
        rng_state,
        set_rng_state,
        set_seed,
    )

    init_distributed()
    initialize_layout(load_config("tiny_gpt"))
    set_seed(5)
    state = rng_state()

    def arrays(x, path="") -> list[str]:
        if type(x).__module__ == "numpy":
            return [path]
        if isinstance(x, dict):
            return [p for k, v in x.items() for p in arrays(v, f"{path}/{k}")]
        if isinstance(x, (list, tuple)):
            return [p for i, v in enumerate(x) for p in arrays(v, f"{path}/{i}")]
        return []

    tracker = tensor_parallel.get_cuda_rng_tracker()
    before = tracker.get_states()
    set_rng_state(dict(state, tracker={k: torch.zeros(16, dtype=torch.uint8) for k in before}))
    kept = all(torch.equal(before[k], v) for k, v in tracker.get_states().items())
    with tracker.fork():
        drew = torch.nn.functional.dropout(torch.ones(8), 0.5).numel() == 8
    return arrays(state), kept, drew


def test_saved_generators_load_anywhere():
    """Catches generator states that tie a checkpoint to where it was saved: NumPy's
    state held as an array (a GeoMesh checkpoint, loaded with ``weights_only=True``,
    then needs NumPy's types registered, which only megatron's import did), and a
    tracker state saved on a GPU (CUDA's 16-byte Philox state) set on a CPU run, where
    the first dropout under the tracker failed ("Expected a CPUGeneratorImplState of
    size 5056 but found 16"): now left as seeded, with a warning."""
    (res,) = launch(_portable, 1)
    arrays, kept, drew = res
    assert arrays == [] and kept and drew
