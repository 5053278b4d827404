"""Colocated generation: TP and PP over processes (gloo) give the tokens of TP 1."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time

import pytest

from kvbridge.errors import SpecError
from refengine import PRESETS, Instance, encode, generate

pytestmark = pytest.mark.e2e

PROMPT = encode("Paged KV moves from P to D, whatever the layout.")
NEW_TOKENS = 16


@functools.cache
def colocated(name: str) -> tuple[int, ...]:
    return tuple(generate(name, PROMPT, tp=1, n_new_tokens=NEW_TOKENS))


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("tp", [2, 3])
def test_tensor_parallel_gives_the_tokens_of_tp1(name: str, tp: int) -> None:
    assert tuple(generate(name, PROMPT, tp=tp, n_new_tokens=NEW_TOKENS)) == colocated(name)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize(("tp", "pp"), [(1, 2), (2, 3)])
def test_pipeline_stages_give_the_tokens_of_one_rank(name: str, tp: int, pp: int) -> None:
    tokens = generate(name, PROMPT, tp=tp, pp=pp, n_new_tokens=NEW_TOKENS)
    assert tuple(tokens) == colocated(name)


def test_one_rank_in_a_worker_process_matches_in_process() -> None:
    assert tuple(generate("jamba", PROMPT, n_new_tokens=NEW_TOKENS, processes=True)) == colocated(
        "jamba"
    )


def test_tp4_where_every_head_count_splits() -> None:
    assert tuple(generate("deepseek", PROMPT, tp=4, n_new_tokens=NEW_TOKENS)) == colocated(
        "deepseek"
    )


def test_heads_that_do_not_split_are_refused_before_any_process_starts() -> None:
    with pytest.raises(SpecError, match="cannot be split over TP 4"):
        Instance("llama", tp=4)


def test_generation_is_not_constant() -> None:
    for name in PRESETS:
        assert len(set(colocated(name))) > 4, name


CHILD = """
import multiprocessing, os, sys
from refengine import Instance
inst = Instance("llama", tp=2)
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
os._exit(0)
"""


def test_workers_exit_when_their_parent_dies() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 2, out.stderr
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"
