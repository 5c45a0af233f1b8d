"""Snapshot live Jupyter kernels, CUDA state included, and restore them later."""
from typing import Any

from ._version import __version__

__all__ = ["__version__", "load_ipython_extension"]


def load_ipython_extension(ipython: Any) -> None:
    """Called by IPython for ``%load_ext jupyter_gpu_snapshot``, and by snapshot-ready
    kernels at start (their kernelspec passes ``--ext``): registers ``%gpu_snapshot``.

    It must never break or slow a kernel: it imports only IPython and the standard library
    (the widget's ipywidgets come later, when asked for) and does no network call.
    """
    try:
        from .kernel.magics import load
    except Exception as exc:  # a kernel must start even if we cannot load
        print(f"jupyter_gpu_snapshot: %gpu_snapshot is unavailable: {exc}")
        return
    load(ipython)


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    """Called by jupyter_server when it finds the extension enabled in its config.

    The server code is imported only here, never when a kernel imports the package.
    """
    from .server import GPUSnapshotApp

    return [{"module": "jupyter_gpu_snapshot.server", "app": GPUSnapshotApp}]
