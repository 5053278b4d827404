"""What D's storage must hold after a vLLM-caches case, made without kvbridge: token by
token and head by head through the engines' own logical vLLM views (``vllm_alloc``), never
through kvbridge's description of them. Attention ``[B, H, N, C]``: token ``t`` of vLLM
block ``ids[t // block]`` lies at kernel block ``ids[t // block]·split + t % block // N``,
row ``t % N``; global head ``h`` on TP rank ``h // H``. Mamba state: slot ``slot`` of
vLLM's own split of the page (conv ``[rows, channels]``, or ``[channels, rows]`` for DS)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from benchmarks.gpu_check.vllm_alloc import MambaSpec, MLAAttentionSpec, split_state


def storage(t: torch.Tensor) -> torch.Tensor:
    """The whole allocation under ``t`` as uint8 (shares its memory)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def mirror(caches: Mapping[str, torch.Tensor], raw: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same views over ``raw``, a copy of their allocation."""
    return {
        n: raw.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
        for n, t in caches.items()
    }


def _where(t: torch.Tensor, ids: Sequence[int], block: int, toks: range) -> tuple[Any, Any]:
    """(kernel block, row) of tokens ``toks`` in view ``t`` (vLLM blocks ``ids``)."""
    tok = torch.arange(toks.start, toks.stop, device=t.device)
    rows = t.shape[2]
    vblock = torch.tensor(list(ids), device=t.device)[tok // block]
    return vblock * (block // rows) + tok % block // rows, tok % rows


def tokens(
    ranks: Sequence[Mapping[str, torch.Tensor]], name: str, ids: Sequence[int], block: int,
    toks: range, mla: bool,
) -> torch.Tensor:  # fmt: skip
    """``[tokens, heads of the model, C]`` of layer ``name`` from every TP rank's view
    (MLA: rank 0's latent, one slot)."""
    parts = []
    for views in ranks[:1] if mla else ranks:
        kb, row = _where(views[name], ids, block, toks)
        parts.append(views[name][kb, :, row, :])
    return torch.cat(parts, dim=1)


def put_tokens(
    view: torch.Tensor, ids: Sequence[int], block: int, toks: range, rank: int,
    values: torch.Tensor, mla: bool,
) -> None:  # fmt: skip
    """Write ``values`` (``[tokens, heads of the model, C]``) into ``view`` of TP rank
    ``rank`` (its heads only; MLA: every rank holds the latent)."""
    heads = view.shape[1]
    h0 = 0 if mla else rank * heads
    kb, row = _where(view, ids, block, toks)
    view[kb, :, row, :] = values[:, h0 : h0 + heads]


def put_state(
    p_view: torch.Tensor, d_view: torch.Tensor, p_spec: MambaSpec, d_spec: MambaSpec,
    slots: tuple[int, int], dim_first: tuple[bool, bool],
) -> None:  # fmt: skip
    """P's slot's conv and SSM state into D's slot, each conv in its own orientation
    (``dim_first``: P's, D's conv kept ``[channels, rows]``, vLLM's DS)."""
    (pc, ps), (dc, ds) = split_state(p_view, p_spec), split_state(d_view, d_spec)
    conv = pc[slots[0]].T if dim_first[0] else pc[slots[0]]
    dc[slots[1]] = conv.T if dim_first[1] else conv
    ds[slots[1]] = ps[slots[0]]


def expect(
    p: Sequence[Mapping[str, torch.Tensor]],
    d: Sequence[Mapping[str, torch.Tensor]],
    specs: tuple[Mapping[str, Any], Mapping[str, Any]],
    ids: tuple[Sequence[int], Sequence[int]],
    slots: tuple[int, int],
    dim_first: tuple[bool, bool],
    block: int,
    toks: range,
) -> None:
    """Write into D's views ``d`` (per rank) what P's views ``p`` hold for tokens ``toks``
    of the request (its blocks ``ids`` on P and on D) and, for state layers, its slot."""
    for name, p_spec in specs[0].items():
        mla = isinstance(p_spec, MLAAttentionSpec)
        if isinstance(p_spec, MambaSpec):
            for views in d:
                put_state(p[0][name], views[name], p_spec, specs[1][name], slots, dim_first)
            continue
        values = tokens(p, name, ids[0], block, toks, mla)
        for r, views in enumerate(d):
            put_tokens(views[name], ids[1], block, toks, r, values, mla)
