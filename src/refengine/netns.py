"""Two simulated hosts on one machine: network namespaces joined by a veth pair.

:class:`Hosts` creates namespaces ``<prefix>-p`` (address ``10.77.x.1``) and
``<prefix>-d`` (``10.77.x.2``); a process (or one thread) enters one with :func:`enter`
before it opens sockets. :meth:`Hosts.cut` takes the link down (a partition: packets
are dropped, TCP connections survive and resume when :meth:`Hosts.heal` brings it
back). Needs root and ``ip``; :func:`unavailable` says why not, for a skip message.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
CLONE_NEWNS = 0x00020000
MS_REC, MS_SLAVE, MNT_DETACH = 0x4000, 0x80000, 2


def unavailable() -> str:
    """Why namespaces cannot be made here ("" if they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "network namespaces need the ip command (iproute2)"
    name = f"kvbprobe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ""


def enter(netns: str, sysfs: bool = True) -> None:
    """Move the calling thread (a fresh process: all of it) into namespace ``netns``.

    ``sysfs``: also give it a private ``/sys`` showing that namespace's interfaces, as
    ``ip netns exec`` does (UCX lists network devices from ``/sys/class/net``: without
    it a rank advertises the other namespace's addresses and peers cannot connect)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} for {netns}: {os.strerror(err)}")

    fd = os.open(f"/var/run/netns/{netns}", os.O_RDONLY)
    try:
        check(libc.setns(fd, CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    if sysfs:
        check(libc.unshare(CLONE_NEWNS), "unshare(mount)")
        check(libc.mount(b"none", b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
        check(libc.umount2(b"/sys", MNT_DETACH), "umount /sys")
        check(libc.mount(netns.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


def in_netns(netns: str, make: Callable[[], T]) -> T:
    """``make()`` run by a thread inside ``netns`` (its sockets, and the threads it
    starts, live there), or here if ``netns`` is empty."""
    if not netns:
        return make()
    out: list[T] = []
    err: list[BaseException] = []

    def run() -> None:
        try:
            enter(netns, sysfs=False)  # sockets only: this process's /sys stays
            out.append(make())
        except BaseException as e:
            err.append(e)

    t = threading.Thread(target=run, name=f"netns-{netns}")
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Hosts:
    """Namespaces ``p`` and ``d`` with one veth link between them."""

    def __init__(self, subnet: int = 77) -> None:
        tag = uuid.uuid4().hex[:5]
        self.p, self.d = f"kvb{tag}-p", f"kvb{tag}-d"
        self.p_addr, self.d_addr = f"10.{subnet}.0.1", f"10.{subnet}.0.2"
        self._p_if, self._d_if = f"kvb{tag}p", f"kvb{tag}d"
        _ip("netns", "add", self.p)
        try:
            _ip("netns", "add", self.d)
            _ip("link", "add", self._p_if, "type", "veth", "peer", "name", self._d_if)
            for ns, dev, addr in (
                (self.p, self._p_if, self.p_addr),
                (self.d, self._d_if, self.d_addr),
            ):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def cut(self) -> None:
        """Partition: drop every packet on the link (connections stay open)."""
        _ip("-n", self.p, "link", "set", self._p_if, "down")

    def heal(self) -> None:
        _ip("-n", self.p, "link", "set", self._p_if, "up")

    def slow(self, rate: str) -> None:
        """A slow link: P's egress (what D reads) limited to ``rate`` (tc's units, e.g.
        ``200kbit``) by a token bucket; :meth:`fast` lifts it."""
        tc = ["tc", "qdisc", "replace", "dev", self._p_if, "root", "tbf", "rate", rate]
        subprocess.run(
            ["ip", "netns", "exec", self.p, *tc, "burst", "16kb", "latency", "5s"],
            check=True, capture_output=True, text=True,
        )  # fmt: skip

    def fast(self) -> None:
        subprocess.run(
            ["ip", "netns", "exec", self.p, "tc", "qdisc", "del", "dev", self._p_if, "root"],
            capture_output=True,
        )

    def close(self) -> None:
        for ns in (self.p, self.d):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
