"""Which push requests one P rank has written: each load's pushes at most once.

D sends a load's :class:`~kvbridge.control.messages.PushRuns` to a P rank with its lease
token, its epoch and a nonce D issued for that load. The first push of (request, token,
D epoch) binds that nonce; the rank then writes each message (``part``) of it once, and
retires the nonce once it accepted the ``last`` one (or when D fences the request after a
failure). Refused, with the reason counted in :attr:`PushLedger.refused`: a push without
a nonce, with a retired nonce, with a nonce other than the one bound (or bound to another
load), or a part written already. So a replayed push (a stale copy, or a key holder
resending one) never writes P's current bytes into D blocks that D has since reused.

Limit: the rank cannot ask P's lease table whether the token is live (the table is in the
P instance's scheduler process): the first push of a load binds. A key holder that makes
up a new push is in the position of any agent that can write into D's registered memory
(docs/faults.md).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from kvbridge.control.messages import PushRuns

KEPT = 65536
"""Loads and retired nonces remembered (oldest forgotten first)."""

Key = tuple[str, str, str]
"""(request id, lease token, D epoch)."""


@dataclass(slots=True)
class _Bound:
    nonce: str
    parts: set[int] = field(default_factory=set)


class PushLedger:
    """Not thread-safe: the rank's side channel serves one message at a time."""

    def __init__(self) -> None:
        self._loads: OrderedDict[Key, _Bound] = OrderedDict()
        self._nonces: OrderedDict[str, Key] = OrderedDict()
        self._retired: OrderedDict[str, None] = OrderedDict()
        self.refused: Counter[str] = Counter()
        """Pushes refused, by reason (``PushRefused.reason``, and ``fenced``)."""

    def admit(self, msg: PushRuns) -> str:
        """Record ``msg`` as written → ""; or the reason it must not be (counted)."""
        key = (msg.request_id, msg.token, msg.d_epoch)
        why = self._why(msg, key)
        if why:
            self.refused[why] += 1
            return why
        bound = self._loads.get(key)
        if bound is None:
            bound = self._loads[key] = _Bound(msg.nonce)
            self._nonces[msg.nonce] = key
            _trim(self._loads)
            _trim(self._nonces)
        bound.parts.add(msg.part)
        if msg.last:
            self.retire(msg.nonce)
        return ""

    def retire(self, nonce: str) -> None:
        self._retired[nonce] = None
        _trim(self._retired)

    def fence(self, request_id: str) -> None:
        """D fenced ``request_id`` after a failure: retire the nonces bound to it."""
        for key, bound in list(self._loads.items()):
            if key[0] == request_id:
                self.retire(bound.nonce)

    def _why(self, msg: PushRuns, key: Key) -> str:
        if not msg.nonce:
            return "no nonce"
        if msg.nonce in self._retired:
            return "retired nonce"
        bound = self._loads.get(key)
        if self._nonces.get(msg.nonce, key) != key or (bound and bound.nonce != msg.nonce):
            return "unknown nonce"
        if bound is not None and msg.part in bound.parts:
            return "replayed"
        return ""


def _trim(d: OrderedDict) -> None:
    while len(d) > KEPT:
        d.popitem(last=False)
