"""Whether the criu the tests run fills restored memory on several CPUs (our patches), as
the install's note says (``core.criu_build``): make test runs the restore path's tests on
our criu and again on stock criu (make test-stock-criu), which must restore the same."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from jupyter_gpu_snapshot._constants import DEFAULT_LIBDIR, ENV_LIBDIR
from jupyter_gpu_snapshot.core.criu_build import describe_fill


def criu_fills_on_workers() -> bool:
    """For the criu on PATH with the plugin directory of $JUPYTER_GPU_SNAPSHOT_LIBDIR."""
    criu = shutil.which("criu")
    assert criu, "criu is not installed"
    libdir = Path(os.environ.get(ENV_LIBDIR, DEFAULT_LIBDIR))
    return describe_fill(Path(criu), libdir / "criu").fast is True
