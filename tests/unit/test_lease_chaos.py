"""Lease chaos: several D instances (one of them a restarted twin: same engine id, new
epoch), handles duplicated at random to a second D, a key holder forging ``confirm``,
``fail`` and ``renew`` for live requests, P's engine overwriting its blocks the moment
they are freed, and some waves held past the lease. Real Producer, ProducerWorker and
Consumers over the loopback transport; every D block a load reports is compared with
what P prefilled. Figures: ``pytest -s tests/unit/test_lease_chaos.py``."""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from dataclasses import dataclass

import numpy as np

from kvbridge.connector.consumer import Consumer
from kvbridge.connector.load import _Load
from kvbridge.connector.peers import Peer
from kvbridge.connector.producer import Producer, ProducerWorker
from kvbridge.control.channel import Client
from kvbridge.control.messages import LeaseOp, LeaseOpName, LeaseReply, tables_digest
from kvbridge.errors import PeerError
from kvbridge.spec import Parallel, attention, group_by_kind
from kvbridge.transport.loopback import Fabric, LoopbackTransport
from tests.support.scenario import Side
from tests.support.stalling import StallingLoopback
from tests.unit.test_connector_loopback import SECRET

TINY = group_by_kind("tiny", [attention(0, 2, 8)], 16)
"""One full-attention layer: in ``block-major`` a block is one contiguous 1 KiB range."""
P_BLOCKS, D_BLOCKS = 256, 96
WAVES, PER_WAVE = 250, 8
DUP, FORGE, SLOW_EVERY = 0.3, 0.5, 25
LEASE_S = 1.0
ENGINES = ("D0", "D1", "D2", "D0")
"""The last is D0 restarted: same engine id, another epoch."""


@dataclass
class Load:
    rid: str
    d: int
    blocks: list[int]
    want: np.ndarray
    """The bytes P prefilled, one row per block."""
    before: np.ndarray
    """D's bytes of those blocks before the load."""
    granted: float
    """``time.monotonic()`` before P granted the lease."""


class DSide:
    def __init__(self, k: int, fabric: Fabric, rng: np.random.Generator):
        self.side = Side(TINY, Parallel(1), "block-major", D_BLOCKS)
        self.side.allocate(rng)
        self.mem = self.side.bufs[0][0].reshape(D_BLOCKS, -1)
        self.free = list(range(D_BLOCKS))
        self.consumer = Consumer(
            ENGINES[k], TINY, Parallel(1), 0, self.side.layouts[0],
            list(self.side.bound(0).bases), StallingLoopback(f"d{k}", fabric), SECRET,
            staging_bytes=0, kernel=False, workers=2 * PER_WAVE,  # every load begins at once
        )  # fmt: skip


class Chaos:
    def __init__(self, seed: int = 11):
        self.rng = np.random.default_rng(seed)
        fabric = Fabric()
        self.p = Side(TINY, Parallel(1), "block-major", P_BLOCKS)
        self.p.allocate(self.rng)
        lay = self.p.layouts[0]
        assert len(lay.regions) == 1 and all(
            v.block_stride * P_BLOCKS == lay.regions[0] for v in lay.views
        )
        self.pmem = self.p.bufs[0][0].reshape(P_BLOCKS, -1)
        self.free = [int(b) for b in self.rng.permutation(P_BLOCKS)]
        self.producer = Producer("P", TINY, Parallel(1), SECRET, lease_s=LEASE_S)
        agent = LoopbackTransport("p0", fabric)
        self.worker = ProducerWorker(0, lay, list(self.p.bound(0).bases), agent, share=False)
        self.producer.add_rank(self.worker.info)
        self.ds = [DSide(k, fabric, self.rng) for k in range(len(ENGINES))]
        self.forger = Client(self.producer.endpoint, SECRET, 3.0)
        self.n = Counter[str]()
        self.why = Counter[str]()
        """Refusals P must have counted, by cause: forgeries, and duplicates' ``begin`` and
        token-less ``renew`` while queued."""
        self.renews_refused = defaultdict[tuple[int, str], list[str]](list)
        """(D, request) → the errors of its token-less renews P refused."""
        for t in range(len(self.ds)):
            self.watch_renews(t)

    def watch_renews(self, t: int) -> None:
        """Keep D ``t``'s refused renews: a duplicate's renew while queued, once the other
        copy began, is refused (``other engine``; ``token required`` at D0's twin)."""
        calls = self.ds[t].consumer.leases
        call = calls.call

        def recorded(
            peer: Peer | Client, job: _Load, op: LeaseOpName, since: float | None = None
        ) -> LeaseReply:
            try:
                return call(peer, job, op, since)
            except PeerError as e:  # kept before the renew lets this load's begin go
                if op == "renew":
                    self.renews_refused[(t, job.handle.request_id)].append(str(e))
                raise

        calls.call = recorded  # type: ignore[method-assign]

    def reuse_freed(self) -> None:
        """P's engine takes freed blocks back at once and overwrites them."""
        for f in self.producer.freed():
            for b in f.tables[0]:
                self.pmem[b] = self.rng.integers(0, 256, self.pmem.shape[1], np.uint8)
                self.free.append(b)

    def prefill(self, k: int, w: int) -> tuple[str, object, int, float]:
        m = int(self.rng.integers(1, 4))
        blocks = [self.free.pop(0) for _ in range(m)]
        self.pmem[blocks] = self.rng.integers(0, 256, (m, self.pmem.shape[1]), np.uint8)
        rid, granted = f"w{w}r{k}", time.monotonic()
        return rid, self.producer.prefill_done(rid, [blocks], 16 * m), m, granted

    def wave(self, w: int, slow: bool) -> None:
        self.reuse_freed()
        loads, handles = [], {}
        for k in range(PER_WAVE):
            rid, handle, m, granted = self.prefill(k, w)
            handles[rid] = handle
            targets = [int(self.rng.integers(len(self.ds)))]
            if self.rng.random() < DUP:
                targets.append(
                    int(self.rng.choice([t for t in range(len(self.ds)) if t != targets[0]]))
                )
                self.n["duplicates injected"] += 1
            for t in targets:
                d = self.ds[t]
                blocks = [d.free.pop(0) for _ in range(m)]
                loads.append(
                    Load(
                        rid,
                        t,
                        blocks,
                        self.pmem[handle.block_tables[0]].copy(),
                        d.mem[blocks].copy(),
                        granted,
                    )
                )  # type: ignore[attr-defined]
        for d in self.ds:
            d.consumer.transport.stall("p0")  # type: ignore[attr-defined]
        for ld in loads:
            self.ds[ld.d].consumer.load(handles[ld.rid], [ld.blocks])  # type: ignore[arg-type]
        self.until_begun(list(handles))
        for handle in handles.values():
            if self.rng.random() < FORGE:
                self.forge(handle)
        if slow:
            time.sleep(LEASE_S * 1.2)  # past the lease: P frees at expiry
        self.reuse_freed()
        for d in self.ds:
            d.consumer.transport.resume("p0")  # type: ignore[attr-defined]
        self.check(loads, slow)

    def until_begun(self, rids: list[str]) -> None:
        end = time.monotonic() + 10
        held = self.producer.leases._held
        while any(r in held and not held[r].owners for r in rids):
            assert time.monotonic() < end, "begins did not reach P"
            time.sleep(0.001)

    def forge(self, handle) -> None:  # type: ignore[no-untyped-def]
        lease = self.producer.leases._held.get(handle.request_id)
        if lease is None or not lease.owners:
            return
        owner = lease.owners[0]
        other = next(
            (
                x.owners[0].token
                for x in list(self.producer.leases._held.values())
                if x is not lease and x.owners
            ),
            "",
        )
        kinds = [
            ("fail", "X", "e", ""),  # another engine id, no token
            ("fail", owner.engine, "restarted", ""),  # the owner's engine id, no token
            ("confirm", owner.engine, owner.epoch, "0" * 32),  # a made-up token
            ("confirm", owner.engine, "stolen", owner.token),  # the real token, another epoch
            ("fail", owner.engine, owner.epoch, other),  # another request's token
            ("renew", owner.engine, owner.epoch, "1" * 32),
        ]
        op, engine, epoch, token = kinds[int(self.rng.integers(len(kinds)))]
        digest = tables_digest(handle.block_tables, handle.n_tokens)
        msg = LeaseOp(op, handle.request_id, handle.lease_id, digest, engine, 0, 1, epoch, token)  # type: ignore[arg-type]
        reply = self.forger.call(msg)
        assert isinstance(reply, LeaseReply)
        self.n["forged ops"] += 1
        self.n[f"forged ops answered {reply.state}"] += 1
        self.why[reply.reason] += reply.state != "expired"  # a lease gone: nothing refused

    def check(self, loads: list[Load], slow: bool) -> None:
        """Every outcome in its bucket: a success (bytes right), a duplicate refused at
        ``begin`` or begun after the lease ended (nothing moved), or the lease found expired
        at ``begin`` (nothing moved) or ``confirm``: in a wave held past the lease, or in
        another that the machine's load held as long (more than a lease between the grant
        and the outcome, which any expiry implies: P's deadline is at least a lease after
        the grant); anything else fails the test."""
        outs, polled = {}, {}
        end = time.monotonic() + 20
        while len(outs) < len(loads):
            assert time.monotonic() < end, f"{len(outs)} of {len(loads)} outcomes"
            for t, d in enumerate(self.ds):
                for o in d.consumer.poll():
                    outs[(t, o.request_id)], polled[(t, o.request_id)] = o, time.monotonic()
            time.sleep(0.001)
        ok_per_request, copies = Counter[str](), Counter(ld.rid for ld in loads)
        lapsed = set()  # requests whose lease a copy found expired, a lease after the grant
        for ld in loads:
            out, d = outs[(ld.d, ld.rid)], self.ds[ld.d]
            got = d.mem[ld.blocks]
            right, untouched = np.array_equal(got, ld.want), np.array_equal(got, ld.before)
            refused = {
                f"PeerError: P refused begin of {ld.rid!r}: {why} (not this D's lease)": why
                for why in ("other engine", "other epoch")
            }
            late = f"LeaseExpired: lease of {ld.rid!r} expired at begin"
            expired = f"LeaseExpired: lease of {ld.rid!r} expired at confirm"
            self.renews(ld, loads, out.ok)
            if out.error in (late, expired) and polled[(ld.d, ld.rid)] - ld.granted > LEASE_S:
                lapsed.add(ld.rid)
            if out.ok:
                ok_per_request[ld.rid] += 1
                self.n["successes"] += 1
                self.n["false successes"] += not right
            elif copies[ld.rid] > 1 and (out.error in refused or out.error == late):
                assert untouched, f"{ld.rid}: a refused duplicate wrote D's blocks"
                self.n["duplicates refused at begin"] += out.error in refused
                self.why[refused.get(out.error, "")] += out.error in refused
                self.n["duplicates begun after the lease ended"] += out.error == late
            elif out.error in (late, expired) and (slow or ld.rid in lapsed):
                assert out.error == expired or untouched, f"{ld.rid}: a late begin wrote"
                self.n["failures"] += 1
                self.n["stale reads caught"] += not right and not untouched
            else:
                raise AssertionError(f"unexpected outcome of {ld.rid} (slow: {slow}): {out}")
            d.free += ld.blocks
        self.n["requests"] += len({ld.rid for ld in loads})
        for rid in set(copies) - set(ok_per_request) if not slow else ():
            assert rid in lapsed, f"{rid}: no copy succeeded, yet no lease ran out"
            self.n["expired in other waves"] += 1
        assert max(ok_per_request.values(), default=0) <= 1

    def renews(self, ld: Load, loads: list[Load], ok: bool) -> None:
        """``ld``'s refused renews into :attr:`why`: only a duplicate's, while the other
        copy held the lease, so never one of a load that succeeded; the cause follows from
        the engine id of the D that began (another id, or D0's twin: same id, no token)."""
        errors = self.renews_refused.pop((ld.d, ld.rid), [])
        if not errors:
            return
        assert not ok, f"{ld.rid}: P refused a renew of the load that succeeded: {errors}"
        others = [x.d for x in loads if x.rid == ld.rid and x.d != ld.d]
        assert len(others) == 1, f"{ld.rid}: P refused a renew of a lone copy: {errors}"
        other = others[0]
        cause = "other engine" if ENGINES[other] != ENGINES[ld.d] else "token required"
        error = f"P refused renew of {ld.rid!r}: {cause} (not this D's lease)"
        assert errors == [error] * len(errors), (ld.rid, errors)
        self.why[cause] += len(errors)
        self.n["duplicates' renews refused"] += len(errors)

    def close(self) -> None:
        self.forger.close()
        for d in self.ds:
            d.consumer.close()
        self.worker.close()
        self.producer.close()


def test_no_false_success_under_duplicates_forgeries_and_reuse():
    chaos = Chaos()
    t0 = time.monotonic()
    try:
        for w in range(WAVES):
            chaos.wave(w, slow=w % SLOW_EVERY == SLOW_EVERY - 1)
    finally:
        chaos.close()
    n = chaos.n
    n["P refusals"] = sum(chaos.producer.leases.refused.values())
    print(f"\nlease chaos in {time.monotonic() - t0:.1f} s: {dict(n)}")
    print(f"P refusals by cause: {dict(chaos.producer.leases.refused)}")
    assert n["requests"] >= 2000
    assert n["false successes"] == 0
    assert n["forged ops answered held"] == 0  # every forgery refused
    assert not chaos.renews_refused  # each one checked with its load
    refused, want = chaos.producer.leases.refused, chaos.why
    for cause in refused | want:  # no false alarm: none but forgeries and duplicates
        assert refused[cause] == want[cause], (cause, refused, want)
    assert n["stale reads caught"] > 0  # the check sees reused bytes (waves past the lease)
    slow = WAVES // SLOW_EVERY * PER_WAVE
    assert n["expired in other waves"] <= n["requests"] // 20  # seldom held that long
    assert n["successes"] >= n["requests"] - slow - n["expired in other waves"]
