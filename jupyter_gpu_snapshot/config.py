"""User-facing configuration, ``c.GPUSnapshot.*``, shared by the server, provisioner and CLI.

Traits only: ``engines.make_engine`` turns them into an engine.
"""

from __future__ import annotations

import os

from traitlets import Bool, Float, Int, Unicode, default
from traitlets.config import Configurable

from ._constants import ENV_CRIU
from .core.store import default_store_dir


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
        deleted after a new snapshot of that notebook is committed. Snapshots the user named
        are never deleted.""",
    ).tag(config=True)

    snapshot_on_shutdown = Bool(
        True,
        help="""When the server stops (SIGTERM, 'jupyter server stop', a node shutdown), snapshot
        the snapshot-ready kernels that ran something since their last snapshot before
        shutting them down, as many as fit in shutdown_budget.""",
    ).tag(config=True)

    shutdown_budget = Float(
        25.0,
        help="""Seconds that snapshots on shutdown may take in all. Each kernel's save time is
        estimated from its size and this machine's save rates; kernels whose save does not
        fit are shut down without one and keep their newest autosave (the log says so).
        The default fits Kubernetes' 30 s terminationGracePeriodSeconds; give the service
        manager budget + 10 s (docs/server.md).""",
    ).tag(config=True)

    autosave = Bool(
        True,
        help="""Snapshot snapshot-ready kernels on a schedule (autosave_interval_minutes,
        autosave_after_cell_minutes) so that an unplanned node loss costs at most one
        interval of work. A notebook can override it (%gpu_snapshot autosave).""",
    ).tag(config=True)

    autosave_interval_minutes = Float(
        15.0,
        help="""Autosave a kernel this many minutes after its last snapshot, provided it ran
        something since. An idle kernel is not saved again. Fractions are allowed.""",
    ).tag(config=True)

    autosave_after_cell_minutes = Float(
        10.0,
        help="""Autosave a kernel as soon as a cell that ran at least this many minutes ends
        (0 turns it off): long training cells are what people cannot afford to lose.""",
    ).tag(config=True)

    autosave_during_cell = Bool(
        False,
        help="""Let the interval autosave also happen while a cell runs. The save pauses
        the running cell for as long as the dump takes, as %gpu_snapshot save from a cell
        does. Off: a busy kernel is saved once its cell ends.""",
    ).tag(config=True)

    autosave_keep = Int(
        2,
        help="""Keep the newest N autosaves of each notebook. Older ones are deleted only
        once a newer autosave has committed; snapshots the user made are never touched.""",
    ).tag(config=True)

    autosave_min_free_bytes = Int(
        2 << 30,
        help="""Skip an autosave (and log why) when it would leave less than this many bytes
        free on the store's disk: a full disk can hang the machine.""",
    ).tag(config=True)

    autosave_max_bytes = Int(
        0,
        help="""Skip an autosave (and log why) when the autosaves in the store would take
        more than this many bytes once it commits (0: no cap but the free-disk margin).""",
    ).tag(config=True)

    autosave_check_seconds = Float(
        2.0,
        help="""How often the autosave scheduler looks at the kernels (seconds). Each look
        reads what the server already knows (no message to the kernels); it also decides
        how closely the length of a long cell is measured.""",
    ).tag(config=True)

    save_gpu_rate = Float(
        0.0,
        help="""Bytes per second at which the driver moves GPU memory to the host, for the
        shutdown's save-time estimates. 0: learn it from this machine's past saves, else
        use the measured 1.45e9.""",
    ).tag(config=True)

    save_image_rate = Float(
        0.0,
        help="""Bytes per second of writing and committing an image (criu dump plus
        checksums and fsync), for the shutdown's save-time estimates. 0: learn it from this
        machine's past saves, else use the measured 0.67e9.""",
    ).tag(config=True)

    save_fixed_seconds = Float(
        0.0,
        help="""Seconds every save costs whatever its size, for the shutdown's save-time
        estimates. 0: learn it from this machine's past saves, else use 1.5.""",
    ).tag(config=True)
