"""A renamed notebook keeps its snapshots and its own autosave and hibernation choices.

jupyter_server emits a contents event for each rename made through its contents API:
JupyterLab's first save of ``Untitled.ipynb`` under the name the user gives it, a rename or
a move in the file browser, of a notebook or of the folder that holds it. Each one is kept
(``node.notebook_moves``: the snapshots taken before it belong to the notebook at its new
path), the notebook's overrides move to the new path (``notebook_policies``), and clients
are told (the snapshots/v1 event) so that they list the snapshots again. A rename made
around the server (``mv`` in a terminal, or while no server ran) is not seen.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from ..core.errors import SnapshotError
from ..node.notebook_moves import NotebookMoves
from .notebook_policies import NotebookPolicies

CONTENTS_EVENT_ID = "https://events.jupyter.org/jupyter_server/contents_service/v1"


class NotebookRenames:
    """Made by ``wiring``, which adds ``on_contents_action`` as a listener of jupyter_server's
    contents events."""

    def __init__(
        self,
        moves: NotebookMoves,
        policies: NotebookPolicies,
        log: logging.Logger,
        listing_changed: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.moves = moves
        self.policies = policies
        self.log = log
        self._listing_changed = listing_changed or (lambda _data: None)

    async def on_contents_action(self, logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        """A listener of the contents events: follows each rename."""
        if data.get("action") != "rename":
            return
        source, dest = data.get("source_path"), data.get("path")
        if not isinstance(source, str) or not isinstance(dest, str):
            return
        try:
            move = await asyncio.to_thread(self.moves.record, source, dest)
            if move is None:
                return
            await self.policies.moved(move.source, move.dest)
        except (OSError, SnapshotError) as exc:
            self.log.warning("gpu-snapshot: the snapshots of %s do not follow it to %s: %s",
                             source, dest, exc)
            return
        self.log.info("gpu-snapshot: %s is now %s; its snapshots and settings follow it",
                      move.source, move.dest)
        self._listing_changed({"action": "notebook_moved", "source_path": move.source,
                               "notebook_path": move.dest})
