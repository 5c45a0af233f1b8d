"""User-facing configuration, ``c.GPUSnapshot.*``, shared by the server, provisioner and CLI.

Traits only: ``engines.make_engine`` turns them into an engine.
"""

from __future__ import annotations

import os

from traitlets import Bool, Dict, Enum, Float, Int, Unicode, default
from traitlets.config import Configurable

from ._constants import ENV_CRIU, ENV_REMOTE_KEY_FILE, ENV_REMOTE_URL
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

    remote_url = Unicode(
        help="""Where snapshots are also kept, for other nodes: any fsspec URL, e.g.
        s3://bucket/prefix (through s3fs), gs://bucket/prefix, or a shared-filesystem path.
        Empty (the default) keeps snapshots on this node only. The local store_dir stays
        where snapshots are saved and restored from, and caches downloaded ones.
        Default: $JUPYTER_GPU_SNAPSHOT_REMOTE_URL, else empty.""",
    ).tag(config=True)

    @default("remote_url")
    def _default_remote_url(self) -> str:
        return os.environ.get(ENV_REMOTE_URL, "")

    remote_endpoint_url = Unicode(
        "",
        help="""For S3-compatible servers (MinIO, SeaweedFS, Ceph...): the endpoint URL, e.g.
        http://minio.internal:9000. Empty uses AWS, or $AWS_ENDPOINT_URL. Credentials come
        from the usual AWS chain (environment, ~/.aws, instance or pod roles).""",
    ).tag(config=True)

    remote_options = Dict(
        help="""Extra fsspec storage options for remote_url, passed to the filesystem as they
        are (for s3fs e.g. {"profile": "snapshots"} or {"client_kwargs": {"region_name":
        "eu-west-1"}}). Prefer the credential chain to putting secrets here.""",
    ).tag(config=True)

    remote_encryption_key_file = Unicode(
        help="""A file holding a 256-bit key (32 raw bytes or 64 hex digits, mode 0600). When
        set, snapshots are encrypted with AES-256-GCM before they leave this node, and nodes
        need the same key to download them. Snapshots hold the whole memory of a kernel,
        secrets included: set this for any store that others can read.
        Default: $JUPYTER_GPU_SNAPSHOT_REMOTE_KEY_FILE, else none.""",
    ).tag(config=True)

    @default("remote_encryption_key_file")
    def _default_remote_encryption_key_file(self) -> str:
        return os.environ.get(ENV_REMOTE_KEY_FILE, "")

    remote_cache_max_bytes = Int(
        0,
        help="""Cap on the bytes of snapshots kept in store_dir when a remote store is set
        (0: no cap). Past it, the least recently used snapshots that also exist remotely are
        removed locally; snapshots that exist only here, or are in use, are never removed.""",
    ).tag(config=True)

    remote_part_bytes = Int(
        16 << 20,
        help="""Size of each part of a multipart upload, in bytes (at least 5 MiB on S3).
        Parts go up remote_workers at a time.""",
    ).tag(config=True)

    remote_workers = Int(
        8,
        help="""Parallel transfers per upload or download. Memory used is about
        remote_workers x remote_part_bytes.""",
    ).tag(config=True)

    adopt_orphaned_kernels = Bool(
        True,
        help="""At start, take back the snapshot-ready kernels that a server killed earlier
        (SIGKILL, a crash) left running on this runtime dir: the same kernel ids and the same
        notebook sessions, no snapshot involved. The server keeps a record of its kernels for
        this in the runtime dir (gpu_snapshot/servers, mode 0600).""",
    ).tag(config=True)

    ghost_limit = Int(
        1 << 20,
        help="""Bytes up to which criu carries the content of a file the kernel holds open but
        that was deleted (criu's --ghost-limit). A save of a kernel holding a larger one is
        refused before the kernel is touched, naming the file.""",
    ).tag(config=True)

    changed_files = Enum(
        ["refuse", "warn"],
        "refuse",
        help="""What a restore does when a file the kernel had open read-only or mapped
        (recorded at the save: size, mtime, and sha256 of small files) changed since: 'refuse'
        (the default) names the files and restores nothing; 'warn' restores with a warning,
        and the kernel reads the new content.""",
    ).tag(config=True)
