"""What a rewind asks the kernel itself, on its control channel: its timeline, and a rewind
to before one of its cells.

A snapshot-ready kernel keeps a timeline, one point per cell (``kernel/timeline/``), and
answers two control messages: "your timeline" and "rewind to before cell N" (docs/rewind.md
gives their contents). Both faces call this with the kernel's connection info: the server
for ``GET kernels/{id}/timeline`` and ``POST kernels/{id}/rewind``, the CLI for a kernel
named by its id or its connection file. A refusal is one of the core's errors, so it reads
the same from either face (and maps to the same HTTP status).

The kernel answers on its control thread, also while a cell runs: it refuses a rewind then
(``KernelBusy``) rather than change names under the running cell.
"""

from __future__ import annotations

from typing import Any

from .._constants import KERNEL_DISPLAY_NAME, REWIND_REQUEST, TIMELINE_REQUEST
from ..core.errors import (
    InvalidRequest,
    KernelBusy,
    NoAnswer,
    NotReady,
    RewindFailed,
    RewindOutOfRange,
    SnapshotError,
)
from .save_requests import ask_kernel

# A kernel with the timeline answers at once, even mid-cell; one without never does. Some
# seconds more than that for a loaded machine.
TIMELINE_SECONDS = 15.0
# A rewind copies back what the undone cells changed: seconds for gigabytes.
REWIND_SECONDS = 600.0
# The kernel's error names (its reply's ``ename``), as the errors a user reads.
_REFUSALS: dict[str, type[SnapshotError]] = {
    "KernelBusy": KernelBusy,
    "RewindOutOfRange": RewindOutOfRange,
    "RewindFailed": RewindFailed,
    # The kernel's timeline is off (its default): it keeps none.
    "TimelineOff": NotReady,
}
_NO_TIMELINE_HINT = (
    f"is it a snapshot-ready kernel ('{KERNEL_DISPLAY_NAME}') started with this version, "
    "and awake (a hibernated kernel answers once woken)? A kernel that is still starting "
    "answers once it is ready"
)


def cell_count(before: object) -> int:
    """``before`` as the execution count a rewind goes back to before; InvalidRequest for
    anything else (JSON's true is no count)."""
    if isinstance(before, bool) or not isinstance(before, int):
        raise InvalidRequest(
            "request", f"'before' must be a cell's execution count, not {before!r}",
            hint='send {"before": N}, N the count in the cell\'s [N]')
    if before < 1:
        raise InvalidRequest("request", f"there is no cell [{before}]: counts start at 1")
    return before


def refusal(step: str, content: dict[str, Any], **details: Any) -> SnapshotError:
    """The error a kernel's error reply (``{"status": "error", "ename", "evalue"}``) stands
    for, its ``ename`` kept in ``details``."""
    ename = str(content.get("ename") or "error")
    cause = str(content.get("evalue") or f"the kernel answered {content!r}")
    kind = _REFUSALS.get(ename, SnapshotError)
    return kind(step, cause, details={"ename": ename, **details})


async def kernel_timeline(connection_info: dict[str, Any]) -> dict[str, Any]:
    """The kernel's timeline: its reply without ``status`` (``points``, ``rewindable``,
    ``running``, ``bytes``, ``limit_bytes``, ``dropped``)."""
    content = await ask_kernel(connection_info, TIMELINE_REQUEST, {}, TIMELINE_SECONDS)
    if content is None:
        raise NoAnswer(
            "timeline", "the kernel did not answer the request for its timeline within "
            f"{TIMELINE_SECONDS:.0f} s", hint=_NO_TIMELINE_HINT)
    if content.get("status") != "ok":
        raise refusal("timeline", content)
    return {key: value for key, value in content.items() if key != "status"}


async def rewind_kernel(connection_info: dict[str, Any], before: int) -> dict[str, Any]:
    """Rewind the kernel to before cell ``before``; the kernel's report of it (``undone``,
    ``restored``, ``removed``, ``not_restored``, ``caveats``)."""
    before = cell_count(before)
    # Asked first: a kernel without a timeline is told in seconds, not after a rewind's
    # wait; and a refused count is answered with the counts that can be asked.
    try:
        timeline = await kernel_timeline(connection_info)
    except SnapshotError as exc:
        # Told as the rewind's failure: that is what the user asked for.
        raise type(exc)("rewind", exc.cause, hint=exc.hint, details=exc.details) from None
    content = await ask_kernel(connection_info, REWIND_REQUEST, {"before": before},
                               REWIND_SECONDS)
    if content is None:
        raise NoAnswer(
            "rewind", f"the kernel did not answer the rewind within {REWIND_SECONDS:.0f} s; "
            "it may still be rewinding", hint="ask for its timeline to see where it stands")
    if content.get("status") != "ok":
        extra = {}
        if content.get("ename") == "RewindOutOfRange":
            extra["rewindable"] = list(timeline.get("rewindable") or [])
        raise refusal("rewind", content, **extra)
    report = content.get("report")
    if not isinstance(report, dict):
        # It says it rewound: no RewindFailed, which would claim nothing changed.
        raise SnapshotError("rewind", f"the kernel answered the rewind without its report: "
                            f"{content!r}", hint="ask for its timeline to see where it stands")
    return report
