"""Memory kind as data: regions know host or device memory, the handshake carries it, the
loopback transport moves device memory through torch (here: host memory reached through
torch CPU tensors, ``KVBRIDGE_DEVICE_ON_CPU=1``), and a transport refuses what it cannot
move, by name."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from kvbridge.connector.handle import TransferHandle
from kvbridge.control.messages import rank_layout, rank_regions
from kvbridge.errors import LayoutError, PeerError, TransportError
from kvbridge.layout.tensor import MemKind, Region, regions_at
from kvbridge.transport.loopback import Fabric, LoopbackTransport
from kvbridge.transport.memory import byte_tensor, torch_device
from tests.unit.test_connector_loopback import World, check_bytes

HOST, DEVICE = MemKind.HOST, MemKind.DEVICE


@pytest.fixture
def device_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVBRIDGE_DEVICE_ON_CPU", "1")


def test_a_region_knows_its_memory_and_refuses_nonsense() -> None:
    r = Region(4096, 64, DEVICE, 3)
    assert (r.kind, r.device) == (DEVICE, 3)
    assert Region(4096, 64).kind is HOST
    with pytest.raises(LayoutError):
        Region(4096, 64, "vram", 0)  # type: ignore[arg-type]
    with pytest.raises(LayoutError):
        Region(4096, 64, DEVICE, -1)
    assert [(x.addr, x.kind, x.device) for x in regions_at([8, 16], (8, 8), DEVICE, 1)] == [
        (8, DEVICE, 1),
        (16, DEVICE, 1),
    ]


def test_device_memory_without_cuda_is_refused_unless_emulated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVBRIDGE_DEVICE_ON_CPU", raising=False)
    monkeypatch.setattr("kvbridge.transport.memory.cuda_available", lambda: False)
    with pytest.raises(TransportError, match="no CUDA device"):
        torch_device(DEVICE, 0)
    monkeypatch.setenv("KVBRIDGE_DEVICE_ON_CPU", "1")
    assert torch_device(DEVICE, 0).type == "cpu"
    assert torch_device(HOST).type == "cpu"


def test_byte_tensor_aliases_the_memory(device_on_cpu: None) -> None:
    buf = np.arange(256, dtype=np.uint8)
    t = byte_tensor(Region(int(buf.ctypes.data) + 16, 32, DEVICE, 0))
    assert t.tolist() == list(range(16, 48))
    t[0] = 200  # a write through the tensor lands in the memory itself
    assert buf[16] == 200 and buf[15] == 15 and buf[48] == 48


@pytest.mark.parametrize("kinds", [(HOST, DEVICE), (DEVICE, HOST), (DEVICE, DEVICE)])
def test_loopback_moves_device_memory_byte_exact(device_on_cpu: None, kinds) -> None:
    fabric = Fabric()
    src, dst = np.arange(8192, dtype=np.uint64).view(np.uint8), np.zeros(65536, np.uint8)
    a, b = LoopbackTransport("a", fabric), LoopbackTransport("b", fabric)
    b.add_peer(a.register([Region(int(src.ctypes.data), src.nbytes, kinds[0])]))
    base = int(dst.ctypes.data)
    b.register([Region(base, 4096, kinds[1]), Region(base + 8192, 8192, kinds[1])])
    s_off = np.array([0, 1000, 60000, 5], np.uint64)
    d_off = np.array([8192, 0, 12000, 16000], np.uint64)
    n = np.array([100, 3000, 4000, 1], np.uint64)
    h = b.read("a", d_off + np.uint64(dst.ctypes.data), s_off + np.uint64(src.ctypes.data), n)
    b.wait(h, 1.0)
    want = np.zeros_like(dst)
    for s, d, k in zip(s_off.tolist(), d_off.tolist(), n.tolist(), strict=True):
        want[d : d + k] = src[s : s + k]
    assert np.array_equal(dst, want)
    end_in_gap = np.array([base + 4000], np.uint64)  # 100 B from 4000: 4 B past region 0
    with pytest.raises(TransportError, match="outside registered memory"):
        b.read("a", end_in_gap, s_off[:1] + np.uint64(src.ctypes.data), n[:1])
    assert np.array_equal(dst, want)


class _HostOnly(LoopbackTransport):
    kinds = frozenset({HOST})


def test_a_transport_refuses_memory_it_cannot_move_by_name() -> None:
    buf = np.zeros(64, np.uint8)
    t = _HostOnly("h", Fabric())
    with pytest.raises(TransportError, match="moves host memory, not the device region"):
        t.register([Region(int(buf.ctypes.data), 64, DEVICE, 2)])


@pytest.mark.parametrize("memory", [(DEVICE, DEVICE), (DEVICE, HOST), (HOST, DEVICE)])
def test_pull_between_device_and_host_ranks_is_byte_exact(device_on_cpu: None, memory) -> None:
    w = World(memory=memory)
    try:
        assert {(i.memory, i.device) for i in w.producer.ranks.values()} == {(memory[0].value, 0)}
        before = [[b.copy() for b in bufs] for bufs in w.d.bufs]
        handle, d_tabs = w.request("r1", 45)
        w.consumers[0].load(TransferHandle.from_bytes(handle.to_bytes()), d_tabs)
        (out,) = w.wait()
        assert out.ok, out.error
        check_bytes(w, before, 45, 0, d_tabs)
    finally:
        w.close()


def test_a_peer_rank_of_unknown_memory_kind_is_refused() -> None:
    w = World()
    try:
        info = next(iter(w.producer.ranks.values()))
        lay = rank_layout(info)
        assert [r.kind for r in rank_regions(info, lay)] == [HOST] * len(lay.regions)
        for bad in (
            {"memory": "hbm"},
            {"memory": "device", "device": -1},
        ):
            with pytest.raises(PeerError, match=r"memory kind|device"):
                rank_regions(msgspec.structs.replace(info, **bad), lay)
    finally:
        w.close()
