"""Transport: moves runs between agents (map: ``docs/structure.md``).

Make one by name with :func:`make_transport`; add one with :func:`register_transport`
(``transport/registry.py``)."""

from kvbridge.transport.base import Region, Transport, XferHandle, XferState
from kvbridge.transport.registry import make_transport, register_transport, transport_names

__all__ = [
    "Region",
    "Transport",
    "XferHandle",
    "XferState",
    "make_transport",
    "register_transport",
    "transport_names",
]
