"""User-facing configuration, ``c.GPUSnapshot.*``, shared by the server, provisioner and CLI.

Traits only: ``local_engine.make_engine`` turns them into an engine.
"""

from __future__ import annotations

import os

from traitlets import Bool, Dict, Enum, Float, Int, List, Unicode, default
from traitlets.config import Configurable

from ._constants import (
    DEFAULT_LIBDIR,
    ENV_CHUNK_IMAGES,
    ENV_CRIU,
    ENV_GROW_GPU_ALLOCATORS,
    ENV_LIBDIR,
    ENV_REMOTE_KEY_FILE,
    ENV_REMOTE_URL,
)
from .agent_client.protocol import DEFAULT_SOCKET


class GPUSnapshot(Configurable):
    """Settings of jupyter_gpu_snapshot. Each also reads an environment variable."""

    store_dir = Unicode(
        help="""Directory that holds the snapshots (mode 0700). Snapshots contain the whole
        memory of a kernel, secrets included, so keep it private and on a disk with room for
        them. Default: $JUPYTER_GPU_SNAPSHOT_DIR, else gpu_snapshots in the Jupyter data dir.""",
    ).tag(config=True)

    @default("store_dir")
    def _default_store_dir(self) -> str:
        from .core.store import default_store_dir

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
        from .core.store import default_key_file

        return str(default_key_file())

    use_agent = Enum(
        ["auto", "always", "never"], default_value="auto",
        help="""Whether snapshots go through the node agent (``jupyter gpu-snapshot agent``,
        run by root once per node; see docs/cluster.md). ``auto``: when this process is not
        root and the agent's socket exists. ``always``: every save, restore and kernel launch
        goes through it. ``never``: this process runs criu itself (it must be root).
        Default: $JUPYTER_GPU_SNAPSHOT_USE_AGENT, else auto.""",
    ).tag(config=True)

    @default("use_agent")
    def _default_use_agent(self) -> str:
        value = os.environ.get("JUPYTER_GPU_SNAPSHOT_USE_AGENT", "auto")
        return value if value in ("auto", "always", "never") else "auto"

    agent_socket = Unicode(
        help="""The node agent's Unix socket. Default: $JUPYTER_GPU_SNAPSHOT_AGENT_SOCKET, else
        /run/jupyter-gpu-snapshot/agent.sock.""",
    ).tag(config=True)

    @default("agent_socket")
    def _default_agent_socket(self) -> str:
        return os.environ.get("JUPYTER_GPU_SNAPSHOT_AGENT_SOCKET", str(DEFAULT_SOCKET))

    def through_agent(self) -> bool:
        """Whether this process reaches the engine through the node agent."""
        if self.use_agent == "always":
            return True
        if self.use_agent == "never":
            return False
        return os.geteuid() != 0 and os.path.exists(self.agent_socket)

    criu_path = Unicode(
        help="""The criu executable (name on PATH or absolute path); version 4.2 or newer.
        Default: $JUPYTER_GPU_SNAPSHOT_CRIU, else 'criu'.""",
    ).tag(config=True)

    @default("criu_path")
    def _default_criu_path(self) -> str:
        return os.environ.get(ENV_CRIU, "criu")

    libdir = Unicode(
        help="""Directory holding CRIU's CUDA plugin, built for the criu in use
        (criu/cuda_plugin.so), and the cuda-checkpoint stand-in that lets the plugin call the
        driver through this process (bin/cuda-checkpoint); scripts/install-criu.sh installs
        both. Saving or restoring a kernel that holds CUDA state needs them. Default:
        $JUPYTER_GPU_SNAPSHOT_LIBDIR, else /usr/local/lib/jupyter-gpu-snapshot.""",
    ).tag(config=True)

    @default("libdir")
    def _default_libdir(self) -> str:
        return os.environ.get(ENV_LIBDIR, DEFAULT_LIBDIR)

    cuda_lock_timeout = Float(
        10.0,
        help="""Seconds to wait for running CUDA work to finish when locking a kernel's CUDA
        state before a snapshot. When it passes, the snapshot is refused and the kernel keeps
        running untouched.""",
    ).tag(config=True)

    timeline = Bool(
        False,
        help="""Start snapshot-ready kernels with a timeline: after each cell, copies of what
        it changed, so that the kernel can be rewound to before any cell (docs/rewind.md).
        Off by default: the copies stay in the kernel's memory (a deleted name keeps its
        value for a rewind) and every process snapshot carries them. In one kernel:
        %gpu_snapshot timeline on.""",
    ).tag(config=True)

    drop_allocator_caches = Bool(
        True,
        help="""Before suspending CUDA, release memory that PyTorch's caching allocator and
        CuPy's pools hold but do not use, when the kernel is idle. Images get several times
        smaller; live tensors are untouched.""",
    ).tag(config=True)

    grow_gpu_allocators = Bool(
        help="""Launch snapshot-ready kernels with XLA_PYTHON_CLIENT_PREALLOCATE=false and
        TF_FORCE_GPU_ALLOW_GROWTH=true, so that JAX and TensorFlow take GPU memory as their
        arrays need it. By default JAX reserves 75 % of the GPU at its first use and
        TensorFlow nearly all of it, and a save copies every reserved byte to host memory
        and disk: 72 MB of JAX arrays made a 67 GB image on an H100. Without preallocation
        JAX may fragment memory, run some workloads a little slower, and run out of memory
        later rather than at its start (docs/gpu.md, "Framework allocators"). A value the
        user set (the server's environment, the kernelspec's env, the env a kernel is
        started with) is never overridden. Applies to kernels started after it changes.
        Default: $JUPYTER_GPU_SNAPSHOT_GROW_GPU_ALLOCATORS (0/false/no/off turn it off),
        else True.""",
    ).tag(config=True)

    @default("grow_gpu_allocators")
    def _default_grow_gpu_allocators(self) -> bool:
        return _flag(ENV_GROW_GPU_ALLOCATORS)

    chunk_images = Bool(
        help="""Keep large image files by content: each 4 KiB page once per store, pages of
        zeros never, so that a save writes only the pages the store lacks (two saves of an
        inference kernel share most of their pages). Restores read the pages from the store
        through criu's image-streamer protocol, a few seconds slower than whole files. Off,
        saves write whole image files, as before. Applies to saves made after it changes;
        either kind of snapshot restores whatever its value. Default:
        $JUPYTER_GPU_SNAPSHOT_CHUNK_IMAGES (0/false/no/off turn it off), else True.""",
    ).tag(config=True)

    @default("chunk_images")
    def _default_chunk_images(self) -> bool:
        return _flag(ENV_CHUNK_IMAGES)

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
        more than this many bytes once it commits (0: no cap but the free-disk margin). An
        autosave counts what its save wrote: with chunk_images, the pages it did not share
        with earlier snapshots.""",
    ).tag(config=True)

    autosave_check_seconds = Float(
        2.0,
        help="""How often the autosave scheduler looks at the kernels (seconds). Each look
        reads what the server already knows (no message to the kernels); it also decides
        how closely the length of a long cell is measured.""",
    ).tag(config=True)

    hibernate_after_minutes = Float(
        0.0,
        help="""Hibernate a snapshot-ready kernel that has been idle this many minutes: save
        it, end its process so that its GPU and host memory are free, and keep its kernel
        id, session and notebook. The next message that needs it (a cell, a widget, a
        completion) restores it first. Idle: no cell running and no output for that long
        (and no client connected, with hibernate_only_without_clients). 0 turns it off.
        Fractions are allowed.""",
    ).tag(config=True)

    release_gpu_after_minutes = Float(
        10.0,
        help="""Release the GPU of a snapshot-ready kernel that has been idle this many
        minutes, keeping its process (hibernation's gpu tier): its GPU memory moves into
        its own host memory, its threads are held, and the GPU is free for others. The next
        message that needs it brings the memory back in seconds. Nothing is written to
        disk. Only kernels holding GPU memory are released; hibernate_after_minutes, when
        it comes first, saves the kernel to disk instead. 0 turns it off. A notebook's own
        choice (%gpu_snapshot hibernate gpu after 5m, or the JupyterLab sidebar) wins over
        this setting.""",
    ).tag(config=True)

    host_memory_low_percent = Float(
        10.0,
        help="""When the node's available host memory falls below this share of its total
        (in percent), kernels asleep in the gpu tier, whose GPU memory sits in their host
        memory, move to the process tier one at a time, least recently used first: each is
        written to disk as it sleeps (its GPU untouched) and its host memory is freed. A
        kernel asleep in the gpu tier also moves once it has been idle for
        hibernate_after_minutes. 0 turns the memory check off.""",
    ).tag(config=True)

    hibernate_min_gpu_bytes = Int(
        0,
        help="""Hibernate only idle kernels that hold at least this many bytes of GPU memory
        (0: any idle snapshot-ready kernel).""",
    ).tag(config=True)

    hibernate_only_without_clients = Bool(
        False,
        help="""Hibernate only idle kernels that no client (a browser tab, a console) is
        connected to. Off, a notebook left open in a browser overnight hibernates too.""",
    ).tag(config=True)

    portable_on = List(
        Unicode(),
        default_value=["hibernate"],
        help="""Saves that also write a portable copy of the kernel's namespace (what a
        restore falls back to when the image cannot come back: docs/fallback.md), by their
        reason: "hibernate" (a kernel hibernated to disk), "shutdown", "autosave". Such a
        copy waits at most portable_budget_seconds for a running cell to end; one that
        cannot be written is given up, and the save goes on without it (its manifest says
        so). A user's own request (%gpu_snapshot save --portable) waits for the cell.""",
    ).tag(config=True)

    portable_budget_seconds = Float(
        30.0,
        help="""Seconds a policy's portable copy (portable_on) waits for a running cell to
        end; past them the copy is given up and the save goes on without it.""",
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

    criu_timeout = Float(
        1800.0,
        help="""Seconds one run of criu (a save's dump, a restore) may take before it is killed
        and the operation fails, saying so; 0 for no limit. A deadline for a criu that hangs
        (a file of the kernel's on a file system that never answers), far above any run that
        works: a criu killed while it dumps can end the kernel.""",
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


def _flag(variable: str) -> bool:
    """A true/false environment variable that is true when unset."""
    value = os.environ.get(variable, "").strip().lower()
    if value in ("", "1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"${variable} is {value!r}: set it to true or false, or unset it")
