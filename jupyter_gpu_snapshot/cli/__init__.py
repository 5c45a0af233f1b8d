"""``jupyter gpu-snapshot``: the command line (``main``) and its machine checks (``checks``)."""

from .main import main

__all__ = ["main"]
