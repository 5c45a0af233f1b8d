"""Points inside the store's work on page packs where the fault suite kills the process.

``arm(point)`` wraps one function of the product, in this process only, so that the process
SIGKILLs itself at that point, with no chance to clean up: the product's code carries no
test hook. ``testkit/fault_saver.py`` arms a point for a save (``--die-at``); run as
``python -m testkit.fault_points STORE REF POINT``, this module deletes snapshot REF and dies
at POINT of the delete.
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
from collections.abc import Callable
from typing import Any

from jupyter_gpu_snapshot.core.store import DELETING_PREFIX, PARTIAL_PREFIX, SnapshotStore, packs
from jupyter_gpu_snapshot.core.store.packs import collector
from jupyter_gpu_snapshot.core.store.snapshot import is_snapshot_id


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _after(owner: Any, name: str, when: Callable[..., bool] = lambda *a, **k: True) -> None:
    """Make ``owner.name`` die right after a call for which ``when(*args)`` holds."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def dying(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        if when(*args, **kwargs):
            die()
        return result

    setattr(owner, name, staticmethod(dying) if isinstance(
        owner.__dict__.get(name), staticmethod) else dying)


def _renamed(src: Callable[[str], bool], dst: Callable[[str], bool]) -> None:
    """Make ``os.rename`` die right after it renamed an entry ``src`` accepts to a name
    ``dst`` accepts: the store's publishing and unlisting renames, told apart by names."""
    def when(old: Any, new: Any, *args: Any, **kwargs: Any) -> bool:
        return src(str(old)) and dst(str(new))
    _after(os, "rename", when)


def _partial(name: str) -> bool:
    return name.startswith(PARTIAL_PREFIX)


def _doomed(name: str) -> bool:
    return name.startswith(DELETING_PREFIX)


POINTS: dict[str, Callable[[], None]] = {
    # A commit, once some of its new pages are in its pack, before the pack's ids exist.
    "writing-pack": lambda: _after(packs.PackWriter, "append"),
    # A commit, once its pack and the pack's ids are durable, before any recipe is written.
    "pack-written": lambda: _after(packs.PackWriter, "finish"),
    # A commit, right after the rename that publishes the snapshot, before the whole image
    # files that are now recipes are removed.
    "renamed": lambda: _renamed(_partial, is_snapshot_id),
    # A delete, once the snapshot is renamed out of the listing, before it is removed.
    "deleting": lambda: _renamed(is_snapshot_id, _doomed),
    # The delete's collector, once a mostly dead pack is rewritten, before the old one goes.
    "pack-rewritten": lambda: _after(collector, "rewrite"),
}


def arm(point: str) -> None:
    POINTS[point]()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("ref")
    parser.add_argument("point", choices=sorted(POINTS))
    args = parser.parse_args()
    arm(args.point)
    SnapshotStore(args.store).delete(args.ref)
    raise SystemExit(f"the delete finished without reaching {args.point!r}")


if __name__ == "__main__":
    main()
