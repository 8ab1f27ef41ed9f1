"""Convert Hugging Face checkpoints to and from this project's megatron-core checkpoints.

Usage::

    # HF → megatron, config.yaml for a TP=2 job (loads at any layout)
    python tools/convert_checkpoint.py hf-to-mcore --model llama \\
        --input hf/Llama-3.2-1B --output ckpt/llama1b --tp 2
    # fine-tune it: the written config.yaml sets checkpoint.load (weights only)
    torchrun --nproc-per-node 2 train.py --config ckpt/llama1b/config.yaml data.path=my.jsonl

    # megatron (a run's checkpoints/ folder, any TP/PP) → HF
    python tools/convert_checkpoint.py mcore-to-hf --model llama \\
        --input runs/my-run/checkpoints --output hf/my-run

Supported: ``LlamaForCausalLM`` (GQA, tied or untied embeddings, Llama-3 RoPE
scaling), ``GPT2LMHeadModel`` (GPT-3-style ``gpt`` family) and BERT
(``MegatronBertForMaskedLM`` exactly; ``BertForMaskedLM``/``BertForPreTraining``
by a documented, *not function-preserving* LayerNorm mapping — see
:mod:`tools.hf_mapping`).

How: the HF tensors are mapped to megatron's *global* (TP=1, unpadded)
tensors (:mod:`tools.hf_mapping`), loaded into a TP=1 model built by
:func:`jobruntime.model.build_model` and written with
``dist_checkpointing.save`` of its sharded state dict.  dist_checkpointing
stores global tensors and reshards on load, so the checkpoint loads at any
TP/PP/DP layout: the vocabulary is padded once, independent of the layout
(``model.padded_vocab_size``, default a multiple of 128, see
:mod:`jobruntime.vocab`; ``--padded-vocab-size`` for a TP that does not
divide it), recorded in ``config.yaml`` and the checkpoint; zero rows are
appended on import and stripped on export (export reads the size the
checkpoint holds).  Export goes the same way back.  The
conversion runs in one process (or on every rank of a ``torchrun`` world).

Output of ``hf-to-mcore`` (a ``checkpoints/``-style folder)::

    OUT/iter_0000000/   dist_checkpointing checkpoint, weights only (+ COMPLETE)
    OUT/latest
    OUT/config.yaml     project config: model section from config.json,
                        parallel.tp/pp, checkpoint.load=OUT, load_optimizer=false
    OUT/hf_config.json  the original config.json (token ids are restored from it)
    OUT/tokenizer.json  (and the other tokenizer files, when the input has them)

Exit codes: 0 done, 2 bad input (message on stderr).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def path_problem(input_path: str | None, output_path: str | None) -> str | None:
    """Why ``--input`` / ``--output`` cannot be used, else ``None`` (stdlib only: checked
    before the imports below, which take ~30 s with megatron-core)."""
    from jobruntime.outputs import output_folder_error

    if input_path is not None and not Path(input_path).exists():
        return (f"--input {input_path} does not exist; give an HF model folder (hf-to-mcore) or "
                "a run's checkpoints/ folder (mcore-to-hf)")
    return output_folder_error(output_path, "--output") if output_path is not None else None


if __name__ == "__main__":  # a missing folder is told at once, not after the imports
    _pre = argparse.ArgumentParser(add_help=False)
    _pre.add_argument("--input")
    _pre.add_argument("--output")
    if _problem := path_problem(*vars(_pre.parse_known_args()[0]).values()):
        print(f"error: {_problem}", file=sys.stderr)
        sys.exit(2)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from jobruntime.checkpoint import (  # noqa: E402
    FORMAT_VERSION,
    CheckpointError,
    _arch,
    arch_diff,
    arch_mismatch,
    committed_folder,
    find_checkpoint,
    reading,
)
from jobruntime.config import (  # noqa: E402
    ConfigError,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    load_config,
    save_config,
)
from jobruntime.metrics import json_text  # noqa: E402
from jobruntime.tokenizer import load_tokenizer  # noqa: E402
from tools.hf_mapping import (  # noqa: E402
    HF_CLASSES,
    NOT_FUNCTION_PRESERVING,
    ConversionError,
    default_hf_arch,
    hf_config_from_model,
    hf_to_mcore_state,
    mcore_to_hf_state,
)

log = logging.getLogger("tools.convert")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.txt", "vocab.json", "merges.txt")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")
_TOKEN_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------------------
# Hugging Face files
# ---------------------------------------------------------------------------


def _read_json(path: Path) -> dict:
    """A JSON object from ``path``.

    Raises:
        ConversionError: unreadable, not JSON, or not an object.
    """
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"'{path}' is not readable JSON ({type(e).__name__}: "
                              f"{' '.join(str(e).split())[:160]}); fix or replace the file") from None
    if not isinstance(value, dict):
        raise ConversionError(f"'{path}' holds a JSON {type(value).__name__}, not an object")
    return value


def read_hf_checkpoint(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """``config.json`` and all tensors of an HF model folder (safetensors, sharded
    safetensors, or ``pytorch_model.bin``).

    Raises:
        ConversionError: no config.json or no weights there.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConversionError(f"'{path}' has no config.json; point --input at an HF model folder")
    hcfg = _read_json(path / "config.json")
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if (path / "model.safetensors").is_file():
        state = load_file(str(path / "model.safetensors"))
    elif index.is_file():
        state = {}
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConversionError(f"'{index}' has no weight_map object")
        for shard in sorted(set(map(str, weight_map.values()))):
            state.update(load_file(str(path / shard)))
    elif (path / "pytorch_model.bin").is_file():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ConversionError(f"'{path}' has no model.safetensors(.index.json) or pytorch_model.bin")
    return hcfg, state


@contextlib.contextmanager
def _staged_folder(out: Path):
    """Yield a hidden staging folder next to ``out``; on success its files move into
    ``out`` (a new ``out`` is one rename), on error it is removed: a failed
    export leaves no half-written folder."""
    stage = out.with_name(f".{out.name}.partial-{os.getpid()}")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    try:
        yield stage
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if not out.exists():
        os.replace(stage, out)
        return
    for f in stage.iterdir():  # into an existing folder: file by file, each atomic
        os.replace(f, out / f.name)
    stage.rmdir()


def _copy_tokenizer(src_dir: Path, dst_dir: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src_dir / name).is_file():
            shutil.copy2(src_dir / name, dst_dir / name)
            copied.append(name)
    return copied


def write_hf_checkpoint(path: str | Path, model: ModelConfig, state: dict[str, torch.Tensor],
                        arch: str, *, token_ids: dict | None = None) -> Path:
    """Write ``config.json`` (via the transformers config class) and ``model.safetensors``."""
    import transformers
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cls_name, kwargs = hf_config_from_model(model, arch)
    config = getattr(transformers, cls_name)(**kwargs, **(token_ids or {}))
    config.architectures = [HF_CLASSES[arch][1]]
    dtypes = {t.dtype for t in state.values()}
    config.dtype = str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None
    config.save_pretrained(str(path))
    # safetensors wants contiguous tensors that own their storage (no views)
    tensors = {k: (v.clone() if v._base is not None else v).contiguous() for k, v in state.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


# ---------------------------------------------------------------------------
# megatron checkpoints
# ---------------------------------------------------------------------------


def _pad_vocab(state: dict, padded: int) -> dict:
    """Append zero rows to the vocabulary tensors up to ``padded`` rows."""
    out = dict(state)
    for k in _VOCAB_KEYS:
        if k in out:
            t = out[k]
            out[k] = torch.cat([t, t.new_zeros((padded - t.shape[0], *t.shape[1:]))])
    return out


def _strip_vocab(state: dict, vocab: int) -> dict:
    return {k: (v[:vocab].clone() if k in _VOCAB_KEYS else v) for k, v in state.items()}


def _io_model(model: ModelConfig, padded_vocab: int, dtype: torch.dtype) -> torch.nn.Module:
    """A TP=1, PP=1 megatron model with uninitialised CPU weights (built on meta, then
    ``to_empty``), on the current world: every rank holds the full model.  Local
    layer specs even on GPU: the names :mod:`tools.hf_mapping` uses; the sharded
    (checkpoint) keys are the same as Transformer Engine's.  (Re)initialises
    megatron's layout to TP=1, PP=1: do not call it inside a training job."""
    from jobruntime.model import build_model
    from jobruntime.parallel import init_distributed, initialize_layout

    init_distributed()
    world = dist.get_world_size()
    job = JobConfig(model=model, parallel=ParallelConfig(micro_batch_size=1, global_batch_size=world))
    initialize_layout(job)
    full = dataclasses.replace(model, vocab_size=padded_vocab)
    return build_model(full, job.parallel, params_dtype=dtype, meta=True,
                       local_spec=True).to_empty(device="cpu")


def write_mcore_checkpoint(root: str | Path, model: ModelConfig, state: dict[str, torch.Tensor], *,
                           dtype: torch.dtype | None = None, extra: dict | None = None) -> Path:
    """Write megatron TP=1 tensors (unpadded) as a weights-only checkpoint ``root/iter_0000000``.

    The vocabulary is padded to ``model.padded_vocab`` rows (zeros); the
    result loads with :func:`jobruntime.checkpoint.load_checkpoint`
    (``load_optimizer=False``) at any layout whose TP divides that size.
    Collective: call on every rank.
    """
    root = Path(root)
    dtype = dtype or state["embedding.word_embeddings.weight"].dtype
    padded = model.padded_vocab
    module = _io_model(model, padded, dtype)
    with torch.no_grad():
        missing, unexpected = module.load_state_dict(_pad_vocab(state, padded), strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ConversionError(f"state does not fit the model: missing {missing[:6]}, "
                              f"unexpected {unexpected[:6]}")
    from megatron.core import dist_checkpointing

    name = "iter_0000000"
    with committed_folder(root, name, marker="converted, weights only") as tmp:
        # the common-state keys load_checkpoint reads; no optimizer / scheduler / rng
        dist_checkpointing.save({
            "model": module.sharded_state_dict(prefix=""),
            "step": 0, "consumed_samples": 0, "arch": _arch(model),
            "format_version": FORMAT_VERSION, "extra": extra or {}, "weights_only": True,
        }, str(tmp))
    return root / name


def find_config(path: str | Path) -> Path:
    """The project ``config.yaml`` next to a checkpoint (converted folder or run dir).

    Raises:
        ConversionError: none found (pass ``--config``).
    """
    path = Path(path)
    places = [path, path.parent, path.parent.parent]
    try:
        ckpt = find_checkpoint(path)
        places += [ckpt.parent, ckpt.parent.parent]
    except CheckpointError:
        pass
    for p in places:
        if (p / "config.yaml").is_file():
            return p / "config.yaml"
    raise ConversionError(f"no config.yaml next to '{path}'; pass --config with the run's config")


def read_mcore_checkpoint(path: str | Path, model: ModelConfig) -> tuple[Path, dict[str, torch.Tensor]]:
    """Global (TP=1, unpadded) tensors of a checkpoint saved at any layout.

    Collective: call on every rank (each gets the full state).

    Raises:
        CheckpointError: not found, or saved from another architecture than ``model``.
    """
    from megatron.core import dist_checkpointing

    ckpt = find_checkpoint(path)
    with reading(ckpt):
        common = dist_checkpointing.load_common_state_dict(str(ckpt))
    diff = arch_diff(common.get("arch", {}) if isinstance(common, dict) else {}, model)
    diff.pop("padded_vocab_size", None)  # export reads the rows the checkpoint holds
    if diff:
        raise CheckpointError(arch_mismatch(ckpt, diff))
    with reading(ckpt):
        emb = dist_checkpointing.load_tensors_metadata(str(ckpt))["embedding.word_embeddings.weight"]
    module = _io_model(model, emb.global_shape[0], emb.dtype)
    with reading(ckpt):
        loaded = dist_checkpointing.load({"model": module.sharded_state_dict(prefix="")},
                                         str(ckpt))
    module.load_state_dict(loaded["model"])
    state = {k: v for k, v in module.state_dict().items() if not k.endswith("_extra_state")}
    return ckpt, _strip_vocab(state, model.vocab_size)


# ---------------------------------------------------------------------------
# The two directions
# ---------------------------------------------------------------------------


def hf_to_mcore(src: str | Path, out: str | Path, family: str, *, tp: int = 1, pp: int = 1,
                dtype: str = "auto", seq_length: int | None = None, hf_arch: str | None = None,
                padded_vocab_size: int | None = None) -> dict:
    """Convert an HF model folder to a weights-only megatron checkpoint folder ``out``.

    Args:
        tp, pp: the layout written to ``config.yaml`` (the checkpoint loads at any).
        hf_arch: the architecture the input must have (``--hf-arch``); the
            mapping always follows the input's ``config.json``.
        padded_vocab_size: embedding rows (``None``: a multiple of 128, see
            :mod:`jobruntime.vocab`); recorded in config.yaml and the checkpoint.

    Returns:
        A summary dict (output, family, vocab sizes, parameters, layout).

    Raises:
        ConversionError: the input is not ``family`` / ``hf_arch``, or unmappable.
        ConfigError: the layout or padded size does not fit the model.
    """
    src, out = Path(src), Path(out).absolute()
    hcfg, hf_state = read_hf_checkpoint(src)
    model, state = hf_to_mcore_state(family, hcfg, hf_state, seq_length=seq_length, hf_arch=hf_arch)
    model.padded_vocab_size = padded_vocab_size
    job = JobConfig(model=model, parallel=ParallelConfig(tp=tp, pp=pp))
    job.validate(tp * pp)  # heads, layers and the padded vocabulary divide the layout
    if dtype != "auto":
        state = {k: v.to(_DTYPES[dtype]) for k, v in state.items()}
    write_mcore_checkpoint(out, model, state, extra={"converted_from": str(src.resolve())})
    if _rank() == 0:
        copied = _copy_tokenizer(src, out)
        shutil.copy2(src / "config.json", out / "hf_config.json")
        tok = next((out / n for n in ("tokenizer.json", "tokenizer.model") if n in copied), None)
        if tok is None:
            log.warning("no tokenizer.json / tokenizer.model in %s: set data.tokenizer to the "
                        "model's tokenizer before fine-tuning (auto would train a new one)", src)
        job.name = src.name
        job.data.tokenizer = str(tok) if tok else "auto"
        job.checkpoint.load, job.checkpoint.load_optimizer = str(out), False
        job.checkpoint.load_exact = hcfg.get("model_type") not in NOT_FUNCTION_PRESERVING
        save_config(job, out / "config.yaml")
    _barrier()
    return dict(output=str(out), family=family, hf_arch=hcfg.get("model_type"),
                vocab_size=model.vocab_size, padded_vocab=model.padded_vocab,
                tp=tp, pp=pp, parameters=sum(t.numel() for t in state.values()))


def _source_hf_config(cfg_path: Path, job: JobConfig) -> dict | None:
    """The HF ``config.json`` the weights came from (``hf_config.json`` of a
    converted folder: next to ``cfg_path``, or at the run's ``checkpoint.load``)."""
    places = [cfg_path.parent]
    if job.checkpoint.load:
        load = Path(job.checkpoint.load)
        places += [load, load.parent]
    for p in places:
        if (p / "hf_config.json").is_file():
            return _read_json(p / "hf_config.json")
    return None


def mcore_to_hf(src: str | Path, out: str | Path, family: str, *, config: str | Path | None = None,
                arch: str | None = None) -> dict:
    """Convert a megatron checkpoint (any layout) to an HF model folder ``out``.

    Args:
        config: the project config of the checkpoint; default: ``config.yaml``
            next to it (converted folder or run directory).
        arch: HF architecture (``llama``, ``gpt2``, ``megatron-bert``, ``bert``);
            default: the one the weights were converted from (``hf_config.json``
            of the converted folder, also found through a fine-tuned run's
            ``checkpoint.load``), else per family (BERT → ``megatron-bert``,
            the function-equivalent one).
    """
    try:
        import transformers  # noqa: F401 - the HF config classes write config.json
    except ImportError:
        raise ConversionError("mcore-to-hf needs Hugging Face transformers (its config classes "
                              "write config.json): pip install transformers") from None
    cfg_path = Path(config) if config else find_config(src)
    job = load_config(cfg_path)
    if job.model.family != family:
        raise ConversionError(f"--model {family} but {cfg_path} has model.family={job.model.family}")
    source = _source_hf_config(cfg_path, job)
    source_arch = source.get("model_type") if source else None
    if arch is not None and source_arch not in (None, arch):
        log.warning("writing HF %s weights converted from HF %s: the LayerNorm layout differs, the "
                    "model must be fine-tuned (see tools/hf_mapping.py)", arch, source_arch)
    arch = arch or source_arch or default_hf_arch(family)
    ckpt, state = read_mcore_checkpoint(src, job.model)
    hf_state = mcore_to_hf_state(job.model, state, arch)
    if _rank() == 0:
        token_ids = {k: source[k] for k in _TOKEN_ID_KEYS if source and source.get(k) is not None}
        with _staged_folder(Path(out)) as stage:
            copied = _copy_tokenizer(cfg_path.parent, stage)  # a run folder holds its tokenizer
            tok = Path(job.data.tokenizer)
            if not copied and job.data.tokenizer != "auto" and tok.is_file():
                shutil.copy2(tok, stage / ("tokenizer.json" if tok.suffix == ".json"
                                           else "tokenizer.model"))
            tok_file = next((stage / n for n in ("tokenizer.json", "tokenizer.model")
                             if (stage / n).is_file()), None)
            if not token_ids and tok_file is not None:
                # the project's tokenizers end documents with eod and never add bos
                t = load_tokenizer(tok_file)
                token_ids = {"bos_token_id": t.eod, "eos_token_id": t.eod, "pad_token_id": t.pad}
            write_hf_checkpoint(stage, job.model, hf_state, arch, token_ids=token_ids)
    _barrier()
    return dict(output=str(Path(out).absolute()), checkpoint=str(ckpt), family=family, hf_arch=arch,
                vocab_size=job.model.vocab_size, parameters=sum(t.numel() for t in hf_state.values()))


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("direction", choices=["hf-to-mcore", "mcore-to-hf"])
    p.add_argument("--model", required=True, choices=["llama", "gpt", "bert"], help="model family")
    p.add_argument("--input", required=True, help="HF model folder, or megatron checkpoint folder")
    p.add_argument("--output", required=True, help="output folder")
    p.add_argument("--tp", type=int, default=1, help="hf-to-mcore: TP size written to config.yaml "
                   "(the checkpoint loads at any layout); mcore-to-hf reads any layout")
    p.add_argument("--padded-vocab-size", type=int, default=None,
                   help="hf-to-mcore: embedding rows (default: the vocabulary rounded up to a "
                   "multiple of 128; give a multiple of the TP sizes if one does not divide that)")
    p.add_argument("--pp", type=int, default=1, help="hf-to-mcore: PP size written to config.yaml")
    p.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES],
                   help="hf-to-mcore: weight dtype (auto: as stored)")
    p.add_argument("--seq-length", type=int, default=None,
                   help="hf-to-mcore: model.seq_length (default min(max positions, 2048; 512 BERT))")
    p.add_argument("--config", default=None, help="mcore-to-hf: project config of the checkpoint")
    p.add_argument("--hf-arch", default=None, choices=sorted(HF_CLASSES),
                   help="hf-to-mcore: the architecture the input must have (its config.json "
                   "decides the mapping); mcore-to-hf: HF architecture to write (default: the one "
                   "converted from, else megatron-bert for bert: equivalent; bert is the post-LN "
                   "layout, not equivalent)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from jobruntime.logging_utils import setup_logging
    from jobruntime.parallel import shutdown

    setup_logging()
    if problem := path_problem(args.input, args.output):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        if args.direction == "hf-to-mcore":
            summary = hf_to_mcore(args.input, args.output, args.model, tp=args.tp, pp=args.pp,
                                  dtype=args.dtype, seq_length=args.seq_length,
                                  hf_arch=args.hf_arch, padded_vocab_size=args.padded_vocab_size)
        else:
            summary = mcore_to_hf(args.input, args.output, args.model, config=args.config,
                                  arch=args.hf_arch)
    except (ConversionError, CheckpointError, ConfigError) as e:
        if _rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        shutdown()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json_text(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
