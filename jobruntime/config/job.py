"""The whole job: :class:`JobConfig`, one field per section."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .base import ConfigError
from .checkpoint import CheckpointConfig
from .cona import ConaConfig
from .data import DataConfig
from .geomesh import GeoMeshConfig
from .logging import LoggingConfig
from .model import ModelConfig
from .parallel import ParallelConfig
from .train import TrainConfig


@dataclass(kw_only=True)
class JobConfig:
    """The whole job.  Sections are documented in their own classes."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    geomesh: GeoMeshConfig = field(default_factory=GeoMeshConfig)
    cona: ConaConfig = field(default_factory=ConaConfig)
    name: str = "job"
    """Preset name (file stem), used in run names."""

    def validate_sections(self) -> None:
        """Check each section's own settings (everything but the layout, which needs the
        world size; GeoMesh's section is checked by ``geomesh.context``).

        Raises:
            ConfigError: the first out-of-range setting, named; or a setting that the
                job kind ignores (``cona.schedule`` outside GeoMesh, zero-shot tasks in a
                GeoMesh or CONA run), a resume that CONA's emulated clock cannot make
                (``checkpoint.load`` with ``load_optimizer``), or a weights-only start
                that GeoMesh cannot make (``load_optimizer=false``).
        """
        self.model.validate()
        self.train.validate()
        self.data.validate()
        self.checkpoint.validate()
        self.cona.validate()
        geomesh = self.geomesh.method != "none"
        if self.cona.schedule is not None and not geomesh:  # CONA alone chooses layouts
            raise ConfigError("cona.schedule switches the layouts of GeoMesh regions; it needs "
                              "a GeoMesh run (geomesh.method, a real-mode cluster), or unset "
                              "it: CONA on its own chooses its layouts")
        if (self.cona.enabled and self.cona.clock == "emulated" and not geomesh
                and self.checkpoint.load and self.checkpoint.load_optimizer):
            raise ConfigError("CONA's emulated clock cannot resume a run: it saves no clock "
                              "and no CONA state, so a resume would go on with the "
                              "checkpoint's optimizer and data position at emulated time 0; "
                              "set checkpoint.load_optimizer=false to start it from the "
                              "checkpoint's weights, or resume with cona.clock=wall")
        if geomesh and self.checkpoint.load and not self.checkpoint.load_optimizer:
            raise ConfigError(f"geomesh.method={self.geomesh.method} resumes a run's whole state "
                              "from checkpoint.load and starts no run from a checkpoint's "
                              "weights alone: drop checkpoint.load_optimizer=false to resume, "
                              "or unset checkpoint.load")
        if geomesh and self.checkpoint.optimizer_settings == "checkpoint":
            raise ConfigError("a GeoMesh run trains with its config's optimizer settings "
                              "(every region shares them: the run identity), so "
                              "checkpoint.optimizer_settings=checkpoint cannot keep a "
                              "checkpoint's: put its values in the config, or set =config")
        if self.train.zero_shot_tasks and (geomesh or self.cona.enabled):
            raise ConfigError("train.zero_shot_tasks scores the model after an ordinary job; "
                              "GeoMesh and CONA runs do not run it: unset it")

    def validate(self, world_size: int = 1) -> int:
        """Validate every section; return the DP size for ``world_size`` processes."""
        self.validate_sections()
        return self.parallel.validate(self.model, world_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
