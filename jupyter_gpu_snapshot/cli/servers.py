"""The commands that act through the user's running Jupyter servers: ``hibernation``,
``hibernate`` and ``wake`` (hibernation is a state of a server's kernel slot, so it is the
server that knows it).

A running server writes ``jpserver-<pid>.json`` (its URL and token) into the Jupyter
runtime directory; ``--url`` and ``--token`` name a server directly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
from jupyter_core.paths import jupyter_runtime_dir

from .._constants import API_PREFIX, format_bytes, table
from ..core.errors import NotFound, SnapshotError
from .output import print_json, say

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


def cmd_hibernation(args: argparse.Namespace) -> int:
    """The hibernated kernels of the running servers (or of the one --url names)."""
    kernels: list[dict[str, Any]] = []
    for server in chosen_servers(args.url, args.token):
        listing = server.call("GET", "hibernation", step="list")
        kernels += [{**k, "server": server.url} for k in listing["kernels"]]
    if args.json:
        print_json(kernels)
        return 0
    if not kernels:
        say("no hibernated kernels")
        return 0
    rows = [["KERNEL", "STATE", "TIER", "NOTEBOOK", "GPU FREED", "SINCE", "SNAPSHOT", "SERVER"]]
    for k in kernels:
        since = datetime.fromtimestamp(k["since"]).strftime("%Y-%m-%d %H:%M:%S") \
            if k.get("since") else "-"
        rows.append([
            k["kernel_id"], k["state"], k.get("tier") or "process", k.get("notebook_path") or "-",
            format_bytes(k.get("gpu_bytes_freed") or 0), since, k.get("snapshot_id") or "-",
            k["server"],
        ])
    say(table(rows))
    return 0


def _server_of(args: argparse.Namespace) -> RunningServer:
    """The running server that has kernel ``args.kernel_id``."""
    for server in chosen_servers(args.url, args.token):
        with contextlib.suppress(SnapshotError):
            server.call("GET", f"kernels/{args.kernel_id}/status", step="lookup")
            return server
    raise NotFound("lookup", f"no running server has kernel {args.kernel_id!r}",
                   hint="'jupyter gpu-snapshot hibernation' lists the hibernated kernels")


def cmd_hibernate(args: argparse.Namespace) -> int:
    state = _server_of(args).call(
        "POST", f"kernels/{args.kernel_id}/hibernate", {"when_idle": True, "tier": args.tier},
        step="hibernate")
    say(f"kernel {args.kernel_id}: {state['state']}"
        + (" (as soon as it is idle)" if state["state"] == "requested" else ""))
    return 0


def cmd_wake(args: argparse.Namespace) -> int:
    state = _server_of(args).call("POST", f"kernels/{args.kernel_id}/wake", step="wake")
    say(f"kernel {args.kernel_id}: {state['state']} (job {state.get('job_id') or '-'})")
    return 0
