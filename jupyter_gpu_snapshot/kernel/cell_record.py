"""The kernel's record of its cells, for the portable fallback.

When a snapshot's process image cannot be restored (another driver, other GPUs), the
user's state comes back from a portable copy of the namespace (``portable``, written on
request by ``portable_request``) and from re-running the cells this kernel ran.
``install(shell)`` sets up both, once, at start:

- For every cell (an execution with a count: ``store_history``), the count and the user's
  names it defined or rebound (a name whose value's ``id()`` changed, names of IPython's own
  left out; a value freed and replaced within one cell may reuse its id, and that rebinding
  is missed: holding the old values would keep them alive). The sources are IPython's own
  history, read when asked for. A cell is listed once it has finished. Silent executions
  are not cells.
- A handler on the control channel, which answers even while a cell runs:
  ``gpu_snapshot_cells_request`` (content ``{}``) is answered by
  ``gpu_snapshot_cells_reply``: ``{"status": "ok", "cells": [{"count", "source",
  "defined", "ok"}], "complete": bool, "omitted"?: int}``, in execution order. ``ok`` is
  false for a cell that raised. The sources add up to at most 2 MiB: beyond that the
  newest cells are kept, ``complete`` is false and ``omitted`` counts the older ones left
  out.
- The portable request, and the holding still of user code while a copy is written
  (``portable_request.install``).
- The timeline of the cells' changes and the rewind (``timeline.install``; kept where
  ``JUPYTER_GPU_SNAPSHOT_TIMELINE=on``, or once ``%gpu_snapshot timeline on`` asks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._constants import CELLS_REPLY, CELLS_REQUEST, HISTORY_SOURCE_BYTES
from . import portable_request, timeline
from .control_channel import error_content, send_reply
from .portable import is_user_name

if TYPE_CHECKING:
    from IPython.core.interactiveshell import ExecutionInfo, ExecutionResult, InteractiveShell


@dataclass(frozen=True)
class RecordedCell:
    count: int
    defined: tuple[str, ...]
    ok: bool


class CellRecorder:
    """Follows the shell's cells, and answers the cells request."""

    def __init__(self, shell: InteractiveShell) -> None:
        self.shell = shell
        self.cells: list[RecordedCell] = []
        # The names before each running cell, by its ExecutionInfo (cells can nest).
        self._before: dict[int, dict[str, int]] = {}

    # -- the shell's events (its thread) --------------------------------------------------
    def pre_run_cell(self, info: ExecutionInfo) -> None:
        if info.silent or not info.store_history:
            return
        self._before[id(info)] = {
            name: id(value) for name, value in self.shell.user_ns.items() if is_user_name(name)
        }

    def post_run_cell(self, result: ExecutionResult | None) -> None:
        if result is None:
            return
        before = self._before.pop(id(result.info), None)
        count = result.execution_count
        if before is None or count is None:
            return
        defined = tuple(
            name for name, value in self.shell.user_ns.items()
            if is_user_name(name) and before.get(name) != id(value)
        )
        cells = self.cells
        # Counts only grow, unless %reset started the history again.
        while cells and cells[-1].count >= count:
            cells.pop()
        cells.append(RecordedCell(count, defined, bool(result.success)))

    # -- what the control requests answer --------------------------------------------------
    def cells_content(self, limit: int = HISTORY_SOURCE_BYTES) -> dict[str, Any]:
        """The recorded cells, newest kept where their sources exceed ``limit`` bytes."""
        cells = list(self.cells)
        history = self.shell.history_manager
        sources: list[str] = list(history.input_hist_raw) if history is not None else []
        kept: list[dict[str, Any]] = []
        total = 0
        for cell in reversed(cells):
            source = sources[cell.count] if 0 <= cell.count < len(sources) else ""
            total += len(source.encode("utf-8", "surrogatepass"))
            if total > limit:
                break
            kept.append({"count": cell.count, "source": source,
                         "defined": list(cell.defined), "ok": cell.ok})
        kept.reverse()
        content: dict[str, Any] = {"status": "ok", "cells": kept,
                                   "complete": len(kept) == len(cells)}
        if len(kept) < len(cells):
            content["omitted"] = len(cells) - len(kept)
        return content

    # -- the control channel (its thread) -------------------------------------------------
    def cells_request(self, stream: Any, ident: Any, parent: dict[str, Any]) -> None:
        try:
            content = self.cells_content()
        except Exception as exc:
            content = error_content(exc)
        send_reply(self.shell, stream, CELLS_REPLY, content, parent, ident)


_recorder: CellRecorder | None = None


def install(shell: InteractiveShell) -> None:
    """Record this shell's cells and answer the control requests; again: nothing more."""
    global _recorder
    if _recorder is not None and _recorder.shell is shell:
        return
    portable_request.install(shell)
    recorder = CellRecorder(shell)
    events = shell.events
    events.register("pre_run_cell", recorder.pre_run_cell)
    events.register("post_run_cell", recorder.post_run_cell)
    kernel = getattr(shell, "kernel", None)
    handlers = getattr(kernel, "control_handlers", None)
    if isinstance(handlers, dict):
        handlers[CELLS_REQUEST] = recorder.cells_request
    _recorder = recorder
    timeline.install(shell)


def recorder() -> CellRecorder | None:
    """The recorder ``install`` set up, if any."""
    return _recorder
