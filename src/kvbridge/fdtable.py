"""Room in the process's file-descriptor table, made at engine start.

Linux grows a process's descriptor table when a new descriptor passes its size (256, 512,
1024, ...), and in a process with several threads each growth waits for an RCU grace
period. In a busy vLLM worker that wait took 0.5-1.1 s (the thread sleeping in
``synchronize_rcu`` inside ``eventfd2``), and it fell inside a request's first handshake:
pyzmq creates sockets holding the GIL, so the worker stalled with it. Growing the table
once at start, before any request, keeps that wait off the request path.
"""

from __future__ import annotations

import fcntl
import os
import resource

HEADROOM = 1024
"""Descriptors a request path may open (side-channel sockets, transport connections)
before the table must grow again."""


def reserve_fds(headroom: int = HEADROOM) -> int:
    """Grow the descriptor table to hold ``headroom`` more descriptors than the highest
    open one (within the soft ``RLIMIT_NOFILE``); the descriptor number that reached, or
    0 where nothing was done. Never touches an open descriptor, never raises."""
    try:
        highest = max(int(n) for n in os.listdir("/proc/self/fd"))
    except (OSError, ValueError):
        return 0
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = highest + headroom
    if soft != resource.RLIM_INFINITY:
        target = min(target, soft - 1)
    if target <= highest:
        return 0
    try:
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        try:
            high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, target)  # lowest free one >= target
        finally:
            os.close(fd)
        os.close(high)
    except OSError:  # at the descriptor limit already, no /dev/null: nothing to do
        return 0
    return high
