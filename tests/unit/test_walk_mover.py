"""Change-walk "a new mover" (docs/structure.md), performed here: a mover registered from
this file (``register_mover``) is tried by the real Consumer in its order, moves the loads
it says it serves byte-exact against the element-wise reference, is named in
``Outcome.mover``, and leaves every other load to the built-in movers."""

from __future__ import annotations

import ctypes

import pytest

from kvbridge.connector.load import _Load
from kvbridge.connector.movers.registry import MoverKind, mover_names, movers, register_mover
from kvbridge.connector.peers import Peer
from kvbridge.errors import KVBridgeError
from kvbridge.plan.plan import Plan
from tests.unit.test_connector_loopback import World
from tests.unit.test_kernel_mover import load_one

NAME = "walk-memmove"
PREFIX = "walk-mover:"
COPIED: list[int] = []
"""Bytes the walk mover copied, per load."""


def _serves(d: object, peer: Peer, plan: Plan, job: _Load) -> str:
    """Loads of this file only (P's memory is this process's: the tests run P and D in
    one process), so other tests' consumers keep the built-in movers."""
    return "walk: P in this process" if job.handle.request_id.startswith(PREFIX) else ""


def _run(d: object, peer: Peer, plan: Plan, job: _Load) -> None:
    """Each run copied with memmove from P's addresses (the pair's geometry)."""
    copied = 0
    for r in plan.runs.values():
        for s, dst, n in zip(*(a.tolist() for a in r.as_uint64()), strict=True):
            ctypes.memmove(dst, s, n)
            copied += n
        job.posted += len(r)
    COPIED.append(copied)


if NAME not in mover_names():
    register_mover(MoverKind(NAME, 5, _serves, _run))


def test_a_registered_mover_moves_the_loads_it_serves() -> None:
    assert [m.name for m in movers()][:2] == ["kernel", NAME]  # tried after the kernel
    w = World()
    try:
        assert w.consumers[0].kernel is not None  # present, but P shares no memory here
        COPIED.clear()
        out = load_one(w, PREFIX + "r1", 45)  # asserts the bytes
        assert (out.mover, out.reason) == (NAME, "walk: P in this process")
        assert [out.bytes] == COPIED and out.descriptors > 0
        other = load_one(w, "r2", 45)
        assert other.mover == "pull" and [out.bytes] == COPIED  # not served: built-in
    finally:
        w.close()


def test_mover_names_are_checked_once() -> None:
    with pytest.raises(KVBridgeError, match="registered already"):
        register_mover(MoverKind("pull", 99, _serves, _run))
    assert {"kernel", "push", "pull", NAME} <= set(mover_names())
