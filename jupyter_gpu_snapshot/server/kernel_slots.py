"""The Jupyter server's kernel slots and the sessions that use them, as snapshots see them.

Lookups (a kernel's notebook, a session's kernel, the kernelspecs that launch through our
provisioner) and the end of a restore: the engine hands over a running tree
(``RestoredKernel``), and ``put_restored`` makes it a kernel of the server in a new slot,
switches the notebook's session to it and retires the kernel the session used before.
One ``KernelSlots`` is made with the server's other parts (``wiring``) and handed to the
service and to what else needs a kernel's notebook; handlers and the autosave scheduler
ask it their lookups directly (through ``SnapshotService.slots``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import posixpath
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from jupyter_core.utils import ensure_async
from tornado import web

from .._constants import KERNEL_NAME, PROVISIONER_NAME
from ..core import procfs
from ..core.errors import InvalidRequest, NotFound, SnapshotError
from ..core.store import Snapshot
from ..launch.kernelspec import launches_through_provisioner
from ..launch.provisioner import ADOPT_KWARG, Adoption, SnapshotReadyProvisioner
from ..node.engine import RestoredKernel
from ..node.gpus import remap_notice
from .jupyter_server_internals import drop_pending_kernel
from .kernel_env import refresh_kernel_env


@dataclass(eq=False)
class KernelSlots:
    """The server's kernel, session, contents and kernelspec managers, for snapshots.

    Made by ``wiring.build_server_parts``; a manager the server lacks is None, and what it
    would answer is then missing (no sessions, no kernelspecs of ours).
    """

    kernel_manager: Any
    session_manager: Any
    contents_manager: Any
    kernel_spec_manager: Any
    log: logging.Logger
    # The environment refreshes of restored kernels, which nobody awaits.
    _background: set[asyncio.Future[bool]] = field(default_factory=set)

    # -- sessions --------------------------------------------------------------------------
    async def sessions(self) -> list[dict[str, Any]]:
        if self.session_manager is None:
            return []
        return list(await ensure_async(self.session_manager.list_sessions()))

    async def notebook_path(self, kernel_id: str) -> str | None:
        """The path of the notebook (or else any document) whose session runs the kernel."""
        mine = [s for s in await self.sessions() if (s.get("kernel") or {}).get("id") == kernel_id]
        mine.sort(key=lambda s: s.get("type") != "notebook")
        return str(mine[0]["path"]) if mine else None

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

    async def restore_target(
        self, path: str | None, session_id: str | None
    ) -> tuple[dict[str, Any] | None, str | None]:
        """The session a restore switches to its new kernel and the notebook path it runs
        beside, from what the request names; raises before the restore job starts.

        Called by ``SnapshotService.start_restore``. The session of ``session_id``, else
        the one of notebook ``path``; a session alone gives its own path.
        """
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
        return session, path

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

    async def _kernel_dir(self, path: str) -> str:
        if self.contents_manager is not None:
            with contextlib.suppress(Exception):
                return str(await ensure_async(self.contents_manager.get_kernel_path(path=path)))
        return posixpath.dirname(path)

    # -- kernelspecs -----------------------------------------------------------------------
    async def our_kernelspecs(self) -> dict[str, Any]:
        """The installed kernelspecs that launch kernels through our provisioner."""
        if self.kernel_spec_manager is None:
            return {}
        specs: dict[str, Any] = await asyncio.to_thread(self.kernel_spec_manager.get_all_specs)
        return {name: spec for name, spec in specs.items()
                if launches_through_provisioner((spec or {}).get("spec", {}).get("metadata"))}

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

    # -- a restored kernel into a new slot ---------------------------------------------------
    async def put_restored(
        self,
        kernel_id: str,
        restored: RestoredKernel,
        ours: Collection[str],
        session: dict[str, Any] | None,
        path: str | None,
        credential: str | None = None,
    ) -> str | None:
        """Make the restored tree the kernel of slot ``kernel_id`` and point the session at
        it; returns the session's id (None without a session or path). ``credential`` is
        the one the tree holds (of the kernel it was saved from), if known.

        Called by the restore job once the engine restored the tree. A failure undoes what
        it did: a tree the kernel manager could not adopt is killed, a kernel no session
        could take is shut down.
        """
        try:
            await self._adopt(kernel_id, restored, ours, path, credential)
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
        self.tell_new_slot(kernel_id, remap_notice(restored.notes.get("gpu_remap")))
        try:
            return await self._attach(kernel_id, session, path)
        except Exception as exc:
            # A kernel nobody can reach from the notebook is no restore: undo it.
            await self.shutdown_quietly(kernel_id)
            raise SnapshotError(
                "attach", f"could not switch the session to the restored kernel: {exc}"
            ) from exc

    async def _adopt(
        self,
        kernel_id: str,
        restored: RestoredKernel,
        ours: Collection[str],
        path: str | None,
        credential: str | None,
    ) -> None:
        """Start the kernel slot ``kernel_id`` on the restored tree (plain data only)."""
        kernel_name = self.restore_kernel_name(restored.snapshot, ours)
        adoption = Adoption(
            restored.pid, restored.connection_info, restored.snapshot.id, credential
        )
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

    # -- a fresh kernel for a fallback ------------------------------------------------------
    async def start_fresh(self, kernel_id: str, kernel_name: str, path: str | None) -> Any:
        """Start a new kernel in slot ``kernel_id`` (beside the notebook at ``path``, with
        its environment), for a fallback to fill; returns its kernel manager once it
        answers. No session uses it yet (``attach_fresh``)."""
        launch: dict[str, Any] = {}
        if path:
            launch["path"] = await self._kernel_dir(path)
            if self.session_manager is not None:
                launch["env"] = self.session_manager.get_kernel_env(path)
        try:
            await ensure_async(self.kernel_manager.start_kernel(
                kernel_id=kernel_id, kernel_name=kernel_name, **launch))
            km = self.kernel_manager.get_kernel(kernel_id)
            await km.ready
        except Exception as exc:
            self._forget_failed_start(kernel_id)
            raise SnapshotError("start", f"the fresh kernel did not start: {exc}") from exc
        return km

    async def attach_fresh(
        self, kernel_id: str, session: dict[str, Any] | None, path: str | None
    ) -> str | None:
        """Point the session (or the notebook's, or a new one) at the fresh kernel of a
        fallback; returns the session's id. On failure the caller shuts the kernel down."""
        try:
            return await self._attach(kernel_id, session, path)
        except Exception as exc:
            raise SnapshotError(
                "attach", f"could not switch the session to the fresh kernel: {exc}"
            ) from exc

    def tell_new_slot(self, kernel_id: str, notice: str = "") -> None:
        """Give the restored kernel this slot's environment, without waiting for it.

        Its ``os.environ`` still names the slot and server it was saved from, so
        %gpu_snapshot inside it would address those. A kernel restored in the middle of a
        cell answers only after that cell. ``notice`` (a GPU remap) is shown by the kernel
        at the start of its next cell.
        """
        task = asyncio.ensure_future(self.tell_slot(kernel_id, notice))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def tell_slot(self, kernel_id: str, notice: str = "") -> bool:
        """``tell_new_slot``, awaited: whether the kernel confirmed. A woken kernel is told
        before the messages held for it go out, so its first cell already knows its slot."""
        km = self.kernel_manager.get_kernel(kernel_id)
        provisioner = km.provisioner
        env = provisioner.server_env() if isinstance(provisioner, SnapshotReadyProvisioner) else {}
        if not env and not notice:
            return True
        told = await refresh_kernel_env(km, env, self.log, notice)
        if told and isinstance(provisioner, SnapshotReadyProvisioner):
            # The tree calls with this kernel's own credential from now on.
            provisioner.told_own_credential()
        return told

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
        drop_pending_kernel(km, kernel_id)

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
        if any((s.get("kernel") or {}).get("id") == old_kernel_id for s in await self.sessions()):
            return
        await self.shutdown_quietly(old_kernel_id)

    # -- other slots -----------------------------------------------------------------------
    async def port_holder(self, snapshot: Snapshot, restoring_id: str) -> dict[str, Any]:
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

    async def shutdown_quietly(self, kernel_id: str) -> None:
        """Shut a kernel down, logging instead of raising; called after a stopping save
        and when a restore retires or undoes a kernel."""
        if kernel_id not in self.kernel_manager:
            return
        try:
            await ensure_async(self.kernel_manager.shutdown_kernel(kernel_id, now=True))
        except Exception:  # the snapshot is safe; a slot that lingers is only untidy
            self.log.exception("gpu-snapshot: could not shut down kernel %s", kernel_id)
