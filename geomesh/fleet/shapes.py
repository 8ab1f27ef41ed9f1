"""Region shapes checked against the model before anything is built.

A worker's *shape* is its ``tp``, ``pp`` and ``num_gpus`` (replicas
``dp = num_gpus / (tp·pp)``).  That ``tp·pp`` divides ``num_gpus`` is checked
when the cluster file is loaded (:func:`geomesh.fleet.cluster.load_cluster`); the two
rules here need the model, and :func:`geomesh.context.build_context` applies
them before placement, process groups, data or plan:

1. the shape splits the model — megatron-core's rules, kept in one place
   (:meth:`jobruntime.config.ModelConfig.split_problems`: heads, query groups,
   FFN hidden size and padded vocabulary by ``tp``, layers by ``pp``);
2. the model state and activations of micro-batch 1 fit one GPU's memory at
   that shape — the planner's memory model
   (:class:`geomesh.fleet.worker_models.MemoryModel`), which the planner would otherwise
   find only when it plans, after the run's setup.

Which model: in emulated mode the *target* model (``geomesh.target_model``):
it sets the clock's step times and the bytes on the wire, and the clock's 1F1B
bubble and the memory model assume even stages and TP shards (the proxy
really trained there runs at TP=PP=1).  In real mode the job's own model,
which every region builds at its own shape.

Errors: :class:`~geomesh.fleet.cluster.ClusterError` (``train.py`` prints it on one
line and exits 2) naming the worker, the rule with its numbers, and the fix.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jobruntime.config import ModelConfig
from jobruntime.memory import GIB

from .cluster import ClusterError, ClusterSpec, WorkerSpec

if TYPE_CHECKING:
    from .worker_models import MemoryModel


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shapes(w: WorkerSpec, model: ModelConfig) -> list[WorkerSpec]:
    """The worker at every ``(tp, pp)`` of its GPUs that splits ``model``, fewest
    model-parallel GPUs first (then the lower ``pp``: no pipeline bubble)."""
    n = w.num_gpus
    out = [dataclasses.replace(w, tp=t, pp=p) for t in _divisors(n) for p in _divisors(n // t)
           if not model.split_problems(t, p)]
    return sorted(out, key=lambda s: (s.tp * s.pp, s.pp))


def split_refusal(w: WorkerSpec, model: ModelConfig, model_name: str) -> str | None:
    """The one-line refusal of a shape that does not split ``model`` (``None``: it splits)."""
    problems = model.split_problems(w.tp, w.pp)
    if not problems:
        return None
    n = w.num_gpus
    tps = [t for t in _divisors(n) if not model.split_problems(t, 1)]
    pps = [p for p in _divisors(n) if not model.split_problems(1, p)]
    return (f"worker {w.label} cannot split {model_name}: {'; '.join(problems)}; "
            f"give it tp in {tps} and pp in {pps} with tp*pp dividing num_gpus={n}")


def memory_refusal(w: WorkerSpec, memory: MemoryModel, model_name: str, *,
                   micro_batch_size: int = 1) -> str | None:
    """The one-line refusal of a shape whose fullest GPU cannot hold ``model_name`` at
    ``micro_batch_size`` (``None``: it fits), with the memory model's numbers in GiB:
    per-GPU memory; model state split into weights, grads, optimizer (fp32 master
    weights and Adam moments) and outer state (θ_global, outer momentum, message);
    activations; the fixed allowance; and the smallest shape of its GPUs that fits."""
    est = memory.estimate(w, micro_batch_size)
    limit = memory.limit_bytes(w)
    if est.total_bytes <= limit:
        return None
    parts = memory.runtime.state_bytes_parts(w.dp)
    names = {"extra": "outer state"}  # GeoMesh's extra state per parameter
    state = " + ".join(f"{names.get(k, k)} {est.params * b / GIB:.1f}"
                       for k, b in parts.items() if b)
    fits = [s for s in _shapes(w, memory.model)
            if memory.estimate(s, micro_batch_size).total_bytes <= memory.limit_bytes(s)]
    if fits:
        fix = f"raise tp or pp (tp={fits[0].tp}, pp={fits[0].pp} fits), or give it"
    elif est.overhead_bytes >= limit:  # no shape helps: the allowance alone is too much
        fix = "the allowance alone does not fit; give it"
    else:
        fix = (f"no tp/pp of its {w.num_gpus} GPU(s) fits; give it more GPUs (num_gpus) to raise "
               "tp or pp, or")
    return (f"worker {w.label} cannot fit {model_name} in {limit / GIB:.1f} GiB per GPU: at "
            f"tp={w.tp}, pp={w.pp} its fullest GPU holds {est.params / 1e9:.2f} B parameters "
            f"whose state needs {est.state_bytes / GIB:.1f} GiB ({state} GiB), plus "
            f"{est.activation_bytes / GIB:.1f} GiB of activations at micro-batch "
            f"{micro_batch_size} and a {est.overhead_bytes / GIB:.1f} GiB allowance = "
            f"{est.total_gib:.1f} GiB; {fix} a GPU with more memory (gpu, memory_gib)")


def check_region_shapes(cluster: ClusterSpec, model: ModelConfig, memory: MemoryModel, *,
                        model_name: str) -> None:
    """Refuse the first worker whose shape does not split ``model`` or does not fit its
    GPUs' memory at micro-batch 1 (module docstring), before anything is built.

    Args:
        cluster: the loaded cluster (``num_gpus`` a multiple of ``tp·pp`` already).
        model: the model every worker's shape must hold (emulated: the target model;
            real: the job's).
        memory: the planner's memory model of ``model`` (with its outer state).
        model_name: how messages name the model, e.g. ``"the target model gpt3_1.3b"``.

    Raises:
        ClusterError: one line naming the worker, the broken rule with its numbers
            (GiB for memory), and the fix.
    """
    for w in cluster.workers:
        why = split_refusal(w, model, model_name)
        if why:
            raise ClusterError(why)
    for w in cluster.workers:
        why = memory_refusal(w, memory, model_name)
        if why:
            raise ClusterError(why)
