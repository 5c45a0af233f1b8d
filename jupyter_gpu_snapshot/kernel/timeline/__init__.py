"""A kernel's timeline: after every cell, copies of what it changed; and the rewind that puts
the namespace back to how it was before any recorded cell.

``fingerprint`` finds cheaply what a cell changed (``scope``: which names it could reach),
``copies`` keeps the copies of one point, ``restore`` prepares and applies a rewind,
``timeline`` holds the points within their ``limits``, ``requests`` answers the control channel (the
magic and the CLI say it in words with ``_constants.timeline_lines`` and
``rewind_report_lines``). ``install(shell)`` sets it up once; ``cell_record``
calls it for every snapshot-ready kernel. docs/rewind.md says what is exact and what not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..._constants import REWIND_REPLY, REWIND_REQUEST, TIMELINE_REPLY, TIMELINE_REQUEST
from .limits import (
    ENV_LIMIT_BYTES,
    ENV_MAX_POINTS,
    ENV_TIMELINE,
    TIMELINE_OFF,
    enabled_by_env,
    limits_from_env,
)
from .requests import TimelineRequests, answer_off
from .timeline import KernelBusy, RewindFailed, RewindOutOfRange, Timeline

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__all__ = [
    "ENV_LIMIT_BYTES",
    "ENV_MAX_POINTS",
    "ENV_TIMELINE",
    "TIMELINE_OFF",
    "KernelBusy",
    "RewindFailed",
    "RewindOutOfRange",
    "Timeline",
    "current",
    "install",
    "start",
    "stop",
]

_installed: Timeline | None = None
_shell: InteractiveShell | None = None


def install(shell: InteractiveShell) -> Timeline | None:
    """Answer this shell's timeline requests, and keep its timeline where the environment
    asks for it (``JUPYTER_GPU_SNAPSHOT_TIMELINE=on``; ``start`` turns it on later); again:
    nothing more. The timeline, or None while it is off."""
    global _shell
    if _shell is shell:
        return _installed
    _shell = shell
    if enabled_by_env():
        return start(shell)
    _answer_off(shell)
    return None


def start(shell: InteractiveShell) -> Timeline:
    """Keep a timeline of this shell's cells from now on (the one kept already, if any)."""
    global _installed, _shell
    if _installed is not None and _installed.shell is shell:
        return _installed
    _shell = shell
    limit_bytes, max_points = limits_from_env()
    timeline = Timeline(shell, limit_bytes, max_points)
    shell.events.register("pre_run_cell", timeline.pre_run_cell)
    shell.events.register("post_run_cell", timeline.post_run_cell)
    handlers = _handlers(shell)
    if handlers is not None:
        requests = TimelineRequests(timeline)
        handlers[TIMELINE_REQUEST] = requests.timeline_request
        handlers[REWIND_REQUEST] = requests.rewind_request
    _installed = timeline
    return timeline


def stop(shell: InteractiveShell) -> None:
    """Keep no timeline any more: its points and their copies are let go."""
    global _installed
    timeline = _installed
    if timeline is None or timeline.shell is not shell:
        return
    shell.events.unregister("pre_run_cell", timeline.pre_run_cell)
    shell.events.unregister("post_run_cell", timeline.post_run_cell)
    _installed = None
    _answer_off(shell)


def _handlers(shell: InteractiveShell) -> dict[str, Any] | None:
    handlers = getattr(getattr(shell, "kernel", None), "control_handlers", None)
    return handlers if isinstance(handlers, dict) else None


def _answer_off(shell: InteractiveShell) -> None:
    handlers = _handlers(shell)
    if handlers is not None:
        handlers[TIMELINE_REQUEST] = answer_off(shell, TIMELINE_REPLY)
        handlers[REWIND_REQUEST] = answer_off(shell, REWIND_REPLY)


def current() -> Timeline | None:
    """The timeline ``install`` set up, if any."""
    return _installed
