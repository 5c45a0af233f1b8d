"""``jupyter gpu-snapshot``: the command table (``main``) and the commands, each module
imported only when one of its commands runs."""

from .main import main

__all__ = ["main"]
