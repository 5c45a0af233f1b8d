"""When a snapshot's image cannot come back, the work it held still can: its portable copy
loaded into a fresh kernel, its recorded cells re-run there, or both.

A process image restores only where the node matches it (driver branch, GPU models, criu,
Linux). A snapshot may also carry what survives any node: the cells the kernel ran, with the
names each defined (the manifest's "history", recorded at every save), and, when asked for,
a portable copy of the namespace (the manifest's "portable": tensors and arrays in
safetensors files, the rest through dill; ``kernel/portable/``). The three ways back:

- ``portable``: load the copy; tensors go to the device kind they were on where this node
  has one, else to the CPU, and the report says so;
- ``replay``: re-run every recorded cell, in order;
- ``both``: load the copy, then re-run only the cells that defined a name the copy lacks.

What none of them brings back (open files, sockets, threads, processes, generators, and
whatever a cell did outside the namespace) is named in the report or in docs/fallback.md.

Both faces use this module: the server around a new kernel slot, the CLI around a kernel
it starts itself. It speaks to the fresh kernel through a jupyter_client kernel client and
never trusts the kernel's answers beyond showing them: the kernel is the user's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from queue import Empty
from typing import Any

from jupyter_core.utils import ensure_async

from .._constants import FALLBACK_MODES
from ..core.errors import (
    Busy,
    Interrupted,
    InvalidRequest,
    NotFound,
    PortsInUse,
    SnapshotError,
)
from ..core.store import Snapshot, fallbacks_offered
from .engine import NodeEngine

PORTABLE, REPLAY, BOTH = FALLBACK_MODES
MODES = FALLBACK_MODES

# How often a wait for the fresh kernel's reply checks that it still lives.
ALIVE_CHECK_SECONDS = 2.0

Say = Callable[[str], None]


@dataclass(frozen=True)
class FreshKernel:
    """The kernel a fallback fills: a started jupyter_client client of its shell channel,
    and whether its process still lives."""

    client: Any
    alive: Callable[[], Awaitable[bool]]


def offered(manifest: dict[str, Any]) -> list[str]:
    """The ways back a snapshot offers (``core.store.fallbacks_offered``)."""
    return fallbacks_offered(manifest)


def require_offered(snapshot: Snapshot, mode: str) -> None:
    """Refuse ``mode`` for ``snapshot`` before anything starts, saying what it offers."""
    if mode not in MODES:
        raise InvalidRequest("preflight", f"unknown fallback {mode!r}",
                             hint=f"choose one of {', '.join(MODES)}")
    snapshot.require_trusted("preflight")
    modes = offered(snapshot.manifest)
    if mode not in modes:
        has = ", ".join(modes) if modes else "no fallback (it was saved without a portable "\
            "copy and recorded no cells)"
        raise InvalidRequest(
            "preflight", f"snapshot {snapshot.name} cannot come back by {mode}: it offers {has}",
            hint="save with a portable copy (%gpu_snapshot save --portable) to carry the "
            "namespace itself" if mode != REPLAY else None,
        )


def needs_portable_files(mode: str) -> bool:
    return mode in (PORTABLE, BOTH)


def cells_to_replay(manifest: dict[str, Any], mode: str, loaded: set[str]) -> list[dict[str, Any]]:
    """The recorded cells ``mode`` re-runs, in order: all of them for ``replay``; for
    ``both``, those that defined a name the copy did not bring back (``loaded`` holds the
    names it did). A cell that defined nothing (a print, a change made in place) is re-run
    only by ``replay``."""
    cells = list((manifest.get("history") or {}).get("cells", []))
    if mode == REPLAY:
        return cells
    if mode == BOTH:
        return [cell for cell in cells if set(cell["defined"]) - loaded]
    return []


def load_expression(directory: Path, portable: dict[str, Any]) -> str:
    """The user expression the fresh kernel evaluates to load the copy in ``directory``
    (``kernel.portable.load_into_kernel``): handed the copy's report from the signed
    manifest, it leaves nothing in the namespace but the names it loads."""
    return (
        "__import__('jupyter_gpu_snapshot.kernel.portable', fromlist=['load_into_kernel'])"
        f".load_into_kernel({str(directory)!r}, {json.dumps(portable)!r})"
    )


def offer_for(error: SnapshotError, snapshot: Snapshot) -> list[str]:
    """The fallbacks a failed restore of ``snapshot`` offers: those of a trusted snapshot
    whose image was refused or failed. A refusal about the request or this moment (taken
    ports, a busy snapshot, an interrupted restore) offers none: trying again can work."""
    if isinstance(error, (PortsInUse, Busy, InvalidRequest, NotFound, Interrupted)):
        return []
    return offered(snapshot.manifest) if snapshot.trusted else []


async def bring_back(
    kernel: FreshKernel,
    engine: NodeEngine,
    snapshot: Snapshot,
    mode: str,
    say: Say,
) -> dict[str, Any]:
    """Load and/or replay into the fresh ``kernel``; return the report: ``{mode, loaded,
    not_loaded, replayed, notes}``. The modes that load the portable copy get it from
    ``engine``, every file checked against its signed digest first.

    Raises SnapshotError only when the kernel itself failed (it died); a name or a cell
    that fails is in the report.
    """
    with contextlib.ExitStack() as held:
        portable_dir = None
        if needs_portable_files(mode):
            say("checking the portable copy")
            portable_dir = await asyncio.to_thread(
                held.enter_context, engine.portable_files(snapshot))
        return await _bring_back(kernel, snapshot, mode, portable_dir, say)


async def _bring_back(
    kernel: FreshKernel,
    snapshot: Snapshot,
    mode: str,
    portable_dir: Path | None,
    say: Say,
) -> dict[str, Any]:
    manifest = snapshot.manifest
    report: dict[str, Any] = {"mode": mode, "loaded": [], "not_loaded": [], "replayed": [],
                              "notes": []}
    loaded: set[str] = set()
    if portable_dir is not None:
        say("loading the portable copy")
        load = await _load(kernel, portable_dir, manifest["portable"])
        report["loaded"] = load.get("loaded", [])
        report["not_loaded"] = load.get("not_loaded", [])
        report["notes"].extend(load.get("notes", []))
        loaded = {str(entry.get("name")) for entry in report["loaded"]}
    cells = cells_to_replay(manifest, mode, loaded)
    history = manifest.get("history") or {}
    if cells and not history.get("complete", True):
        report["notes"].append(
            f"the {history.get('omitted', 0)} oldest cells were not recorded; "
            "names they alone defined do not come back")
    for number, cell in enumerate(cells, 1):
        say(f"re-running cell [{cell['count']}] ({number} of {len(cells)})")
        report["replayed"].append(await _replay(kernel, cell))
    if mode == BOTH:
        # A cell that failed again rebuilt nothing: what only it defined is still missing.
        rebuilt = [cell for cell, ran in zip(cells, report["replayed"], strict=True)
                   if ran["status"] == "ok"]
        missing = _still_missing(manifest, loaded, rebuilt)
        report["not_loaded"] = [entry for entry in report["not_loaded"]
                                if entry.get("name") in missing]
    return report


async def _load(kernel: FreshKernel, directory: Path,
                portable: dict[str, Any]) -> dict[str, Any]:
    reply = await _execute(kernel, "", store_history=False,
                           user_expressions={"portable": load_expression(directory, portable)})
    content = reply["content"]
    found = (content.get("user_expressions") or {}).get("portable") or {}
    if content.get("status") != "ok" or found.get("status") != "ok":
        failure = found if found.get("status") == "error" else content
        raise SnapshotError(
            "load", "the fresh kernel could not load the portable copy: "
            f"{failure.get('ename')}: {failure.get('evalue')}",
            hint="re-run the cells instead (fallback replay), if the snapshot recorded them")
    data = found.get("data") or {}
    loaded = data.get("application/json")
    if not isinstance(loaded, dict):
        raise SnapshotError("load", "the fresh kernel's load report is unreadable")
    return loaded


async def _replay(kernel: FreshKernel, cell: dict[str, Any]) -> dict[str, Any]:
    reply = await _execute(kernel, cell["source"], store_history=True)
    content = reply["content"]
    entry: dict[str, Any] = {"count": cell["count"], "status": content.get("status", "error")}
    if entry["status"] != "ok":
        entry["error"] = f"{content.get('ename')}: {content.get('evalue')}"
        if cell.get("ok") is False:
            entry["error"] += " (it raised when it first ran, too)"
    return entry


async def _execute(kernel: FreshKernel, code: str, store_history: bool,
                   user_expressions: dict[str, str] | None = None) -> dict[str, Any]:
    """One execute request and its reply. No time limit: a cell re-run may train for hours;
    a kernel that dies ends the wait (asked every few seconds)."""
    client = kernel.client
    msg_id = client.execute(code, silent=False, store_history=store_history,
                            user_expressions=user_expressions or {}, allow_stdin=False)
    while True:
        try:
            reply: dict[str, Any] = await ensure_async(
                client.get_shell_msg(timeout=ALIVE_CHECK_SECONDS))
        except (Empty, asyncio.TimeoutError):
            if not await kernel.alive():
                raise SnapshotError(
                    "replay" if store_history else "load", "the fresh kernel died",
                    hint="the snapshot is intact; its kernel's log may say why") from None
            continue
        if reply.get("parent_header", {}).get("msg_id") == msg_id:
            return reply


def _still_missing(manifest: dict[str, Any], loaded: set[str],
                   replayed: list[dict[str, Any]]) -> set[str]:
    """The names neither loaded nor defined by a cell that ran again without an error."""
    rebuilt = {name for cell in replayed for name in cell["defined"]}
    carried_or_not = {entry["name"] for entry in
                      (manifest.get("portable") or {}).get("not_carried", [])}
    return (carried_or_not | _all_defined(manifest)) - loaded - rebuilt


def _all_defined(manifest: dict[str, Any]) -> set[str]:
    return {name for cell in (manifest.get("history") or {}).get("cells", [])
            for name in cell["defined"]}

