"""CONA: online parallelism-strategy chaining.

Pure logic (no process groups): :mod:`cona.strategy` (layouts),
:mod:`cona.memory_model` (per-device bytes), :mod:`cona.cost_model`
(iteration time, calibration), :mod:`cona.grad_stats` (gradient noise scale),
:mod:`cona.surrogate` (Pollux goodput), :mod:`cona.lr_rule` (the LR across batch
sizes), :mod:`cona.picks` (static picks: fastest, start strategy),
:mod:`cona.controller` (when to switch),
:mod:`cona.candidates` (the candidate set), :mod:`cona.mapping` (the one
proxy-to-target rule), :mod:`cona.emulated` (the emulated cluster's clock),
:mod:`cona.oracle` (exact search over chains; :mod:`cona.oracle_types`, what it works
with; :mod:`cona.oracle_pruned`, its beam search; :mod:`cona.oracle_greedy`, the greedy
reference).

Runtime (megatron-core, imported on use): :mod:`cona.context` (decides the
clock once and builds a run), :mod:`cona.state` (sample-based LR schedule,
named optimizer state, snapshots), :mod:`cona.probe` (GNS from the training
step), :mod:`cona.switch` (rebuild groups, reshard weights and optimizer state
in memory), :mod:`cona.job` (real / emulated job; :mod:`cona.direct_probes`, the
emulated job's direct measurements: :mod:`cona.curvature`, the noise scale with the
curvature measured), :mod:`cona.run`
(``run(cfg, run_dir)``, what ``train.py`` calls), :mod:`cona.loop` (its loop) and
:mod:`cona.baselines` (CONA, static and oracle-chain runs of ``bench/cona_ttp.py``).
"""

from .controller import Controller, Decision
from .cost_model import CostModel, Interconnect, IterationEstimate
from .grad_stats import GradientNoiseScale, estimate_from_norms
from .lr_rule import scale_lr
from .memory_model import MemoryEstimate, MemoryModel
from .picks import best_goodput_strategy, best_throughput_strategy, start_strategy
from .strategy import Strategy, check_strategy, enumerate_strategies, strategies_from_dicts
from .surrogate import (
    Score,
    chaining_ceiling,
    goodput,
    rank_strategies,
    statistical_efficiency,
)

__all__ = [
    "Controller",
    "CostModel",
    "Decision",
    "GradientNoiseScale",
    "Interconnect",
    "IterationEstimate",
    "MemoryEstimate",
    "MemoryModel",
    "Score",
    "Strategy",
    "best_goodput_strategy",
    "best_throughput_strategy",
    "chaining_ceiling",
    "check_strategy",
    "enumerate_strategies",
    "estimate_from_norms",
    "goodput",
    "rank_strategies",
    "scale_lr",
    "start_strategy",
    "statistical_efficiency",
    "strategies_from_dicts",
]
