"""Authenticated envelopes around every GeoMesh message that crosses a job boundary.

The codecs (:mod:`geomesh.wire.codec`) produce the bytes of a pseudo-gradient; a
CRC-32 in them catches corruption in transit, nothing a sender does on
purpose.  This layer wraps those bytes (and the healing state a live peer
sends to a worker that rejoins, :mod:`geomesh.exchange.membership`) in an envelope
authenticated with HMAC-SHA256 (RFC 2104, FIPS 198-1) under a per-run secret,
and binds it to the run, the round, the sender and the shard::

    header  40 B  magic "GMEV" | version u16 | kind u8 | flags u8 | run u64
                  | round u64 | worker u32 | shard u32 | body length u64
    body          the codec's message (kind DATA), nothing (JOIN), or a
                  serialized state (HEAL)
    tag     32 B  HMAC-SHA256(secret, header | body)

The tag is checked first (constant-time, :func:`hmac.compare_digest`) and no
other field is read before it matches.  Then the header must name this run,
the round the receiver is in, the worker whose slot in the all-gather it
arrived in, this shard, a known kind, and each ``(worker, round)`` once:
replays of older rounds, duplicates, messages of another run or version and
unauthenticated ones are rejected with :class:`EnvelopeError` and counted by
reason in :class:`Opener`.

What the secret does and does not give.  Every holder of the secret can seal
messages, so it keeps *outsiders* out (anyone on the WAN path, a process of
another run); it cannot tell one worker of the run from another.  An insider
that sends absurd values is the job of :mod:`geomesh.wire.guard` (checks of the
decoded values before aggregation, optional robust aggregation).

Secret: ``GEOMESH_SECRET`` (environment) or ``geomesh.secret_file`` (a file
holding it), never a command-line value; at least 16 bytes.  Make a new one
per run, e.g. ``python -c "import secrets; print(secrets.token_hex(32))"``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from jobruntime.config import ConfigError

MAGIC = b"GMEV"
VERSION = 1
_HEADER = struct.Struct("<4sHBBQQIIQ")  # 40 bytes
TAG_BYTES = 32
OVERHEAD = _HEADER.size + TAG_BYTES
"""Bytes an envelope adds to its body (72)."""
SECRET_ENV = "GEOMESH_SECRET"
MIN_SECRET_BYTES = 16

DATA, JOIN, HEAL = 1, 2, 3
KINDS = {DATA: "data", JOIN: "join", HEAL: "heal"}


class EnvelopeError(ValueError):
    """A message failed authentication or binding; ``reason`` is the counter it went to.

    Attributes:
        reason: one of ``truncated``, ``unauthenticated``, ``version``,
            ``other_run``, ``kind``, ``replay``, ``wrong_sender``, ``shard``,
            ``duplicate``, ``length``.
        peer_run: the run identity the envelope names (``other_run`` only; else ``None``).
    """

    def __init__(self, message: str, reason: str, peer_run: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.peer_run = peer_run


def load_secret(secret_file: str | None, *, required: bool = True) -> bytes | None:
    """The run's secret: the file ``secret_file`` if given, else ``$GEOMESH_SECRET``.

    Args:
        secret_file: path of a file holding the secret (surrounding whitespace
            is stripped), or ``None``.
        required: raise when neither is set (else return ``None``).

    Raises:
        ConfigError: unreadable file, a secret under 16 bytes, or none given
            when ``required``.
    """
    if secret_file:
        try:
            raw = Path(secret_file).read_bytes().strip()
        except OSError as e:
            raise ConfigError(
                f"geomesh.secret_file={secret_file!r} cannot be read ({e.strerror or e}); give a "
                f"file holding the run's secret, or set ${SECRET_ENV}"
            ) from None
        where = f"geomesh.secret_file={secret_file!r}"
    elif os.environ.get(SECRET_ENV):
        raw = os.environ[SECRET_ENV].strip().encode()
        where = f"${SECRET_ENV}"
    elif required:
        raise ConfigError(
            f"GeoMesh jobs of one run authenticate their messages with a shared secret: set "
            f"${SECRET_ENV} or geomesh.secret_file=FILE on every job (make one with: python -c "
            "\"import secrets; print(secrets.token_hex(32))\")"
        )
    else:
        return None
    if len(raw) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"the secret in {where} has {len(raw)} bytes; use at least {MIN_SECRET_BYTES} "
            "(e.g. 64 hex digits from secrets.token_hex(32))"
        )
    return raw


@dataclass(frozen=True)
class Sealed:
    """The checked header of an opened envelope, and its body."""

    kind: int
    round: int
    worker: int
    shard: int
    body: bytes


class Sealer:
    """Seals this job's messages.

    Args:
        secret: the run's secret (:func:`load_secret`).
        run: the run's 64-bit identity (:func:`geomesh.exchange.run_identity.run_identity`).
    """

    def __init__(self, secret: bytes, run: int) -> None:
        self._key = bytes(secret)
        self.run = run

    def seal(self, body: bytes, *, kind: int, round: int, worker: int, shard: int = 0) -> bytes:
        """Envelope of ``body`` (format in the module docstring)."""
        head = _HEADER.pack(MAGIC, VERSION, kind, 0, self.run, round, worker, shard, len(body))
        tag = hmac.new(self._key, head + body, hashlib.sha256).digest()
        return head + bytes(body) + tag


class Opener(Sealer):
    """Opens peers' envelopes: authentication, binding and counts of what was rejected.

    Attributes:
        rejected: ``Counter`` of rejections by reason.
        opened: envelopes accepted.
    """

    def __init__(self, secret: bytes, run: int) -> None:
        super().__init__(secret, run)
        self.rejected: Counter[str] = Counter()
        self.opened = 0
        self._seen: set[tuple[int, int, int, int]] = set()  # (kind, round, worker, shard)

    def _reject(self, message: str, reason: str, peer_run: int | None = None) -> EnvelopeError:
        self.rejected[reason] += 1
        return EnvelopeError(message, reason, peer_run)

    def open(self, data: bytes | bytearray | memoryview, *, round: int, sender: int | None = None,
             shard: int = 0, kinds: tuple[int, ...] = (DATA, JOIN)) -> Sealed:
        """Check one envelope received in ``round`` (from the slot of worker ``sender``).

        Args:
            round: the round the receiver is in; other rounds are replays.
            sender: worker whose slot of the all-gather it came in (``None``:
                any worker).
            shard: this rank's shard of the exchange.
            kinds: kinds acceptable here.

        Raises:
            EnvelopeError: see the module docstring; the message names the sender slot.
        """
        data = bytes(data)
        who = f"message in worker {sender}'s slot" if sender is not None else "message"
        if len(data) < OVERHEAD:
            raise self._reject(f"{who}: {len(data)} bytes, an envelope needs {OVERHEAD}",
                               "truncated")
        head, body, tag = data[:_HEADER.size], data[_HEADER.size:-TAG_BYTES], data[-TAG_BYTES:]
        want = hmac.new(self._key, head + body, hashlib.sha256).digest()
        if not hmac.compare_digest(tag, want):
            raise self._reject(f"{who}: HMAC-SHA256 tag does not match (not sealed with this "
                               "run's secret, or altered)", "unauthenticated")
        magic, version, kind, _flags, run, rnd, worker, shd, length = _HEADER.unpack(head)
        if magic != MAGIC or version != VERSION:
            raise self._reject(f"{who}: envelope version {version}, this build reads {VERSION}",
                               "version")
        if run != self.run:
            raise self._reject(f"{who}: sealed for another run ({run:016x}, this is "
                               f"{self.run:016x})", "other_run", run)
        if kind not in kinds:
            raise self._reject(f"{who}: kind {KINDS.get(kind, kind)!r} is not accepted here",
                               "kind")
        if rnd != round:
            raise self._reject(f"{who}: sealed for round {rnd}, this is round {round} (a replay)",
                               "replay")
        if sender is not None and worker != sender:
            raise self._reject(f"{who}: claims to come from worker {worker}", "wrong_sender")
        if shd != shard:
            raise self._reject(f"{who}: for shard {shd}, this is shard {shard}", "shard")
        if length != len(body):
            raise self._reject(f"{who}: header says {length} body bytes, got {len(body)}",
                               "length")
        key = (kind, rnd, worker, shd)
        if key in self._seen:
            raise self._reject(f"{who}: worker {worker} already sent its round-{rnd} message",
                               "duplicate")
        self._seen.add(key)
        if len(self._seen) > 4096:  # keep the last rounds only
            self._seen = {k for k in self._seen if k[1] + 2 >= rnd}
        self.opened += 1
        return Sealed(kind=kind, round=rnd, worker=worker, shard=shd, body=body)

    def forget_round(self, round: int) -> None:
        """Allow ``round``'s messages again (an exchange retried after a lost worker)."""
        self._seen = {k for k in self._seen if k[1] != round}
