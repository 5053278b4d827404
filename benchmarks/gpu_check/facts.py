"""What a case reports besides times: whether the fused Triton copy kernel ran in each D
rank (a silent fall back to torch's index kernels would pass every byte check) and
whether kvbridge's own choice took the kernel mover where it could.

On the GPU both are facts that fail the case: Triton enabled (``KVBRIDGE_TRITON`` not
"0") but ``triton_copy.STATE.failed`` (it did not import, build or launch); and a
kvbridge load that did not take the kernel mover although P shares its memory on this
node. On the CPU (``--cpu``) they are printed, never failures.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

from benchmarks.triton_state import kernel_facts

if TYPE_CHECKING:
    from benchmarks.gpu_check import messages as m
    from benchmarks.gpu_check.driver import CaseRun
    from benchmarks.gpu_check.rank import RankState

_WARNINGS: list[str] = []
"""triton_copy's warnings in this process (why Triton was given up), the last few."""


class _Keep(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        _WARNINGS[:] = [*_WARNINGS[-4:], record.getMessage()]


logging.getLogger("kvbridge.connector.movers.triton_copy").addHandler(_Keep(logging.WARNING))


def _imports() -> tuple[bool, str, str]:
    """``(triton imports, why not, its version)``."""
    try:
        triton = importlib.import_module("triton")
    except Exception as e:  # any import failure is the fact
        return False, f"{type(e).__name__}: {e}", ""
    return True, "", str(getattr(triton, "__version__", ""))


def triton_facts(st: RankState, _: m.TritonFacts) -> dict[str, Any]:
    """D rank: the fused kernel's state in this process after its copies."""
    from kvbridge.connector.movers import device_copies, triton_copy

    state = getattr(triton_copy, "STATE", None)
    failed = bool(getattr(state, "failed", False))
    built = getattr(state, "forms", None) is not None
    imports, error, version = _imports()
    return {
        "role": st.role,
        "rank": st.rank,
        "cuda": st.setup.gpu,
        "enabled": device_copies.triton_enabled(),
        "imports": imports,
        "import_error": error,
        "version": version,
        "known": state is not None,
        "failed": failed,
        "built": built,
        "ran": built and not failed,
        "warnings": list(_WARNINGS),
        "kernels": kernel_facts() if state is not None else {},
    }


def _verdict(f: dict[str, Any]) -> tuple[str, bool]:
    """``(what the table says, whether it fails the case)``."""
    if not f["cuda"]:
        imports = f"triton {f['version']} imports" if f["imports"] else "triton does not import"
        return f"n/a on CPU (torch copies; {imports})", False
    if not f["known"]:
        return "unknown (triton_copy.STATE not found)", True
    if not f["enabled"]:
        return "off (KVBRIDGE_TRITON=0): torch copies", False
    if f["failed"]:
        why = f["import_error"] or "; ".join(f["warnings"]) or "see the rank's log"
        return f"FELL BACK to torch copies ({why})", True
    if not f["built"]:
        return "not used (no copy on the GPU in this process)", False
    kernels = f.get("kernels") or {}
    ran = f"fused kernel ran (triton {f['version']}){_forms(kernels, f['warnings'])}"
    return ran, bool(kernels.get("fixed_failed"))


def _forms(k: dict[str, Any], warnings: list[str]) -> str:
    """The kernel's forms: copies by each, the fixed lengths compiled and how long."""
    runs = k.get("launches") or {}
    ready = k.get("fixed_ready") or []
    out = f"; copies: {runs.get('generic', 0)} generic, {runs.get('fixed', 0)} fixed-length"
    if ready:
        worst = max(r["compile_s"] for r in ready) * 1e3
        rows = ", ".join(f"{r['row']}×{r['dtype']}" for r in ready)
        out += f" ({len(ready)} lengths compiled: {rows}; slowest compile {worst:.0f} ms)"
    if k.get("fixed_failed"):
        out += f"; FIXED-LENGTH FORM FAILED ({'; '.join(warnings) or 'see the log'})"
    return out


def check_triton(cr: CaseRun, facts: list[dict[str, Any]]) -> None:
    """Record each D rank's facts with their verdict; a fall back on the GPU fails the
    case (``errors["triton"]``)."""
    bad = []
    for f in facts:
        f["verdict"], fails = _verdict(f)
        if fails:
            bad.append(f"D{f['rank']}: {f['verdict']}")
    cr.res.triton = facts
    if bad:
        cr.res.errors["triton"] = "; ".join(bad)


def check_mover(cr: CaseRun) -> None:
    """The kvbridge row's mover must be the kernel mover on the GPU where every P rank
    shares its memory (same node: one machine); the first load that took another is a
    failure there (``errors["kvbridge"]``), a remark with its reason on the CPU."""
    shares = all(r.info is not None and r.info.shares for r in cr.ready[0])
    for s in cr.res.samples:
        mover = s.detail.get("mover")
        if s.method != "kvbridge" or mover == "kernel":
            continue
        why = f"request {s.request} took {mover!r}, not the kernel mover: {s.detail.get('reason')}"
        if cr.opts.gpu and shares:
            cr.res.errors["kvbridge"] = f"{why} (P shares its memory on this node)"
        else:
            cr.res.remarks.append(f"kvbridge: {why}")
        return
