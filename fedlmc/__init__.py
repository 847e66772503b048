"""fedlmc: federated learning of Transformers, merged modulo their symmetries.

The library has no Flower import; ``strategies/``, ``clients/`` and ``simulations/`` build on it.
"""

from .io import load, read_meta, save

__version__ = "0.1.0"
__all__ = ["save", "load", "read_meta", "__version__"]
