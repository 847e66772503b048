"""One vocabulary for the three ways to combine models, the same in the API, the CLI, run_config,
strategy histories and results: ``average`` (plain, coordinate-wise), ``aligned`` (weight matching to a
universe, then averaged) and ``refined`` (aligned, plus Dirichlet refinement). Older names are
accepted for one release, with a ``DeprecationWarning``."""
from __future__ import annotations

import warnings
from typing import Iterable

ALIASES = {"fedavg": "average", "vanilla": "average", "plain": "average", "wm": "aligned", "universe": "aligned",
           "refine": "refined", "dirichlet": "refined"}


def method_name(name: str, allowed: Iterable[str], what: str = "method") -> str:
    """``name`` in the current vocabulary (a deprecated alias is translated, with a warning); a clear
    error for anything not in ``allowed``."""
    allowed = tuple(allowed)
    new = ALIASES.get(name, name) if name not in allowed else name
    if new not in allowed:
        raise ValueError(f"unknown {what} {name!r}; choose one of {', '.join(allowed)}")
    if new != name:
        warnings.warn(f"{what} {name!r} is deprecated: use {new!r}", DeprecationWarning, stacklevel=3)
    return new
