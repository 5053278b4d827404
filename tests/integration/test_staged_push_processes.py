"""Staged push between real processes over NIXL: P TP 1 → D TP 2, NHD (a head split:
every token row of K and V is its own small run), byte-exact against the reference."""

from __future__ import annotations

import pytest

from tests.integration.test_pd_processes import Pair, hybrid
from tests.support.rank_worker import Verify

pytestmark = pytest.mark.integration


def test_staged_push_is_byte_exact() -> None:
    pair = Pair(hybrid(), 1, 2, "nhd", "nhd", 16, 16, mode="push")
    try:
        for rid, n, cached in [("a", 300, 0), ("b", 200, 48)]:
            handle, d_tabs = pair.prefill(rid, n)
            pair.load(handle, d_tabs, cached)
            outs = [o[rid] for o in pair.wait([rid])]
            assert all(o.ok for o in outs), [o.error for o in outs]
            assert all(o.staged_runs > 500 and o.descriptors < 10 for o in outs), outs
            assert pair.d.call(Verify(rid, n, cached, d_tabs)) == [0, 0]
    finally:
        pair.close()
