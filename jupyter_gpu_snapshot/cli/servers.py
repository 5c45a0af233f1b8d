"""The user's running Jupyter servers, for the CLI commands that act through one
(hibernation is a state of a server's kernel slot, so it is the server that knows it).

A running server writes ``jpserver-<pid>.json`` (its URL and token) into the Jupyter
runtime directory; ``--url`` and ``--token`` name a server directly.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from jupyter_core.paths import jupyter_runtime_dir

from .._constants import API_PREFIX
from ..core.errors import NotFound, SnapshotError

REQUEST_SECONDS = 30.0


@dataclass(frozen=True)
class RunningServer:
    url: str  # base_url included, ending in /
    token: str

    def call(self, method: str, path: str, body: Any = None, step: str = "request") -> Any:
        """One call of the server's gpu-snapshot API; its error answer as a SnapshotError."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            urllib.parse.urljoin(self.url, f"{API_PREFIX}/{path}"), data=data, method=method,
            headers={"Authorization": f"token {self.token}",
                     "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            try:
                answer = json.loads(exc.read() or b"{}")
            except ValueError:
                answer = {}
            raise SnapshotError(
                str(answer.get("step") or step),
                str(answer.get("cause") or f"the server at {self.url} answered {exc.code}"),
                hint=answer.get("hint"),
            ) from None
        except OSError as exc:
            raise SnapshotError(step, f"cannot reach the server at {self.url}: {exc}") from None
        return json.loads(raw) if raw else None


def running_servers(runtime_dir: Path | None = None) -> list[RunningServer]:
    """The servers whose info files are in the runtime directory and whose process runs."""
    found: list[RunningServer] = []
    for path in sorted(Path(runtime_dir or jupyter_runtime_dir()).glob("jpserver-*.json")):
        try:
            info = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if info.get("sock") or not info.get("url") or not psutil.pid_exists(int(info["pid"])):
            continue
        url = str(info["url"]).rstrip("/") + "/" + str(info.get("base_url", "/")).lstrip("/")
        found.append(RunningServer(url if url.endswith("/") else url + "/", info.get("token", "")))
    return found


def chosen_servers(url: str | None, token: str | None) -> list[RunningServer]:
    """The server ``--url`` names, else every running server of this user."""
    if url:
        return [RunningServer(url if url.endswith("/") else url + "/", token or "")]
    servers = running_servers()
    if not servers:
        raise NotFound(
            "lookup", f"no running Jupyter server found in {jupyter_runtime_dir()}",
            hint="start one, or name it with --url (and --token)",
        )
    return servers
