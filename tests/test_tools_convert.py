"""tools/convert_checkpoint.py and tools/zero_shot.py against Hugging Face models.

Tiny randomly initialised HF models (built from a config, nothing downloaded;
LayerNorm/RMSNorm weights and biases randomised too, so a swapped norm or bias
cannot hide): ``LlamaForCausalLM`` (GQA 4/2, tied embeddings, Llama-3 RoPE
scaling), ``GPT2LMHeadModel`` (untied, exact GELU), ``MegatronBertForMaskedLM``
(tied) and ``BertForMaskedLM`` (post-LN; mapped by layout only).  The vocabulary
(300) is not a multiple of 128: 384 rows at every layout (Megatron's rule
padded TP=2 to 512), so padding is exercised.

One launch of two gloo ranks converts (config.yaml for TP=1 and TP=2), checks
TP=1 (DP=2), loads the TP=2 conversions at TP=2 and the TP=1 conversions at
TP=2 and PP=2, saves them from those layouts and converts them back, each time
to the HF architecture the weights came from (no ``--hf-arch``).  Logit tolerance 1e-4 (fp32): the same math in a
different kernel order (fused QKV, vocab-parallel output) differs by ~1e-6;
any mapping error (a transposed Conv1D, a wrong QKV grouping, a swapped
gate/up) shifts logits by ~1e-1.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch

from tests.dist_utils import launch
from tests.hf_reference import choice_scores

VOCAB, SEQ_LEN = 300, 48
KINDS = ("llama", "gpt", "bert", "bert-postln")
FAMILY = {"llama": "llama", "gpt": "gpt", "bert": "bert", "bert-postln": "bert"}
HF_ARCH = {"llama": "llama", "gpt": "gpt2", "bert": "megatron-bert", "bert-postln": "bert"}
TASKS = ("tools/samples/hellaswag_synthetic.jsonl", "tools/samples/piqa_synthetic.jsonl")


def _hf_model(kind: str):
    import transformers as T

    torch.manual_seed({"llama": 1, "gpt": 2, "bert": 3, "bert-postln": 4}[kind])
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    if kind == "llama":
        rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
                "rope_theta": 500000.0}
        model = T.LlamaForCausalLM(T.LlamaConfig(
            **common, num_key_value_heads=2, intermediate_size=96, tie_word_embeddings=True,
            max_position_embeddings=16384, rope_parameters=rope, eos_token_id=0, bos_token_id=0))
    elif kind == "gpt":
        model = T.GPT2LMHeadModel(T.GPT2Config(
            vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=96,
            activation_function="gelu", tie_word_embeddings=False, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    else:
        cls, cfg = ((T.MegatronBertForMaskedLM, T.MegatronBertConfig) if kind == "bert"
                    else (T.BertForMaskedLM, T.BertConfig))
        model = cls(cfg(**common, intermediate_size=128, max_position_embeddings=64,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms around 1, biases around 0
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name.lower() or ".ln." in name
                                                      or name.endswith("ln.weight") else 0.0))
            else:  # std 1/sqrt(h) instead of 0.02: every sublayer moves the logits
                p.normal_(0.0, 0.125)
    return model.eval()


def _hf_logits(model, kind, tokens):
    with torch.no_grad():
        if kind.startswith("bert"):
            return model(tokens, attention_mask=torch.ones_like(tokens),
                         token_type_ids=torch.zeros_like(tokens)).logits
        return model(tokens).logits


def _write_tokenizer(path):
    """A word-level tokenizer.json covering the sample tasks (eod = <|endoftext|> = 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tests.conftest import REPO

    text = "Question Answer :"
    for f in TASKS:
        for line in (REPO / f).read_text().splitlines():
            ex = json.loads(line)
            text += " " + " ".join(str(v) for k, v in ex.items() if k != "source")
    words = sorted(set(re.findall(r"\w+|[^\w\s]+", text)))
    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


# -- code run on gloo ranks ---------------------------------------------------


def _megatron_logits(ckpt, tokens, overrides=()):
    """Build a Trainer from ``ckpt/config.yaml`` (+ overrides), load the weights, return
    (trainer, full-vocabulary logits gathered over TP, padding stripped)."""
    from megatron.core import parallel_state

    from jobruntime.checkpoint import load_checkpoint
    from jobruntime.config import load_config
    from jobruntime.parallel import initialize_layout, set_seed
    from jobruntime.trainer import Trainer

    cfg = load_config(f"{ckpt}/config.yaml", ["logging.wandb=disabled", *overrides])
    initialize_layout(cfg)
    set_seed(cfg.train.seed)
    trainer = Trainer(cfg)
    load_checkpoint(cfg.checkpoint.load, trainer, load_optimizer=False)
    if cfg.parallel.pp > 1:
        return trainer, None
    tokens = torch.tensor(tokens)
    module = trainer.module.eval()
    with torch.no_grad():
        if cfg.model.family == "bert":
            out, _ = module(tokens, torch.ones_like(tokens), tokentype_ids=torch.zeros_like(tokens))
        else:
            out = module(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(out) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, out.contiguous(), group=group)
    return trainer, torch.cat(parts, dim=-1)[..., :VOCAB]


def _zero_shot_scores(trainer, tokenizer_path):
    from jobruntime.tokenizer import load_tokenizer
    from tests.conftest import REPO
    from tools.zero_shot import evaluate_zero_shot

    tok = load_tokenizer(tokenizer_path)
    out = {}
    for task in TASKS:
        result = evaluate_zero_shot(trainer, tok, REPO / task, return_scores=True)
        out[task] = (result.pop("scores"), result)
    return out


def _ranks(root, tokens):
    """On 2 gloo ranks: convert every kind (for TP=1 and TP=2); logits at TP=1 (DP=2)
    and the megatron → HF → megatron round trip; logits and zero-shot at TP=2;
    the TP=1 conversion's logits at TP=2; zero-shot at PP=2; save from TP=2 and PP=2
    and convert those back to HF."""
    torch.set_num_threads(1)  # tiny models; spinning OpenMP threads only slow a shared CPU
    from megatron.core import dist_checkpointing

    from jobruntime.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from tools.convert_checkpoint import hf_to_mcore, mcore_to_hf

    out = {}
    for kind in KINDS:
        fam, res = FAMILY[kind], {}
        hf_to_mcore(f"{root}/hf-{kind}", f"{root}/mc1-{kind}", fam, seq_length=SEQ_LEN)
        hf_to_mcore(f"{root}/hf-{kind}", f"{root}/mc2-{kind}", fam, tp=2, seq_length=SEQ_LEN)
        _, res["logits_tp1"] = _megatron_logits(f"{root}/mc1-{kind}", tokens)
        _, res["logits_tp2from1"] = _megatron_logits(f"{root}/mc1-{kind}", tokens, ("parallel.tp=2",))
        mcore_to_hf(f"{root}/mc1-{kind}", f"{root}/back-{kind}", fam)  # the source's arch
        hf_to_mcore(f"{root}/back-{kind}", f"{root}/mc1b-{kind}", fam, seq_length=SEQ_LEN)
        a = dist_checkpointing.load_plain_tensors(f"{root}/mc1-{kind}/iter_0000000")
        b = dist_checkpointing.load_plain_tensors(f"{root}/mc1b-{kind}/iter_0000000")
        tensors = [k for k, v in a.items() if isinstance(v, torch.Tensor)]
        res["roundtrip_equal"] = set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in tensors)
        res["keys"] = len(tensors)
        for layout, src, overrides in (("tp2", "mc2", ()), ("pp2", "mc1", ("parallel.pp=2",))):
            trainer, res[f"logits_{layout}"] = _megatron_logits(f"{root}/{src}-{kind}", tokens, overrides)
            if kind == "llama":
                res[f"zero_shot_{layout}"] = _zero_shot_scores(trainer, f"{root}/mc1-{kind}/tokenizer.json")
            save_checkpoint(root / f"{layout}-{kind}", trainer, consumed_samples=0)
            mcore_to_hf(root / f"{layout}-{kind}", root / f"hf-{layout}-{kind}", fam,
                        config=f"{root}/{src}-{kind}/config.yaml")
        out[kind] = res
    # resuming (optimizer included) from a weights-only checkpoint must name the fix
    from jobruntime.config import load_config
    from jobruntime.parallel import initialize_layout
    from jobruntime.trainer import Trainer

    cfg = load_config(f"{root}/mc1-llama/config.yaml", ["logging.wandb=disabled"])
    initialize_layout(cfg)
    try:
        load_checkpoint(cfg.checkpoint.load, Trainer(cfg))
        out["resume_error"] = None
    except CheckpointError as e:
        out["resume_error"] = str(e)
    return out


# -- fixtures -----------------------------------------------------------------


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """Tiny HF models saved to disk, their logits on fixed tokens, and the tokenizer."""
    root = tmp_path_factory.mktemp("convert")
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    models, logits = {}, {}
    for kind in KINDS:
        models[kind] = _hf_model(kind)
        models[kind].save_pretrained(root / f"hf-{kind}")
        logits[kind] = _hf_logits(models[kind], kind, tokens)
    _write_tokenizer(root / "hf-llama" / "tokenizer.json")
    return {"root": root, "tokens": tokens, "models": models, "logits": logits}


@pytest.fixture(scope="module")
def converted(hf):
    """Rank 0's results of :func:`_ranks` (one launch: each process costs ~5 s of imports)."""
    return launch(_ranks, 2, hf["root"], hf["tokens"].tolist())[0]


def _safetensors(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# -- pure mapping ---------------------------------------------------------------


def test_fused_qkv_layout_groups_heads():
    """Catches a QKV fusion that concatenates [Q; K; V] instead of megatron's per-group
    layout (it would still be a valid shape).  Exact: only reshapes."""
    from tools.hf_mapping import fuse_qkv, split_qkv

    d, heads, groups = 2, 4, 2
    q = torch.arange(heads * d).float().reshape(-1, 1) + 100  # rows 100..107
    k = torch.arange(groups * d).float().reshape(-1, 1) + 200
    v = torch.arange(groups * d).float().reshape(-1, 1) + 300
    qkv = fuse_qkv(q, k, v, heads, groups)
    # group 0: q heads 0,1 (rows 100-103), k head 0, v head 0; then group 1
    expect = [100, 101, 102, 103, 200, 201, 300, 301, 104, 105, 106, 107, 202, 203, 302, 303]
    assert qkv.flatten().tolist() == expect
    for a, b in zip(split_qkv(qkv, heads, groups), (q, k, v)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("preset", ["tiny_llama", "tiny_gpt", "tiny_bert"])
def test_config_round_trip(preset):
    """Catches a ModelConfig field lost or renamed on the way to config.json and back
    (a preset must come back equal, so converted checkpoints pass the arch check)."""
    from jobruntime.config import load_config
    from tools.hf_mapping import default_hf_arch, hf_config_from_model, model_config_from_hf

    model = load_config(preset).model
    arch = default_hf_arch(model.family)
    _, kwargs = hf_config_from_model(model, arch)
    back = model_config_from_hf(model.family, {**kwargs, "model_type": arch},
                                seq_length=model.seq_length)
    # defaults may come back spelled out or as None (ffn_hidden_size: 1024 == null at
    # h=256); jobruntime.checkpoint.arch_diff resolves them the same way
    for name in ("ffn", "kv_heads", "max_positions"):
        assert getattr(back, name) == getattr(model, name)
    assert dataclasses.replace(back, ffn_hidden_size=None, num_query_groups=None,
                               max_position_embeddings=None) == dataclasses.replace(
        model, ffn_hidden_size=None, num_query_groups=None, max_position_embeddings=None)


def test_unexpressible_config_is_refused():
    """Catches silently exporting a RoPE model as GPT-2 (which has learned positions)."""
    from jobruntime.config import load_config
    from tools.hf_mapping import ConversionError, hf_config_from_model

    model = load_config("tiny_gpt", ["model.position_embedding=rope"]).model
    with pytest.raises(ConversionError, match="position_embedding"):
        hf_config_from_model(model, "gpt2")


# -- conversion ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "gpt", "bert"])
@pytest.mark.parametrize("layout", ["tp1", "tp2", "tp2from1"])
def test_hf_to_mcore_logits_match(hf, converted, kind, layout):
    """HF → megatron gives the HF model's logits at TP=1 and TP=2, and a conversion made
    for TP=1 gives them at TP=2 too (catches a padded size that depends on TP: the
    padding rows took part in the softmax, a 300-id Llama started at ln 512)."""
    ours = converted[kind][f"logits_{layout}"]
    diff = (ours - hf["logits"][kind]).abs().max().item()
    print(f"{kind} {layout}: max |logit diff| = {diff:.2e}")
    assert diff < 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_mcore_hf_mcore_round_trip_is_bit_exact(converted, kind):
    """Catches any lossy step (dtype cast, a dropped or duplicated tensor) on the way
    megatron → HF → megatron: every tensor of the two checkpoints is identical."""
    assert converted[kind]["keys"] >= 8  # stacked layers: one key per weight kind
    assert converted[kind]["roundtrip_equal"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", ["tp1", "tp2", "pp2"])
def test_checkpoint_converts_back_to_hf_bit_exact(hf, converted, kind, layout):
    """A checkpoint converted at TP=1 (exported directly), or loaded and saved again at
    TP=2 or PP=2 by the job runtime, converts back to the original HF tensors bit-exact
    (catches resharding of gate/up or QKV, tied-output handling across stages, and
    padding not stripped)."""
    root = hf["root"]
    src = {"tp1": f"back-{kind}", "tp2": f"hf-tp2-{kind}", "pp2": f"hf-pp2-{kind}"}[layout]
    ours, ref = _safetensors(root / src), _safetensors(root / f"hf-{kind}")
    assert set(ours) == set(ref)
    for k in ref:
        assert torch.equal(ours[k], ref[k]), k


@pytest.mark.parametrize("kind", KINDS)
def test_exported_model_loads_in_transformers(hf, converted, kind):
    """The exported folder is a valid HF model of the same class with the same logits
    (catches a wrong config.json: class, tied flags, RoPE parameters, token ids)."""
    import transformers as T

    model = T.AutoModelForMaskedLM if kind.startswith("bert") else T.AutoModelForCausalLM
    back = model.from_pretrained(hf["root"] / f"hf-tp2-{kind}").eval()
    assert type(back) is type(hf["models"][kind])
    diff = (_hf_logits(back, kind, hf["tokens"]) - hf["logits"][kind]).abs().max().item()
    assert diff == 0.0


def test_export_defaults_to_the_source_architecture(hf, converted):
    """Catches an HF BertForMaskedLM written back as MegatronBertForMaskedLM when
    --hf-arch is not given (10 LayerNorm tensors differed): every kind comes back as
    its own class, from the converted folder and from checkpoints saved at TP=2/PP=2
    (the tensors bit-exact: test_checkpoint_converts_back_to_hf_bit_exact)."""
    for kind in KINDS:
        for folder in (f"back-{kind}", f"hf-tp2-{kind}", f"hf-pp2-{kind}"):
            written = json.loads((hf["root"] / folder / "config.json").read_text())
            assert written["architectures"] == [type(hf["models"][kind]).__name__], folder
            assert written["model_type"] == HF_ARCH[kind]


def test_architecture_fields_of_config_json_are_checked():
    """Catches an input read by a mapping it does not fit: a class without an LM head
    (BertModel) or architectures that contradict model_type are refused, naming both."""
    from tools.hf_mapping import ConversionError, hf_arch_of

    assert hf_arch_of({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, family="bert",
                      hf_arch="bert") == "bert"
    assert hf_arch_of({"model_type": "gpt2"}, family="gpt") == "gpt2"  # no architectures field
    with pytest.raises(ConversionError, match=r"\['BertModel'\]"):
        hf_arch_of({"model_type": "bert", "architectures": ["BertModel"]})
    with pytest.raises(ConversionError, match="GPT2LMHeadModel.*model_type 'llama'"):
        hf_arch_of({"model_type": "llama", "architectures": ["GPT2LMHeadModel"]})


@pytest.mark.parametrize("kind, args, needle", [
    ("gpt", ["--model", "llama"], "use --model gpt"),
    ("llama", ["--model", "bert"], "use --model llama"),
    ("bert-postln", ["--model", "bert", "--hf-arch", "megatron-bert"], "use --hf-arch bert"),
    ("bert", ["--model", "bert", "--hf-arch", "bert"], "use --hf-arch megatron-bert"),
], ids=["gpt2-as-llama", "llama-as-bert", "bert-as-megatron-bert", "megatron-bert-as-bert"])
def test_mismatched_architecture_is_one_line_exit_2(hf, tmp_path, capsys, kind, args, needle):
    """Catches converting an input with another family's or architecture's mapping:
    exit 2, one line naming what the input is and the flag that fits, nothing written."""
    from tools.convert_checkpoint import main

    out = tmp_path / "out"
    rc = main(["hf-to-mcore", *args, "--input", str(hf["root"] / f"hf-{kind}"), "--output", str(out)])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and needle in lines[0], lines
    assert type(hf["models"][kind]).__name__ in lines[0]
    assert not out.exists()


def test_bert_post_ln_conversion_is_not_equivalent_and_says_so(hf, converted, caplog):
    """Catches HF BERT converted into a different function without a word: HF
    BertForMaskedLM is post-LN, megatron's BertModel pre-LN, so the layout-preserving
    mapping changes the function (large logit differences), while megatron-bert (same
    architecture) matches to 1e-4.  Each direction of the post-LN mapping must log one
    warning line calling the result an initialisation, and hf-to-mcore must record it in
    the written config (checkpoint.load_exact: false); megatron-bert neither."""
    import logging

    from jobruntime.config import load_config
    from tools.convert_checkpoint import read_hf_checkpoint
    from tools.hf_mapping import hf_to_mcore_state, mcore_to_hf_state

    for kind, bound_ok, exact in (("bert", lambda d: d < 1e-4, True),
                                  ("bert-postln", lambda d: d > 1e-2, False)):
        diff = (converted[kind]["logits_tp1"] - hf["logits"][kind]).abs().max().item()
        assert bound_ok(diff), (kind, diff)
        caplog.clear()
        hcfg, state = read_hf_checkpoint(hf["root"] / f"hf-{kind}")
        with caplog.at_level(logging.WARNING, logger="tools.convert"):
            model, mstate = hf_to_mcore_state("bert", hcfg, state, seq_length=SEQ_LEN)
            mcore_to_hf_state(model, mstate, HF_ARCH[kind])
        warned = [r.getMessage() for r in caplog.records if "initialisation" in r.getMessage()]
        assert len(warned) == (0 if exact else 2), caplog.text
        assert all("\n" not in w and "post-LN" in w for w in warned)
        cfg = load_config(hf["root"] / f"mc1-{kind}" / "config.yaml")
        assert cfg.checkpoint.load_exact is exact and cfg.checkpoint.load_optimizer is False


def test_tokenizer_and_config_carried_over(hf, converted):
    """config.yaml points train.py at the checkpoint (weights only) and the copied tokenizer."""
    from jobruntime.config import load_config

    root = hf["root"]
    cfg = load_config(root / "mc2-llama" / "config.yaml")
    assert cfg.checkpoint.load == str(root / "mc2-llama") and cfg.checkpoint.load_optimizer is False
    assert cfg.parallel.tp == 2 and cfg.model.num_query_groups == 2 and cfg.model.rope_scaling
    assert cfg.data.tokenizer == str(root / "mc2-llama" / "tokenizer.json")
    assert (root / "back-llama" / "tokenizer.json").is_file()
    assert json.loads((root / "back-llama" / "config.json").read_text())["eos_token_id"] == 0


def test_weights_only_checkpoint_needs_load_optimizer_false(converted):
    """Resuming (optimizer included) from a converted checkpoint fails with a message
    that names the fix instead of a missing-key error deep in dist_checkpointing."""
    assert "checkpoint.load_optimizer=false" in converted["resume_error"]


# -- zero-shot ------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_zero_shot(hf):
    """Per task: the examples and the HF model's choice log-likelihoods."""
    from jobruntime.tokenizer import load_tokenizer
    from tests.conftest import REPO
    from tools.zero_shot import build_requests, load_task

    tok = load_tokenizer(hf["root"] / "hf-llama" / "tokenizer.json")
    out = {}
    for task in TASKS:
        examples = load_task(REPO / task)
        out[task] = (examples, choice_scores(hf["models"]["llama"], build_requests(examples, tok), SEQ_LEN))
    return out


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
@pytest.mark.parametrize("task", TASKS)
def test_zero_shot_scores_match_hf(hf_zero_shot, converted, layout, task):
    """evaluate_zero_shot on the converted Llama at TP=2 (vocab-parallel logits, padded
    rows masked) and PP=2 (pipeline schedule) equals log-likelihoods computed with the
    HF model; accuracy follows from those scores.  Tolerance 1e-3 on sums of ~20
    log-probs (fp32 megatron vs float64 reference)."""
    from tools.zero_shot import accuracy

    scores, result = converted["llama"][f"zero_shot_{layout}"][task]
    examples, ref = hf_zero_shot[task]
    assert len(scores) == len(ref) == sum(len(e.choices) for e in examples)
    assert max(abs(a - b) for a, b in zip(scores, ref)) < 1e-3
    assert {k: v for k, v in result.items() if k not in ("device", "precision")} == {
        **accuracy(examples, ref), "task": result["task"]}
    assert result["device"] == ("cuda" if torch.cuda.is_available() else "cpu"), result
    assert result["n"] == len(examples)
