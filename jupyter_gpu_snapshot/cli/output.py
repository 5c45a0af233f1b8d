"""How the commands print: plain lines on stdout, never wrapped, so that ids and paths copy
whole; JSON for programs; rich's colours, tables and progress bar where a person reads them.

rich is imported by the first command that draws with it, never by a listing's lines.
"""

from __future__ import annotations

import functools
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from ..core.hooks import Progress


def say(text: str) -> None:
    """A message on stdout as plain lines."""
    sys.stdout.write(text + "\n")


def print_json(data: Any) -> None:
    # Plain JSON for programs: rich would colour it wherever FORCE_COLOR is set (ipykernel
    # sets it, so `!jupyter gpu-snapshot list --json` in a cell got escape codes).
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@functools.cache
def console(stderr: bool = False) -> Console:
    """The rich console of stdout (or of stderr), made at its first use."""
    from rich.console import Console

    return Console(stderr=stderr)


def warn(markup: str) -> None:
    """One line on stderr with rich's markup, e.g. ``[red]error:[/] ...``, never folded."""
    console(stderr=True).print(markup, highlight=False, soft_wrap=True)


class ProgressBar:
    """The engine's progress on stderr while a person watches; with ``enabled`` false (--json,
    stderr no terminal) it draws nothing and rich is not imported."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: Any = None
        self._task: Any = None

    def __enter__(self) -> ProgressBar:
        if self.enabled:
            from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

            self._bar = Progress(
                TextColumn("{task.description:>9}"), BarColumn(), DownloadColumn(),
                console=console(stderr=True), transient=True,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("preflight", total=None)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.__exit__(None, None, None)

    def __call__(self, p: Progress) -> None:
        if self._bar is not None:
            self._bar.update(self._task, description=p.phase, completed=p.done,
                             total=p.total or None)


def stderr_is_terminal() -> bool:
    """Whether a person watches stderr, as rich judges it (FORCE_COLOR and the like)."""
    return bool(console(stderr=True).is_terminal)
