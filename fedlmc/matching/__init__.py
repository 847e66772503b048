"""Pairwise alignment: each method returns a ``Transform`` T with ``apply_transform(B, T)`` aligned to A."""

from fedlmc.matching.activation import activation_matching, residual_activation_cross
from fedlmc.matching.learned import learned_matching, relaxed_model
from fedlmc.matching.weight import weight_matching

__all__ = ["weight_matching", "activation_matching", "learned_matching", "relaxed_model", "residual_activation_cross"]
