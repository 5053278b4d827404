"""Topology: which P rank serves which part of a D rank's cache (map: ``docs/structure.md``)."""

from kvbridge.topology.sources import Piece, layers_of_rank, sources

__all__ = ["Piece", "layers_of_rank", "sources"]
