"""The server extension's objects, each made once and complete, in one place.

``build_server_parts`` is called by ``GPUSnapshotApp.initialize_settings`` when the server
loads the extension. It makes every object with what it needs, in an order without loops,
and sets nothing on any of them afterwards:

- the settings, the engine (its recovery of what a killed server left), this node's
  snapshots with the remote store of ``c.GPUSnapshot.remote_url``;
- the job runner, the server's kernel slots, hibernation's registry of sleeping kernels
  (``Sleepers``) and the record of kernel deaths, which the service reads;
- the service, the autosave scheduler, hibernation (which changes ``Sleepers``), the
  kernels' timelines (their rewinds), and the record of this server's kernels for adoption
  by a later server.

It registers the extension's events and the listeners of jupyter_server's kernel_actions
and contents events (a renamed notebook keeps its snapshots: ``notebook_renames``). The
app keeps the one ``ServerParts`` it returns, and starts, routes to and stops what it holds.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jupyter_server.serverapp import ServerApp

from ..config import GPUSnapshot
from ..core.errors import SnapshotError
from ..node.engine import NodeEngine, RecoveryReport
from ..node.local_engine import process_engine
from ..node.notebook_moves import NotebookMoves
from ..node.remotes import RemoteStore, make_remote_store
from ..node.snapshots import NodeSnapshots
from .adoption import KernelRecord
from .autosave import AutosaveScheduler
from .deaths import KERNEL_ACTIONS_EVENT_ID, KernelDeath, KernelDeaths
from .hibernation import Hibernation
from .hibernation_policy import HibernationPolicy
from .jobs import Job, JobRunner
from .kernel_slots import KernelSlots
from .notebook_policies import policy_key
from .notebook_renames import CONTENTS_EVENT_ID, NotebookRenames
from .remote_sync import RemoteSync
from .service import SnapshotService
from .sleepers import Sleepers
from .status import newest_once_saved
from .timelines import KernelTimelines
from .wake_notes import drop_wake_notes

EVENT_SCHEMA = Path(__file__).parent / "event_schemas" / "job-v1.yaml"
JOB_EVENT_ID = "https://events.jupyter.org/jupyter_gpu_snapshot/job/v1"
DEATH_EVENT_SCHEMA = Path(__file__).parent / "event_schemas" / "kernel-death-v1.yaml"
DEATH_EVENT_ID = "https://events.jupyter.org/jupyter_gpu_snapshot/kernel-death/v1"
HIBERNATION_EVENT_SCHEMA = Path(__file__).parent / "event_schemas" / "hibernation-v1.yaml"
HIBERNATION_EVENT_ID = "https://events.jupyter.org/jupyter_gpu_snapshot/hibernation/v1"
SNAPSHOTS_EVENT_SCHEMA = Path(__file__).parent / "event_schemas" / "snapshots-v1.yaml"
SNAPSHOTS_EVENT_ID = "https://events.jupyter.org/jupyter_gpu_snapshot/snapshots/v1"
REWIND_EVENT_SCHEMA = Path(__file__).parent / "event_schemas" / "rewind-v1.yaml"
REWIND_EVENT_ID = "https://events.jupyter.org/jupyter_gpu_snapshot/rewind/v1"
# What the operator may set for kernels' provisioners themselves; it wins over the app's.
PROVISIONER_OVERRIDES = ("server_url", "server_token")


@dataclass(frozen=True)
class ServerParts:
    """Everything the extension made when the server loaded it (``build_server_parts``)."""

    settings: GPUSnapshot
    node: NodeSnapshots
    jobs: JobRunner
    slots: KernelSlots
    sleepers: Sleepers
    deaths: KernelDeaths
    service: SnapshotService
    autosave: AutosaveScheduler
    hibernation: Hibernation
    # The kernels' timelines and their rewinds.
    timelines: KernelTimelines
    # With c.GPUSnapshot.adopt_orphaned_kernels: this server's kernels, as a server that
    # starts after this one was killed finds them.
    kernel_record: KernelRecord | None
    # Derives each kernel's credential; made per server start, kept in this process only.
    kernel_token_secret: str
    # c.SnapshotReadyProvisioner.server_url/server_token as the operator configured them,
    # read before the app hands its own values to the kernel manager's config.
    provisioner_overrides: Mapping[str, str]


def build_server_parts(
    serverapp: ServerApp, config_parent: Any, log: logging.Logger
) -> ServerParts:
    """Make the extension's objects for ``serverapp``; ``config_parent`` (the app) is where
    ``c.GPUSnapshot`` is read from."""
    settings = GPUSnapshot(parent=config_parent)
    configured = serverapp.config.get("SnapshotReadyProvisioner", {})
    provisioner_overrides = {
        k: v for k, v in configured.items() if k in PROVISIONER_OVERRIDES
    }
    engine = process_engine(settings)
    # Through the agent, the agent recovers the user's store; this one holds no snapshot.
    recovery = engine.recover()
    recovered = _log_recovery(recovery, log) if recovery is not None else []
    # A renamed notebook takes its snapshots along (``notebook_renames``).
    node = NodeSnapshots(engine, _remote_store(engine, settings, log),
                         int(settings.remote_cache_max_bytes), NotebookMoves(engine.own_dir))
    event_logger = serverapp.event_logger
    assert event_logger is not None
    event_logger.register_event_schema(EVENT_SCHEMA)
    event_logger.register_event_schema(DEATH_EVENT_SCHEMA)
    event_logger.register_event_schema(HIBERNATION_EVENT_SCHEMA)
    event_logger.register_event_schema(SNAPSHOTS_EVENT_SCHEMA)
    event_logger.register_event_schema(REWIND_EVENT_SCHEMA)

    def emit_job(job: Job) -> None:
        # Jobs start once the server runs, after this function has returned: the autosave
        # scheduler made below is there by then.
        if job.kind in ("restore", "wake") and job.status == "succeeded":
            autosave.note_restored(str(job.kernel_id))
        event_logger.emit(schema_id=JOB_EVENT_ID, data=job.to_dict())

    def emit_death(kernel_id: str, death: KernelDeath) -> None:
        event_logger.emit(
            schema_id=DEATH_EVENT_ID, data={"kernel_id": kernel_id, **death.to_dict()}
        )

    def emit_hibernation(data: dict[str, object]) -> None:
        event_logger.emit(schema_id=HIBERNATION_EVENT_ID, data=data)

    def emit_listing_changed(data: dict[str, Any]) -> None:
        event_logger.emit(schema_id=SNAPSHOTS_EVENT_ID, data=data)

    def emit_rewound(data: dict[str, Any]) -> None:
        event_logger.emit(schema_id=REWIND_EVENT_ID, data=data)

    jobs = JobRunner(on_change=emit_job, log=log)
    slots = KernelSlots(
        serverapp.kernel_manager, serverapp.session_manager, serverapp.contents_manager,
        serverapp.kernel_spec_manager, log,
    )
    sleepers = Sleepers(jobs)
    # Every kernel that starts from now on is followed (restored and adopted ones too),
    # through jupyter_server's own kernel_actions events.
    deaths = KernelDeaths(
        serverapp.kernel_manager, newest_once_saved(jobs, node.list), slots.notebook_path,
        log, on_death=emit_death,
    )
    service = SnapshotService(
        node,
        settings,
        slots=slots,
        jobs=jobs,
        deaths=deaths,
        sleepers=sleepers,
        log=log,
        remote=RemoteSync(node, log=log) if node.remote is not None else None,
        listing_changed=emit_listing_changed,
    )
    if service.remote is not None:
        # Saves that a killed server left committed here never uploaded: they owe it.
        for snapshot_id in recovered:
            service.remote.pending.mark(snapshot_id)
    autosave = AutosaveScheduler(service, settings, log=log)

    async def notebook_policy(kernel_id: str) -> HibernationPolicy:
        """The policy of the kernel's notebook: its own choices over the server's settings."""
        notebook = await slots.notebook_path(kernel_id)
        return autosave.policies.policy(policy_key(kernel_id, notebook))

    async def hibernate_after(kernel_id: str) -> float:
        """Minutes of idleness after which the kernel hibernates in the process tier."""
        return (await notebook_policy(kernel_id)).hibernate_after_minutes

    async def release_gpu_after(kernel_id: str) -> float:
        """Minutes of idleness after which the kernel releases its GPU (the gpu tier)."""
        return (await notebook_policy(kernel_id)).release_gpu_after_minutes

    hibernation = Hibernation(
        service, sleepers, settings, log=log, emit=emit_hibernation,
        hibernate_after=hibernate_after, release_gpu_after=release_gpu_after,
    )
    for listener in (autosave.on_kernel_action, hibernation.on_kernel_action,
                     deaths.on_kernel_action):
        event_logger.add_listener(
            modified=False, schema_id=KERNEL_ACTIONS_EVENT_ID, listener=listener,
        )
    contents: Any = serverapp.contents_manager
    if hasattr(contents, "register_pre_save_hook"):
        contents.register_pre_save_hook(drop_wake_notes)
    renames = NotebookRenames(node.moves, autosave.policies, log, emit_listing_changed)
    event_logger.add_listener(
        modified=False, schema_id=CONTENTS_EVENT_ID, listener=renames.on_contents_action,
    )
    # Made now, before the server takes requests: it records each kernel as it starts,
    # before the start is answered.
    kernel_record = (
        KernelRecord(serverapp.kernel_manager, serverapp.session_manager, log)
        if settings.adopt_orphaned_kernels else None
    )
    return ServerParts(
        settings=settings,
        node=node,
        jobs=jobs,
        slots=slots,
        sleepers=sleepers,
        deaths=deaths,
        service=service,
        autosave=autosave,
        hibernation=hibernation,
        timelines=KernelTimelines(service, rewound=emit_rewound, log=log),
        kernel_record=kernel_record,
        kernel_token_secret=secrets.token_hex(32),
        provisioner_overrides=provisioner_overrides,
    )


def _remote_store(
    engine: NodeEngine, settings: GPUSnapshot, log: logging.Logger
) -> RemoteStore | None:
    """The remote store of ``c.GPUSnapshot.remote_url``, or None (none set, or unusable:
    then the server runs with local snapshots only and says why)."""
    if engine.local_store is None:
        if settings.remote_url:
            log.error(
                "gpu-snapshot: snapshots go through the node agent, which keeps them on "
                "this node: c.GPUSnapshot.remote_url (%s) is not used", settings.remote_url)
        return None
    try:
        remote = make_remote_store(settings)
    except (SnapshotError, ImportError, ValueError, OSError) as exc:
        log.error(
            "gpu-snapshot: the remote store %s cannot be used, snapshots stay on this "
            "node: %s", settings.remote_url, exc,
        )
        return None
    if remote is None:
        return None
    log.info("gpu-snapshot: snapshots are uploaded to %s%s", remote.url,
             ", encrypted" if remote.key else "")
    return remote


def _log_recovery(report: RecoveryReport, log: logging.Logger) -> list[str]:
    """Say what the engine's recovery did with what saves killed with an earlier server
    left (see ``core.recovery``); returns the ids of the snapshots it committed."""
    for snapshot in report.committed:
        log.warning(
            "gpu-snapshot: committed snapshot %s (%s), whose save was killed after its "
            "dump completed", snapshot.name, snapshot.id,
        )
    for path, why in report.kept:
        log.error("gpu-snapshot: kept %s aside: %s; delete it by hand", path, why)
    for pid in report.woken:
        log.info("gpu-snapshot: woke kernel tree %s after an interrupted save", pid)
    for path in report.removed:
        log.info("gpu-snapshot: removed stale working directory %s", path)
    return [snapshot.id for snapshot in report.committed]
