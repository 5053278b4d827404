"""Rows (one per case and strategy) from a case's samples, and the text table.

Times are per request, end to end (plan + post + land), medians and 90th percentiles
over the measured requests; ``ratio`` is the median of (contiguous READ of the same bytes,
measured right after) / (the transfer), so 1.0 means as fast as one contiguous READ;
``vs_vllm`` the median of (kvbridge) / (vLLM-like) for the same request, and
``vllm_ratio`` the vLLM-like path's own ``ratio``: the ``vs_vllm`` a transfer exactly as
fast as one contiguous READ of the same bytes would get (the table shows both, as
``×vLLM / floor``): one contiguous READ is the fastest way the transport moves those
bytes, so no way of posting them is expected to get below it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.trace_worker import CaseResult, Sample

POSTING = ("init", "prep", "strided")
POSTING_NAMES = {
    "init": "initialize_xfer",
    "prep": "prep+make_prepped",
    "strided": "strided+make_prepped",
}
STRATEGIES = (("direct", "init"), ("staged", "staged"))


def _q(xs: Sequence[float], q: float, scale: float = 1.0, nd: int = 3) -> float | None:
    return round(float(np.quantile(np.asarray(xs), q)) * scale, nd) if len(xs) else None


def _by_request(samples: list[Sample], method: str) -> dict[int, Sample]:
    return {s.request: s for s in samples if s.method == method}


def _figures(ss: list[Sample]) -> dict[str, Any]:
    return {
        "requests": len(ss),
        "tokens_median": _q([s.tokens for s in ss], 0.5, nd=0),
        "bytes_median": _q([s.nbytes for s in ss], 0.5, nd=0),
        "descriptors_median": _q([s.descriptors for s in ss], 0.5, nd=0),
        "runs_median": _q([s.runs for s in ss], 0.5, nd=0),
        "bytes_per_descriptor": _q([s.nbytes / max(s.descriptors, 1) for s in ss], 0.5, nd=0),
        "e2e_ms_median": _q([s.seconds for s in ss], 0.5, 1e3),
        "e2e_ms_p90": _q([s.seconds for s in ss], 0.9, 1e3),
        "plan_us_median": _q([s.plan_s for s in ss], 0.5, 1e6, 1),
        "gbps": _q([s.nbytes / s.seconds for s in ss], 0.5, 1e-9, 2),
        "contiguous_ms_median": _q([s.contig_s for s in ss], 0.5, 1e3),
        "contiguous_gbps": _q([s.nbytes / s.contig_s for s in ss], 0.5, 1e-9, 2),
        "ratio": _q([s.contig_s / s.seconds for s in ss], 0.5, nd=3),
    }


def _vllm(ss: list[Sample], res: CaseResult) -> dict[str, Any]:
    vl = _by_request(res.samples, "vllm")
    if not vl:
        return {"vllm_ms_median": None, "vllm_note": res.vllm_note or "not measured"}
    both = [(s, vl[s.request]) for s in ss if s.request in vl]
    v = [b for _, b in both]
    return {
        "vllm_ms_median": _q([x.seconds for x in v], 0.5, 1e3),
        "vllm_ms_p90": _q([x.seconds for x in v], 0.9, 1e3),
        "vllm_descriptors_median": _q([x.descriptors for x in v], 0.5, nd=0),
        "vllm_merged_median": _q([x.merged for x in v], 0.5, nd=0),
        "vllm_bytes_median": _q([x.nbytes for x in v], 0.5, nd=0),
        "vllm_ratio": _q([x.contig_s / x.seconds for x in v], 0.5),
        "vs_vllm": _q([a.seconds / b.seconds for a, b in both], 0.5),
        "vs_vllm_p90": _q([a.seconds / b.seconds for a, b in both], 0.9),
        "descriptors_vs_vllm_max": _q([a.descriptors / b.descriptors for a, b in both], 1.0),
    }


def _posting(res: CaseResult) -> dict[str, Any]:
    ms = {m: _q([s.seconds for s in res.samples if s.method == m], 0.5, 1e3) for m in POSTING}
    known = {m: t for m, t in ms.items() if t is not None}
    return {
        "posting_ms": {POSTING_NAMES[m]: t for m, t in ms.items()},
        "fastest_posting": POSTING_NAMES[min(known, key=known.__getitem__)] if known else None,
        "strided_rows_median": _q(
            [s.rows for s in res.samples if s.method == "strided"], 0.5, nd=0
        ),
    }


def _staged(ss: list[Sample], res: CaseResult) -> dict[str, Any]:
    direct = _by_request(res.samples, "init")
    pairs = [(direct[s.request].seconds, s.seconds) for s in ss if s.request in direct]
    return {"staged_speedup": _q([d / s for d, s in pairs], 0.5, nd=2)}


def rows(res: CaseResult) -> list[dict[str, Any]]:
    """The case's rows: strategy ``direct`` (kvbridge's plan, ``initialize_xfer``, as the
    consumer posts it; other posting paths alongside) and ``staged``."""
    c = res.case
    base: dict[str, Any] = {
        "model": c.model, "p_tp": c.p_tp, "d_tp": c.d_tp,
        "p_layout": c.p_layout, "d_layout": c.d_layout, "pool_blocks": res.blocks,
        "live": c.live, "prompt_median_tokens": round(res.median_tokens),
        "prompt_max_tokens": res.max_tokens,
    }  # fmt: skip
    checked = res.samples
    base["verified_transfers"] = 2 * len(checked)
    base["verified_bytes"] = 2 * sum(s.nbytes for s in checked)
    base["mismatches"] = sum(s.bad_words + s.bad_contig for s in checked)
    base["auto"] = dict(res.auto)
    base["error"] = res.error or None
    out = []
    for strategy, method in STRATEGIES:
        ss = [s for s in res.samples if s.method == method]
        row = {**base, "strategy": strategy, **_figures(ss), **_vllm(ss, res)}
        row.update(_posting(res) if strategy == "direct" else _staged(ss, res))
        out.append(row)
    return out


COLUMNS = (
    ("case", 34), ("strat", 6), ("n", 3), ("tokens", 6), ("MiB", 6), ("desc", 7),
    ("e2e ms p50/p90", 15), ("GB/s", 5), ("ratio", 5), ("vLLM ms", 8), ("vLLM desc", 9),
    ("×vLLM / floor", 13), ("fastest posting / staged ×", 26),
)  # fmt: skip


def _cells(r: dict[str, Any]) -> list[str]:
    lay = r["p_layout"] if r["p_layout"] == r["d_layout"] else f"{r['p_layout']}→{r['d_layout']}"
    case = f"{r['model']} {r['p_tp']}→{r['d_tp']} {lay}"
    if r.get("e2e_ms_median") is None:
        return [case, r["strategy"], "0", "", "", "", f"FAILED: {r['error']}"]
    mib = (r["bytes_median"] or 0) / 2**20
    last = r.get("fastest_posting") or f"{r.get('staged_speedup')}× direct"
    v = r.get("vllm_ms_median")
    return [
        case, r["strategy"], str(r["requests"]), f"{r['tokens_median']:.0f}", f"{mib:.1f}",
        f"{r['descriptors_median']:.0f}", f"{r['e2e_ms_median']:.2f}/{r['e2e_ms_p90']:.2f}",
        f"{r['gbps']:.2f}", f"{r['ratio']:.2f}", "—" if v is None else f"{v:.2f}",
        "—" if v is None else f"{r['vllm_descriptors_median']:.0f}",
        "—" if v is None else f"{r['vs_vllm']:.2f} / {r['vllm_ratio']:.2f}", last,
    ]  # fmt: skip


def table(rows_: list[dict[str, Any]]) -> str:
    """A fixed-width text table of the rows."""
    lines = ["  ".join(name.ljust(w) for name, w in COLUMNS)]
    for r in rows_:
        cells = _cells(r)
        lines.append("  ".join(c.ljust(w) for c, (_, w) in zip(cells, COLUMNS, strict=False)))
    return "\n".join(lines)
