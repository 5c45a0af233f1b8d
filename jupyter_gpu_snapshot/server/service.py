"""What the REST API does: the engine, applied to the server's kernels and sessions.

Handlers call this and nothing else; it raises only the core's errors (``InvalidRequest``,
``NotFound``, ``Busy``, ``NotReady``, ``SnapshotError``), which the handlers map to HTTP
statuses in one place.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
import queue
import shutil
import time
import uuid
from collections.abc import Collection
from typing import Any

from jupyter_core.utils import ensure_async
from tornado import web

from .._constants import KERNEL_NAME, PROVISIONER_NAME
from ..config import GPUSnapshot
from ..core import procfs, retention
from ..core.engine import RestoredKernel, SaveTarget, SnapshotEngine
from ..core.errors import (
    Busy,
    InvalidRequest,
    NotFound,
    NotReady,
    PortsInUse,
    SnapshotError,
)
from ..core.store import Snapshot, validate_name
from ..launch.provisioner import ADOPT_KWARG, Adoption, root_pid
from .jobs import Job, JobRunner
from .kernel_env import refresh_kernel_env
from .status import TreeFacts, cuda_status
from .status import kernel_status as describe_kernel

# How long a save waits for a kernel that is still starting to answer.
KERNEL_ANSWER_SECONDS = 30.0


def kernel_key(kernel_id: str) -> str:
    return f"kernel:{kernel_id}"


def snapshot_key(snapshot_id: str) -> str:
    return f"snapshot:{snapshot_id}"


class SnapshotService:
    """Snapshots of the server's kernels: queries, save and restore jobs, status."""

    def __init__(
        self,
        engine: SnapshotEngine,
        settings: GPUSnapshot,
        kernel_manager: Any,
        session_manager: Any = None,
        contents_manager: Any = None,
        kernel_spec_manager: Any = None,
        jobs: JobRunner | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.kernel_manager = kernel_manager
        self.session_manager = session_manager
        self.contents_manager = contents_manager
        self.kernel_spec_manager = kernel_spec_manager
        self.log = log or logging.getLogger(__name__)
        self.jobs = jobs or JobRunner(log=self.log)
        self._background: set[asyncio.Future[bool]] = set()
        self.tree_facts = TreeFacts(engine.criu)

    # -- snapshots -------------------------------------------------------------------------
    # The engine reads and removes files: every call of it runs in a worker thread, so the
    # event loop answers other requests meanwhile. Unsigned and damaged snapshots are shown
    # too, with their status and problem.
    async def list_snapshots(self, notebook_path: str | None = None) -> list[dict[str, Any]]:
        found = await asyncio.to_thread(self.engine.catalog, notebook_path)
        return [s.summary() for s in found]

    async def store_usage(self) -> dict[str, Any]:
        """The store's directory and the free space of its file system, for the sidebar."""
        root = self.engine.store.root
        try:
            usage = await asyncio.to_thread(shutil.disk_usage, root)
        except OSError:
            return {"path": str(root), "free_bytes": None}
        return {"path": str(root), "free_bytes": usage.free}

    async def get_snapshot(self, ref: str) -> dict[str, Any]:
        return (await asyncio.to_thread(self.engine.get, ref)).summary()

    async def rename_snapshot(self, ref: str, new_name: str) -> dict[str, Any]:
        """Called by ``SnapshotHandler.patch``; the renamed snapshot's summary."""
        snapshot = await asyncio.to_thread(self.engine.get, ref)
        holder = self.jobs.busy_with(snapshot_key(snapshot.id))
        if holder is not None:
            raise Busy(
                "rename",
                f"snapshot {snapshot.id} is being restored (job {holder.id})",
                hint="wait for the restore to finish",
            )
        return (await asyncio.to_thread(self.engine.rename, snapshot.id, new_name)).summary()

    async def delete_snapshot(self, ref: str) -> None:
        snapshot = await asyncio.to_thread(self.engine.get, ref)
        holder = self.jobs.busy_with(snapshot_key(snapshot.id))
        if holder is not None:
            raise Busy(
                "delete",
                f"snapshot {snapshot.id} is being restored (job {holder.id})",
                hint="wait for the restore to finish",
            )
        await asyncio.to_thread(self.engine.delete, snapshot.id)

    # -- kernels ---------------------------------------------------------------------------
    def kernel(self, kernel_id: str) -> Any:
        """The kernel manager of one of the server's kernels; NotFound if there is none."""
        if kernel_id not in self.kernel_manager:
            raise NotFound(
                "lookup",
                f"no kernel {kernel_id!r} on this server",
                hint="GET /api/kernels lists the running kernels",
            )
        return self.kernel_manager.get_kernel(kernel_id)

    async def _sessions(self) -> list[dict[str, Any]]:
        if self.session_manager is None:
            return []
        return list(await ensure_async(self.session_manager.list_sessions()))

    async def notebook_path(self, kernel_id: str) -> str | None:
        """The path of the notebook (or else any document) whose session runs the kernel."""
        mine = [s for s in await self._sessions() if (s.get("kernel") or {}).get("id") == kernel_id]
        mine.sort(key=lambda s: s.get("type") != "notebook")
        return str(mine[0]["path"]) if mine else None

    async def kernel_status(self, kernel_id: str) -> dict[str, Any]:
        """Readiness, CUDA state, last snapshot and running job of a kernel."""
        km = self.kernel(kernel_id)
        return await describe_kernel(
            kernel_id,
            km.kernel_name,
            root_pid(km),
            await self.notebook_path(kernel_id),
            await asyncio.to_thread(self.engine.list),
            self.running_job(kernel_id),
            self.tree_facts,
            self.log,
        )

    async def cuda_state(self, root: int | None) -> dict[str, Any] | None:
        """The CUDA state of the kernel tree at ``root``; None when nobody can tell."""
        _, uses_cuda = await asyncio.to_thread(self.tree_facts.get, root)
        return await cuda_status(root, uses_cuda, self.log)

    async def kernel_size(self, kernel_id: str) -> tuple[int, int]:
        """Host and GPU memory of the kernel's processes, which its save has to move.

        Called by ``shutdown.snapshot_kernels_on_shutdown`` to estimate each save's time.
        """
        root = root_pid(self.kernel(kernel_id))
        host = await asyncio.to_thread(procfs.tree_rss, root) if root else 0
        cuda = await self.cuda_state(root)
        return host, int((cuda or {}).get("memory_bytes") or 0)

    def running_job(self, kernel_id: str) -> Job | None:
        return self.jobs.busy_with(kernel_key(kernel_id))

    # -- save ------------------------------------------------------------------------------
    async def start_save(
        self,
        kernel_id: str,
        name: str | None = None,
        stop: bool = False,
        reason: str = "user",
    ) -> Job:
        """Validate the request and start a save job; raises at once for a bad request."""
        self.kernel(kernel_id)
        if name is not None:
            validate_name(name)
            if await asyncio.to_thread(self.engine.find_name, name) is not None:
                raise InvalidRequest(
                    "preflight",
                    f"a snapshot named {name!r} exists already",
                    hint="pick another name, or delete the old one first",
                )
        job = Job("save", kernel_id, reason=reason)
        return self.jobs.start(
            job, [kernel_key(kernel_id)], lambda j: self._save(j, kernel_id, name, stop, reason)
        )

    async def _save(
        self, job: Job, kernel_id: str, name: str | None, stop: bool, reason: str
    ) -> dict[str, Any]:
        km = self.kernel(kernel_id)
        root = root_pid(km)
        if root is None:
            raise NotFound("preflight", f"kernel {kernel_id} has no running process")
        spec = getattr(km, "kernel_spec", None)
        target = SaveTarget(
            pid=root,
            kernel_name=km.kernel_name,
            kernel_spec=spec.to_dict() if spec is not None else None,
            connection_info=km.get_connection_info(session=False),
            notebook_path=await self.notebook_path(kernel_id),
            kernel_id=kernel_id,
            reason=reason,
        )
        await self._until_answering(km, kernel_id)
        if stop:
            # criu ends the tree after a stopping dump; the restarter would then start an
            # empty kernel in this slot. It watches again if the kernel survives.
            km.stop_restarter()
        try:
            snapshot = await self.engine.save(
                target, name=name, stop=stop, progress=self.jobs.progress(job)
            )
        except BaseException:
            if stop:
                km.start_restarter()
            raise
        job.snapshot_id = snapshot.id
        if stop:
            await self._shutdown_quietly(kernel_id)
        await self._apply_retention(snapshot)
        return snapshot.summary()

    async def _until_answering(self, km: Any, kernel_id: str) -> None:
        """Wait until the kernel answers on its control channel.

        A kernel dumped while it is still starting (before it has bound its ports) comes
        back as a process that never answers; the server lists a kernel as soon as its
        process runs. The control channel answers even while a cell runs.
        """
        client = km.client()
        client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
        try:
            request = client.session.msg("kernel_info_request")
            client.control_channel.send(request)
            deadline = time.monotonic() + KERNEL_ANSWER_SECONDS
            while (left := deadline - time.monotonic()) > 0:
                try:
                    reply = await ensure_async(client.control_channel.get_msg(timeout=left))
                except queue.Empty:
                    break
                if reply.get("parent_header", {}).get("msg_id") == request["header"]["msg_id"]:
                    return
        finally:
            client.stop_channels()
        raise NotReady(
            "preflight",
            f"kernel {kernel_id} did not answer within {KERNEL_ANSWER_SECONDS:.0f} s",
            hint="is it still starting? Try again once it is idle",
        )

    async def _shutdown_quietly(self, kernel_id: str) -> None:
        if kernel_id not in self.kernel_manager:
            return
        try:
            await ensure_async(self.kernel_manager.shutdown_kernel(kernel_id, now=True))
        except Exception:  # the snapshot is safe; a slot that lingers is only untidy
            self.log.exception("gpu-snapshot: could not shut down kernel %s", kernel_id)

    async def _apply_retention(self, snapshot: Snapshot) -> None:
        """Delete what ``core.retention`` says the new snapshot makes obsolete.

        Called by ``_save`` once ``snapshot`` has committed, so nothing older goes first.
        """
        trusted = await asyncio.to_thread(self.engine.list)
        doomed = retention.to_delete(
            [s.summary() for s in trusted],
            snapshot.summary(),
            keep_autosaves=int(self.settings.autosave_keep),
            keep_last=int(self.settings.keep_last),
        )
        for snapshot_id in doomed:
            if self.jobs.busy_with(snapshot_key(snapshot_id)) is not None:
                continue
            try:
                await asyncio.to_thread(self.engine.delete, snapshot_id)
                self.log.info(
                    "gpu-snapshot: retention removed snapshot %s (%s kept)", snapshot_id,
                    snapshot.id,
                )
            except (SnapshotError, OSError) as exc:
                self.log.warning(
                    "gpu-snapshot: retention could not remove %s: %s", snapshot_id, exc
                )

    async def latest_snapshots(self, notebook_path: str | None = None) -> list[dict[str, Any]]:
        """The newest trusted snapshot of each notebook (or of one), whatever its reason."""
        trusted = await asyncio.to_thread(self.engine.list, notebook_path)
        summaries = [s.summary() for s in trusted]
        return [dict(s) for s in retention.newest_per_notebook(summaries)]

    # -- restore ---------------------------------------------------------------------------
    async def start_restore(
        self, ref: str, path: str | None = None, session_id: str | None = None
    ) -> Job:
        """Validate the request and start a restore job into a new kernel slot."""
        snapshot = await asyncio.to_thread(self.engine.get, ref)
        if path is not None:
            path = await self._contents_path(path)
        session = None
        if session_id is not None:
            session = await self._session(session_id=session_id)
            if session is None:
                raise NotFound("lookup", f"no session {session_id!r} on this server")
        elif path is not None:
            session = await self._session(path=path)
        if session is not None and path is None:
            path = str(session["path"])
        new_kernel_id = str(uuid.uuid4())
        keys = [snapshot_key(snapshot.id), kernel_key(new_kernel_id)]
        if session is not None:
            # Its kernel is replaced at the end; no other operation may hold it meanwhile.
            keys.append(kernel_key(session["kernel"]["id"]))
        job = Job("restore", new_kernel_id, snapshot.id)
        return self.jobs.start(job, keys, lambda j: self._restore(j, snapshot, session, path))

    async def _contents_path(self, path: str) -> str:
        """``path`` as an API path inside the contents root; what /api/sessions accepts."""
        api_path = path.strip("/")
        refused = ".." in api_path.split("/") or "\0" in api_path
        cause = "it leaves the contents root"
        if not refused and self.contents_manager is not None:
            try:
                await ensure_async(self.contents_manager.get_kernel_path(path=api_path))
            except web.HTTPError as exc:
                refused, cause = True, str(exc.log_message or exc)
        if refused:
            raise InvalidRequest(
                "preflight",
                f"notebook path {path!r} is refused: {cause}",
                hint="give a path relative to the server's root, as /api/sessions takes it",
            )
        return api_path

    async def session_kernel_id(self, session_id: str) -> str | None:
        """The id of the kernel session ``session_id`` uses, or None."""
        session = await self._session(session_id=session_id)
        return str(session["kernel"]["id"]) if session and session.get("kernel") else None

    async def session_kernel_id_at(self, path: str) -> str | None:
        """The id of the kernel the session of notebook ``path`` uses, or None."""
        session = await self._session(path=path.strip("/"))
        return str(session["kernel"]["id"]) if session and session.get("kernel") else None

    async def session_of_kernel(self, kernel_id: str) -> dict[str, Any] | None:
        """The session that uses kernel ``kernel_id``, or None."""
        return await self._session(kernel_id=kernel_id)

    async def _session(self, **query: str) -> dict[str, Any] | None:
        if self.session_manager is None:
            return None
        try:
            return dict(await self.session_manager.get_session(**query))
        except web.HTTPError as exc:
            if exc.status_code == 404:
                return None
            raise

    async def _our_kernelspecs(self) -> dict[str, Any]:
        """The installed kernelspecs that launch kernels through our provisioner."""
        if self.kernel_spec_manager is None:
            return {}
        specs: dict[str, Any] = await asyncio.to_thread(self.kernel_spec_manager.get_all_specs)

        def ours(spec: dict[str, Any]) -> bool:
            meta = (spec or {}).get("spec", {}).get("metadata", {})
            provisioner = (meta.get("kernel_provisioner") or {}).get("provisioner_name")
            return bool(provisioner == PROVISIONER_NAME)

        return {name: spec for name, spec in specs.items() if ours(spec)}

    def restore_kernel_name(self, snapshot: Snapshot, ours: Collection[str]) -> str:
        """The kernelspec a restored kernel runs under (it decides what a restart starts)."""
        saved = str((snapshot.manifest.get("kernel") or {}).get("name") or "")
        for name in (saved, KERNEL_NAME):
            if name and name in ours:
                return name
        raise NotFound(
            "preflight",
            f"no kernelspec launches kernels through {PROVISIONER_NAME} "
            f"(looked for {saved or KERNEL_NAME!r} and {KERNEL_NAME!r})",
            hint="install it with 'jupyter gpu-snapshot kernelspec install --sys-prefix'",
        )

    async def _restore(
        self, job: Job, snapshot: Snapshot, session: dict[str, Any] | None, path: str | None
    ) -> dict[str, Any]:
        """Restore with the engine, then let the kernel manager adopt the running tree."""
        kernel_id = job.kernel_id
        assert kernel_id is not None
        ours = await self._our_kernelspecs()
        if not ours:  # refuse before a restore that no kernel slot could take
            self.restore_kernel_name(snapshot, ours)
        try:
            restored = await self.engine.restore(snapshot, self.jobs.progress(job))
        except PortsInUse as exc:
            # Name the kernel that holds the ports, so a client offers to shut down that one.
            exc.details.update(await self._port_holder(snapshot, kernel_id))
            raise
        try:
            await self._adopt(kernel_id, restored, ours, path)
        except BaseException as exc:
            # Nothing half-adopted may linger holding the snapshot's ports.
            await asyncio.to_thread(procfs.kill_tree, restored.pid)
            self._forget_failed_start(kernel_id)
            if isinstance(exc, KeyError):
                raise SnapshotError("adopt", "the restored kernel vanished") from None
            if isinstance(exc, Exception) and not isinstance(exc, SnapshotError):
                raise SnapshotError(
                    "adopt", f"the kernel manager could not adopt the restored kernel: {exc}"
                ) from exc
            raise
        self._tell_new_slot(kernel_id)
        try:
            session_id = await self._attach(kernel_id, session, path)
        except Exception as exc:
            # A kernel nobody can reach from the notebook is no restore: undo it.
            await self._shutdown_quietly(kernel_id)
            raise SnapshotError(
                "attach", f"could not switch the session to the restored kernel: {exc}"
            ) from exc
        return {"kernel_id": kernel_id, "session_id": session_id}

    async def _adopt(
        self, kernel_id: str, restored: RestoredKernel, ours: Collection[str], path: str | None
    ) -> None:
        """Start the kernel slot ``kernel_id`` on the restored tree (plain data only)."""
        kernel_name = self.restore_kernel_name(restored.snapshot, ours)
        adoption = Adoption(restored.pid, restored.connection_info, restored.snapshot.id)
        launch: dict[str, Any] = {ADOPT_KWARG: adoption}
        if path:
            # Only a later restart uses these: it starts a fresh kernel beside the notebook.
            launch["path"] = await self._kernel_dir(path)
            if self.session_manager is not None:
                launch["env"] = self.session_manager.get_kernel_env(path)
        await ensure_async(
            self.kernel_manager.start_kernel(kernel_id=kernel_id, kernel_name=kernel_name, **launch)
        )
        # With pending kernels, start_kernel returns before the adoption has run.
        await self.kernel_manager.get_kernel(kernel_id).ready

    def _tell_new_slot(self, kernel_id: str) -> None:
        """Give the restored kernel this slot's environment, without waiting for it.

        Its ``os.environ`` still names the slot and server it was saved from, so
        %gpu_snapshot inside it would address those. A kernel restored in the middle of a
        cell answers only after that cell.
        """
        km = self.kernel_manager.get_kernel(kernel_id)
        env = km.provisioner.server_env() if hasattr(km.provisioner, "server_env") else {}
        if not env:
            return
        task = asyncio.ensure_future(refresh_kernel_env(km, env, self.log))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
    async def _port_holder(self, snapshot: Snapshot, restoring_id: str) -> dict[str, Any]:
        """Which of the server's kernels listens on the snapshot's ports, and its notebook.

        Called when a restore is refused for taken ports, so that a client can offer to shut
        down that kernel (usually the one the snapshot was taken of) and no other.
        """
        wanted = {v for k, v in snapshot.connection_info.items() if k.endswith("_port") and v}
        for kernel_id in self.kernel_manager.list_kernel_ids():
            if kernel_id == restoring_id:
                continue
            with contextlib.suppress(Exception):
                info = self.kernel_manager.get_kernel(kernel_id).get_connection_info()
                if wanted & {v for k, v in info.items() if k.endswith("_port")}:
                    return {
                        "holder_kernel_id": kernel_id,
                        "holder_notebook_path": await self.notebook_path(kernel_id),
                    }
        return {"holder_kernel_id": None, "holder_notebook_path": None}

    def _forget_failed_start(self, kernel_id: str) -> None:
        """Drop what the kernel manager keeps of a kernel whose start failed.

        jupyter_client leaves a failed start in its pending kernels, and shutdown_all then
        fails on it (404) when the server stops; with pending kernels on, the slot itself
        stays listed. Neither may outlive a failed restore.
        """
        km = self.kernel_manager
        if kernel_id in km:
            with contextlib.suppress(Exception):
                km.remove_kernel(kernel_id)
        pending = getattr(km, "_pending_kernels", None)
        if isinstance(pending, dict):
            pending.pop(kernel_id, None)

    async def _kernel_dir(self, path: str) -> str:
        if self.contents_manager is not None:
            with contextlib.suppress(Exception):
                return str(await ensure_async(self.contents_manager.get_kernel_path(path=path)))
        return posixpath.dirname(path)

    async def _attach(
        self, kernel_id: str, session: dict[str, Any] | None, path: str | None
    ) -> str | None:
        """Point the given session (or the notebook's, or a new one) at the restored kernel."""
        sm = self.session_manager
        if sm is None:
            return None
        if session is not None:
            try:
                await sm.update_session(session["id"], kernel_id=kernel_id)
            except web.HTTPError as exc:
                # The server dropped the session (its kernel died) since the request.
                if exc.status_code != 404:
                    raise
            else:
                await self._retire(str(session["kernel"]["id"]), kernel_id)
                return str(session["id"])
        if not path:
            return None
        kind = "notebook" if path.endswith(".ipynb") else "file"
        model = await sm.create_session(
            path=path, name=posixpath.basename(path), type=kind, kernel_id=kernel_id
        )
        return str(model["id"])

    async def _retire(self, old_kernel_id: str, new_kernel_id: str) -> None:
        """Shut down the kernel a session used before, unless another session still uses it.

        This is what changing a notebook's kernel in JupyterLab does.
        """
        if old_kernel_id == new_kernel_id or old_kernel_id not in self.kernel_manager:
            return
        if any((s.get("kernel") or {}).get("id") == old_kernel_id for s in await self._sessions()):
            return
        await self._shutdown_quietly(old_kernel_id)

