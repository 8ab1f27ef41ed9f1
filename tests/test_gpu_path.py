"""The GPU code path, exercised on CPU: bf16 through megatron's Float16Module and
mixed-precision optimizer, SDPA attention against megatron's local attention,
fused kernels chosen by what imports, and tensors on the compute device.

Each test names the GPU failure it stands for (issue 9: four failures on an
H200 that no CPU test had caught).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from tests.dist_utils import child_env, launch

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("jobruntime", "geomesh", "cona", "tools", "bench")
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "as_tensor", "arange", "rand", "randn",
             "randint", "eye", "linspace", "frombuffer", "from_numpy"}


def _small(preset: str, *overrides: str):
    from jobruntime.config import load_config

    return load_config(preset, ["model.num_layers=2", "model.seq_length=32", "model.vocab_size=512",
                                "logging.wandb=disabled", *overrides])


def _batch(cfg, seed: int = 0) -> dict:
    """One synthetic micro-batch; for BERT the first sequence is half padding."""
    from jobruntime.data import synthetic_microbatch

    batch = synthetic_microbatch(cfg.model, cfg.parallel.micro_batch_size,
                                 torch.Generator().manual_seed(seed))
    if cfg.model.family == "bert":  # exercises the padding mask
        s = cfg.model.seq_length
        batch["padding_mask"][0, s // 2:] = 0
        batch["loss_mask"][0, s // 2:] = 0
        batch["loss_mask"][:, ::3] = 1.0 * batch["padding_mask"][:, ::3]
    return batch


def _forward_loss(cfg, backend: str) -> float:
    """Mean loss of a fresh model (seed 1234) on one batch, with ``backend`` attention."""
    from jobruntime.model import build_model
    from jobruntime.parallel import set_seed

    cfg.model.attention_backend = backend
    set_seed(1234)
    model = build_model(cfg.model, cfg.parallel)
    batch = _batch(cfg)
    with torch.no_grad():
        if cfg.model.family == "bert":
            out, _ = model(batch["text"], batch["padding_mask"], tokentype_ids=batch["types"],
                           lm_labels=batch["labels"])
        else:
            out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return float((out * batch["loss_mask"]).sum() / batch["loss_mask"].sum())


def _bert_unmasked_equals_masked(cfg) -> float:
    """|loss(all-ones padding mask) - loss(no mask)| of one tiny BERT (the unpadded fast path)."""
    from jobruntime.model import build_model
    from jobruntime.parallel import set_seed

    set_seed(1234)
    model = build_model(cfg.model, cfg.parallel)
    batch = _batch(cfg)
    batch["padding_mask"].fill_(1)
    with torch.no_grad():
        masked, _ = model(batch["text"], batch["padding_mask"], tokentype_ids=batch["types"],
                          lm_labels=batch["labels"])
        unmasked, _ = model(batch["text"], None, tokentype_ids=batch["types"],
                            lm_labels=batch["labels"])
    return float((masked - unmasked).abs().max())


def _attention_kernel_errors(cfg, device: str = "cpu") -> dict:
    """Max |SDPA - megatron local| on random q, k, v of this rank's heads, fp32 and bf16.

    Returns:
        ``{"torch.float32": err, "torch.bfloat16": err, "devices": [device types of
        both outputs], "dtypes": [the outputs' dtype per input dtype]}``: where the
        kernels really ran (a ``.to("cuda")`` mapped to the CPU shows here).
    """
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from jobruntime.attention import SDPAttention
    from jobruntime.model import to_transformer_config

    bert = cfg.model.family == "bert"
    mask_type = AttnMaskType.padding if bert else AttnMaskType.causal
    tp = cfg.parallel.tp
    heads, groups = cfg.model.num_attention_heads // tp, cfg.model.kv_heads // tp
    hn = cfg.model.hidden_size // cfg.model.num_attention_heads
    s, b = cfg.model.seq_length, 2
    g = torch.Generator().manual_seed(7)
    q = torch.randn(s, b, heads, hn, generator=g).to(device)  # host draw, then moved
    k = torch.randn(s, b, groups, hn, generator=g).to(device)  # host draw, then moved
    v = torch.randn(s, b, groups, hn, generator=g).to(device)  # host draw, then moved
    mask = None
    if bert:  # megatron's convention: True = masked out; second sequence padded after s/4
        mask = torch.zeros(b, 1, 1, s, dtype=torch.bool, device=device)
        mask[1, ..., s // 4:] = True
    errors, devices, dtypes = {}, set(), []
    for dtype in (torch.float32, torch.bfloat16):
        tcfg = to_transformer_config(cfg.model, cfg.parallel, params_dtype=dtype)
        local = DotProductAttention(tcfg, 1, mask_type, "self")
        sdpa = SDPAttention(tcfg, 1, mask_type, "self")
        ref = local(q.to(dtype), k.to(dtype), v.to(dtype), mask)
        out = sdpa(q.to(dtype), k.to(dtype), v.to(dtype), mask)
        assert out.shape == ref.shape == (s, b, heads * hn)
        devices |= {ref.device.type, out.device.type}
        dtypes.append(str(out.dtype) if out.dtype == ref.dtype else f"{out.dtype} vs {ref.dtype}")
        errors[str(dtype)] = float((out.float() - ref.float()).abs().max())
    return {**errors, "devices": sorted(devices), "dtypes": dtypes}


def _weights_only_reload(cfg, trainer, batch, ckpt_dir) -> tuple[float, float, float]:
    """Loss of ``trainer`` on ``batch``; of a fresh Trainer after loading its checkpoint
    without the optimizer; and of that Trainer after one optimizer step at lr 0."""
    from jobruntime.checkpoint import load_checkpoint, save_checkpoint
    from jobruntime.parallel import set_seed
    from jobruntime.trainer import Trainer

    trained = trainer.evaluate([[batch]])
    save_checkpoint(Path(ckpt_dir), trainer, consumed_samples=0)
    set_seed(cfg.train.seed)
    fresh = Trainer(cfg)  # the seed's initialisation, in the model and in the main copies
    load_checkpoint(ckpt_dir, fresh, load_optimizer=False)
    loaded = fresh.evaluate([[batch]])
    fresh.lr_scale = 0.0  # a step that must change nothing
    fresh.train_step([batch])
    return trained, loaded, fresh.evaluate([[batch]])


def _bf16_training(cfg, ckpt_dir) -> dict:
    """Trainer in bf16 and fp32 from the same seed on one repeated batch; in bf16, a
    weights-only reload of the trained model (:func:`_weights_only_reload`)."""
    from megatron.core.transformer.module import Float16Module

    from jobruntime.parallel import initialize_layout, set_seed
    from jobruntime.trainer import Trainer

    out = {}
    for precision in ("fp32", "bf16"):
        cfg.train.precision = precision
        initialize_layout(cfg)
        set_seed(cfg.train.seed)
        trainer = Trainer(cfg)
        batch = _batch(cfg)
        losses = [trainer.train_step([batch]).loss for _ in range(12)]
        inner = trainer.optimizer.optimizer  # torch AdamW inside megatron's chain
        params = trainer.get_params()  # fp32: the optimizer's main copies under bf16
        out[precision] = {
            "losses": losses,
            "wrapper": type(trainer.model[0].module).__name__,
            "float16_module": isinstance(trainer.model[0].module, Float16Module),
            "optimizer": [type(o).__name__ for o in trainer.optimizer.chained_optimizers],
            "get_params_dtype": str(next(iter(params.values())).dtype),
            # bf16 rounding of the fp32 main weights: 0 iff get_params returned bf16 values
            "main_minus_model": max(float((params[n] - p.float()).abs().max())
                                    for n, p in trainer.module.named_parameters()),
            "fused_adamw": all(gr.get("fused") for gr in inner.param_groups),
            "param_dtype": str(next(trainer.module.parameters()).dtype),
        }
    out["bf16"]["weights_only"] = _weights_only_reload(cfg, trainer, batch, ckpt_dir)
    return out


def _run_all(ckpt_dir):
    """On 2 ranks (TP=2): attention kernels, whole-model losses, bf16 training."""
    from jobruntime.parallel import initialize_layout, set_seed

    out = {}
    for preset in ("tiny_gpt", "tiny_llama", "tiny_bert"):
        cfg = _small(preset, "parallel.tp=2", "parallel.micro_batch_size=2",
                     "parallel.global_batch_size=2")
        initialize_layout(cfg)
        set_seed(1234)  # megatron's RNG tracker (attention dropout) needs its states
        out[preset] = {"kernel": _attention_kernel_errors(cfg),
                       "local": _forward_loss(cfg, "local"), "sdpa": _forward_loss(cfg, "sdpa")}
        if preset == "tiny_bert":
            out[preset]["unmasked_error"] = _bert_unmasked_equals_masked(cfg)
    cfg = _small("tiny_gpt", "parallel.tp=2", "parallel.micro_batch_size=2",
                 "parallel.global_batch_size=2", "train.lr=3e-3", "train.warmup_iters=0")
    out["bf16"] = _bf16_training(cfg, ckpt_dir)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(_run_all, 2, str(tmp_path_factory.mktemp("bf16_ckpt")))


@pytest.mark.parametrize("preset", ["tiny_gpt", "tiny_llama", "tiny_bert"])
def test_sdpa_equals_local_attention(results, preset):
    """Catches a wrong SDPA layout, scale, causal/padding mask or GQA head
    grouping (any gives errors of order 1).  fp32 kernels agree to ~1e-6;
    bf16 inputs differ by rounding of the scores and probabilities (~1e-2
    worst element over 32 keys: bf16 has 8 mantissa bits)."""
    for rank in results:
        r = rank[preset]
        assert r["kernel"]["devices"] == ["cpu"], r
        assert r["kernel"]["dtypes"] == ["torch.float32", "torch.bfloat16"], r
        assert r["kernel"]["torch.float32"] < 1e-5, r
        assert r["kernel"]["torch.bfloat16"] < 6e-2, r
        assert r["sdpa"] == pytest.approx(r["local"], abs=1e-5), r
        if preset == "tiny_bert":  # an unpadded batch may skip the mask: same losses
            assert r["unmasked_error"] < 1e-5, r


def test_bf16_trains_through_megatron_wrappers_on_cpu(results):
    """Catches the GPU failures 2 and 3 on CPU: bf16 parameters not accepted by
    megatron's mixed-precision optimizer (type check on torch.cuda.* types),
    and bf16 weights fed fp32 activations (no Float16Module).  bf16 must
    train as fp32 does: step-1 losses within 0.02 (bf16 rounding of an ~6.2
    loss), and both memorise the repeated batch."""
    for rank in results:
        bf16, fp32 = rank["bf16"]["bf16"], rank["bf16"]["fp32"]
        assert bf16["float16_module"] and not fp32["float16_module"], (bf16, fp32)
        assert bf16["optimizer"] == ["Float16OptimizerWithFloat16Params"], bf16
        # GeoMesh/CONA read weights through get_params: the fp32 main copies, not bf16
        assert bf16["get_params_dtype"] == "torch.float32" and bf16["main_minus_model"] > 0, bf16
        assert bf16["param_dtype"] == "torch.bfloat16" and bf16["fused_adamw"], bf16
        assert bf16["losses"][0] == pytest.approx(fp32["losses"][0], abs=0.02)
        for run in (bf16, fp32):
            assert run["losses"][-1] < run["losses"][0] - 1.0, run["losses"]


def test_bf16_weights_only_load_keeps_its_weights_at_tp2(results):
    """A checkpoint loaded without its optimizer (a fine-tune, zero-shot, a CONA job
    started from checkpoint.load) at TP=2 in bf16: the loaded model has the trained
    model's loss, and an optimizer step at lr 0 keeps it.  Catches the fp32 main copies
    left at the fresh initialisation (measured without the refresh: 0.229 after the load,
    6.284 after one step at lr 0); exact weights, so 1e-5 covers evaluation order only."""
    for rank in results:
        trained, loaded, stepped = rank["bf16"]["bf16"]["weights_only"]
        assert trained < rank["bf16"]["bf16"]["losses"][0] - 1.0  # far from the fresh model
        assert loaded == pytest.approx(trained, abs=1e-5)
        assert stepped == pytest.approx(trained, abs=1e-5), (trained, loaded, stepped)


def test_device_summary_reads_the_parameters(monkeypatch):
    """Catches records that say where work was meant to run (issue 25): the bench
    reported ``cuda`` whenever ``torch.cuda.is_available()``.  With CUDA pretended
    present, a bf16 model on the CPU must be reported as cpu / bfloat16."""
    from jobruntime.devices import device_summary

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    model = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert device_summary(model) == {"device": "cpu", "gpu": None, "precision": "bfloat16",
                                     "peak_memory_gib": None}


def test_fused_kernels_follow_imports(monkeypatch):
    """Catches GPU failure 1 (persist_layer_norm on without apex) and Llama's
    scaled_masked_softmax_cuda import error: with CUDA pretended present, every
    fusion flag must equal its kernel's import probe, and megatron's torch
    LayerNorm must build from the config."""
    import jobruntime.kernels as kernels
    from jobruntime.config import load_config
    from jobruntime.model import to_transformer_config

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    kernels.available_kernels.cache_clear()
    try:
        k = kernels.available_kernels()
        for preset in ("tiny_gpt", "tiny_llama", "tiny_bert"):
            cfg = load_config(preset)
            t = to_transformer_config(cfg.model, cfg.parallel)
            assert t.persist_layer_norm == k.persist_layer_norm
            assert t.masked_softmax_fusion == k.masked_softmax
            assert t.gradient_accumulation_fusion == k.grad_accumulation
            assert t.apply_rope_fusion == (k.rope and cfg.model.position_embedding == "rope")
            # megatron's fused bias-GeLU is the tanh approximation: SwiGLU only (issue 24)
            assert t.bias_activation_fusion == (k.jit and cfg.model.activation == "swiglu")
            assert not t.cross_entropy_loss_fusion  # fp32: the fused one returns bf16 gradients
            bf16 = to_transformer_config(cfg.model, cfg.parallel, params_dtype=torch.bfloat16)
            assert bf16.cross_entropy_loss_fusion == k.jit
            cfg.model.kernel_fusions = "off"
            off = to_transformer_config(cfg.model, cfg.parallel)
            assert not (off.bias_activation_fusion or off.persist_layer_norm
                        or off.masked_softmax_fusion or off.cross_entropy_loss_fusion)
            if not kernels._imports("apex"):
                from megatron.core.transformer.torch_norm import WrappedTorchNorm

                WrappedTorchNorm(t, cfg.model.hidden_size)  # asserted on persist_layer_norm
    finally:
        kernels.available_kernels.cache_clear()


def test_sequence_parallel_without_te_or_apex_is_a_config_error(cache_dir, tmp_path):
    """Catches ``parallel.sequence_parallel=true`` reaching megatron's torch LayerNorm
    (``WrappedTorchNorm``), which asserts "sequence parallel not supported by torch
    LayerNorm" inside the build: a traceback, exit 1.  Without Transformer Engine and apex
    it must be one line naming the key and the fix, exit 2.  Two ranks at TP=2, started
    as torchrun starts its workers (rank 1 prints nothing: errors come from rank 0)."""
    import subprocess
    import sys

    from megatron.core.models.gpt import gpt_layer_specs

    from jobruntime.kernels import available_kernels
    from tests.dist_utils import free_port

    if gpt_layer_specs.HAVE_APEX or available_kernels().transformer_engine:
        pytest.skip("apex or Transformer Engine present: sequence parallelism is supported")
    port = free_port()
    cmd = [sys.executable, str(REPO / "train.py"), "--config", "tiny_gpt", "--run-dir",
           str(tmp_path / "run"), f"data.cache_dir={cache_dir}", "parallel.tp=2",
           "parallel.sequence_parallel=true", "train.iters=1", "logging.wandb=disabled"]
    procs = [subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**child_env(), "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": str(port), "RANK": str(r),
                                              "LOCAL_RANK": str(r), "WORLD_SIZE": "2"})
             for r in range(2)]
    outs = [p.communicate(timeout=600)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outs[0][-3000:]
    lines = [ln for ln in outs[0].splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), outs[0][-3000:]
    assert "parallel.sequence_parallel=false" in lines[0] and "apex" in lines[0]
    assert not (tmp_path / "run").exists()  # nothing half-made is left behind


def test_collective_check_names_wrong_device(monkeypatch):
    """Catches GPU failure 4 on CPU: a CPU tensor handed to an NCCL collective
    must fail at the call with a message naming the collective and the device
    (not deep inside NCCL).  The group's backend is pretended to be NCCL."""
    import jobruntime.devices as devices

    calls = []
    checked = devices._checked("all_reduce", lambda t, group=None: calls.append(t))
    monkeypatch.setattr(devices, "_backend", lambda group: "nccl")
    with pytest.raises(devices.DeviceError, match="all_reduce on a nccl group got a tensor on cpu"):
        checked(torch.zeros(1))
    assert not calls
    monkeypatch.setattr(devices, "_backend", lambda group: "gloo")
    checked(torch.zeros(1))
    assert len(calls) == 1


def test_module_device_check():
    """A model left on another device than the compute device is named before
    megatron's optimizer sees it."""
    from jobruntime.devices import DeviceError, check_module_devices

    m = torch.nn.Linear(2, 2, device="meta")
    with pytest.raises(DeviceError, match="weight is on meta"):
        check_module_devices(m, torch.device("cpu"), "model")
    check_module_devices(torch.nn.Linear(2, 2), torch.device("cpu"), "model")


def _factory_calls_without_device(path: Path) -> list[str]:
    lines = path.read_text().splitlines()
    bad = []
    for node in ast.walk(ast.parse("\n".join(lines))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)):
            span = lines[node.lineno - 1:(node.end_lineno or node.lineno)]
            if not any("# host" in line for line in span):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {lines[node.lineno - 1].strip()}")
    return bad


def test_every_tensor_factory_names_its_device():
    """The static twin of the collective check (GPU failure 4's kind): a tensor
    created without ``device=`` lands on the CPU, which on a GPU breaks the
    first NCCL collective or device-mixing op that sees it.  Every factory
    call in the project names its device, or says ``# host`` (host memory on
    purpose: data batches, wire bytes) on its line."""
    bad = []
    for pkg in PACKAGES:
        for path in sorted((REPO / pkg).rglob("*.py")):
            bad += _factory_calls_without_device(path)
    assert not bad, "tensors created without device= (add device=..., or '# host'):\n" + "\n".join(bad)
