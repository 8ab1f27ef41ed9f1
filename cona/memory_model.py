"""CONA's view of the project's memory model (moved to :mod:`jobruntime.memory`).

One memory model serves GeoMesh's planner and CONA; it lives in the job
runtime, takes any layout with ``tp, pp, dp, micro_batch_size,
num_microbatches`` (a :class:`cona.strategy.Strategy` is one) and no longer
imports ``cona.strategy``.  Kept so that ``cona.memory_model`` imports work.
"""

from jobruntime.memory import STATE_BYTES, MemoryEstimate, MemoryModel, Precision

__all__ = ["STATE_BYTES", "MemoryEstimate", "MemoryModel", "Precision"]
