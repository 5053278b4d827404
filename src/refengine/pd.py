"""Disaggregated serving with the reference engine: a P instance, a D instance, a router.

Each instance is a set of rank processes (their caches and NIXL agents live there) and,
in this process, its kvbridge endpoint: P's coordinator (:class:`Producer`: handshakes
and leases) or D's way to its rank consumers.

    Router.generate(prompt)
      │ PrefillServer.prefill ─► engine prefill ─► Producer.prefill_done ─► TransferHandle
      │                                                  (first token in its payload)
      │ DecodeServer.decode(handle bytes)
      │   reserve blocks ─► LoadKV on every D rank ─► AwaitKV on every D rank
      │   all ranks ok:  start_decode(first token) ─► decode
      │   any rank failed (policy recompute): prefill on D from scratch ─► decode
      └ PrefillServer.release ─► P frees the blocks once D is done (or on abort)
"""

from __future__ import annotations

import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvbridge.adapter import (
    LoadJob,
    decode_handle,
    edge_tables,
    encode_handle,
    failure,
    summed,
)
from kvbridge.api import (
    Mode,
    Outcome,
    PeerError,
    Policy,
    Producer,
    PromptMismatch,
    SideConfig,
    TransferHandle,
)
from refengine.config import ModelConfig
from refengine.errors import EngineError
from refengine.instance import Instance
from refengine.messages import (
    AwaitKV,
    ConsumeKV,
    KVInfo,
    Loaded,
    LoadKV,
    Prepared,
    PrepareKV,
    ServeKV,
)

HANDSHAKE_SLACK_S = 15.0
"""Added to the transfer deadline when waiting for a load: handshake and lease calls."""
_TOKEN = struct.Struct("<I")


def _instance(side: SideConfig, model: str | ModelConfig, timeout_s: float) -> Instance:
    """The engine instance, one process per rank (even at TP 1: NIXL needs the agent in
    the process that owns the cache)."""
    return Instance(model, side=side, processes=True, timeout_s=timeout_s)


@dataclass(frozen=True, slots=True)
class Decoded:
    """A request's result on D: ``tokens`` (P's first token, then D's), what moved
    (bytes and descriptors summed over D ranks, seconds of the slowest D rank), and
    whether D recomputed the prompt because the transfer failed (``error`` says why)."""

    tokens: list[int]
    bytes: int
    descriptors: int
    seconds: float
    recomputed: bool = False
    error: str = ""


class PrefillServer:
    """A P instance: rank processes serving their caches, and the P coordinator."""

    def __init__(
        self,
        model: str | ModelConfig,
        side: SideConfig,
        secret: bytes,
        lease_s: float = 30.0,
        timeout_s: float = 60.0,
        host: str = "127.0.0.1",
        advertise: str = "",
    ) -> None:
        """``host``: where P's side channels (coordinator and push) bind; ``advertise``:
        the address D connects to, if not ``host`` (D on another machine)."""
        self.engine_id = f"P-{secrets.token_hex(4)}"
        self.engine = _instance(side, model, timeout_s)
        self.producer: Producer | None = None
        self.host, self.advertise, self.netns = host, advertise, side.netns
        try:
            self.producer = self._producer(secret, lease_s)
        except BaseException:
            self.close()
            raise

    def _producer(self, secret: bytes, lease_s: float) -> Producer:
        spec, par = self.engine.spec, self.engine.parallel

        def make() -> Producer:
            return Producer(
                self.engine_id, spec, par, secret, lease_s, self.host, advertise=self.advertise
            )

        if self.netns:
            from refengine.netns import in_netns

            producer = in_netns(self.netns, make)
        else:
            producer = make()
        try:
            serve = ServeKV(self.engine_id, secret, self.host, self.advertise)
            for reply in self.engine.call_ranks(serve):
                assert isinstance(reply, KVInfo), reply
                producer.add_rank(reply.info)
        except BaseException:
            producer.close()
            raise
        return producer

    def prefill(self, req_id: str, prompt: Sequence[int]) -> TransferHandle:
        """Compute the prompt and hold its blocks under a lease; → the handle for D.
        First frees what leases ended since (a D rank confirms after its outcome)."""
        self._free_ended()
        pre = self.engine.prefill(req_id, prompt)
        tables = [list(t) for t in pre.tables]
        payload = _TOKEN.pack(pre.first_token)
        return self._coordinator().prefill_done(req_id, tables, pre.n_tokens, payload, prompt)

    def release(self, req_id: str) -> None:
        """D is finished with ``req_id`` (or gave up): end its lease, free what P may."""
        self._coordinator().abort(req_id)  # no-op when every D rank has already reported
        self._free_ended()

    def _free_ended(self) -> None:
        """Free the blocks of the requests whose leases ended (a D rank still reading an
        aborted request keeps them until it reports: :mod:`kvbridge.control.lease`)."""
        for freed in self._coordinator().freed():
            self.engine.free(freed.request_id)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        self.engine.close()

    def _coordinator(self) -> Producer:
        if self.producer is None:
            raise EngineError(f"{self.engine_id} is closed")
        return self.producer


class DecodeServer:
    """A D instance: rank processes, each with a kvbridge consumer over its cache."""

    def __init__(
        self,
        model: str | ModelConfig,
        side: SideConfig,
        secret: bytes,
        mode: Mode = Mode.PULL,
        transfer_timeout_s: float = 10.0,
        policy: Policy = Policy.RECOMPUTE,
    ) -> None:
        self.engine_id = f"D-{secrets.token_hex(4)}"
        self.policy = policy
        self.await_s = transfer_timeout_s + HANDSHAKE_SLACK_S
        self.engine = _instance(side, model, self.await_s + 30.0)
        try:
            cmd = ConsumeKV(self.engine_id, secret, mode, transfer_timeout_s, policy)
            self.engine.call_ranks(cmd)
        except BaseException:
            self.engine.close()
            raise

    def prepare(self, endpoint: str, engine_id: str) -> list[str]:
        """Every D rank connects to the P instance ``engine_id`` at ``endpoint`` now, not
        in its first request (:meth:`kvbridge.api.Consumer.prepare`) → per rank that
        could not, why (its first request then connects itself)."""
        replies = self.engine.call_ranks(PrepareKV(endpoint, engine_id, self.await_s))
        return [r.error for r in replies if isinstance(r, Prepared) and r.error]

    def decode(
        self, req_id: str, prompt: Sequence[int], handle: bytes, n_new: int, n_cached: int = 0
    ) -> Decoded:
        """``n_new`` tokens of ``prompt`` (the first one from P's handle); the KV of tokens
        ``[n_cached, len(prompt))`` comes from P, the first ``n_cached`` are computed here."""
        h = decode_handle(handle)
        if h.request_id != req_id or h.n_tokens != len(prompt):
            raise PeerError(
                f"handle is for {h.request_id!r} ({h.n_tokens} tokens), "
                f"not {req_id!r} ({len(prompt)} tokens)"
            )
        tables = self.engine.reserve(req_id, prompt, n_cached)
        try:
            out = summed(req_id, self._load(req_id, prompt, h, tables, n_cached))
            moved = out.bytes, out.descriptors, out.seconds
            if out.ok:
                self.engine.start_decode(req_id, _first_token(h))
                tokens = [_first_token(h), *self.engine.decode(req_id, n_new - 1)]
                return Decoded(tokens, *moved)
            if out.action is Policy.FAIL:
                raise EngineError(f"transfer of {req_id!r} failed: {out.error}")
            return Decoded(self._recompute(req_id, prompt, n_new), *moved, True, out.error)
        finally:
            self.engine.free(req_id)

    def close(self) -> None:
        self.engine.close()

    def _load(
        self,
        req_id: str,
        prompt: Sequence[int],
        handle: TransferHandle,
        tables: list[list[int]],
        n_cached: int,
    ) -> list[Outcome]:
        """Every D rank's outcome; a handle of another prompt fails on every rank before
        any is asked to load (nothing reaches P), and the policy decides as for any failure."""
        try:  # only a mismatch is the load's failure; other bad input raises, typed
            handle.check_prompt(prompt)
            refused = ""
        except PromptMismatch as e:
            refused = str(e)
        limits = (self.engine.side.num_blocks,) * len(tables)
        tabs = edge_tables(tables, limits, "D's block tables")  # bad ids: that load fails
        job = LoadJob(req_id, encode_handle(handle), tabs, n_cached, refused)
        if job.refused:
            return [failure(req_id, PromptMismatch(job.refused), self.policy)] * self.engine.world
        self.engine.call_ranks(LoadKV(job))
        replies = self.engine.call_ranks(AwaitKV(req_id, self.await_s))
        return [r.outcome for r in replies if isinstance(r, Loaded)]

    def _recompute(self, req_id: str, prompt: Sequence[int], n_new: int) -> list[int]:
        """The transfer failed: compute the prompt on D from scratch, then decode."""
        self.engine.free(req_id)
        first = self.engine.prefill(req_id, prompt).first_token
        return [first, *self.engine.decode(req_id, n_new - 1)]


class Router:
    """Sends a prompt to P, forwards P's handle (as bytes) to D, returns D's result."""

    def __init__(self, prefill: PrefillServer, decode: DecodeServer) -> None:
        self.prefill, self.decode = prefill, decode

    def generate(
        self, req_id: str, prompt: Sequence[int], n_new: int, n_cached: int = 0
    ) -> Decoded:
        handle = self.prefill.prefill(req_id, prompt).to_bytes()
        try:
            return self.decode.decode(req_id, prompt, handle, n_new, n_cached)
        finally:
            self.prefill.release(req_id)


def _first_token(handle: TransferHandle) -> int:
    if len(handle.payload) != _TOKEN.size:
        raise PeerError(f"handle payload is {len(handle.payload)} B, expected {_TOKEN.size}")
    return int(_TOKEN.unpack(handle.payload)[0])
