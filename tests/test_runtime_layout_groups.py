"""Rebuilding megatron's layout destroys the old process groups (jobruntime.parallel).

``destroy_model_parallel`` only forgets megatron's groups; each gloo group kept two
threads, so a process that rebuilt its layout a few hundred times (the CONA bench's
search, a long CONA run) held thousands of threads and ran several times slower.  On 2
real gloo ranks: rebuilding between TP=1 and TP=2 keeps the thread count flat, and a
switch that keeps the old groups (``release_old_groups=False``) can still use them
until it destroys them.
"""

from __future__ import annotations

import os

import pytest

from tests.dist_utils import launch

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"),
                                reason="counts threads through /proc")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _rebuilds():
    import gc

    import torch
    import torch.distributed as dist

    from jobruntime.config import load_config
    from jobruntime.parallel import destroy_groups, initialize_layout, model_parallel_groups

    cfgs = [load_config("tiny_gpt", ["logging.wandb=disabled", f"parallel.tp={tp}"])
            for tp in (1, 2)]
    initialize_layout(cfgs[0])
    class Owner:  # a model or optimizer of the old layout: its groups in a cycle
        pass

    counts = []
    for i in range(6):
        owner = Owner()
        owner.self, owner.groups = owner, model_parallel_groups()
        del owner  # garbage, but only the cycle collector frees it
        initialize_layout(cfgs[i % 2])
        counts.append(_threads())
    old = model_parallel_groups()
    initialize_layout(cfgs[0], release_old_groups=False)
    kept = _threads()
    t = torch.ones(1)
    for g in old:  # still usable: a switch reshards over them
        dist.all_reduce(t, group=g)
    destroy_groups(old)
    n = len(old)
    del old, g  # a destroyed group's threads end with its last Python reference
    gc.collect()
    return {"counts": counts, "kept": kept, "after": _threads(), "groups": n}


def test_layout_rebuilds_do_not_leak_process_groups():
    for r in launch(_rebuilds, 2):
        c = r["counts"]
        # the same layout rebuilt holds the same threads (each rebuild leaked ~50 before,
        # and the old groups' threads lived on in garbage until a full collection)
        assert c[2] == c[0] and c[3] == c[1] and c[4] == c[0], c
        assert r["groups"] > 0 and r["kept"] > r["after"], r  # kept, then destroyed
        assert r["after"] <= max(c), r
