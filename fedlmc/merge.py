"""The merging API under one path: averages of aligned models (``fedlmc.averaging``) and universe
merges with projection back to each client (``fedlmc.universe``)."""
from .averaging import FORMS, circuit_state, interpolate, merge, unit_weighted, weighted_state
from .universe import project, universe_merge

__all__ = ["FORMS", "circuit_state", "interpolate", "merge", "project", "unit_weighted", "universe_merge",
           "weighted_state"]
