"""The rank processes of the check, on kvbridge's rank-process harness
(:class:`refengine.processes.RankProcesses`: typed commands, every wait bounded, a rank that
fails, exits or stays silent raises :class:`~refengine.processes.RankError`; ``close()``
stops, then terminates, then kills).

``p`` P ranks are harness ranks ``0 … p-1``, ``d`` D ranks follow. One command may go to
several ranks at once (:meth:`Ranks.ask`): all are sent before any answer is read, and
the answers share one deadline.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Sequence
from typing import Any

from benchmarks.gpu_check import rank
from refengine.processes import RankError, RankProcesses

Target = tuple[str, int, Any]
"""``(role, rank, command)``."""


class Ranks:
    def __init__(self, p: int, d: int, gpu: bool, boot_timeout_s: float) -> None:
        self.p, self.d = p, d
        args = [(i, gpu) for i in range(p + d)]
        self.procs = RankProcesses(
            mp.get_context("spawn"), rank.main, args, "gpu-check-", boot_timeout_s
        )
        self.facts: list[dict[str, Any]] = list(self.procs.boot)

    def fits(self, p: int, d: int) -> bool:
        return p <= self.p and d <= self.d and self.alive()

    def alive(self) -> bool:
        return bool(self.procs.procs) and all(proc.is_alive() for proc in self.procs.procs)

    def _index(self, role: str, r: int) -> int:
        return r if role == "P" else self.p + r

    def ask(self, targets: Sequence[Target], timeout_s: float) -> list[Any]:
        """Send each command in order, then read every answer by one deadline; the first
        rank's :class:`RankError` once all answered (the pipes stay in step)."""
        import time

        for role, r, cmd in targets:
            try:
                self.procs.conns[self._index(role, r)].send(cmd)
            except OSError as e:  # its end of the pipe is gone: the process exited
                what = f"{role}{r} {type(cmd).__name__}"
                raise RankError(self._index(role, r), what, f"process exited ({e})") from None
        end = time.monotonic() + timeout_s
        replies: list[Any] = []
        errors: list[RankError] = []
        for role, r, cmd in targets:
            what = f"{role}{r} {type(cmd).__name__}"
            try:
                replies.append(self.procs.answer(self._index(role, r), what, timeout_s, end))
            except RankError as e:
                errors.append(e)
                replies.append(None)
        if errors:
            raise errors[0]
        return replies

    def close(self) -> None:
        self.procs.close()


def fatal(err: RankError, ranks: Ranks) -> bool:
    """Whether ``err`` leaves the processes unusable (one died or did not answer in time),
    rather than a command that failed in a rank that goes on."""
    return not ranks.alive() or "no answer within" in err.error or "process exited" in err.error
