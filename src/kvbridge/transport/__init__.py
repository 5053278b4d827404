"""Transports by name (map: ``docs/structure.md``): the one place a transport is registered.

A transport is a :class:`~kvbridge.transport.base.Transport` subclass. Register a factory
``(agent_name, **options) -> Transport`` under a name; engines and tools then make one with
``make_transport(name, agent_name)`` and never import an implementation module. Factories
import their module when first called, so naming a transport loads nothing (NIXL is heavy).

    nixl       NIXL agent (UCX: shared memory, TCP, RDMA), the default
    loopback   in-process memmove between agents of one process (tests, examples)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvbridge.errors import ConfigError
from kvbridge.registry import Registry
from kvbridge.transport.base import Region, Transport, XferHandle, XferState

__all__ = [
    "Region",
    "Transport",
    "XferHandle",
    "XferState",
    "make_transport",
    "register_transport",
    "transport_names",
]

Factory = Callable[..., Transport]

_FACTORIES: Registry[Factory] = Registry("transport", ConfigError)
DEFAULT = "nixl"


def register_transport(name: str, factory: Factory) -> None:
    """Make ``factory`` known as ``name``; a name is registered once."""
    _FACTORIES.register(name, factory)


def transport_names() -> tuple[str, ...]:
    return _FACTORIES.names()


def make_transport(kind: str, agent_name: str, **options: Any) -> Transport:
    """A new agent of transport ``kind`` named ``agent_name`` (unique per rank)."""
    return _FACTORIES.get(kind)(agent_name, **options)


def _nixl(agent_name: str, **options: Any) -> Transport:
    from kvbridge.transport.nixl import NixlTransport

    return NixlTransport(agent_name, **options)


def _loopback(agent_name: str, **options: Any) -> Transport:
    """Agents reach each other on ``fabric=`` if given, else on this process's fabric."""
    from kvbridge.transport.loopback import LoopbackTransport, process_fabric

    fabric = options.pop("fabric", None) or process_fabric()
    if options:
        raise ConfigError(f"loopback transport takes fabric= only, got {sorted(options)}")
    return LoopbackTransport(agent_name, fabric)


register_transport("nixl", _nixl)
register_transport("loopback", _loopback)
