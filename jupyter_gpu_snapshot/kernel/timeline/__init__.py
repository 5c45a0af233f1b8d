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

from typing import TYPE_CHECKING

from ..._constants import REWIND_REPLY, REWIND_REQUEST, TIMELINE_REPLY, TIMELINE_REQUEST
from .limits import ENV_LIMIT_BYTES, ENV_MAX_POINTS, ENV_TIMELINE, enabled_by_env, limits_from_env
from .requests import TimelineRequests, answer_off
from .timeline import KernelBusy, RewindFailed, RewindOutOfRange, Timeline

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell

__all__ = [
    "ENV_LIMIT_BYTES",
    "ENV_MAX_POINTS",
    "ENV_TIMELINE",
    "KernelBusy",
    "RewindFailed",
    "RewindOutOfRange",
    "Timeline",
    "current",
    "install",
]

_installed: Timeline | None = None


def install(shell: InteractiveShell) -> Timeline | None:
    """Keep this shell's timeline and answer its control requests; again: nothing more.
    None where the environment turned it off (``JUPYTER_GPU_SNAPSHOT_TIMELINE=off``)."""
    global _installed
    if _installed is not None and _installed.shell is shell:
        return _installed
    handlers = getattr(getattr(shell, "kernel", None), "control_handlers", None)
    if not enabled_by_env():
        if isinstance(handlers, dict):
            handlers[TIMELINE_REQUEST] = answer_off(shell, TIMELINE_REPLY)
            handlers[REWIND_REQUEST] = answer_off(shell, REWIND_REPLY)
        return None
    limit_bytes, max_points = limits_from_env()
    timeline = Timeline(shell, limit_bytes, max_points)
    shell.events.register("pre_run_cell", timeline.pre_run_cell)
    shell.events.register("post_run_cell", timeline.post_run_cell)
    if isinstance(handlers, dict):
        requests = TimelineRequests(timeline)
        handlers[TIMELINE_REQUEST] = requests.timeline_request
        handlers[REWIND_REQUEST] = requests.rewind_request
    _installed = timeline
    return timeline


def current() -> Timeline | None:
    """The timeline ``install`` set up, if any."""
    return _installed
