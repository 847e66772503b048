"""Flower strategies (Message API) that aggregate client Transformers modulo their symmetries."""
from .aligned import AlignedFedAvg

__all__ = ["AlignedFedAvg"]
