"""REST handlers under ``{base_url}gpu-snapshot/``; openapi.yaml beside this file documents them.

Handlers are thin: they parse the request, call ``SnapshotService`` and write JSON. The
core's errors become HTTP statuses in one place, ``SnapshotAPIHandler.write_error``.
Every handler is authenticated and authorized against the ``kernels`` resource, so the
server's own authorizer decides; saving and restoring count as ``execute``. POST and
DELETE need an XSRF token when the request is authenticated by cookie (the server's
default check).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any, TypeVar, cast

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from .._constants import API_PREFIX
from ..core.errors import Busy, InvalidRequest, NotFound, NotReady, SnapshotError
from .autosave import POLICY_FIELDS, AutosaveScheduler
from .jobs import JOB_ID_PATTERN
from .service import SnapshotService

# The same pattern the server's own kernel handlers accept.
KERNEL_ID = r"(?P<kernel_id>\w+-\w+-\w+-\w+-\w+)"
# Ids and names are validated by the store; anything without a slash reaches it.
SNAPSHOT_REF = r"(?P<ref>[^/]+)"

AUTH_RESOURCE = "kernels"

STATUS_OF: tuple[tuple[type[SnapshotError], int], ...] = (
    (InvalidRequest, 400),
    (NotFound, 404),
    (Busy, 409),
    (NotReady, 409),
    (SnapshotError, 500),
)


F = TypeVar("F", bound=Callable[..., Any])
# Saving and restoring run code in a kernel's name: they need the "execute" permission.
authorized_to_execute = cast(Callable[[F], F], authorized(action="execute"))


def status_of(error: SnapshotError) -> int:
    return next(code for cls, code in STATUS_OF if isinstance(error, cls))


class SnapshotAPIHandler(APIHandler):
    """Base of the handlers: the service, JSON bodies, and the error mapping."""

    auth_resource = AUTH_RESOURCE
    service: SnapshotService

    def initialize(self, service: SnapshotService) -> None:
        self.service = service

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
        """Errors of the core become ``{message, step, cause, hint, log}`` with their status."""
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
        if latest in ("true", "1"):
            found = await asyncio.to_thread(self.service.latest_snapshots, notebook_path)
        else:
            found = self.service.list_snapshots(notebook_path)
        self.write_json({"snapshots": found})


class SnapshotHandler(SnapshotAPIHandler):
    """``GET snapshots/{id}``, ``DELETE snapshots/{id}``."""

    @web.authenticated
    @authorized
    async def get(self, ref: str) -> None:
        self.write_json(self.service.get_snapshot(ref))

    @web.authenticated
    @authorized
    async def delete(self, ref: str) -> None:
        self.service.delete_snapshot(ref)
        self.set_status(204)
        self.finish()


class JobCreatingHandler(SnapshotAPIHandler):
    def accepted(self, job_dict: dict[str, Any]) -> None:
        base_url = self.settings.get("base_url", "/")
        self.set_header("Location", url_path_join(base_url, API_PREFIX, "jobs", job_dict["id"]))
        self.write_json(job_dict, status=202)


class RestoreHandler(JobCreatingHandler):
    """``POST snapshots/{id}/restore`` with ``{path?, session_id?}``."""

    @web.authenticated
    @authorized_to_execute
    async def post(self, ref: str) -> None:
        body = self.json_body({"path": str, "session_id": str})
        job = await self.service.start_restore(
            ref, path=body.get("path") or None, session_id=body.get("session_id") or None
        )
        self.accepted(job.to_dict())


class KernelSnapshotsHandler(JobCreatingHandler):
    """``POST kernels/{kernel_id}/snapshots`` with ``{name?, stop?}``."""

    @web.authenticated
    @authorized_to_execute
    async def post(self, kernel_id: str) -> None:
        body = self.json_body({"name": str, "stop": bool})
        job = await self.service.start_save(
            kernel_id, name=body.get("name") or None, stop=bool(body.get("stop"))
        )
        self.accepted(job.to_dict())


class KernelStatusHandler(SnapshotAPIHandler):
    """``GET kernels/{kernel_id}/status``."""

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        self.write_json(await self.service.kernel_status(kernel_id))


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
        self.write_json(await self.autosave.describe(kernel_id))

    @web.authenticated
    @authorized_to_execute
    async def put(self, kernel_id: str) -> None:
        body = self.json_body({k: (*kinds, type(None)) for k, kinds in POLICY_FIELDS.items()})
        self.write_json(await self.autosave.set_override(kernel_id, body))


class JobsHandler(SnapshotAPIHandler):
    """``GET jobs[?kernel_id=K]``."""

    @web.authenticated
    @authorized
    async def get(self) -> None:
        kernel_id = self.get_query_argument("kernel_id", None)
        self.write_json({"jobs": [j.to_dict() for j in self.service.jobs.recent(kernel_id)]})


class JobHandler(SnapshotAPIHandler):
    """``GET jobs/{id}``."""

    @web.authenticated
    @authorized
    async def get(self, job_id: str) -> None:
        self.write_json(self.service.jobs.get(job_id).to_dict())


def routes(
    service: SnapshotService, autosave: AutosaveScheduler
) -> list[tuple[str, type[SnapshotAPIHandler], dict[str, Any]]]:
    """URL patterns relative to the server's base_url (the extension app prepends it)."""
    kwargs: dict[str, Any] = {"service": service}
    table: list[tuple[str, type[SnapshotAPIHandler], dict[str, Any]]] = [
        (r"snapshots", SnapshotsHandler, kwargs),
        (rf"snapshots/{SNAPSHOT_REF}", SnapshotHandler, kwargs),
        (rf"snapshots/{SNAPSHOT_REF}/restore", RestoreHandler, kwargs),
        (rf"kernels/{KERNEL_ID}/snapshots", KernelSnapshotsHandler, kwargs),
        (rf"kernels/{KERNEL_ID}/status", KernelStatusHandler, kwargs),
        (rf"kernels/{KERNEL_ID}/autosave", KernelAutosaveHandler,
         {**kwargs, "autosave": autosave}),
        (r"jobs", JobsHandler, kwargs),
        (rf"jobs/(?P<job_id>{JOB_ID_PATTERN})", JobHandler, kwargs),
    ]
    return [(f"/{API_PREFIX}/{pattern}", handler, kw) for pattern, handler, kw in table]
