"""Every error kvbridge raises. Messages name the offending values."""

from __future__ import annotations


class KVBridgeError(Exception):
    """Base of all kvbridge errors."""


class SpecError(KVBridgeError):
    """A model spec is impossible or inconsistent (e.g. 6 heads on TP 4)."""


class ConfigError(SpecError):
    """A config.json or spec file is malformed; the message names the field."""


class LayoutError(KVBridgeError):
    """A view leaves its region, or a layout does not fit the spec."""


class TopologyError(KVBridgeError):
    """P and D parallel configurations cannot be matched."""


class PlanError(KVBridgeError):
    """A request cannot be planned: bad block ids, too few blocks, duplicates."""


class IncompatibleError(KVBridgeError):
    """P and D disagree on something that affects bytes (spec, dtype, protocol)."""


class TransportError(KVBridgeError):
    """The transport failed: a NIXL error, a dead peer, an out-of-region run."""


class TransferTimeout(TransportError):
    """A transfer did not finish before its deadline."""


class TransferFailed(TransportError):
    """NIXL reported a posted transfer failed (an error status or exception from
    posting or polling it): the transfer has ended, nothing more of it moves."""


class PeerError(KVBridgeError):
    """A peer sent a malformed, unauthenticated or hostile message."""


class PushRefusedError(PeerError):
    """A P rank answered a push with ``PushRefused``: it refused before posting any
    WRITE of it, so nothing of that push can land (an ``ErrorReply`` promises no such
    thing: P may have posted before it failed)."""


class IdentityError(PeerError):
    """A peer's engine id is not the one bound to its key (per-instance identities)."""


class PromptMismatch(PeerError):
    """A handle holds the KV of other prompt tokens than those D decodes from (a router
    mixed up two requests): refused before any byte moves."""


class LeaseExpired(KVBridgeError):
    """P no longer holds the blocks: bytes read under this lease are void."""
