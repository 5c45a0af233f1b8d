"""The notebooks' policy overrides kept in the user's own directory: never read or written
through a link; and the notebook's idle times of hibernation, which ride in the same policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from jupyter_gpu_snapshot.config import GPUSnapshot
from jupyter_gpu_snapshot.core.errors import InvalidRequest
from jupyter_gpu_snapshot.server.notebook_policies import (
    OVERRIDES_FILE,
    NotebookPolicies,
    check_override,
)


def _policies(directory: Path, **settings: Any) -> NotebookPolicies:
    return NotebookPolicies(directory, GPUSnapshot(store_dir=str(directory), **settings))


def test_overrides_round_trip_privately_and_a_planted_link_is_never_followed(tmp_path: Path):
    directory = tmp_path / "store"
    policies = _policies(directory)
    policies.write_overrides({"n.ipynb": {"enabled": False}})
    written = directory / OVERRIDES_FILE
    assert written.stat().st_mode & 0o777 == 0o600
    assert policies.read_overrides() == {"n.ipynb": {"enabled": False}}

    outside = tmp_path / "outside.json"
    outside.write_text(json.dumps({"x.ipynb": {"enabled": False}}))
    written.unlink()
    written.symlink_to(outside)
    assert policies.read_overrides() == {}  # the link is ignored, with a warning
    (directory / f"{OVERRIDES_FILE}.new").symlink_to(outside)
    policies.write_overrides({"n.ipynb": {"interval_minutes": 5.0}})
    assert json.loads(outside.read_text()) == {"x.ipynb": {"enabled": False}}
    assert not written.is_symlink()
    assert policies.read_overrides() == {"n.ipynb": {"interval_minutes": 5.0}}


def test_a_notebooks_idle_times_win_over_the_servers_in_each_tier(tmp_path: Path):
    policies = _policies(tmp_path / "store", release_gpu_after_minutes=5.0,
                         hibernate_after_minutes=30.0)
    policy = policies.policy("n.ipynb").to_dict()
    assert (policy["release_gpu_after_minutes"], policy["hibernate_after_minutes"]) == (5, 30)

    # 0 is the notebook's "never", kept as such; None puts the server's setting back.
    assert check_override({"release_gpu_after_minutes": 0, "hibernate_after_minutes": None}) == {
        "release_gpu_after_minutes": 0.0, "hibernate_after_minutes": None}
    policies.write_overrides({"n.ipynb": check_override({"release_gpu_after_minutes": 2})})
    policies.load()
    assert policies.overrides == {"n.ipynb": {"release_gpu_after_minutes": 2.0}}
    assert policies.policy("n.ipynb").release_gpu_after_minutes == 2.0
    assert policies.policy("n.ipynb").hibernate_after_minutes == 30.0
    assert policies.policy("other.ipynb").release_gpu_after_minutes == 5.0


@pytest.mark.parametrize(("value", "says"), [
    (-1, "must be 0 or more"), (True, "has the wrong type"), ("5", "has the wrong type"),
])
def test_an_idle_time_that_is_no_number_of_minutes_is_refused(value: Any, says: str):
    for field in ("release_gpu_after_minutes", "hibernate_after_minutes"):
        with pytest.raises(InvalidRequest) as refused:
            check_override({field: value})
        assert refused.value.message == f"autosave field {field!r} {says}"
