"""TP=2, PP=2 and DP=2 against the single-process reference, on real gloo processes.

Every layout is built from the same seed — no shared step-0 checkpoint — and
sees the same global batches, so the losses must agree up to floating-point
reduction order: the same seed must give the same model at every TP and PP
size, with the same padded vocabulary (one size per run) whose padding ids
take no part in the softmax.  Vocabularies 4096 (no padding), 4099 and 4100
(padded differently per TP by Megatron's rule) and 50257 (GPT-2's) use a
4096-piece tokenizer; a TP=1 checkpoint resumed at TP=2 must continue the
same losses for several optimizer steps (weights, Adam moments and schedule
resharded), and a CONA switch DP2 → TP2 must work at vocabulary 4099.
"""

from __future__ import annotations

import math

import pytest

from tests.dist_utils import launch

STEPS = 5
VOCABS = (4096, 4099, 4100, 50257)
# The fast tier checks 4100 (Megatron's rule padded it differently per TP: the case that
# broke); the others, and the CONA switch at 4099, are in the slow tier (minutes).
FAST_VOCAB = 4100
SLOW_VOCABS = tuple(v for v in VOCABS if v != FAST_VOCAB)
VOCAB_PARAMS = [v if v == FAST_VOCAB else pytest.param(v, marks=pytest.mark.slow) for v in VOCABS]
# Per vocabulary: layouts compared for VOCAB_STEPS steps; the TP=1 reference saves at
# SAVE_AT and runs on to RESUME_STEPS, as does its resume at TP=2.  Every run has
# train.iters=RESUME_STEPS, so all follow one LR schedule.
VOCAB_STEPS, SAVE_AT, RESUME_STEPS = 2, 1, 4
SMALL = ["model.num_layers=2", "model.hidden_size=128", "model.seq_length=64",
         "parallel.micro_batch_size=2", "parallel.global_batch_size=4", "train.warmup_iters=1"]


def _cfg(name, cache_dir, *overrides):
    from jobruntime.config import load_config

    return load_config(name, [f"data.cache_dir={cache_dir}", "logging.wandb=disabled",
                              "train.eval_interval=0", "train.warmup_iters=2", *overrides])


def _vocab_cfg(cache_dir, tokenizer, vocab, *overrides):
    return _cfg("tiny_gpt", cache_dir, f"data.tokenizer={tokenizer}", f"model.vocab_size={vocab}",
                f"train.iters={RESUME_STEPS}", *SMALL, *overrides)


def _train(cfg, steps, *, load=None, save_at=None, save_to=None):
    """Losses of ``steps`` steps from the seed (or from checkpoint ``load``)."""
    from pathlib import Path

    from jobruntime.checkpoint import load_checkpoint, save_checkpoint
    from jobruntime.loop import build_data
    from jobruntime.parallel import initialize_layout, set_seed
    from jobruntime.trainer import Trainer

    topo = initialize_layout(cfg)
    set_seed(cfg.train.seed)
    trainer = Trainer(cfg)
    consumed = load_checkpoint(load, trainer)["consumed_samples"] if load else 0
    data = build_data(cfg, topo, consumed)
    losses = []
    while trainer.step < steps:
        losses.append(trainer.train_step(data.train.next()).loss)
        if trainer.step == save_at:
            save_checkpoint(Path(save_to), trainer, consumed_samples=data.train.consumed_samples)
    return losses, trainer


def _reference(cache_dir, ckpt_root, vocabs, core):
    """World of 1: tiny_gpt losses (``core``); per vocabulary of ``vocabs``, losses of
    RESUME_STEPS uninterrupted steps and a step-SAVE_AT checkpoint; the logits of the
    padding ids."""
    import torch

    torch.set_num_threads(1)

    from jobruntime.data import prepare_corpus

    out = {}
    if core:
        out["tiny_gpt"] = _train(_cfg("tiny_gpt", cache_dir, f"train.iters={STEPS}"), STEPS)[0]
    base = _cfg("tiny_gpt", cache_dir)
    tokenizer = str(prepare_corpus(base.data, base.model).tokenizer.path)  # 4096 pieces
    out["tokenizer"] = tokenizer
    for vocab in vocabs:
        losses, trainer = _train(_vocab_cfg(cache_dir, tokenizer, vocab), RESUME_STEPS,
                                 save_at=SAVE_AT, save_to=f"{ckpt_root}/v{vocab}")
        out[vocab] = losses
        with torch.no_grad():
            tokens = torch.randint(0, 4096, (1, 8))
            logits = trainer.module(tokens, torch.arange(8)[None], None)  # [1, 8, padded]
        pad = logits[..., vocab:]
        out[f"logits{vocab}"] = (logits.shape[-1], pad.max().item() if pad.numel() else None,
                                 logits[..., :vocab].isfinite().all().item())
    return out


def _layouts(cache_dir, ckpt_root, tokenizer, vocabs, core):
    """On 2 ranks: TP=2, PP=2, DP=2 of tiny_gpt (``core``); TP=2 and PP=2 per vocabulary
    of ``vocabs``, and TP=2 resumed from the TP=1 step-1 checkpoint; a CONA switch DP2 ->
    TP2 at vocabulary 4099 (if in ``vocabs``); tiny_llama and tiny_bert trained 30 steps
    at TP=2 (``core``)."""
    import torch

    torch.set_num_threads(1)  # 2 ranks share 2 cores
    out = {}
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2), ("dp2", 1, 1)) if core else ():
        cfg = _cfg("tiny_gpt", cache_dir, f"train.iters={STEPS}", f"parallel.tp={tp}",
                   f"parallel.pp={pp}")
        out[name] = _train(cfg, STEPS)[0]
    for vocab in vocabs:
        for name, over in (("tp2", "parallel.tp=2"), ("pp2", "parallel.pp=2")):
            out[(vocab, name)] = _train(_vocab_cfg(cache_dir, tokenizer, vocab, over), VOCAB_STEPS)[0]
        out[(vocab, "resume_tp2")] = _train(_vocab_cfg(cache_dir, tokenizer, vocab, "parallel.tp=2"),
                                            RESUME_STEPS, load=f"{ckpt_root}/v{vocab}")[0]
    if 4099 in vocabs:
        out["cona_4099"] = _cona_switch(cache_dir, tokenizer)
    for preset in ("tiny_llama", "tiny_bert") if core else ():
        cfg = _cfg(preset, cache_dir, "train.iters=30", "parallel.tp=2", "train.warmup_iters=5")
        out[preset] = _train(cfg, 30)[0]
    return out


def _cona_switch(cache_dir, tokenizer):
    """Vocabulary 4099 (4224 rows; Megatron's rule padded TP=2 to 4352): 2 steps at
    DP2-TP1, switch to DP1-TP2, 2 more; and the same 4 steps never switching."""
    import types

    from cona.state import build_trainer, strategy_config
    from cona.strategy import Strategy
    from cona.switch import switch_layout
    from jobruntime.data import GlobalBatchSampler, build_dataset, prepare_corpus
    from jobruntime.parallel import initialize_layout, set_seed

    cfg = _vocab_cfg(cache_dir, tokenizer, 4099, "train.iters=4")
    gb = cfg.parallel.global_batch_size
    corpus = prepare_corpus(cfg.data, cfg.model)
    ds = build_dataset(corpus, cfg.model, "train", 4 * gb, cfg.train.seed, cache_dir)

    def sampler(c, topo, consumed):
        return GlobalBatchSampler(ds, global_batch_size=gb, micro_batch_size=c.parallel.micro_batch_size,
                                  dp=topo.dp, dp_rank=topo.dp_rank, consumed_samples=consumed)

    topo = initialize_layout(cfg)
    set_seed(cfg.train.seed)
    trainer, s = build_trainer(cfg, gb), sampler(cfg, topo, 0)
    reference = [trainer.train_step(s.next()).loss for _ in range(4)]
    del trainer
    topo = initialize_layout(cfg)
    set_seed(cfg.train.seed)
    job, s = types.SimpleNamespace(trainer=build_trainer(cfg, gb)), sampler(cfg, topo, 0)
    losses = [job.trainer.train_step(s.next()).loss for _ in range(2)]
    new_cfg = strategy_config(cfg, Strategy(1, 2, 1, 2, gb), lr=cfg.train.lr, min_lr=cfg.train.min_lr)
    topo, _ = switch_layout(job, new_cfg, reference_batch=gb, seed=cfg.train.seed)
    s = sampler(new_cfg, topo, s.consumed_samples)
    losses += [job.trainer.train_step(s.next()).loss for _ in range(2)]
    return reference, losses, topo.tp


def _results(cache_dir, tmp_path_factory, vocabs, core):
    ckpt = str(tmp_path_factory.mktemp("vocab_ckpt"))
    (ref,) = launch(_reference, 1, cache_dir, ckpt, vocabs, core, timeout_s=1800)
    per_rank = launch(_layouts, 2, cache_dir, ckpt, ref["tokenizer"], vocabs, core,
                      timeout_s=1800)
    return ref, per_rank


@pytest.fixture(scope="module")
def results(cache_dir, tmp_path_factory):
    """The fast tier's: tiny_gpt at every layout, :data:`FAST_VOCAB`, llama and BERT."""
    return _results(cache_dir, tmp_path_factory, (FAST_VOCAB,), core=True)


@pytest.fixture(scope="module")
def slow_results(cache_dir, tmp_path_factory):
    """The slow tier's: the other vocabularies and the CONA switch at 4099."""
    return _results(cache_dir, tmp_path_factory, SLOW_VOCABS, core=False)


def _for_vocab(request, vocab):
    return request.getfixturevalue("results" if vocab == FAST_VOCAB else "slow_results")


@pytest.mark.parametrize("layout", ["tp2", "pp2", "dp2"])
def test_layout_matches_single_process(results, layout):
    """Catches wrong TP/PP/DP splits of weights, gradients or batches, and a PP
    layout initialised differently from PP=1 (measured 8.3462 vs 8.3067 at step
    1 before every stage drew from the PP=1 stream): any of these changes the
    loss by far more than 1e-4; 1e-4 leaves room for fp32 reduction order over
    5 Adam steps (~1e-6)."""
    ref, per_rank = results
    for rank_out in per_rank:  # every rank reports the same loss
        got = rank_out[layout]
        assert abs(got[0] - ref["tiny_gpt"][0]) < 1e-5, (layout, got[0], ref["tiny_gpt"][0])
        assert got == pytest.approx(ref["tiny_gpt"], abs=1e-4), (layout, ref["tiny_gpt"], got)
    assert ref["tiny_gpt"][-1] < ref["tiny_gpt"][0]  # and training is actually happening


@pytest.mark.parametrize("vocab", VOCAB_PARAMS)
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_same_seed_same_model_at_every_vocabulary(request, vocab, layout):
    """Catches a padded vocabulary that depends on TP (vocab 4100: step-1 loss 8.4203
    at TP=1 vs 8.3974 at TP=2 before; 4099 and 50257 likewise) and padding rows in
    the softmax.  Step 1 within 1e-5 (fp32 reduction order ~1e-6); step 2 within
    1e-4 (Adam amplifies that noise in tiny gradients)."""
    ref, per_rank = _for_vocab(request, vocab)
    want = ref[vocab][:VOCAB_STEPS]
    for rank_out in per_rank:
        got = rank_out[(vocab, layout)]
        assert abs(got[0] - want[0]) < 1e-5, (vocab, layout, got, want)
        assert got == pytest.approx(want, abs=1e-4), (vocab, layout, got, want)


@pytest.mark.parametrize("vocab", VOCAB_PARAMS)
def test_resume_across_tp_is_loss_continuous(request, vocab):
    """A checkpoint saved at TP=1 after step 1 and resumed at TP=2 continues the
    uninterrupted TP=1 run: steps 2-4 (three optimizer steps after the resume) give the
    same losses.  Catches the model resumed as another model (the loss jumped by 0.04 at
    vocab 4100) and, from step 3 on, optimizer state lost in the resharding: Adam
    moments zeroed on a TP>1 resume move steps 3-4 by 1.1e-2 to 4.5e-2 (measured, every
    vocabulary; step 2 is computed before the first update and cannot show it).  1e-4:
    fp32 reduction order between layouts (measured <= 9.5e-7), room for Adam's
    amplification on tiny gradients."""
    ref, per_rank = _for_vocab(request, vocab)
    want = ref[vocab][SAVE_AT:]
    for rank_out in per_rank:  # every rank reports the same loss
        after = rank_out[(vocab, "resume_tp2")]
        assert len(after) == len(want) == RESUME_STEPS - SAVE_AT
        assert after == pytest.approx(want, abs=1e-4), (vocab, after, want)


@pytest.mark.parametrize("vocab", VOCAB_PARAMS)
def test_padding_ids_have_minus_inf_logits(request, vocab):
    """Catches padding rows taking part in the softmax: the padded size is the vocabulary
    rounded up to 128 (the same at every TP), padding logits are -inf, real ones finite."""
    ref, _ = _for_vocab(request, vocab)
    rows, pad_max, real_finite = ref[f"logits{vocab}"]
    assert rows == -(-vocab // 128) * 128  # the default padding: a multiple of 128
    assert real_finite and (pad_max is None) == (rows == vocab)
    assert pad_max in (None, -math.inf)


@pytest.mark.slow
def test_cona_switch_between_tp_sizes_at_vocab_4099(slow_results):
    """Catches 'Cannot build TP descriptor for embedding.word_embeddings.weight': the
    TP=1 and TP=2 embeddings had different padded shapes.  After the switch the losses
    follow the never-switching run (1e-4: reduction order between layouts)."""
    _, per_rank = slow_results
    for rank_out in per_rank:
        reference, switched, tp = rank_out["cona_4099"]
        assert tp == 2
        assert switched == pytest.approx(reference, abs=1e-4), (reference, switched)


@pytest.mark.parametrize("preset", ["tiny_llama", "tiny_bert"])
def test_tp2_training_reduces_loss(results, preset):
    """Catches a model that builds at TP=2 but does not learn (broken gradients
    in GQA/SwiGLU/RoPE or BERT's masked-LM head): the loss of the last 5 steps
    must be clearly below the first 5."""
    _, per_rank = results
    losses = per_rank[0][preset]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, losses
