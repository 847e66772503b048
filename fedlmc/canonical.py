"""The canonical form (LayerNorm → parameter-free RMSNorm, exact) and back: ``fedlmc.symmetry.canonical``
under its short public path."""
from .symmetry.canonical import canonicalize, residual_offcentre, to_layernorm

__all__ = ["canonicalize", "residual_offcentre", "to_layernorm"]
