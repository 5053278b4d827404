"""Change-walk "a new engine adapter": a toy engine's hooks, written here over
``kvbridge.api`` and ``kvbridge.adapter`` only, move a prefilled request's KV from P to D
over the loopback transport; D's bytes are checked against the pattern P wrote."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvbridge.adapter import (
    HANDLE_KEY,
    Loading,
    LoadJob,
    Requests,
    Tally,
    decode_handle,
    encode_handle,
    reduce,
    refusal,
    state_tables,
)
from kvbridge.api import (
    Consumer,
    KVBridgeError,
    Outcome,
    Parallel,
    Producer,
    ProducerWorker,
    PromptMismatch,
    RankLayout,
    View,
    attention,
    build_layout,
    checked_tables,
    group_by_kind,
    make_transport,
)

SECRET = b"walk-engine-adapter"
SPEC = group_by_kind("toy", [attention(i, 4, 8) for i in range(2)], 16)
P_PAR, D_PAR = Parallel(2), Parallel(1)
D_BLOCK, N = 8, 40


def pattern(layer: int, stream: str, token: int, unit: int, nbytes: int) -> np.ndarray:
    """What P's prefill writes for one token and KV head: a function of where it belongs."""
    base = 31 * layer + 17 * (stream == "v") + 7 * token + 3 * unit
    return ((base + np.arange(nbytes)) % 251).astype(np.uint8)


def slot(v: View, table: list[int], block: int, token: int, unit: int) -> slice:
    """Where ``v`` keeps ``token``'s unit ``unit``: the view formula (docs/structure.md)."""
    off = v.offset + table[token // block] * v.block_stride + v.seg_offsets[0]
    off += (token % block) * v.row_strides[0] + (unit - v.seg_units[0][0]) * v.unit_strides[0]
    return slice(off, off + v.unit_bytes[0])


def each_slot(layout: RankLayout) -> Any:
    for v in layout.views:
        for u in range(*v.seg_units[0]):
            yield v, u


class ToyP:
    """The toy engine's P: two ranks of numpy memory, prefill writes the pattern."""

    def __init__(self) -> None:
        spec = SPEC
        self.layouts = [build_layout(spec, P_PAR, r, "hnd", 8) for r in range(2)]
        self.memory = [[np.zeros(n, np.uint8) for n in lay.regions] for lay in self.layouts]
        self.workers = []
        for r, (lay, mem) in enumerate(zip(self.layouts, self.memory, strict=True)):
            bases = [int(b.ctypes.data) for b in mem]
            transport = make_transport("loopback", f"walk-p{r}")
            self.workers.append(ProducerWorker(r, lay, bases, transport))
        self.producer = Producer("walk-P", spec, P_PAR, SECRET, lease_s=30)
        for w in self.workers:
            self.producer.add_rank(w.info)

    def prefill(self, rid: str, prompt: list[int], table: list[int]) -> dict[str, str]:
        """Hook: the request's prompt computed; its transfer params for D."""
        for lay, mem in zip(self.layouts, self.memory, strict=True):
            for v, u in each_slot(lay):
                for t in range(len(prompt)):
                    want = pattern(v.layer, v.stream, t, u, v.unit_bytes[0])
                    mem[v.region][slot(v, table, 16, t, u)] = want
        handle = self.producer.prefill_done(rid, [table], len(prompt), prompt=prompt)
        return {HANDLE_KEY: encode_handle(handle)}

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.producer.close()


class ToyD:
    """The toy engine's D: its scheduler hook queues a job, its rank hook runs it."""

    def __init__(self) -> None:
        spec = SPEC.with_block_sizes(D_BLOCK)
        self.layout = build_layout(spec, D_PAR, 0, "nhd", 16)
        self.memory = [np.zeros(n, np.uint8) for n in self.layout.regions]
        bases = [int(b.ctypes.data) for b in self.memory]
        transport = make_transport("loopback", "walk-d0")
        self.consumer = Consumer("walk-D", spec, D_PAR, 0, self.layout, bases, transport, SECRET)
        self.requests, self.loading, self.tally = Requests(), Loading(), Tally()

    def schedule(
        self, rid: str, prompt: list[int], params: dict[str, str], table: list[int], cached: int
    ) -> None:
        """Scheduler hook: a request arrived with P's transfer params (a handle of another
        prompt is refused here, and fails at the rank)."""
        text = params[HANDLE_KEY]
        tables = checked_tables([table], self.layout.num_blocks, "D's block tables")
        tables = state_tables(tables, {}, "none", len(prompt))  # no state group here
        self.requests.load(LoadJob(rid, text, tables, cached, refusal(text, prompt)))

    def step(self) -> None:
        """Rank hook: start the step's jobs; a refused one fails without reaching P."""
        loads, _ = self.requests.take()
        for job in loads:
            try:
                self.loading.start(job, lambda h, j: self.consumer.load(h, j.tables, j.cached))
            except KVBridgeError as e:
                self.loading.fail(job.request_id, e)

    def results(self, count: int) -> list[Outcome]:
        out: list[Outcome] = []
        end = time.monotonic() + 10
        while len(out) < count and time.monotonic() < end:
            out += self.loading.finished(self.consumer.poll())
            time.sleep(0.002)
        for o in out:
            self.tally.load(o)
        return out

    def close(self) -> None:
        self.consumer.close()


def test_a_toy_engine_moves_kv_through_the_adapter() -> None:
    p, d = ToyP(), ToyD()
    try:
        prompt, cached = list(range(100, 100 + N)), 8
        p_table, d_table = [6, 2, 7], [9, 3, 0, 12, 5]
        params = p.prefill("p-req", prompt, p_table)
        assert decode_handle(params[HANDLE_KEY]).request_id == "p-req"
        d.schedule("d-req", prompt, params, d_table, cached)
        d.schedule("d-bad", [1, *prompt[1:]], params, d_table, cached)  # another prompt
        d.step()
        outs = {o.request_id: o for o in d.results(2)}  # under D's request ids
        assert outs["d-req"].ok, outs["d-req"].error
        bad = outs["d-bad"]  # never queued: no time, no stages, its cause first
        assert not bad.ok and bad.error.startswith(f"{PromptMismatch.__name__}: ")
        assert bad.seconds == 0 and not bad.stages
        moved = 0
        for v, u in each_slot(d.layout):
            for t in range(N):
                got = d.memory[v.region][slot(v, d_table, D_BLOCK, t, u)]
                want = pattern(v.layer, v.stream, t, u, v.unit_bytes[0])
                if t < cached:  # D's own tokens: untouched
                    assert not got.any(), (v.layer, v.stream, t, u)
                else:
                    assert np.array_equal(got, want), (v.layer, v.stream, t, u)
                    moved += got.size
        assert outs["d-req"].bytes == moved == (N - cached) * 2 * 2 * 4 * 8 * 2
        summary = reduce(*d.tally.take())
        assert summary["loads"] == 2 and summary["failed"] == 1
        assert summary["MiB"] == round(moved / 2**20, 3) and summary["descriptors"] > 0
        assert [f.request_id for f in p.producer.freed(wait_for=1)] == ["p-req"]
    finally:
        d.close()
        p.close()
