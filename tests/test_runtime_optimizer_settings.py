"""A resume's optimizer settings against the config's (``checkpoint.optimizer_settings``).

Loading a checkpoint brought the saved weight decay (megatron's scheduler) and Adam's
betas and eps (torch's param groups) with the state, silently: a resume with
``train.adam_beta2=0.99`` and ``train.weight_decay=0.05`` trained at 0.95 and 0.1 while
its ``config.yaml`` recorded the new values (review helper, measured).  Each case here
saves a checkpoint under one config and loads it into a trainer of another.
"""

from __future__ import annotations

import pytest
import torch

from jobruntime.config import load_config

OTHER = ["train.adam_beta1=0.8", "train.adam_beta2=0.99", "train.adam_eps=1e-6",
         "train.weight_decay=0.05"]


def _trainer(cache_dir: str, *extra: str):
    from jobruntime.parallel import initialize_layout
    from jobruntime.trainer import Trainer

    cfg = load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", "model.seq_length=64",
                                   "logging.wandb=disabled", "train.warmup_iters=2", *extra])
    initialize_layout(cfg)
    return cfg, Trainer(cfg)


@pytest.fixture(scope="module")
def saved(cache_dir, tmp_path_factory):
    """A checkpoint after 3 steps at the preset's settings (beta 0.9/0.95, eps 1e-8,
    weight decay 0.1)."""
    from jobruntime.checkpoint import save_checkpoint
    from jobruntime.data import synthetic_microbatch

    cfg, trainer = _trainer(cache_dir)
    g = torch.Generator().manual_seed(0)
    p = cfg.parallel
    for _ in range(3):
        trainer.train_step([synthetic_microbatch(cfg.model, p.micro_batch_size, g)
                            for _ in range(p.global_batch_size // p.micro_batch_size)])
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "checkpoints", trainer,
                           consumed_samples=3 * p.global_batch_size)


def _loaded(cache_dir, path, *extra):
    from jobruntime.checkpoint import load_checkpoint

    cfg, trainer = _trainer(cache_dir, *extra)
    load_checkpoint(path, trainer)
    return cfg, trainer


def _unbiased(trainer) -> dict[str, tuple[float, float]]:
    """Each parameter's bias-corrected Adam moments, summed: ``m / (1 - b1^t)``,
    ``v / (1 - b2^t)`` (Kingma & Ba 2015, Alg. 1)."""
    from jobruntime.optimizer_state import adam_hyperparameters, optimizer_state_by_name

    b1, b2, _ = adam_hyperparameters(trainer)
    return {n: (float((s.state["exp_avg"] / (1 - b1 ** s.step)).abs().sum()),
                float((s.state["exp_avg_sq"] / (1 - b2 ** s.step)).sum()))
            for n, s in optimizer_state_by_name(trainer).items()}


def _in_use(trainer) -> tuple[float, float, float, float]:
    """``(beta1, beta2, eps, weight decay)`` the next step trains at: the torch
    optimizer's decayed group after the scheduler's step (megatron sets the weight decay
    there)."""
    from jobruntime.optimizer_state import adam_hyperparameters, torch_optimizers

    trainer.scheduler.step(0)
    wd = max(g["weight_decay"] for o in torch_optimizers(trainer.optimizer)
             for g in o.param_groups)
    return (*adam_hyperparameters(trainer), wd)


def test_same_refuses_other_adam_and_weight_decay_naming_each(cache_dir, saved):
    """Catches the old resume, which trained at the checkpoint's 0.9/0.95/1e-8/0.1."""
    from jobruntime.checkpoint import CheckpointError
    from jobruntime.trainer import reconcile_optimizer_settings

    cfg, trainer = _loaded(cache_dir, saved, *OTHER)
    assert _in_use(trainer) == pytest.approx((0.9, 0.95, 1e-8, 0.1))  # what load brings
    with pytest.raises(CheckpointError) as e:
        reconcile_optimizer_settings(trainer, cfg.train, "same", str(saved))
    for told in ("train.adam_beta1: checkpoint 0.9, config 0.8",
                 "train.adam_beta2: checkpoint 0.95, config 0.99",
                 "train.adam_eps: checkpoint 1e-08, config 1e-06",
                 "train.weight_decay: checkpoint 0.1, config 0.05",
                 "checkpoint.optimizer_settings=config"):
        assert told in str(e.value), str(e.value)
    assert "lr_decay_iters" not in str(e.value)  # the schedule's length did not change
    same_cfg, same = _loaded(cache_dir, saved)
    reconcile_optimizer_settings(same, same_cfg.train, "same", str(saved))  # nothing differs


def test_config_trains_at_the_configs_and_keeps_the_moments_estimates(cache_dir, saved):
    """``config``: the next step runs at the config's betas, eps and weight decay, and
    Adam's moments keep their bias-corrected values (moments built under 0.95 divided by
    0.99's correction would make the step several times too large)."""
    from jobruntime.trainer import reconcile_optimizer_settings

    _, before = _loaded(cache_dir, saved)
    cfg, trainer = _loaded(cache_dir, saved, *OTHER)
    reconcile_optimizer_settings(trainer, cfg.train, "config", str(saved))
    assert _in_use(trainer) == pytest.approx((0.8, 0.99, 1e-6, 0.05))
    want, got = _unbiased(before), _unbiased(trainer)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name] == pytest.approx(want[name], rel=1e-5), name


def test_checkpoint_keeps_the_saved_ones_and_the_config_records_them(cache_dir, saved):
    from jobruntime.trainer import reconcile_optimizer_settings

    cfg, trainer = _loaded(cache_dir, saved, *OTHER)
    reconcile_optimizer_settings(trainer, cfg.train, "checkpoint", str(saved))
    assert _in_use(trainer) == pytest.approx((0.9, 0.95, 1e-8, 0.1))
    t = cfg.train
    assert (t.adam_beta1, t.adam_beta2, t.adam_eps, t.weight_decay) == \
        pytest.approx((0.9, 0.95, 1e-8, 0.1))


def test_without_the_lr_part_only_adam_is_read(cache_dir, saved):
    """CONA scales the LR with its batch and rebuilds its schedule from the config
    (``lr=False``): another ``train.lr`` or weight decay is not its business here, Adam's
    betas and eps are (they came from the checkpoint until the first layout switch)."""
    from jobruntime.trainer import reconcile_optimizer_settings

    cfg, trainer = _loaded(cache_dir, saved, "train.lr=0.0123", "train.adam_beta1=0.8")
    reconcile_optimizer_settings(trainer, cfg.train, "config", str(saved), lr=False,
                                 lengths=False)
    assert _in_use(trainer)[:3] == pytest.approx((0.8, 0.95, 1e-8))
    assert trainer.scheduler.max_lr == pytest.approx(0.002)  # left to the caller


def test_geomesh_refuses_keeping_a_checkpoints_settings():
    """GeoMesh's regions share the config's settings (the run identity): keeping a
    checkpoint's would train on values no identity names."""
    from jobruntime.config import ConfigError

    job = ["geomesh.method=geomesh", "geomesh.cluster=two_worker"]
    with pytest.raises(ConfigError, match="optimizer_settings=checkpoint cannot keep"):
        load_config("tiny_gpt", [*job, "checkpoint.optimizer_settings=checkpoint"]
                    ).validate_sections()
    load_config("tiny_gpt", [*job, "checkpoint.optimizer_settings=config"]).validate_sections()


def test_a_cona_resume_runs_at_its_configs_adam(cache_dir, saved):
    """Catches CONA's resume keeping the checkpoint's ``beta1`` and ``eps`` until its first
    layout switch rebuilt the optimizer from the config (``beta2`` follows the strategy
    before every step already, :meth:`cona.run.Loop.follow_adam`)."""
    from cona import state as cstate
    from cona.job import load_start
    from jobruntime.parallel import initialize_layout

    cfg = load_config("tiny_gpt", [f"data.cache_dir={cache_dir}", "model.seq_length=64",
                                   "logging.wandb=disabled", "train.warmup_iters=2",
                                   "cona.enabled=true", "train.adam_beta1=0.8",
                                   "train.adam_eps=1e-6", f"checkpoint.load={saved}"])
    initialize_layout(cfg)
    trainer = cstate.build_trainer(cfg, cfg.parallel.global_batch_size)
    consumed, _ = load_start(cfg, trainer)
    assert consumed == 3 * cfg.parallel.global_batch_size
    assert cstate.adam_hyperparameters(trainer)[::2] == pytest.approx((0.8, 1e-6))


def test_the_refusal_prints_every_digit_and_old_configs_still_load(cache_dir, saved):
    """Catches values printed with ``%g`` but compared exactly ("checkpoint 0.00282843,
    config 0.00282843" for a CONA run's batch-scaled LR: advice that cannot be followed),
    and a run folder's ``config.yaml`` from before the rename (``checkpoint.lr_schedule``)
    that its own resume advice could no longer load (break-test helper)."""
    from jobruntime.checkpoint import CheckpointError
    from jobruntime.trainer import reconcile_optimizer_settings

    cfg, trainer = _loaded(cache_dir, saved, "train.lr=0.0020000001")
    with pytest.raises(CheckpointError, match=r"train.lr: checkpoint 0.002, config 0.0020000001"):
        reconcile_optimizer_settings(trainer, cfg.train, "same", str(saved))
    old = load_config("tiny_gpt", ["checkpoint.lr_schedule=config"])
    assert old.checkpoint.optimizer_settings == "config"
