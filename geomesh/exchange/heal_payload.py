"""What a healing worker receives from a live peer: GeoMesh's state (``θ_global``, the
outer momentum, the round, the data position, the plan) as one sealed, pickle-free blob
over torchft's HTTP checkpoint transport (:mod:`geomesh.exchange.membership`, step 2).

Tensors travel in safetensors, everything else in JSON: nothing a peer sends is
unpickled, and nothing in it is used before the envelope (:mod:`geomesh.wire.envelope`,
kind HEAL) is opened with the run's secret.
"""

from __future__ import annotations

import json
import urllib.request
from datetime import timedelta

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torchft.checkpointing._serialization import _streaming_load
from torchft.checkpointing.http_transport import HTTPTransport

from ..wire.envelope import HEAL, EnvelopeError, Opener


def pack_state(state: dict) -> bytes:
    """Nested dicts of str keys with tensor / JSON leaves -> bytes (safetensors)."""
    tensors: dict[str, torch.Tensor] = {}

    def walk(x, path):
        if isinstance(x, torch.Tensor):
            key = f"t{len(tensors)}"
            tensors[key] = x.detach().cpu().contiguous()
            return {"__tensor__": key}
        if isinstance(x, dict):
            return {str(k): walk(v, f"{path}/{k}") for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(x)]
        return x

    tree = walk(state, "")
    return st_save(tensors, metadata={"tree": json.dumps(tree)})


def unpack_state(data: bytes) -> dict:
    """Inverse of :func:`pack_state` (safetensors and JSON only: no code runs)."""
    from safetensors import safe_open  # noqa: F401 - the format's reader is the trust boundary

    header_len = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8:8 + header_len]).get("__metadata__", {})
    tensors = st_load(data)

    def walk(x):
        if isinstance(x, dict):
            if set(x) == {"__tensor__"}:
                return tensors[x["__tensor__"]]
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(json.loads(meta["tree"]))


class SignedHTTPTransport(HTTPTransport):
    """torchft's HTTP checkpoint transport carrying one sealed, pickle-free blob.

    torchft's own transports unpickle what a peer sends (``weights_only=False``);
    here the served object is a single uint8 tensor (loaded with
    ``weights_only=True``) holding a HEAL envelope whose body is
    :func:`pack_state` output, opened with the run's secret before anything
    in it is used.

    Raises (in ``recv_checkpoint``, reported by the Manager as a failed heal):
        EnvelopeError: the blob is not authentic or not for this step.
    """

    def __init__(self, opener: Opener, *, worker: int, shard: int, timeout: timedelta) -> None:
        super().__init__(timeout=timeout, num_chunks=0)
        self._opener, self._worker, self._shard = opener, worker, shard
        self._server.RequestHandlerClass.log_message = lambda *a, **k: None  # no stderr lines

    def send_checkpoint(self, dst_ranks, step, state_dict, timeout) -> None:
        blob = self._opener.seal(pack_state(state_dict), kind=HEAL, round=step,
                                 worker=self._worker, shard=self._shard)
        tensor = torch.frombuffer(bytearray(blob), dtype=torch.uint8)  # host: sent over HTTP
        super().send_checkpoint(dst_ranks, step, {"blob": tensor}, timeout)

    @classmethod
    def _load_from_address(cls, address: str, timeout: timedelta) -> object:
        with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
            return _streaming_load(f, weights_only=True)

    def recv_checkpoint(self, src_rank, metadata, step, timeout):
        got = super().recv_checkpoint(src_rank, metadata, step, timeout)
        blob = got["blob"] if isinstance(got, dict) and "blob" in got else None
        if not isinstance(blob, torch.Tensor) or blob.dtype != torch.uint8:
            raise EnvelopeError("healing state from a peer is not a sealed blob", "kind")
        self._opener.forget_round(step)
        sealed = self._opener.open(blob.numpy().tobytes(), round=step, shard=self._shard,
                                   kinds=(HEAL,))
        return unpack_state(sealed.body)
