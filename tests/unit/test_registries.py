"""Layouts, transports and engine mixers are registered in one place each: a new one is
one registration, and everything downstream (planner, CLI flags, engine) accepts it."""

from __future__ import annotations

import numpy as np
import pytest

from kvbridge.api import (
    ConfigError,
    DType,
    LayoutError,
    Parallel,
    Region,
    attention,
    build_layout,
    group_by_kind,
    layout_names,
    make_transport,
    register_layout,
    register_transport,
    transport_names,
)
from kvbridge.cli import args as cli_args
from kvbridge.layout.build import Built, Groups, LayoutKind, place, view_of
from tests.support.scenario import Side, run_scenario


def _v_first(groups: Groups, nblk: tuple[int, ...], packed: bool) -> Built:
    """Per layer like nhd, but a block keeps the layer's last stream first (V before K)."""
    regions: list[int] = []
    views = []
    for g, layers in enumerate(groups):
        for pieces in layers:
            stride = sum(p.nbytes for p in pieces)
            for p, off in place(list(reversed(pieces)), 0):
                views.append(view_of(p, len(regions), off, stride, nblk[g]))
            regions.append(stride * nblk[g])
    return regions, views, list(range(len(groups)))


if "v-first" not in layout_names():
    register_layout(LayoutKind("v-first", _v_first, order="nhd"))


def _spec(block: int):  # type: ignore[no-untyped-def]
    layers = [attention(i, 4, 16, DType.BF16) for i in range(3)]
    return group_by_kind("toy", layers, block)


def test_a_registered_layout_moves_bytes_exactly_like_the_built_in_ones() -> None:
    lay = build_layout(_spec(16), Parallel(1), 0, "v-first", 4)
    first = {x.stream: x.offset for x in lay.views if x.layer == 0}
    assert first["v"] < first["k"]  # the new placement is in effect
    for p_lay, d_lay in [("v-first", "hnd"), ("hnd", "v-first"), ("v-first", "block-major")]:
        p = Side(_spec(16), Parallel(2), p_lay, 12)
        d = Side(_spec(8), Parallel(1), d_lay, 24)
        plans = run_scenario(p, d, 70, 0, np.random.default_rng(3))  # asserts bytes
        assert sum(pl.nbytes for pl in plans.values()) == 70 * 3 * 2 * 4 * 16 * 2


def test_the_cli_and_the_errors_know_a_registered_layout() -> None:
    assert cli_args.side("tp=1,layout=v-first")
    with pytest.raises(LayoutError, match="v-first"):
        build_layout(_spec(16), Parallel(1), 0, "no-such", 4)
    with pytest.raises(LayoutError, match="registered already"):
        register_layout(LayoutKind("nhd", _v_first))


def test_transports_are_made_by_name() -> None:
    assert {"nixl", "loopback"} <= set(transport_names())
    a, b = make_transport("loopback", "reg-a"), make_transport("loopback", "reg-b")
    src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
    peer = b.add_peer(a.register([Region(int(src.ctypes.data), 64)]))
    b.register([Region(int(dst.ctypes.data), 64)])
    u = np.uint64
    b.read(peer, np.array([dst.ctypes.data], u), np.array([src.ctypes.data], u), np.array([64], u))
    assert np.array_equal(src, dst)
    a.close(), b.close()
    with pytest.raises(ConfigError, match=r"unknown transport 'carrier-pigeon'.*loopback"):
        make_transport("carrier-pigeon", "x")


def test_a_registered_transport_is_what_the_engine_and_vllm_config_accept() -> None:
    made: list[str] = []

    def counting(name: str, **kw: object):  # type: ignore[no-untyped-def]
        made.append(name)
        return make_transport("loopback", name)

    if "counting" not in transport_names():
        register_transport("counting", counting)
    make_transport("counting", "reg-c").close()
    assert made == ["reg-c"]
    with pytest.raises(ConfigError, match="registered already"):
        register_transport("nixl", counting)


def test_engine_mixers_are_one_table_for_spec_and_model() -> None:
    from refengine import MIXERS, EngineError, model_spec, preset
    from refengine.mixers import get_mixer, mixer_names

    assert set(MIXERS) <= set(mixer_names())
    spec = model_spec(preset("jamba"))
    for i, name in enumerate(preset("jamba").pattern):
        assert spec.layers[i] == get_mixer(name).cache(i, preset("jamba"))
    with pytest.raises(EngineError, match="unknown mixer 'moe'"):
        get_mixer("moe")
    with pytest.raises(EngineError, match="mixers \\['moe'\\]"):
        preset("llama", pattern=("full", "moe"))
