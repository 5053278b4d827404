"""Topology: which P rank serves which part of a D rank's cache (map: ``docs/structure.md``)."""

from kvbridge.topology.sources import Piece, sources

__all__ = ["Piece", "sources"]
