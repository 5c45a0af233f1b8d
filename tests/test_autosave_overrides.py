"""The autosave policy overrides kept in the store's root: never read or written through a link."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core.store import SnapshotStore
from jupyter_gpu_snapshot.server.autosave import OVERRIDES_FILE, AutosaveScheduler


def _scheduler(store: SnapshotStore) -> AutosaveScheduler:
    service: Any = SimpleNamespace(engine=SimpleNamespace(store=store))
    return AutosaveScheduler(service, GPUSnapshot(store_dir=str(store.root)))


def test_overrides_round_trip_privately_and_a_planted_link_is_never_followed(tmp_path: Path):
    store = SnapshotStore(tmp_path / "store")
    scheduler = _scheduler(store)
    scheduler._save_overrides({"n.ipynb": {"enabled": False}})
    written = store.root / OVERRIDES_FILE
    assert written.stat().st_mode & 0o777 == 0o600
    assert scheduler._load_overrides() == {"n.ipynb": {"enabled": False}}

    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"x.ipynb": {"enabled": False}}))
    written.unlink()
    written.symlink_to(outside)
    assert scheduler._load_overrides() == {}  # the link is ignored, with a warning
    (store.root / f"{OVERRIDES_FILE}.new").symlink_to(outside)
    scheduler._save_overrides({"n.ipynb": {"interval_minutes": 5.0}})
    assert json.loads(outside.read_text()) == {"x.ipynb": {"enabled": False}}
    assert not written.is_symlink()
    assert scheduler._load_overrides() == {"n.ipynb": {"interval_minutes": 5.0}}
