"""User-facing configuration, ``c.GPUSnapshot.*``, shared by the server, provisioner and CLI.

Traits only: ``engines.make_engine`` turns them into an engine.
"""

from __future__ import annotations

import os

from traitlets import Bool, Float, Int, Unicode, default
from traitlets.config import Configurable

from ._constants import ENV_CRIU
from .core.store import default_key_file, default_store_dir


class GPUSnapshot(Configurable):
    """Settings of jupyter_gpu_snapshot. Each also reads an environment variable."""

    store_dir = Unicode(
        help="""Directory that holds the snapshots (mode 0700). Snapshots contain the whole
        memory of a kernel, secrets included, so keep it private and on a disk with room for
        them. Default: $JUPYTER_GPU_SNAPSHOT_DIR, else gpu_snapshots in the Jupyter data dir.""",
    ).tag(config=True)

    @default("store_dir")
    def _default_store_dir(self) -> str:
        return str(default_store_dir())

    signing_key_file = Unicode(
        help="""File holding the key that signs every snapshot's manifest (HMAC-SHA256). Only
        snapshots signed with it are listed as ok and restored, so keep it outside the store,
        private (mode 0600), and give every node that shares a store the same file. Created
        on first use. Default: $JUPYTER_GPU_SNAPSHOT_SIGNING_KEY_FILE, else
        gpu_snapshot_signing.key in the Jupyter data dir.""",
    ).tag(config=True)

    @default("signing_key_file")
    def _default_signing_key_file(self) -> str:
        return str(default_key_file())

    criu_path = Unicode(
        help="""The criu executable (name on PATH or absolute path); version 4.2 or newer.
        Default: $JUPYTER_GPU_SNAPSHOT_CRIU, else 'criu'.""",
    ).tag(config=True)

    @default("criu_path")
    def _default_criu_path(self) -> str:
        return os.environ.get(ENV_CRIU, "criu")

    cuda_lock_timeout = Float(
        10.0,
        help="""Seconds to wait for running CUDA work to finish when locking a kernel's CUDA
        state before a snapshot. When it passes, the snapshot is refused and the kernel keeps
        running untouched.""",
    ).tag(config=True)

    drop_allocator_caches = Bool(
        True,
        help="""Before suspending CUDA, release memory that PyTorch's caching allocator and
        CuPy's pools hold but do not use, when the kernel is idle. Images get several times
        smaller; live tensors are untouched.""",
    ).tag(config=True)

    keep_last = Int(
        0,
        help="""Keep only the newest N snapshots of each notebook (0 keeps all). Older ones are
        deleted after a new snapshot of that notebook is committed.""",
    ).tag(config=True)

    snapshot_on_shutdown = Bool(
        False,
        help="""When the server stops (SIGTERM, 'jupyter server stop', a node shutdown), snapshot
        every snapshot-ready kernel before shutting it down, so that it can be restored after
        the next start.""",
    ).tag(config=True)

    shutdown_budget = Float(
        120.0,
        help="""Seconds that snapshots on shutdown may take in all. Kernels not saved by then
        are shut down without a snapshot (and a warning is logged).""",
    ).tag(config=True)
