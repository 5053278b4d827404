"""Which direction moves bytes faster between this D rank and a P instance, measured.

On host memory READ and WRITE cost about the same; between two processes' GPU memory
without RDMA, UCX emulates READ over TCP (0.5 GB/s) while WRITE is zero-copy CUDA IPC
(1.0-1.4 TB/s, ``docs/performance.md``); over RDMA READ is fine again. No flag can know
which holds for a pair, so in :attr:`~kvbridge.connector.load.Mode.AUTO` D measures both
once per P epoch, on the memory the transfers will use:

    READ   D reads PROBE_BYTES of P rank ``src``'s first region into a staging slot
    WRITE  D asks that rank (its push channel) to write the same bytes into the slot

Both land in D's own staging slot (never in a KV block); a probe still running at its
deadline keeps the slot out of the pool. Push is chosen when WRITE took less than
1/``MARGIN`` of READ's time; the outcome says what was measured.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbridge.connector.load import Mode
from kvbridge.connector.peers import Peer
from kvbridge.connector.push import reply_runs
from kvbridge.connector.staging import Stager
from kvbridge.control.messages import PushRuns
from kvbridge.errors import KVBridgeError
from kvbridge.transport.base import Transport

PROBE_BYTES = 8 << 20
MARGIN = 1.5
PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Directions:
    """What one measurement found: seconds for ``nbytes`` each way (inf: failed)."""

    nbytes: int
    read_s: float
    write_s: float
    note: str = ""

    def choice(self) -> tuple[Mode, str]:
        """``(pull or push, why)``."""
        if self.note:
            return Mode.PULL, f"auto: pull ({self.note})"
        speeds = f"READ {_rate(self.nbytes, self.read_s)}, WRITE {_rate(self.nbytes, self.write_s)}"
        if self.write_s * MARGIN < self.read_s:
            return Mode.PUSH, f"auto: push, measured {speeds}"
        return Mode.PULL, f"auto: pull, measured {speeds}"


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if 0 < seconds < float("inf") else "failed"


def measure(
    transport: Transport,
    stager: Stager | None,
    peer: Peer,
    src: int,
    agent_md: bytes,
    await_notif: Callable[[set[bytes], float], None],
    d_engine: str = "",
) -> Directions:
    """Time a READ and a WRITE of the same bytes between P rank ``src`` and D's staging
    slot. ``agent_md``: D's transport metadata (P needs it to write); ``await_notif``:
    waits for notifications until a monotonic deadline (TransferTimeout after it);
    ``d_engine``: D's engine id (the probe's push names it)."""
    if stager is None:
        return Directions(0, 0.0, 0.0, "no staging slot to probe into")
    info = peer.ranks.get(src)
    if info is None or not info.endpoint or not info.regions:
        return Directions(0, 0.0, 0.0, f"P rank {src} serves no push channel")
    size = min(PROBE_BYTES, stager.pool.slot_bytes, info.regions[0])
    slot = stager.pool.take(PROBE_TIMEOUT_S)
    if slot is None:
        return Directions(0, 0.0, 0.0, "no free staging slot")
    clean = False
    try:
        at = stager.pool.region.addr + slot * stager.pool.slot_bytes
        one = np.ones(1, np.uint64)
        local, remote, n = one * at, one * info.bases[0], one * size
        t0 = time.perf_counter()
        transport.wait(transport.read(peer.agents[src], local, remote, n), PROBE_TIMEOUT_S)
        read_s = time.perf_counter() - t0
        write_s = _write(peer, src, agent_md, d_engine, (local, remote, n), await_notif)
        clean = True
    except KVBridgeError as exc:
        return Directions(size, float("inf"), float("inf"), f"probe failed: {exc}")
    finally:
        stager.pool.give_back(slot, clean)
    return Directions(size, read_s, write_s)


def _write(
    peer: Peer,
    src: int,
    agent_md: bytes,
    d_engine: str,
    runs: tuple[np.ndarray, np.ndarray, np.ndarray],
    await_notif: Callable[[set[bytes], float], None],
) -> float:
    """Seconds from asking P rank ``src`` (with D's ``agent_md`` and ``d_engine``) to write
    ``runs`` (local = D) to their landing."""
    local, remote, n = (a.astype("<u8").tobytes() for a in runs)
    notif = f"kvb-probe:{secrets.token_hex(8)}".encode()
    probe = PushRuns(
        "probe:" + notif.decode(), agent_md, src=remote, dst=local, nbytes=n, notif=notif,
        nonce=notif.decode(), d_engine=d_engine,
    )  # fmt: skip
    t0 = time.perf_counter()
    reply_runs(peer.rank_client(src).call(probe), "probe")
    await_notif({notif}, time.monotonic() + PROBE_TIMEOUT_S)
    return time.perf_counter() - t0
