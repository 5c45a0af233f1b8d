"""Snapshot live Jupyter kernels, CUDA state included, and restore them later."""
from ._version import __version__

__all__ = ["__version__"]
