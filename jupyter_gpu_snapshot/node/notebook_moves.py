"""Where a snapshot's notebook is now: the notebook renames the server has seen.

A snapshot's manifest names the notebook it was saved from, and the manifest is signed: it
is never rewritten. A notebook that moves afterwards takes its snapshots along: JupyterLab's
first save renames ``Untitled.ipynb`` to the name the user gives it, the file browser renames
notebooks and the folders that hold them. The server records each rename it sees
(jupyter_server's contents events, ``server.wiring``) with its time, in ``MOVES_FILE`` beside
the snapshots (``NodeEngine.own_dir``, the user's own directory); a snapshot's notebook is
then its saved path carried through the renames made after the snapshot was taken, in
order. A notebook made later at the old path (the next ``Untitled.ipynb``) is a new one: the
snapshots taken before the rename are not its own.

``NodeSnapshots`` places every snapshot it hands out (``place``), so that the listings, a
kernel's status, retention and what a kernel's credential reaches all agree.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..core import safe_fs
from ..core.store import Snapshot

log = logging.getLogger(__name__)

# Dot files in the store's root are no snapshots (``snapshot.is_snapshot_id``).
MOVES_FILE = ".notebook-moves.json"
MOVES_LIMIT = 4 << 20
# The newest renames kept: an older one only moves snapshots older than it, if any are left.
MOVES_KEPT = 2000


@dataclass(frozen=True)
class Move:
    """A notebook (or a folder of them) renamed from ``source`` to ``dest`` at ``at``."""

    source: str
    dest: str
    at: float

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "dest": self.dest, "at": self.at}


def carried(path: str, created: float, moves: list[Move]) -> str:
    """``path`` (a notebook's when a snapshot was taken at ``created``) through the renames
    made after that, oldest first."""
    for move in moves:
        if move.at <= created:
            continue
        if path == move.source:
            path = move.dest
        elif path.startswith(move.source + "/"):
            path = move.dest + path[len(move.source):]
    return path


def _api_path(path: str) -> str:
    return path.strip("/")


class NotebookMoves:
    """The renames kept in ``directory`` (None: nothing is kept, nothing moves). The server
    records them; the server and the CLI place snapshots with them. Thread-safe."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._moves: list[Move] = []
        # (inode, mtime, size) of the file when it was read: another process may write it.
        self._stamp: tuple[int, int, int] | None = None

    # -- reading -------------------------------------------------------------------------------
    def moves(self) -> list[Move]:
        """Every kept rename, oldest first, as the file says now. Blocks (a stat)."""
        with self._lock:
            self._refresh()
            return list(self._moves)

    def place(self, snapshot: Snapshot) -> Snapshot:
        """``snapshot`` with its notebook where it is now (``Snapshot.moved_notebook``)."""
        saved = snapshot.saved_notebook_path
        if saved is None:
            return snapshot
        moves = self.moves()
        now = carried(saved, snapshot.created, moves) if moves else saved
        return snapshot if now == saved else replace(snapshot, moved_notebook=now)

    def _refresh(self) -> None:
        if self.directory is None:
            return
        path = self.directory / MOVES_FILE
        try:
            st = os.stat(path, follow_symlinks=False)
        except OSError:
            self._moves, self._stamp = [], None
            return
        stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return
        self._moves, self._stamp = self._read(), stamp

    def _read(self) -> list[Move]:
        """The file's renames; none when it cannot be read (a link or a non-file there is
        refused, never followed)."""
        assert self.directory is not None
        try:
            with safe_fs.opened_dir(os.path.realpath(self.directory)) as dir_fd:
                data = json.loads(safe_fs.read_small(MOVES_FILE, dir_fd, MOVES_LIMIT))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            log.warning("gpu-snapshot: ignoring %s: %s", self.directory / MOVES_FILE, exc)
            return []
        moves: list[Move] = []
        for item in data.get("moves", []) if isinstance(data, dict) else []:
            with contextlib.suppress(AttributeError, KeyError, TypeError, ValueError):
                source, dest = str(item["source"]), str(item["dest"])
                if source and dest:
                    moves.append(Move(source, dest, float(item["at"])))
        return sorted(moves, key=lambda m: m.at)

    # -- recording -----------------------------------------------------------------------------
    def record(self, source: str, dest: str, at: float | None = None) -> Move | None:
        """Keep that ``source`` (a notebook or a folder) is now ``dest``; called by the
        server for each rename of its contents. Blocks: run it in a worker thread.

        The directory is made private (0700) if missing, as the store makes its root, and
        refused unless private; the file is replaced through the directory's fd, never
        through a link.
        """
        source, dest = _api_path(source), _api_path(dest)
        if self.directory is None or not source or not dest or source == dest:
            return None
        move = Move(source, dest, time.time() if at is None else at)
        with self._lock:
            self._refresh()
            kept = [*self._moves, move][-MOVES_KEPT:]
            self._write(kept)
            self._moves = kept
        return move

    def _write(self, moves: list[Move]) -> None:
        assert self.directory is not None
        safe_fs.make_private_dirs(self.directory)
        safe_fs.tighten_own_dir(self.directory)
        safe_fs.require_private_dir(self.directory)
        spare = f"{MOVES_FILE}.new"
        data = json.dumps({"moves": [m.to_dict() for m in moves]}, indent=1).encode()
        with safe_fs.opened_dir(os.path.realpath(self.directory)) as dir_fd:
            safe_fs.remove_at(spare, dir_fd)
            safe_fs.write_new(spare, dir_fd, data)
            os.replace(spare, MOVES_FILE, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            st = os.stat(MOVES_FILE, dir_fd=dir_fd, follow_symlinks=False)
        self._stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
