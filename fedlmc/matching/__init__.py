"""Pairwise alignment: each method returns a ``Transform`` T with ``apply_transform(B, T)`` aligned to A."""
from .weight import weight_matching

__all__ = ["weight_matching"]
