"""The errors a user reads.

Every error names the step that failed, the cause, and what to do. The server maps the
classes here to HTTP statuses in one place; the CLI and the magic print ``str(error)``.
Each class has a ``code``, the machine-readable kind that clients branch on (the English
text may change; the codes are part of the API).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class SnapshotError(Exception):
    """A snapshot or restore step failed.

    ``step`` is one of the engine's phase names (preflight, suspend, dump, commit, resume,
    verify, restore, ...); ``log_path`` points at the kept CRIU log when there is one;
    ``details`` holds facts a client can act on (for ``ports_in_use``, the kernel holding them).
    """

    code = "failed"

    def __init__(
        self,
        step: str,
        cause: str,
        *,
        hint: str | None = None,
        log_path: Path | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        self.step = step
        self.cause = cause
        self.hint = hint
        self.log_path = log_path
        self.details: dict[str, Any] = dict(details or {})
        super().__init__(self.message)

    @property
    def message(self) -> str:
        text = f"{self.step} failed: {self.cause}"
        if self.hint:
            text += f". {self.hint[:1].upper()}{self.hint[1:]}"
        if self.log_path is not None:
            text += f" (log: {self.log_path})"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "step": self.step,
            "cause": self.cause,
            "hint": self.hint,
            "log": str(self.log_path) if self.log_path else None,
            "message": self.message,
            "details": self.details,
        }


class InvalidRequest(SnapshotError):
    """The request itself is wrong (bad name, bad option): nothing was touched."""

    code = "invalid_request"

    @property
    def message(self) -> str:
        # No step failed: the request was refused before any ran.
        text = self.cause
        if self.hint:
            text += f". {self.hint[:1].upper()}{self.hint[1:]}"
        return text


class NotFound(SnapshotError):
    """The snapshot or kernel named does not exist."""

    code = "not_found"


class Busy(SnapshotError):
    """Another snapshot operation on the same kernel is under way."""

    code = "busy"


class NotReady(SnapshotError):
    """The process cannot be snapshotted as launched (wrong kernel, missing privileges...)."""

    code = "not_ready"


class PortsInUse(SnapshotError):
    """A restore would listen on ports that something runs on now (often the original kernel).

    ``details["ports"]`` names the taken channels; the server adds ``holder_kernel_id`` and
    ``holder_notebook_path`` when one of its own kernels holds them.
    """

    code = "ports_in_use"


class KernelBusy(Busy):
    """The kernel runs a cell, and what was asked of it (a rewind) waits for no cell."""

    code = "kernel_busy"


class RewindOutOfRange(SnapshotError):
    """The kernel's timeline cannot go back to before that cell (no such point, or dropped
    for the limit); ``details["rewindable"]`` lists the cells it can go back to before."""

    code = "rewind_out_of_range"


class RewindFailed(SnapshotError):
    """The kernel tried a rewind and gave it up; its namespace is as it was before."""

    code = "rewind_failed"


class NoAnswer(SnapshotError):
    """The kernel did not answer a request on its control channel in time (it has no
    timeline, it is starting, or it is stuck)."""

    code = "no_answer"


class Interrupted(SnapshotError):
    """The caller asked the operation to stop (Ctrl-C, a server stopping); it rolled back."""

    code = "interrupted"

    def __init__(self, step: str) -> None:
        super().__init__(
            step,
            "interrupted; the save was rolled back and the kernel keeps running",
            hint="nothing was saved",
        )


class Incompatible(SnapshotError):
    """This node cannot run the snapshot (CPU flags, kernel series, mapped files, GPUs).

    ``details["differences"]`` lists each difference as ``{kind, text}``, kind being one of
    ``cpu``, ``kernel``, ``files``, ``gpu``.
    """

    code = "incompatible_node"
