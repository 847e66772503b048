"""fedlmc: federated learning of Transformers, merged modulo their symmetries.

Symmetries, matching, universes and training import no Flower (``tests/test_layers.py``: a GPU
machine with only torch's stack runs them); ``fedlmc.strategies`` and the apps in ``strategies/``,
``clients/`` and ``simulations/`` build on Flower.
"""

from fedlmc.io import load, read_meta, save

__version__ = "0.1.0"
__all__ = ["save", "load", "read_meta", "__version__"]
