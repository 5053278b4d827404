"""What the fused copy kernels (:mod:`kvbridge.connector.movers.triton_copy`) did in this
process, and a wait for the fixed-length forms being compiled: read by gpu-check's
facts and the kernels' tests, never on a load's path."""

from __future__ import annotations

import time
from typing import Any

from kvbridge.connector.movers import triton_copy


def kernel_facts() -> dict[str, Any]:
    """Copies per form, the fixed lengths compiled (with each compile's seconds), and
    whether a form failed."""
    st = triton_copy.STATE
    with st.lock:
        ready = sorted(
            ({"kind": k, "row": r, "dtype": str(d).removeprefix("torch."), "device": dev,
              "compile_s": s} for (k, r, d, dev), s in st.ready.items()),
            key=lambda f: (f["kind"], f["row"], f["dtype"]),
        )  # fmt: skip
        return {
            "failed": st.failed,
            "built": st.forms is not None,
            "fixed_failed": st.fixed_failed,
            "fixed_ready": ready,
            "fixed_queued": len(st.queued),
            "launches": dict(st.launches),
        }


def wait_compiled(timeout_s: float) -> bool:
    """Wait until every queued fixed form compiled or failed; False at the deadline."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = triton_copy.STATE
        with st.lock:
            if st.fixed_failed or st.queued <= st.ready.keys():
                return True
        time.sleep(0.005)
    return False
