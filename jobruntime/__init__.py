"""The job runtime: everything one megatron-core training job needs.

Modules, in the order a job uses them:

- :mod:`.config` — the typed config tree, presets and ``section.key=value`` overrides;
- :mod:`.cpu_compat` — megatron-core on a CPU-only torch (on only without CUDA);
- :mod:`.parallel` — process groups and the :class:`~.parallel.Topology`;
- :mod:`.ports` — a rendezvous port no outgoing connection can take first;
- :mod:`.model` — ``GPTModel`` / ``BertModel`` from the config (TE specs on GPU);
- :mod:`.tokenizer`, :mod:`.data` — corpus → tokenizer → indexed dataset → samplers;
- :mod:`.trainer` — DDP, optimizer, LR schedule and the forward/backward schedule;
- :mod:`.checkpoint` — dist_checkpointing save/load (layout-independent, crash-safe);
- :mod:`.metrics` — metrics.jsonl, summary.json, wandb, TTP;
- :mod:`.outputs` — output folders named on a command line, checked before any work;
- :mod:`.loop` — the training loop of an ordinary job;
- :mod:`.flops`, :mod:`.hardware` — analytic FLOPs/params and GPU profiles.

GeoMesh (``geomesh/``) and CONA (``cona/``) build on these; nothing here
knows about them beyond their config sections.
"""

from .logging_utils import quiet_expected_warnings

quiet_expected_warnings()
