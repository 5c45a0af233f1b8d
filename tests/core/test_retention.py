"""The retention rules and the save-time model, as tables of cases over snapshot summaries."""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest

from jupyter_gpu_snapshot.core import estimate
from jupyter_gpu_snapshot.core.store import default_name, retention, validate_name


def snap(sid: str, created: float, reason: str = "autosave", notebook: str | None = "a.ipynb",
         name: str | None = None, size: int = 100, kernel_id: str = "k1",
         **extra: Any) -> dict[str, Any]:
    return {
        "id": sid, "created": created, "reason": reason, "notebook_path": notebook,
        "name": name or f"python3-snapshot-{sid}", "size_bytes": size,
        "kernel": {"name": "python3-snapshot", "kernel_id": kernel_id}, **extra,
    }


CASES = [
    # (what, snapshots, committed id, keep_autosaves, keep_last, deleted)
    ("the third autosave removes the oldest",
     [snap("a1", 1), snap("a2", 2), snap("a3", 3)], "a3", 2, 0, ["a1"]),
    ("a user's save removes no autosave",
     [snap("a1", 1), snap("a2", 2), snap("a3", 3), snap("u1", 4, "user")], "u1", 2, 0, []),
    ("other notebooks do not count",
     [snap("b1", 1, notebook="b.ipynb"), snap("a1", 2), snap("a2", 3)], "a2", 1, 0, ["a1"]),
    ("named snapshots survive keep_last; unnamed ones do not",
     [snap("u1", 1, "user", name="before-train"), snap("u2", 2, "user"), snap("s1", 3,
      "shutdown"), snap("a1", 4)], "a1", 2, 1, ["u2", "s1"]),
    ("kernels without a notebook keep their own autosaves",
     [snap("x1", 1, notebook=None, kernel_id="kx"), snap("x2", 2, notebook=None,
      kernel_id="kx"), snap("y1", 3, notebook=None, kernel_id="ky")], "x2", 1, 0, ["x1"]),
    ("keep 0 keeps every autosave",
     [snap("a1", 1), snap("a2", 2)], "a2", 0, 0, []),
]


@pytest.mark.parametrize(("what", "snapshots", "committed", "keep", "keep_last", "deleted"),
                         CASES, ids=[c[0] for c in CASES])
def test_retention(what: str, snapshots: list[dict[str, Any]], committed: str, keep: int,
                   keep_last: int, deleted: list[str]) -> None:
    new = next(s for s in snapshots if s["id"] == committed)
    assert sorted(retention.to_delete(snapshots, new, keep, keep_last)) == sorted(deleted)


def test_newest_per_notebook_whatever_the_reason() -> None:
    found = retention.newest_per_notebook([
        snap("a1", 1), snap("u1", 5, "user"), snap("s1", 3, "shutdown", notebook="b.ipynb"),
        snap("x1", 9, notebook=None),
    ])
    assert [s["id"] for s in found] == ["u1", "s1"]


@pytest.mark.parametrize(
    ("estimate_bytes", "free", "autosaves", "reclaimed", "min_free", "cap", "refused"),
    [
        (100, 1000, 0, 0, 500, 0, None),
        (600, 1000, 0, 0, 500, 0, "autosave_min_free_bytes"),
        (100, 1000, 300, 0, 0, 350, "autosave_max_bytes"),
        # The autosave it replaces makes room under the cap, not on the disk.
        (100, 1000, 300, 100, 0, 350, None),
    ],
)
def test_autosave_room(estimate_bytes: int, free: int, autosaves: int, reclaimed: int,
                       min_free: int, cap: int, refused: str | None) -> None:
    room = retention.DiskRoom(free, autosaves, reclaimed)
    answer = retention.autosave_refusal(estimate_bytes, room, min_free, cap)
    assert (answer is None) == (refused is None), answer
    if refused:
        assert refused in str(answer)


def test_defaults_match_the_measured_llama_save() -> None:
    # DESIGN.md: a 16.1 GB GPU kernel (17.9 GB image) saved in 34.2 s on the H200.
    seconds = estimate.SaveRates().seconds(host_bytes=1_800_000_000, gpu_bytes=16_100_000_000)
    assert 30 < seconds < 45


def test_rates_are_learned_from_past_saves() -> None:
    past = [
        snap("big", 1, size=2_000_000_000,
             timings={"suspend": 1.0, "dump": 1.5, "commit": 0.5, "total": 3.5},
             gpu={"moved_bytes": 1_000_000_000}),
        snap("small", 2, size=50_000_000,
             timings={"suspend": 0.0, "dump": 0.3, "commit": 0.1, "total": 0.8}),
        snap("foreign", 3, size=10**10, timings={}),
    ]
    rates = estimate.learn_rates(past)
    # The image's rate is the whole save's but the GPU's checkpoint: 2 GB in 3.5 - 1 s.
    assert rates.image_rate == pytest.approx(0.8e9)
    assert rates.gpu_rate == pytest.approx(1e9)
    assert rates.fixed_seconds == pytest.approx(0.8)
    assert estimate.learn_rates([]) == estimate.SaveRates()


def test_a_kernels_own_saves_time_its_next_one() -> None:
    """A 3 GiB kernel whose saves took 14 s is estimated from them, not from the store's
    quicker saves of other kernels (or the defaults, which said 6 s)."""
    size = 3 * 2**30
    mine = {"kernel_id": "k-big", "name": "python3-snapshot"}
    past = [
        snap("big-1", 1, size=size, kernel=mine, timings={"dump": 6.0, "commit": 7.0,
                                                            "total": 14.0}),
        snap("other", 2, size=size, timings={"dump": 1.0, "commit": 1.0, "total": 2.5}),
    ]
    own = estimate.learn_kernel_rates(past, "k-big", None)
    assert own.seconds(host_bytes=size, gpu_bytes=0) == pytest.approx(14.0 + own.fixed_seconds)
    store = estimate.learn_kernel_rates(past, "k-new", None)
    assert store.image_rate == pytest.approx(
        statistics.median([size / 14.0, size / 2.5]))
    # A kernel of the same notebook counts as its own.
    notebook = estimate.learn_kernel_rates(
        [{**past[0], "notebook_path": "train.ipynb"}, past[1]], "k-restarted", "train.ipynb")
    assert notebook.image_rate == pytest.approx(size / 14.0)


def test_shutdown_order_puts_the_most_work_first() -> None:
    kernels = [
        estimate.KernelToSave("idle-ish", 10, 0, 5.0),
        estimate.KernelToSave("trainer", 10**9, 10**10, 3600.0),
        estimate.KernelToSave("unknown", 10, 0, float("inf")),
    ]
    assert [k.kernel_id for k in estimate.shutdown_order(kernels)] == [
        "unknown", "trainer", "idle-ish",
    ]


def test_autosaves_count_what_their_saves_wrote() -> None:
    """A chunked autosave takes its new pages on disk, not its whole size; one from before
    chunking takes its size."""
    summaries = [snap("a1", 1, size=1000, new_bytes=1000), snap("a2", 2, size=1000,
                 new_bytes=50), snap("a3", 3, size=700), snap("u1", 4, "user", size=5000)]
    assert retention.autosave_bytes(summaries) == 1000 + 50 + 700
    assert retention.reclaimed_by_next_autosave(summaries, "notebook:a.ipynb", 2) == 50 + 1000


def test_default_names_read_as_notebook_and_local_time_and_count_as_unnamed() -> None:
    now = time.mktime((2026, 12, 7, 14, 32, 5, 0, 0, -1))
    assert default_name("work/demo.ipynb", "python3-snapshot", now) == "demo-14.32"
    assert default_name(None, "python3-snapshot", now) == "python3-snapshot-14.32"
    # Whatever the notebook is called, the name is one the store takes.
    for path in ("Données 2.ipynb", "..ipynb", "-x-.ipynb", "a" * 90 + ".ipynb", "日本.ipynb"):
        validate_name(default_name(path, "python3-snapshot", now))
    assert default_name("日本.ipynb", "python3-snapshot", now) == "snapshot-14.32"
    # Retention keeps what the user named, not what the save named.
    saved = {"reason": "user", "created": now + 20, "kernel": {"name": "python3-snapshot"}}
    assert not retention.user_named({**saved, "name": "demo-14.32"})
    assert not retention.user_named({**saved, "name": "demo-14.32-2"})
    assert retention.user_named({**saved, "name": "demo-09.15"})
    assert retention.user_named({**saved, "name": "before-training"})
