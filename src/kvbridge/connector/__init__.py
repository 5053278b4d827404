"""Connector: what an engine calls (map: ``docs/structure.md``).

P: one :class:`ProducerWorker` per rank (registers the rank's KV memory, serves its side
channel) and one :class:`Producer` per instance (handshakes, leases, handles).
D: one :class:`Consumer` per rank (loads a :class:`TransferHandle`, reports
:class:`Outcome`)."""

from kvbridge.connector.consumer import Consumer
from kvbridge.connector.handle import TransferHandle
from kvbridge.connector.load import LoadState, Mode, Outcome, Policy
from kvbridge.connector.producer import Producer, ProducerWorker

__all__ = [
    "Consumer",
    "LoadState",
    "Mode",
    "Outcome",
    "Policy",
    "Producer",
    "ProducerWorker",
    "TransferHandle",
]
