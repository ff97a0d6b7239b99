"""Moved to :mod:`meshtron.hlo.order`; this name keeps working."""

from meshtron.hlo.order import UnorderedPair, unordered_collectives

__all__ = ["UnorderedPair", "unordered_collectives"]
