"""The errors a user reads.

Every error names the step that failed, the cause, and what to do. The server maps the
classes here to HTTP statuses in one place; the CLI and the magic print ``str(error)``.
"""

from __future__ import annotations

from pathlib import Path


class SnapshotError(Exception):
    """A snapshot or restore step failed.

    ``step`` is one of the engine's phase names (preflight, suspend, dump, commit, resume,
    verify, restore, ...); ``log_path`` points at the kept CRIU log when there is one.
    """

    def __init__(
        self,
        step: str,
        cause: str,
        *,
        hint: str | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.step = step
        self.cause = cause
        self.hint = hint
        self.log_path = log_path
        super().__init__(self.message)

    @property
    def message(self) -> str:
        text = f"{self.step} failed: {self.cause}"
        if self.hint:
            text += f". {self.hint}"
        if self.log_path is not None:
            text += f" (log: {self.log_path})"
        return text

    def to_dict(self) -> dict[str, str | None]:
        return {
            "step": self.step,
            "cause": self.cause,
            "hint": self.hint,
            "log": str(self.log_path) if self.log_path else None,
            "message": self.message,
        }


class InvalidRequest(SnapshotError):
    """The request itself is wrong (bad name, bad option): nothing was touched."""


class NotFound(SnapshotError):
    """The snapshot or kernel named does not exist."""


class Busy(SnapshotError):
    """Another snapshot operation on the same kernel is under way."""


class NotReady(SnapshotError):
    """The process cannot be snapshotted as launched (wrong kernel, missing privileges...)."""


class Interrupted(SnapshotError):
    """The caller asked the operation to stop (Ctrl-C, a server stopping); it rolled back."""

    def __init__(self, step: str) -> None:
        super().__init__(
            step,
            "interrupted; the save was rolled back and the kernel keeps running",
            hint="nothing was saved",
        )
