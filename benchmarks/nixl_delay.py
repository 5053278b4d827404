"""Give agents that NIXL's Python wrapper builds a progress-thread delay.

The wrapper hard-codes ``pthrDelay = 0``, so an idle agent spins a core (vLLM's own
NixlConnector builds its agent that way). For side-by-side benchmarks on a small machine
:func:`patch_from_env` wraps the binding's agent constructor so that such agents get
``KVBRIDGE_BENCH_PTHR_DELAY_US`` instead; kvbridge's agents set their own delay and are
left alone. Called from a ``sitecustomize`` (spawned processes) and from the engine
harness (forked ones)."""

from __future__ import annotations

import os
from typing import Any

ENV = "KVBRIDGE_BENCH_PTHR_DELAY_US"


def patch_from_env() -> bool:
    """Install the wrapper if ``$KVBRIDGE_BENCH_PTHR_DELAY_US`` > 0; True if installed."""
    delay = int(os.environ.get(ENV, "0") or 0)
    if delay <= 0:
        return False
    try:
        from nixl_cu12 import _api
    except ImportError:
        return False
    real = _api.nixlBind.nixlAgent
    if getattr(real, "_kvbridge_delay", None) is not None:
        return True

    def agent(name: str, cfg: Any) -> Any:
        if cfg.useProgThread and cfg.pthrDelay == 0:
            cfg.pthrDelay = delay
        return real(name, cfg)

    agent._kvbridge_delay = delay  # type: ignore[attr-defined]
    _api.nixlBind.nixlAgent = agent
    return True
