"""vLLM 0.32's GPU KV caches described in place (integrations/vllm/gpu_layout.py).

The caches are made by vLLM's own code on CPU tensors: ``get_kv_cache_config_from_groups``
(the allocation plan, ``compute_layout_strides``) and ``allocate_kv_cache``
(``create_kv_cache_views``: one logical ``[B, H, N, C]`` view per layer), for each of the six
``KVCacheLayout`` values, blocks of 16 and 32 and kernel blocks of 16 in blocks of 32; Mamba
state is split by ``MambaBase.bind_kv_cache``. Known codes are written through those views;
kvbridge's views must address exactly those bytes (the address formula of ``View``, read
back from the raw storage), and P → D transfers between different layouts, planned by
kvbridge, must leave D's storage equal, byte for byte, to what writing P's codes through D's
own vLLM views gives."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest

pytest.importorskip("vllm")
import torch
from vllm.model_executor.layers.mamba import mamba_utils
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvbridge.api import (
    Bound,
    ConfigError,
    DType,
    Geometry,
    Group,
    ModelSpec,
    Parallel,
    Region,
    Side,
    Tables,
    View,
    attention,
    checked_tables,
    mla,
)
from kvbridge.integrations.vllm.cache import VllmCache
from kvbridge.integrations.vllm.gpu_layout import (
    LAYOUTS,
    Placement,
    gpu_rank_layout,
    kernel_tables,
    state_gpu_descs,
)
from kvbridge.integrations.vllm.state import state_layer
from kvbridge.transport.loopback import Fabric, LoopbackTransport

NB = 6  # vLLM blocks per engine
HEADS, HD = 4, 8
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}
INT = {2: torch.int16, 4: torch.int32}
KINDS = {  # (kv heads, head size, head size of V, dtype)
    "kv": (HEADS, HD, HD, torch.float32),
    "diffkv": (HEADS, HD, 4, torch.bfloat16),
    "mla": (1, 24, 0, torch.bfloat16),
}
SEGS = {"MAMBA2": (32, 12, 12), "GDN_ATTN": (16, 16, 16)}  # global conv x|B|C, q|k|v
Engine = tuple[dict[str, Any], dict[str, Any]]  # vLLM's layer views and specs, by name


def layer_of(name: str) -> int:
    return int(name.split(".")[2])


def allocate(groups: list[Any], layout: str, kernel: int | None = None, blocks: int = NB) -> Engine:
    """vLLM's allocation plan and per-layer views for ``groups`` (``KVCacheGroupSpec``),
    ``blocks`` blocks."""
    lay = KVCacheLayout[layout]
    cache = SimpleNamespace(
        get_resolved_kv_cache_layout=lambda: lay,
        num_gpu_blocks_override=blocks,
        prefix_cache_retention_interval=None,
    )
    vc = SimpleNamespace(cache_config=cache, attention_config=SimpleNamespace(hisparse_config=None))
    cfg = get_kv_cache_config_from_groups(vc, groups, 1 << 30)
    kernels = None if kernel is None else [kernel] * len(groups)
    caches = allocate_kv_cache(cfg, torch.device("cpu"), lay, kernels)
    return caches, {name: g.kv_cache_spec for g in groups for name in g.layer_names}


def storage(t: Any) -> Any:
    """The whole storage under ``t`` as a uint8 tensor (shares memory)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())


def bits(t: Any) -> Any:
    return t if t.element_size() == 1 else t.view(INT[t.element_size()])


def code(x: Any, item: int) -> Any:
    """Codes of int64 keys ``x`` for ``item``-byte elements: the key itself (4 bytes: every
    key here is below 2³¹), or 16 bits of a multiplicative hash (2 bytes)."""
    return x if item == 4 else ((x * 0x9E3779B1) >> 13) % 65536 - 32768


def fill(t: Any, offset: int) -> np.ndarray:
    """Write the codes of keys ``offset + i`` into every element ``i`` of ``t`` through ``t``
    itself; return them as unsigned ints of ``t``'s shape."""
    keys = (torch.arange(t.numel(), dtype=torch.int64) + offset).reshape(t.shape)
    bits(t).copy_(code(keys, t.element_size()).to(bits(t).dtype))
    return bits(t).numpy().view(UINT[t.element_size()]).copy()


def read_view(raw: np.ndarray, v: View, seg: int, item: int) -> np.ndarray:
    """The values at every address of segment ``seg`` of ``v``, ``[blocks, rows, units,
    elements]``, from the View formula alone (parts a piece stride apart)."""
    a, b = v.seg_units[seg]
    _, part, ps = v.piece(seg)
    e = np.arange(v.unit_bytes[seg] // item)
    addr = (
        v.offset
        + v.seg_offsets[seg]
        + np.arange(v.blocks)[:, None, None, None] * v.block_stride
        + np.arange(v.rows)[None, :, None, None] * v.row_strides[seg]
        + np.arange(b - a)[None, None, :, None] * v.unit_strides[seg]
        + ((e // (part // item)) * ps + (e % (part // item)) * item)[None, None, None, :]
    )
    return raw[addr[..., None] + np.arange(item)].view(UINT[item])[..., 0]


def attn_engine(kind: str, layout: str, block: int, kernel: int | None, tp: int = 1) -> Engine:
    heads, hk, hv, dt = KINDS[kind]
    if kind == "mla":
        spec: Any = MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=hk, dtype=dt)
    else:
        spec = FullAttentionSpec(
            block_size=block, num_kv_heads=heads // tp, head_size=hk, head_size_v=hv, dtype=dt
        )
    return allocate(
        [KVCacheGroupSpec(["m.layers.0.attn", "m.layers.1.attn"], spec)], layout, kernel
    )


def kb_spec(kind: str, block: int) -> ModelSpec:
    heads, hk, hv, dt = KINDS[kind]
    d = DType.FP32 if dt == torch.float32 else DType.BF16
    if kind == "mla":
        layers = tuple(mla(i, hk, d) for i in (0, 1))
    else:
        layers = tuple(attention(i, heads, hk, d, v_head_dim=hv) for i in (0, 1))
    return ModelSpec("t", layers, (Group("g0", (0, 1), block),))


def cached(spec: ModelSpec, tp: int, eng: Engine, dim_first: bool = False) -> VllmCache:
    """What ``read_cache`` gives ``gpu_rank_layout`` of engine ``eng`` (no PP; a group
    none of whose layers the engine registered: refused)."""
    names = {n: layer_of(n) for n in eng[0]}
    return VllmCache(spec, Parallel(tp), names, 0, kv_specs=eng[1], conv_dim_first=dim_first)


def describe(kind: str, eng: Engine, tp: int, rank: int, layout: str) -> Placement:
    """kvbridge's layout of one vLLM rank (``layout``: cross-checked against the strides)."""
    spec = kb_spec(kind, next(iter(eng[1].values())).block_size)
    return gpu_rank_layout(cached(spec, tp, eng), rank, eng[0], layout)


def assert_view(raw: np.ndarray, v: View, item: int, codes: np.ndarray, c0: int) -> None:
    """Every (block, token, head, element) of ``v`` holds vLLM's code at the logical
    ``[b, h, n, c0 + e]`` of the same token (flat token ``block·rows + row``)."""
    got = read_view(raw, v, 0, item)
    nb, rows, units, elems = got.shape
    kb, pos = np.divmod(np.arange(nb)[:, None] * rows + np.arange(rows), codes.shape[2])
    idx = (kb[:, :, None, None], np.arange(units)[None, None, :, None], pos[:, :, None, None])
    want = codes[(*idx, c0 + np.arange(elems)[None, None, None, :])]
    assert got.shape == want.shape and np.array_equal(got, want), (v.layer, v.stream)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(("block", "kernel"), [(16, None), (32, None), (32, 16)])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_views_address_the_bytes_vllm_wrote(
    layout: str, block: int, kernel: int | None, kind: str
) -> None:
    dense = layout in ("LBHNC", "LBNHC") or (layout == "LHBNC" and kind == "mla")  # H = 1
    if kernel and not dense:
        with pytest.raises(ValueError, match="kernel blocks"):  # vLLM: pages not dense
            attn_engine(kind, layout, block, kernel)
        return
    eng = attn_engine(kind, layout, block, kernel)
    codes = [fill(eng[0][f"m.layers.{i}.attn"], i << 20) for i in (0, 1)]
    got = describe(kind, eng, 1, 0, layout)
    # kernel blocks continue each other's tokens where N is a page's outer axis, or H is 1
    assert got.splits == ((2,) if kernel and layout == "LBHNC" and kind != "mla" else (1,))
    assert len(got.layout.views) == (2 if kind == "mla" else 4)
    raw = storage(eng[0]["m.layers.0.attn"]).numpy()
    for v in got.layout.views:
        item = eng[0][f"m.layers.{v.layer}.attn"].element_size()
        assert_view(raw, v, item, codes[v.layer], KINDS[kind][1] if v.stream == "v" else 0)


def test_a_wrong_description_is_caught() -> None:
    """The check is not vacuous: the same view with its token and head strides swapped
    (or its V put where K is) reads other bytes."""
    eng = attn_engine("kv", "LBHNC", 16, None)
    codes = fill(eng[0]["m.layers.0.attn"], 0)
    raw = storage(eng[0]["m.layers.0.attn"]).numpy()
    v = describe("kv", eng, 1, 0, "LBHNC").layout.view(0, "k")
    assert_view(raw, v, 4, codes, 0)
    swapped = dataclasses.replace(v, row_strides=v.unit_strides, unit_strides=v.row_strides)
    with pytest.raises(AssertionError):
        assert_view(raw, swapped, 4, codes, 0)
    with pytest.raises(AssertionError):
        assert_view(raw, v, 4, codes, HD)


def test_bad_views_are_refused() -> None:
    caches, specs = attn_engine("kv", "BLNHC", 16, None)
    cache = cached(kb_spec("kv", 16), 1, (caches, specs))
    with pytest.raises(ConfigError, match="not vLLM layout LHBNC"):
        gpu_rank_layout(cache, 0, caches, "LHBNC")
    with pytest.raises(ConfigError, match="not a vLLM KV cache layout"):
        gpu_rank_layout(cache, 0, caches, "LBHXC")
    wide = {n: dataclasses.replace(s, head_size_v=4) for n, s in specs.items()}
    with pytest.raises(ConfigError, match=r"is not \[blocks"):
        gpu_rank_layout(dataclasses.replace(cache, kv_specs=wide), 0, caches)
    with pytest.raises(ConfigError, match="holds blocks of 16"):
        gpu_rank_layout(cached(kb_spec("kv", 32), 1, (caches, specs)), 0, caches)


def test_a_state_spec_without_conv_and_ssm_is_refused() -> None:
    """Called directly (not after ``state_layer``), a spec of three shapes is a ConfigError
    naming both counts."""
    page = torch.zeros(4, 1, 1, 1024, dtype=torch.int8)
    spec = SimpleNamespace(shapes=((3, 8), (2, 4, 6), (5,)), dtypes=(torch.float32,) * 2)
    with pytest.raises(ConfigError, match="3 state shapes and 2 dtypes; expected 2 of each"):
        state_gpu_descs("m.layers.0.mixer", page, spec, False)


def hybrid(kind: str, conv: str, layout: str, tp: int, rank: int = 0) -> tuple[Engine, Placement]:
    """Layers 0, 1: Mamba-2 or GDN state (page padded to the attention page); 2, 3:
    attention, blocks of 32; the two groups alias one allocation, as in vLLM."""
    calc = mamba_utils.MambaStateShapeCalculator  # conv [rows, ch] or, DS, [ch, rows]
    with mock.patch.object(mamba_utils, "is_conv_state_dim_first", lambda: conv == "DS"):
        if kind == "MAMBA2":  # heads 4 of 8, 2 groups of state 6, kernel 4
            shapes = calc.mamba2_state_shape(tp, 32, 2, 4, 8, 6, 4)
        else:  # 2 k-heads of 8, 4 v-heads of 4, kernel 4
            shapes = calc.gated_delta_net_state_shape(tp, 2, 4, 8, 4, 4)
    att = FullAttentionSpec(block_size=32, num_kv_heads=2 // tp, head_size=HD, dtype=torch.float32)
    ms = MambaSpec(
        block_size=32,
        shapes=shapes,
        dtypes=(torch.float32,) * 2,
        page_size_padded=att.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum[kind],
    )
    eng = allocate(
        [
            KVCacheGroupSpec(["m.layers.0.mixer", "m.layers.1.mixer"], ms),
            KVCacheGroupSpec(["m.layers.2.attn", "m.layers.3.attn"], att),
        ],
        layout,
    )
    layers = [state_layer(i, ms, tp, conv == "DS") for i in (0, 1)]
    layers += [attention(i, 2, HD, DType.FP32) for i in (2, 3)]
    spec = ModelSpec("h", tuple(layers), (Group("g0", (0, 1), 1), Group("g1", (2, 3), 32)))
    return eng, gpu_rank_layout(cached(spec, tp, eng, conv == "DS"), rank, eng[0], layout)


def split_state(t: Any, spec: Any) -> tuple[Any, ...]:
    """Conv and SSM of one layer as vLLM's Mamba layer sees them."""
    layer = SimpleNamespace(
        get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes
    )
    MambaBase.bind_kv_cache(layer, t)  # type: ignore[arg-type]
    return tuple(layer.kv_cache)


@pytest.mark.parametrize("kind", ["MAMBA2", "GDN_ATTN"])
@pytest.mark.parametrize("conv", ["SD", "DS"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_state_views_address_the_bytes_vllm_wrote(layout: str, conv: str, kind: str) -> None:
    (caches, specs), got = hybrid(kind, conv, layout, 1)
    raw = storage(caches["m.layers.0.mixer"]).numpy()
    for i in (0, 1):
        name = f"m.layers.{i}.mixer"
        c, s = (
            fill(x, (i << 24) + (j << 16))
            for j, x in enumerate(split_state(caches[name], specs[name]))
        )
        want = [c.transpose(0, 2, 1) if conv == "DS" else c, s.reshape(s.shape[0], 1, -1)]
        for k, stream in enumerate(got.spec.layers[i].streams):  # [slot, rows, channels]
            v = got.layout.view(i, stream.name)
            assert (v.pieces != ()) == (conv == "DS" and k == 0)  # DS: a channel's rows apart
            at = 0
            for seg in range(len(stream.segments)):
                vals = read_view(raw, v, seg, 4)  # [slots, rows, units, elements]
                ch = at + np.arange(vals.shape[2] * vals.shape[3]).reshape(vals.shape[2:])
                assert np.array_equal(vals, want[k][:, :, ch]), (i, stream.name, seg)
                at += vals.shape[2] * vals.shape[3]
            assert at == want[k].shape[2]


def write_tokens(t: Any, layer: int, ids: list[int], block: int, toks: range, h0: int) -> None:
    """Token ``i`` (vLLM block ``ids[i // block]``) gets, per head ``h`` (global ``h0 + h``)
    and content element ``c``, the code of ``((layer·64 + i)·64 + head)·64 + c + 1``, written
    through vLLM's view ``t`` (kernel blocks: ``block / N`` per vLLM block)."""
    n = t.shape[2]
    tok = torch.tensor(list(toks))
    kb = torch.tensor([ids[i // block] for i in toks]) * (block // n) + tok % block // n
    head = h0 + torch.arange(t.shape[1])
    key = ((layer * 64 + tok[:, None, None]) * 64 + head[None, :, None]) * 64
    key = key + torch.arange(t.shape[3]) + 1
    bits(t)[kb, :, tok % block % n, :] = code(key, t.element_size()).to(bits(t).dtype)


def write_state(t: Any, spec: Any, slot: int, layer: int, tp: int, r: int) -> None:
    """Slot ``slot`` of a state layer (vLLM's own split of ``t``) on rank ``r`` of ``tp`` gets
    the codes of its global (row, conv channel) and (head, element), whatever its conv
    orientation (``[channels, rows]``: DS)."""
    conv, ssm = (bits(x) for x in split_state(t, spec))
    widths = SEGS[spec.mamba_type.name]
    ch = torch.cat(
        [sum(widths[:s]) + r * (w // tp) + torch.arange(w // tp) for s, w in enumerate(widths)]
    )
    rows = conv[0].numel() // ch.numel()
    key = (layer * 8 + torch.arange(rows)[:, None]) * 4096 + ch[None, :]
    conv[slot] = (key.T if conv.shape[1] == ch.numel() else key).to(conv.dtype)
    gh = r * ssm.shape[1] + torch.arange(ssm.shape[1])
    inner = torch.arange(ssm[0, 0].numel()).reshape(ssm.shape[2:])
    ssm[slot] = ((layer * 64 + gh)[:, None, None] * 1024 + inner + (1 << 24)).to(ssm.dtype)


def write(eng: Engine, slot: int, ids: list[int], tp: int, r: int, toks: range) -> None:
    """One request's codes through the views of rank ``r``: state in ``slot``, tokens ``toks``
    in vLLM blocks ``ids``."""
    caches, specs = eng
    for name, t in caches.items():
        s, i = specs[name], layer_of(name)
        if isinstance(s, MambaSpec):
            write_state(t, s, slot, i, tp, r)
        else:
            h0 = 0 if isinstance(s, MLAAttentionSpec) else r * t.shape[1]
            write_tokens(t, i, ids, s.block_size, toks, h0)


def transfer(p: list, d: list, ids: tuple, tabs: tuple, n: int, cached: int = 0) -> None:
    """``p``/``d``: per rank (engine, layout); ``ids``: P's and D's (slot, vLLM blocks).
    Write P, plan each D rank against every P rank, move with memmove, and require D's whole
    storage to equal its old bytes with P's codes written through D's own views."""
    fabric, agents = Fabric(), []
    for r, (eng, g) in enumerate(p):
        write(eng, *ids[0], len(p), r, range(n))
        agents.append(LoopbackTransport(f"p{r}", fabric))
        agents[-1].register([Region(b, s) for b, s in zip(g.bases, g.layout.regions, strict=True)])
    bound = [Bound(g.layout, tuple(g.bases)) for _, g in p]
    for r, ((caches, specs), g) in enumerate(d):
        want = storage(next(iter(caches.values()))).clone()
        a = LoopbackTransport(f"d{r}", fabric)
        a.register([Region(b, s) for b, s in zip(g.bases, g.layout.regions, strict=True)])
        pars = Parallel(len(p)), Parallel(len(d))
        d_side = Side(g.spec, pars[1], {r: Bound(g.layout, tuple(g.bases))})
        geom = Geometry(Side(p[0][1].spec, pars[0], bound), d_side, r)
        for src, runs in geom.plan(n, *tabs, cached).runs.items():
            s, dd, ln = runs.as_uint64()
            a.read(a.add_peer(agents[src].register([])), dd, s, ln)
        mirror = {
            nm: want.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
            for nm, t in caches.items()
        }
        write((mirror, specs), *ids[1], len(d), r, range(cached, n))
        assert torch.equal(storage(next(iter(caches.values()))), want), r


@pytest.mark.parametrize(
    ("kind", "p", "d", "cached"),
    [  # kind, P (layout, block, kernel, tp), D (…), cached on D
        ("kv", ("BLHNC", 16, None, 1), ("LHBNC", 32, None, 1), 0),
        ("kv", ("LBHNC", 32, 16, 1), ("BHLNC", 16, None, 2), 0),
        ("kv", ("BLNHC", 32, None, 2), ("LBNHC", 32, 16, 1), 16),
        ("diffkv", ("LBNHC", 16, None, 1), ("LBHNC", 32, 16, 2), 0),
        ("mla", ("LHBNC", 16, None, 1), ("BLHNC", 32, None, 2), 0),
    ],
)
def test_transfer_between_layouts_is_byte_exact(kind: str, p: tuple, d: tuple, cached: int) -> None:
    n, rng = 45, np.random.default_rng(3)
    sides, ids, tabs = [], [], []
    for layout, block, kernel, tp in (p, d):
        engines = [attn_engine(kind, layout, block, kernel, tp) for _ in range(tp)]
        sides.append([(e, describe(kind, e, tp, r, layout)) for r, e in enumerate(engines)])
        ids.append((-1, [int(x) for x in rng.permutation(NB)[: -(-n // block)]]))
        tabs.append(
            kernel_tables(checked_tables([ids[-1][1]], [NB], "vLLM"), sides[-1][0][1].splits)
        )
    transfer(*sides, tuple(ids), tuple(tabs), n, cached)


@pytest.mark.parametrize("kind", ["MAMBA2", "GDN_ATTN"])
@pytest.mark.parametrize(
    ("p", "d"), [(("DS", "LBHNC", 1), ("SD", "BLHNC", 2)), (("SD", "BHLNC", 2), ("DS", "LBNHC", 1))]
)
def test_state_and_attention_transfer_is_byte_exact(kind: str, p: tuple, d: tuple) -> None:
    """A hybrid request (two state layers, one slot; two attention layers) P → D across
    TP, conv orientation and layout: conv rows and channels, SSM heads and K|V tokens land
    where D's own vLLM views put them, every other byte kept."""
    rng = np.random.default_rng(5)
    sides = [[hybrid(kind, c, lay, tp, r) for r in range(tp)] for c, lay, tp in (p, d)]
    ids = tuple(
        (int(x[0]), [int(y) for y in x[1:]]) for x in (rng.permutation(NB)[:3] for _ in "pd")
    )
    tabs = tuple([[slot], blocks] for slot, blocks in ids)
    transfer(*sides, ids, tabs, 45)


def test_kernel_tables_map_checked_ids_by_numpy_and_keep_them_checked() -> None:
    """vLLM block ``b`` of a group split in ``s`` is kernel blocks ``b·s … b·s + s - 1``
    (an element-wise reference); checked ids stay checked (against ``n·s`` blocks),
    read-only, and unchecked ones stay unchecked."""
    tabs = checked_tables([[3, 0, 5], [4, 1]], [6, 6], "vLLM")
    out = kernel_tables(tabs, (2, 1))
    assert out.lists() == [[b * 2 + j for b in (3, 0, 5) for j in range(2)], [4, 1]]
    assert out.limits == (12, 6) and all(not t.flags.writeable for t in out.ids)
    assert checked_tables(out, [12, 6], "D") is out
    loose = Tables(tabs.ids, tabs.limits)
    assert checked_tables(kernel_tables(loose, (2, 1)), [12, 6], "D") is not out
