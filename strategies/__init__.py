"""Deprecated path: the strategies live in ``fedlmc.strategies``.

A Flower app often has its own ``strategies`` module or package, which would shadow this one; import
from ``fedlmc.strategies`` instead (``from fedlmc.strategies import AlignedFedAvg``)."""
import warnings

from fedlmc.strategies import *  # noqa: F401,F403
from fedlmc.strategies import __all__  # noqa: F401

warnings.warn("`strategies` is deprecated: import from `fedlmc.strategies`", DeprecationWarning, stacklevel=2)
