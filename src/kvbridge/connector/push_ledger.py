"""Which push requests one P rank has written: each load's pushes at most once
(``docs/faults.md``). The first push of (D engine, request, token, D epoch) binds D's
nonce; each part is written once; the ``last`` part or a fence retires the nonce.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from kvbridge.control.messages import PushRuns

KEPT = 65536
"""Loads and retired nonces remembered (oldest forgotten first)."""

Key = tuple[str, str, str, str]
"""(D engine id, request id, lease token, D epoch)."""


@dataclass(slots=True)
class _Bound:
    nonce: str
    parts: set[int] = field(default_factory=set)


class PushLedger:
    """Not thread-safe: the rank's side channel serves one message at a time."""

    def __init__(self) -> None:
        self._loads: OrderedDict[Key, _Bound] = OrderedDict()
        self._nonces: OrderedDict[tuple[str, str], Key] = OrderedDict()
        self._retired: OrderedDict[tuple[str, str], None] = OrderedDict()
        """Both by (D engine id, nonce)."""
        self.refused: Counter[str] = Counter()
        """Pushes refused, by reason (``PushRefused.reason``, and ``fenced``)."""

    def admit(self, msg: PushRuns) -> str:
        """Record ``msg`` as written → ""; or the reason it must not be (counted)."""
        key = (msg.d_engine, msg.request_id, msg.token, msg.d_epoch)
        why = self._why(msg, key)
        if why:
            self.refused[why] += 1
            return why
        bound = self._loads.get(key)
        if bound is None:
            bound = self._loads[key] = _Bound(msg.nonce)
            self._nonces[msg.d_engine, msg.nonce] = key
            _trim(self._loads)
            _trim(self._nonces)
        bound.parts.add(msg.part)
        if msg.last:
            self.retire(msg.d_engine, msg.nonce)
        return ""

    def retire(self, d_engine: str, nonce: str) -> None:
        self._retired[d_engine, nonce] = None
        _trim(self._retired)

    def fence(self, request_id: str, d_engine: str) -> None:
        """D ``d_engine`` fenced ``request_id`` after a failure: retire the nonces bound
        to its loads of it."""
        for key, bound in list(self._loads.items()):
            if key[:2] == (d_engine, request_id):
                self.retire(d_engine, bound.nonce)

    def _why(self, msg: PushRuns, key: Key) -> str:
        if not msg.nonce:
            return "no nonce"
        if (msg.d_engine, msg.nonce) in self._retired:
            return "retired nonce"
        bound, owner = self._loads.get(key), self._nonces.get((msg.d_engine, msg.nonce), key)
        if owner != key or (bound and bound.nonce != msg.nonce):
            return "unknown nonce"
        if bound is not None and msg.part in bound.parts:
            return "replayed"
        return ""


def _trim(d: OrderedDict) -> None:
    while len(d) > KEPT:
        d.popitem(last=False)
