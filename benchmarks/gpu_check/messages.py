"""What the driver and the rank processes say to each other (pickled over pipes by the
rank-process harness, :mod:`refengine.processes`): one class per command, one per reply."""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.gpu_check.cases import Case, Request
from kvbridge.control.messages import RankInfo
from kvbridge.transport.ipc import Share

# --- set-up ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Setup:
    """Build this rank's layout, memory, NIXL agent and connector end for ``case``."""

    case: Case
    role: str
    rank: int
    gpu: bool
    secret: bytes
    shm_path: str = ""
    staging: int = 0
    """Bytes of the staging buffer."""


@dataclass(frozen=True, slots=True)
class Ready:
    """A rank's memory and agent: region ``bases``, its staging buffer's address, its
    agent's metadata, how peers of this node map its staging buffer (None: they cannot);
    P: its connector description (with its regions' shares)."""

    bases: tuple[int, ...]
    staging: int
    metadata: bytes
    staging_share: Share | None
    info: RankInfo | None = None


@dataclass(frozen=True, slots=True)
class Connect:
    """Every rank's :class:`Ready`, per role: add the peers, build the plans' geometry."""

    p: tuple[Ready, ...]
    d: tuple[Ready, ...]


@dataclass(frozen=True, slots=True)
class Teardown:
    """Close everything of the case (D before P: D unmaps P's memory first)."""


# --- one transfer --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fill:
    """P: write the pattern of ``seed`` into ``request``'s blocks."""

    request: Request
    seed: int


@dataclass(frozen=True, slots=True)
class FillStaging:
    """P: write the flat pattern of ``seed`` into the first ``nbytes`` of the staging buffer."""

    nbytes: int
    seed: int


@dataclass(frozen=True, slots=True)
class Verify:
    """D: compare ``request``'s blocks (``staging``: the first ``nbytes`` of the staging
    buffer, flat pattern) with the pattern of ``seed``."""

    request: Request
    seed: int
    staging: bool = False
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class Checked:
    bad: int
    """Words (staging: bytes) that differ."""
    nbytes: int
    """Bytes compared."""


@dataclass(frozen=True, slots=True)
class Run:
    """Time ``method`` on ``request`` (:data:`benchmarks.gpu_check.methods.METHODS`; the
    vLLM-like path: READ on a D rank, WRITE on a P rank)."""

    method: str
    request: Request
    seed: int
    nbytes: tuple[int, ...] = ()
    """Per D rank, the bytes of the request (the contiguous transfers move as many)."""


@dataclass(frozen=True, slots=True)
class Timing:
    """One rank's part of a timed transfer (``time.monotonic`` stamps: one clock for all
    processes of the machine)."""

    start: float
    end: float
    nbytes: int = 0
    descriptors: int = 0
    """Descriptors posted, or copy kernel calls."""
    plan_s: float = 0.0
    host_s: float = 0.0
    """Host work before the first copy or post: plan, choice of mover, grouping of runs."""
    detail: dict[str, object] = field(default_factory=dict)


# --- kvbridge's choice ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    """D: load ``handle`` (a :class:`~kvbridge.api.TransferHandle`'s bytes) into ``request``'s
    D blocks through the consumer; reply the outcome within ``timeout_s``."""

    handle: bytes
    request: Request
    timeout_s: float
    inline: bool = True
    """Let the consumer start the load on this thread (False: a worker does it all)."""
    nixl_only: bool = False
    """As between nodes: D maps none of P's memory (no kernel mover) and the connector
    chooses among its NIXL movers itself (AUTO: READ or WRITE as measured, direct or
    staged by its cost model)."""


@dataclass(frozen=True, slots=True)
class Prepare:
    """D: prepare the consumer for the P instance ``engine_id`` at ``endpoint`` before its
    first load (:meth:`~kvbridge.api.Consumer.prepare`); reply the seconds it took."""

    endpoint: str
    engine_id: str
    timeout_s: float


@dataclass(frozen=True, slots=True)
class CloseConnector:
    """Close the consumer (D: it unmaps P's memory) and the producer worker (P)."""


# --- the kernel mover's maps ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OpenMaps:
    """D: map P's regions (its ranks' shares) and P rank 0's staging buffer."""

    infos: tuple[RankInfo, ...]
    staging: Share | None


@dataclass(frozen=True, slots=True)
class CloseMaps:
    """D: unmap what :class:`OpenMaps` mapped."""


# --- the vLLM-like path --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VllmOpen:
    """A raw agent with ``threads`` UCX worker threads over this rank's regions; replies
    its metadata."""

    threads: int


@dataclass(frozen=True, slots=True)
class VllmConnect:
    """Add the other role's agents (metadata per rank) and prepare the lists."""

    p: tuple[bytes, ...]
    d: tuple[bytes, ...]


@dataclass(frozen=True, slots=True)
class VllmClose:
    pass


# --- what the run reports besides times ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TritonFacts:
    """D: whether the fused Triton copy kernel ran in this process (or torch took over)."""


@dataclass(frozen=True, slots=True)
class LateFill:
    """P: write the pattern of ``seed`` into ``request``'s blocks late, as an engine whose
    KV write is still running: on the GPU after a ``delay_s`` sleep kernel on a side
    stream (an event recorded after it), on the CPU by a thread that starts once told
    (:class:`Written` or :class:`LateJoin`). Replies at once (:mod:`.ordering`)."""

    request: Request
    seed: int
    delay_s: float


@dataclass(frozen=True, slots=True)
class Written:
    """P: ``ProducerWorker.written(event)`` on the late write's event (the library's rule
    before a handle leaves P); replies once it returned."""

    timeout_s: float


@dataclass(frozen=True, slots=True)
class LateJoin:
    """P: wait for the late write to end (the CPU thread: start it first); replies whether
    it was still running when this arrived."""

    timeout_s: float
