"""Our Streaming DiLoCo is torchft's: ``geomesh.method=streaming_diloco`` against
``torchft.local_sgd.DiLoCo(model_fragments=..., fragment_sync_delay=τ,
fragment_update_alpha=α)``.

Same tiny GPT (same seed), same data order, ``H = 4``, ``P = 2`` fragments
(:func:`geomesh.streaming.fragment_of`), ``τ = 1``, ``α = 0.5``, two workers:

* ours: one emulated run (both workers in one process, :class:`StreamingLoop`),
  recording after every outer step ``θ_global`` and each worker's local weights;
* torchft's: two one-process replica groups (own ``Manager``, TCPStore, gloo
  process group, a ``LighthouseServer`` with ``min_replicas=2``), each training the
  worker of the same index on the same samples with the same megatron-core
  trainer; the model split into the same two fragments (``nn.ParameterList`` of
  the model's own parameters), one outer ``SGD(nesterov=True)`` per fragment;
  recording torchft's global copy of each fragment (``original_parameters``)
  and the model's (merged, local) weights.

Two variants in one launch each side: ``published`` (constant outer momentum)
and ``default`` (our ramp; torchft's per-fragment SGD gets ``μ_t`` before the
round in which its fragment takes its ``t``-th step).

The bound: each sync averages two equal-token messages (``0.5·Δ_0 + 0.5·Δ_1``
against torchft's ``(Δ_0 + Δ_1)/2``, the same float), the outer step is torch
SGD's operations in its order, the merge is the same ``lerp``: θ agrees bit for
bit; ``1e-6`` absolute is allowed (fp32 re-association, were an all-reduce to
sum in another order) and the measured maximum is printed.  ~60-90 s on the
shared 2-core machine (three process launches).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_utils import launch, launch_jobs
from tests.torchft_utils import max_abs_diff

ROUNDS, H, P, TAU, ALPHA = 3, 4, 2, 1, 0.5
OVERRIDES = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2",
    "model.seq_length=32", "parallel.global_batch_size=8", "parallel.micro_batch_size=4",
    f"geomesh.inner_steps={H}", f"geomesh.outer_steps={ROUNDS}", f"geomesh.eval_interval={ROUNDS}",
    "train.eval_iters=1", "train.warmup_iters=2", "logging.wandb=disabled",
    "logging.progress=off", "geomesh.method=streaming_diloco", "geomesh.cluster=two_worker",
    "geomesh.mode=emulated", "geomesh.target_model=gpt3_1.3b", f"geomesh.fragments={P}", f"geomesh.fragment_sync_delay={TAU}",
    f"geomesh.fragment_update_alpha={ALPHA}",
]
VARIANTS = {"published": False, "default": True}  # geomesh.outer_momentum_warmup
BOUND = 1e-6


def _cfg(cache_dir: str, warmup: bool):
    from jobruntime.config import load_config

    return load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", *OVERRIDES,
                                    f"geomesh.outer_momentum_warmup={str(warmup).lower()}"])


def _ours(cache_dir: str, root: str) -> dict:
    """Per variant and outer step: θ_global and each worker's local weights."""
    import torch

    torch.set_num_threads(1)  # shared 2-core machine
    from geomesh.context import build_context
    from geomesh.streaming import StreamingLoop

    class Recorded(StreamingLoop):
        def record(self, *args, **kwargs):
            out = super().record(*args, **kwargs)
            self.trace.append({"theta": {k: v.clone() for k, v in self.theta.items()},
                               "local": [self.workers[i].trainer.get_params()
                                         for i in sorted(self.workers)]})
            return out

    out = {}
    for name, warmup in VARIANTS.items():
        ctx = build_context(_cfg(cache_dir, warmup), Path(root) / f"ours-{name}")
        try:
            loop = Recorded(ctx)
            loop.trace = []
            loop.run()
            out[name] = {"trace": loop.trace, "batches": [list(s.batches) for s in loop.steps]}
        finally:
            ctx.close()
    return out


def _torchft(job: int, cache_dir: str, root: str, lighthouses: dict[str, str]) -> dict:
    """Replica group ``job``: worker ``job``'s inner loop under torchft's Streaming DiLoCo."""
    import torch
    from torch import nn

    torch.set_num_threads(1)
    from torchft.local_sgd import DiLoCo

    from geomesh.streaming import fragment_of
    from geomesh.wire.canonical import layout_map
    from tests import torchft_utils as tu

    tu.quiet_torchft()
    out = {}
    for name, warmup in VARIANTS.items():
        cfg = _cfg(cache_dir, warmup)
        g = cfg.geomesh
        ctx, steps, worker = tu.uniform_worker(cfg, Path(root) / f"torchft-{name}-{job}", job)
        step = steps[job]
        model = worker.trainer.module
        params, keys = dict(model.named_parameters()), layout_map(model)
        names = [[n for n in params if fragment_of(keys[n].key, P) == q] for q in range(P)]
        fragments = []
        for q in range(P):
            frag = nn.Module()
            frag.params = nn.ParameterList([params[n] for n in names[q]])  # the model's own
            fragments.append(frag)
        outers = [torch.optim.SGD(f.parameters(), lr=g.outer_lr, momentum=g.outer_momentum,
                                  nesterov=True) for f in fragments]
        inner = worker.trainer.optimizer.optimizer  # torch AdamW inside megatron's FP32Optimizer
        manager = tu.replica_manager(lighthouses[name], f"sd_{name}_{job}")
        trace = []
        try:
            with DiLoCo(manager, fragments, inner, outers, sync_every=H,
                        fragment_sync_delay=TAU, fragment_update_alpha=ALPHA) as diloco:
                for r in range(g.outer_steps):
                    if warmup:  # each fragment takes its (r+1)-th outer step in round r
                        tu.ramped(outers, g.outer_momentum, r)
                    tu.train_round(worker, steps, job, r)
                    glob = {}  # torchft's θ_global: each fragment's "params.j" copy
                    for q, frag in enumerate(diloco._fragments):
                        glob.update({n: frag.original_parameters[f"params.{j}"].clone()
                                     for j, n in enumerate(names[q])})
                    trace.append({"theta": glob, "local": worker.trainer.get_params()})
            assert manager.current_step() == g.outer_steps * P, manager.current_step()
        finally:
            manager.shutdown(wait=False)
        out[name] = {"trace": trace, "batches": list(step.batches)}
        ctx.close()
    return out


@pytest.fixture(scope="module")
def results(cache_dir, tmp_path_factory):
    from tests.torchft_utils import lighthouses

    root = tmp_path_factory.mktemp("torchft_streaming")
    (ours,) = launch(_ours, 1, cache_dir, str(root))
    with lighthouses(VARIANTS) as addresses:
        theirs = launch_jobs(_torchft, 2, cache_dir, str(root), addresses)
    return ours, theirs


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_streaming_theta_equals_torchft_each_round(results, variant):
    """Catches any departure of ``streaming_diloco`` from torchft's Streaming DiLoCo:
    the fragment split or order, the sync offsets (``(q+1)·H/P``), the step at which
    a fragment's pseudo-gradient is taken (``τ`` before its sync), the merge with
    the local weights (``lerp`` by ``α``), the per-fragment outer momentum: after
    every outer step, θ_global and both workers' local weights of ours equal
    torchft's within ``BOUND``, and the run moved θ by far more than that."""
    ours, theirs = results
    assert ours[variant]["batches"] == [theirs[j][variant]["batches"] for j in range(2)]
    diffs = []
    for r in range(ROUNDS):
        mine = ours[variant]["trace"][r]
        for job in range(2):
            other = theirs[job][variant]["trace"][r]
            diffs.append(max_abs_diff(mine["theta"], other["theta"]))
            diffs.append(max_abs_diff(mine["local"][job], other["local"]))
    print(f"{variant}: max |θ_ours − θ_torchft| (global, local) per round and replica: {diffs}")
    assert max(diffs) <= BOUND
    trace = ours[variant]["trace"]
    assert max_abs_diff(trace[0]["theta"], trace[-1]["theta"]) > 1e3 * BOUND
    # α = 0.5 keeps half of the τ steps' progress: local ≠ global
    assert max_abs_diff(trace[-1]["theta"], trace[-1]["local"][0]) > 1e3 * BOUND
