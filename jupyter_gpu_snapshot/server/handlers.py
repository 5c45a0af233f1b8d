"""REST handlers under ``{base_url}gpu-snapshot/``; openapi.yaml beside this file documents them.

Handlers are thin: they parse the request, call ``SnapshotService`` and write JSON. The
core's errors become HTTP statuses in one place, ``SnapshotAPIHandler.write_error``.
Every handler is authenticated and authorized against the ``kernels`` resource, so the
server's own authorizer decides; saving, restoring and rewinding count as ``execute``. POST and
DELETE need an XSRF token when the request is authenticated by cookie (the server's
default check). A request with a kernel's own credential is further limited to what that
kernel reaches (``kernel_credentials.KernelReach``), checked by the handlers' ``reach``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any, TypeVar, cast

from jupyter_core.utils import ensure_async
from jupyter_server.auth import User
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from .._constants import API_PREFIX
from ..core.errors import (
    Busy,
    Incompatible,
    InvalidRequest,
    NoAnswer,
    NotFound,
    NotReady,
    PortsInUse,
    RewindOutOfRange,
    SnapshotError,
)
from .autosave import AutosaveScheduler
from .hibernation import Hibernation
from .jobs import JOB_ID_PATTERN
from .kernel_credentials import KernelReach, OutOfReach
from .notebook_policies import POLICY_FIELDS
from .service import SnapshotService
from .sleepers import PROCESS_TIER
from .timelines import KernelTimelines

# The same pattern the server's own kernel handlers accept.
KERNEL_ID = r"(?P<kernel_id>\w+-\w+-\w+-\w+-\w+)"
# Ids and names are validated by the store; anything without a slash reaches it.
SNAPSHOT_REF = r"(?P<ref>[^/]+)"

AUTH_RESOURCE = "kernels"
_TOKEN_HEADER = re.compile(r"(?:token|bearer)\s+(.+)", re.IGNORECASE)

STATUS_OF: tuple[tuple[type[SnapshotError], int], ...] = (
    (OutOfReach, 403),
    (InvalidRequest, 400),
    (NotFound, 404),
    (Busy, 409),
    (NotReady, 409),
    (PortsInUse, 409),
    (Incompatible, 409),
    (RewindOutOfRange, 400),
    # The kernel, behind the server, did not answer: a gateway's failure.
    (NoAnswer, 502),
    (SnapshotError, 500),
)


F = TypeVar("F", bound=Callable[..., Any])
# Saving and restoring run code in a kernel's name: they need the "execute" permission.
authorized_to_execute = cast(Callable[[F], F], authorized(action="execute"))


def status_of(error: SnapshotError) -> int:
    return next(code for cls, code in STATUS_OF if isinstance(error, cls))


class KernelScopedIdentity:
    """The server's identity provider, plus the credentials of snapshot-ready kernels.

    A kernel's credential (``launch/kernel_token.py``) is accepted here only, by the
    extension's handlers, while its kernel runs; the handler then limits it to what that
    kernel reaches (``SnapshotAPIHandler.reach``). Everything else goes to the server's own
    provider.
    """

    def __init__(self, inner: Any, handler: SnapshotAPIHandler) -> None:
        self._inner = inner
        self._handler = handler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def get_user(self, handler: Any) -> User | None:
        if self._handler.refused_credential is not None:
            raise self._handler.refused_credential
        kernel_id = self._handler.kernel_scope
        if kernel_id is not None:
            return User(username=f"kernel-{kernel_id}", name=f"kernel {kernel_id}")
        return cast("User | None", await ensure_async(self._inner.get_user(handler)))

    def is_token_authenticated(self, handler: Any) -> bool:
        return self._handler.kernel_scope is not None or bool(
            self._inner.is_token_authenticated(handler)
        )


class SnapshotAPIHandler(APIHandler):
    """Base of the handlers: the service, JSON bodies, and the error mapping."""

    auth_resource = AUTH_RESOURCE
    service: SnapshotService
    # The kernel whose own credential authenticated this request, if one did.
    kernel_scope: str | None = None
    # A kernel's credential that no running kernel holds: answered when authenticating.
    refused_credential: OutOfReach | None = None
    _reach: KernelReach | None = None

    def initialize(self, service: SnapshotService) -> None:
        self.service = service
        match = _TOKEN_HEADER.match(self.request.headers.get("Authorization", ""))
        if match and service is not None:
            try:
                self.kernel_scope = service.credentials.kernel_of(match.group(1).strip())
            except OutOfReach as exc:
                self.refused_credential = exc

    @property
    def identity_provider(self) -> Any:
        return KernelScopedIdentity(super().identity_provider, self)

    def check_xsrf_cookie(self) -> None:
        """A kernel's credential comes in a header, never in a cookie a browser could send
        on its own: no forgery to check for. JupyterHub's single-user server replaces the
        server's own check with one that knows only the hub's tokens, hence this."""
        if self.kernel_scope is not None:
            return
        super().check_xsrf_cookie()

    async def reach(self) -> KernelReach | None:
        """What the kernel whose credential authenticated this request reaches; None for
        any other request, which the server's authorizer alone decides."""
        if self.kernel_scope is None:
            return None
        if self._reach is None:
            self._reach = await self.service.credentials.reach(self.kernel_scope)
        return self._reach

    async def require_kernel(self, kernel_id: str | None) -> None:
        """Refuse a kernel's credential for anything but its own kernel's routes."""
        reach = await self.reach()
        if reach is not None:
            reach.require_kernel(kernel_id)

    async def reachable_snapshot(self, ref: str) -> str:
        """The id of snapshot ``ref`` (an id or a name) for a kernel's credential that
        reaches it, so that the operation acts on the snapshot checked; ``ref`` itself for
        other requests."""
        reach = await self.reach()
        if reach is None:
            return ref
        summary = await self.service.get_snapshot(ref)
        reach.require_snapshot(summary)
        return str(summary["id"])

    def write_json(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data))

    def json_body(self, allowed: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
        """The request's JSON object, checked against ``allowed`` keys and types."""
        if not self.request.body.strip():
            return {}
        try:
            body = json.loads(self.request.body)
        except ValueError as exc:
            raise InvalidRequest("request", f"the body is not JSON: {exc}") from None
        except RecursionError:  # e.g. 200 KB of '[': nested deeper than the parser goes
            raise InvalidRequest("request", "the body is JSON nested too deeply") from None
        if not isinstance(body, dict):
            raise InvalidRequest("request", "the body must be a JSON object")
        for key, value in body.items():
            if key not in allowed:
                raise InvalidRequest(
                    "request",
                    f"unknown field {key!r}",
                    hint=f"allowed fields: {', '.join(sorted(allowed))}",
                )
            if value is not None and not isinstance(value, allowed[key]):
                raise InvalidRequest("request", f"field {key!r} has the wrong type")
        return body

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """Errors of the core become ``{code, message, step, cause, hint, log, details}``."""
        exc_info = kwargs.get("exc_info")
        error = exc_info[1] if exc_info else None
        if not isinstance(error, SnapshotError):
            super().write_error(status_code, **kwargs)
            return
        self.set_status(status_of(error))
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(error.to_dict()))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        # Expected refusals are one log line, not a traceback.
        if isinstance(value, SnapshotError) and status_of(value) < 500:
            self.log.info("gpu-snapshot %s %s: %s", self.request.method, self.request.path, value)
            return
        super().log_exception(typ, value, tb)


class SnapshotsHandler(SnapshotAPIHandler):
    """``GET snapshots[?notebook_path=P][&latest=true]``."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        notebook_path = self.get_query_argument("notebook_path", None)
        latest = self.get_query_argument("latest", "false").lower()
        if latest not in ("true", "false", "1", "0"):
            raise InvalidRequest("request", f"latest must be true or false, not {latest!r}")
        reach = await self.reach()
        if reach is not None:
            reach.require_listing(notebook_path)
        if latest in ("true", "1"):
            found = await self.service.latest_snapshots(notebook_path)
        else:
            found = await self.service.list_snapshots(notebook_path, with_remote=True)
        if reach is not None:
            found = reach.snapshots(found)
        self.write_json({
            "snapshots": found,
            "store": await self.service.store_usage(),
            "remote": await self.service.remote_state(),
        })


class UsageHandler(SnapshotAPIHandler):
    """``GET usage``: the store's bytes on disk, and what deleting each snapshot frees."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        reach = await self.reach()
        if reach is not None:
            reach.require_store("the store's usage")
        self.write_json(await self.service.disk_usage())


class SnapshotHandler(SnapshotAPIHandler):
    """``GET snapshots/{id}``, ``PATCH snapshots/{id}`` (rename),
    ``DELETE snapshots/{id}[?where=local|remote|both]``."""

    @web.authenticated
    @authorized
    async def get(self, ref: str) -> None:
        summary = await self.service.get_snapshot(ref)
        reach = await self.reach()
        if reach is not None:
            reach.require_snapshot(summary)
        self.write_json(summary)

    @web.authenticated
    @authorized
    async def patch(self, ref: str) -> None:
        body = self.json_body({"name": str})
        if not isinstance(body.get("name"), str):
            raise InvalidRequest("rename", "the request names no new name",
                                 hint='send {"name": "new-name"}')
        ref = await self.reachable_snapshot(ref)
        self.write_json(await self.service.rename_snapshot(ref, body["name"]))

    @web.authenticated
    @authorized
    async def delete(self, ref: str) -> None:
        ref = await self.reachable_snapshot(ref)
        await self.service.delete_snapshot(ref, self.get_query_argument("where", "both"))
        self.set_status(204)
        self.finish()


class SnapshotGpusHandler(SnapshotAPIHandler):
    """``GET snapshots/{id}/gpus[?gpus=1,0]``: where a restore would put the GPUs here."""

    @web.authenticated
    @authorized
    async def get(self, ref: str) -> None:
        gpus = self.get_query_argument("gpus", None)  # as the CLI takes it: 1,0
        ref = await self.reachable_snapshot(ref)
        self.write_json(await self.service.gpu_choice(ref, gpus))


class JobCreatingHandler(SnapshotAPIHandler):
    def accepted(self, job_dict: dict[str, Any]) -> None:
        base_url = self.settings.get("base_url", "/")
        self.set_header("Location", url_path_join(base_url, API_PREFIX, "jobs", job_dict["id"]))
        self.write_json(job_dict, status=202)


class RestoreHandler(JobCreatingHandler):
    """``POST snapshots/{id}/restore`` with ``{path?, session_id?, gpus?, fallback?}``."""

    @web.authenticated
    @authorized_to_execute
    async def post(self, ref: str) -> None:
        body = self.json_body({"path": str, "session_id": str, "gpus": list, "fallback": str})
        if self.kernel_scope is not None:
            # A kernel may switch its own notebook to a restored kernel, never another's.
            session_id, path = body.get("session_id"), body.get("path")
            if session_id:
                await self.require_kernel(
                    await self.service.slots.session_kernel_id(session_id))
            elif path:
                owner = await self.service.slots.session_kernel_id_at(path)
                if owner is not None:
                    await self.require_kernel(owner)
                else:
                    reach = await self.reach()
                    assert reach is not None
                    reach.require_new_session_at(path)
            ref = await self.reachable_snapshot(ref)
        job = await self.service.start_restore(
            ref, path=body.get("path") or None, session_id=body.get("session_id") or None,
            gpus=body.get("gpus"), requested_by=self.kernel_scope,
            fallback=body.get("fallback") or None,
        )
        self.accepted(job.to_dict())


class KernelSnapshotsHandler(JobCreatingHandler):
    """``POST kernels/{kernel_id}/snapshots`` with ``{name?, stop?, portable?}``."""

    @web.authenticated
    @authorized_to_execute
    async def post(self, kernel_id: str) -> None:
        await self.require_kernel(kernel_id)
        body = self.json_body({"name": str, "stop": bool, "portable": bool})
        job = await self.service.start_save(
            kernel_id, name=body.get("name") or None, stop=bool(body.get("stop")),
            portable=bool(body.get("portable")),
        )
        self.accepted(job.to_dict())


class KernelStatusHandler(SnapshotAPIHandler):
    """``GET kernels/{kernel_id}/status``."""

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        await self.require_kernel(kernel_id)
        self.write_json(await self.service.kernel_status(kernel_id))


class KernelDeathHandler(SnapshotAPIHandler):
    """``DELETE kernels/{kernel_id}/death``: dismiss the record of the kernel's death."""

    @web.authenticated
    @authorized
    async def delete(self, kernel_id: str) -> None:
        await self.require_kernel(kernel_id)
        self.service.dismiss_death(kernel_id)
        self.set_status(204)
        self.finish()


class KernelSessionHandler(SnapshotAPIHandler):
    """``GET kernels/{kernel_id}/session``: the session (notebook) the kernel serves, or null.

    What a kernel's own credential may know of the server's sessions.
    """

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        await self.require_kernel(kernel_id)
        self.write_json({"session": await self.service.slots.session_of_kernel(kernel_id)})


class KernelAutosaveHandler(SnapshotAPIHandler):
    """``GET kernels/{kernel_id}/autosave``, ``PUT`` with a policy override."""

    autosave: AutosaveScheduler

    def initialize(  # type: ignore[override]
        self, service: SnapshotService, autosave: AutosaveScheduler
    ) -> None:
        super().initialize(service)
        self.autosave = autosave

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        await self.require_kernel(kernel_id)
        self.write_json(await self.autosave.describe(kernel_id))

    @web.authenticated
    @authorized_to_execute
    async def put(self, kernel_id: str) -> None:
        await self.require_kernel(kernel_id)
        body = self.json_body({k: (*kinds, type(None)) for k, kinds in POLICY_FIELDS.items()})
        self.write_json(await self.autosave.set_override(kernel_id, body))


class HibernationAPIHandler(SnapshotAPIHandler):
    hibernation: Hibernation

    def initialize(  # type: ignore[override]
        self, service: SnapshotService, hibernation: Hibernation
    ) -> None:
        super().initialize(service)
        self.hibernation = hibernation


class HibernationHandler(HibernationAPIHandler):
    """``GET hibernation``: the hibernated kernels (a kernel's credential sees its own)."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        kernels = self.hibernation.sleepers.listing()
        reach = await self.reach()
        if reach is not None:
            kernels = [k for k in kernels if reach.reaches_kernel(k["kernel_id"])]
        self.write_json({"kernels": kernels})


class KernelHibernateHandler(HibernationAPIHandler):
    """``POST kernels/{kernel_id}/hibernate`` with ``{when_idle?, tier?}``."""

    @web.authenticated
    @authorized_to_execute
    async def post(self, kernel_id: str) -> None:
        await self.require_kernel(kernel_id)
        body = self.json_body({"when_idle": bool, "tier": str})
        state = await self.hibernation.request(
            kernel_id, when_idle=bool(body.get("when_idle")),
            tier=str(body.get("tier") or PROCESS_TIER),
        )
        self.write_json(state, status=202)


class KernelWakeHandler(HibernationAPIHandler):
    """``POST kernels/{kernel_id}/wake``."""

    @web.authenticated
    @authorized_to_execute
    async def post(self, kernel_id: str) -> None:
        await self.require_kernel(kernel_id)
        self.write_json(await self.hibernation.wake(kernel_id), status=202)


class TimelineAPIHandler(SnapshotAPIHandler):
    timelines: KernelTimelines

    def initialize(  # type: ignore[override]
        self, service: SnapshotService, timelines: KernelTimelines
    ) -> None:
        super().initialize(service)
        self.timelines = timelines


class KernelTimelineHandler(TimelineAPIHandler):
    """``GET kernels/{kernel_id}/timeline``: the kernel's points, one per cell."""

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        await self.require_kernel(kernel_id)
        self.write_json(await self.timelines.timeline(kernel_id))


class KernelRewindHandler(TimelineAPIHandler):
    """``POST kernels/{kernel_id}/rewind`` with ``{before}``: the kernel back to how it was
    before that cell; answers the kernel's report once it is made."""

    @web.authenticated
    @authorized_to_execute
    async def post(self, kernel_id: str) -> None:
        await self.require_kernel(kernel_id)
        body = self.json_body({"before": int})
        if "before" not in body:
            raise InvalidRequest("request", "the request names no cell to rewind to before",
                                 hint='send {"before": N}, N the count in the cell\'s [N]')
        report = await self.timelines.rewind(kernel_id, body["before"])
        self.write_json({"report": report})


class JobsHandler(SnapshotAPIHandler):
    """``GET jobs[?kernel_id=K]``."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        kernel_id = self.get_query_argument("kernel_id", None)
        await self.require_kernel(kernel_id)
        self.write_json({"jobs": [j.to_dict() for j in self.service.jobs.recent(kernel_id)]})


class JobHandler(SnapshotAPIHandler):
    """``GET jobs/{id}``."""

    @web.authenticated
    @authorized
    async def get(self, job_id: str) -> None:
        job = self.service.jobs.get(job_id)
        reach = await self.reach()
        if reach is not None:
            reach.require_job(job)
        self.write_json(job.to_dict())


def routes(
    service: SnapshotService,
    autosave: AutosaveScheduler,
    hibernation: Hibernation | None = None,
    timelines: KernelTimelines | None = None,
) -> list[tuple[str, type[SnapshotAPIHandler], dict[str, Any]]]:
    """URL patterns relative to the server's base_url (the extension app prepends it)."""
    kwargs: dict[str, Any] = {"service": service}
    table: list[tuple[str, type[SnapshotAPIHandler], dict[str, Any]]] = [
        (r"snapshots", SnapshotsHandler, kwargs),
        (r"usage", UsageHandler, kwargs),
        (rf"snapshots/{SNAPSHOT_REF}", SnapshotHandler, kwargs),
        (rf"snapshots/{SNAPSHOT_REF}/restore", RestoreHandler, kwargs),
        (rf"snapshots/{SNAPSHOT_REF}/gpus", SnapshotGpusHandler, kwargs),
        (rf"kernels/{KERNEL_ID}/snapshots", KernelSnapshotsHandler, kwargs),
        (rf"kernels/{KERNEL_ID}/status", KernelStatusHandler, kwargs),
        (rf"kernels/{KERNEL_ID}/death", KernelDeathHandler, kwargs),
        (rf"kernels/{KERNEL_ID}/session", KernelSessionHandler, kwargs),
        (rf"kernels/{KERNEL_ID}/autosave", KernelAutosaveHandler,
         {**kwargs, "autosave": autosave}),
        (r"hibernation", HibernationHandler, {**kwargs, "hibernation": hibernation}),
        (rf"kernels/{KERNEL_ID}/hibernate", KernelHibernateHandler,
         {**kwargs, "hibernation": hibernation}),
        (rf"kernels/{KERNEL_ID}/wake", KernelWakeHandler, {**kwargs, "hibernation": hibernation}),
        (rf"kernels/{KERNEL_ID}/timeline", KernelTimelineHandler,
         {**kwargs, "timelines": timelines}),
        (rf"kernels/{KERNEL_ID}/rewind", KernelRewindHandler, {**kwargs, "timelines": timelines}),
        (r"jobs", JobsHandler, kwargs),
        (rf"jobs/(?P<job_id>{JOB_ID_PATTERN})", JobHandler, kwargs),
    ]
    return [(f"/{API_PREFIX}/{pattern}", handler, kw) for pattern, handler, kw in table]
