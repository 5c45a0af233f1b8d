"""What the timeline sees a cell change, in an IPython shell in this process: big arrays
digested again only where the cell could reach them, and what it cannot see named, never
claimed exact. (The rewind itself is tested in real kernels: test_timeline.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from IPython.core.interactiveshell import InteractiveShell

from jupyter_gpu_snapshot.kernel.timeline import Timeline
from jupyter_gpu_snapshot.kernel.timeline.limits import limits_from_env, parse_bytes

BIG = "np.zeros((8 << 20) // 8)"  # 8 MiB: above what is digested after every cell


@pytest.fixture
def shell() -> Iterator[InteractiveShell]:
    shell = InteractiveShell.instance()
    shell.reset(new_session=True)
    yield shell
    shell.reset(new_session=True)


@pytest.fixture
def timeline(shell: InteractiveShell) -> Iterator[Timeline]:
    kept = Timeline(shell, 1 << 30, 100)
    shell.events.register("pre_run_cell", kept.pre_run_cell)
    shell.events.register("post_run_cell", kept.post_run_cell)
    yield kept
    shell.events.unregister("pre_run_cell", kept.pre_run_cell)
    shell.events.unregister("post_run_cell", kept.post_run_cell)


def changed(shell: InteractiveShell, timeline: Timeline, code: str) -> list[str]:
    result = shell.run_cell(code, store_history=True)
    assert result.success, result.error_in_exec
    point = timeline.points[-1]
    assert point.count == result.execution_count
    return point.changed


def test_big_arrays_changed_through_what_the_cell_names(shell: InteractiveShell,
                                                         timeline: Timeline) -> None:
    assert set(changed(shell, timeline, f"""
import numpy as np
big = {BIG}
other = {BIG}
holder = {{"inside": big}}
def bump():
    big[0] += 1
""")) == {"np", "big", "other", "holder", "bump"}
    # Named by the cell, by a function of the notebook it calls, through a dict that holds
    # it (which then also changed), through globals().
    assert changed(shell, timeline, "big[1] = 5") == ["big", "holder"]
    assert changed(shell, timeline, "bump()") == ["big", "holder"]
    assert changed(shell, timeline, "holder['inside'][2] = 7") == ["big", "holder"]
    assert changed(shell, timeline, "globals()['other'][0] = 1") == ["other"]
    # A cell that touches nothing big changes nothing.
    assert changed(shell, timeline, "print(len(big))") == []


def test_a_view_and_its_base_change_together(shell: InteractiveShell,
                                             timeline: Timeline) -> None:
    # 16 MiB and 8 MiB: both above what is digested after every cell.
    changed(shell, timeline, "import numpy as np\nbase = np.zeros(2 << 20)\nhalf = base[: 1 << 20]")
    assert changed(shell, timeline, "half[0] = 1") == ["base", "half"]
    assert changed(shell, timeline, "base[1] = 1") == ["base", "half"]


def test_what_the_walk_cannot_see_is_not_claimed(shell: InteractiveShell,
                                                 timeline: Timeline) -> None:
    changed(shell, timeline, f"""
import numpy as np, threading
big = {BIG}
hooks = [lambda: big.fill(3)]
lock = threading.Lock()
""")
    # A callback kept in a list: the cell's code does not show that it reaches big, so
    # its change is not seen then; the next cell that names big sees it.
    assert changed(shell, timeline, "hooks[0]()") == []
    assert changed(shell, timeline, "total = float(big.sum())") == ["big", "total"]
    # A lock cannot be copied, and its insides cannot be read: both are said.
    assert timeline.points[0].entries["lock"].kind == "uncopied"
    assert "lock" in timeline.unseen
    caveats = timeline._caveats()
    assert any(caveat.startswith("lock: ") for caveat in caveats)


def test_limits_read_from_the_environment() -> None:
    assert parse_bytes("2G") == 2 << 30
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("3.5MiB") == int(3.5 * (1 << 20))
    assert parse_bytes("1000") == 1000
    assert limits_from_env({"JUPYTER_GPU_SNAPSHOT_TIMELINE_BYTES": "1g",
                            "JUPYTER_GPU_SNAPSHOT_TIMELINE_POINTS": "7"}) == (1 << 30, 7)
    limit, points = limits_from_env({})
    assert 0 < limit <= 8 << 30 and points == 100


def test_a_name_older_than_the_timeline_cannot_be_rewound_past(
    shell: InteractiveShell,
) -> None:
    from jupyter_gpu_snapshot.kernel.timeline import RewindOutOfRange

    shell.run_cell("older = [1]", store_history=True)
    kept = Timeline(shell, 1 << 30, 100)
    shell.events.register("post_run_cell", kept.post_run_cell)
    try:
        first = shell.run_cell("x = 1", store_history=True).execution_count
        touched = shell.run_cell("older.append(2)", store_history=True).execution_count
        later = shell.run_cell("x = 2", store_history=True).execution_count
        # Before `touched`, older's value is not known: only later points can be rewound to.
        assert kept.content()["rewindable"] == [later]
        assert "older" in kept.points[-2].changed and kept.points[-2].count == touched
        with pytest.raises(RewindOutOfRange, match=f"before cell {first}: the cells that "
                           f"can be are {later}$"):
            kept.rewind(first)
        kept.rewind(later)
        assert shell.user_ns["x"] == 1 and shell.user_ns["older"] == [1, 2]
    finally:
        shell.events.unregister("post_run_cell", kept.post_run_cell)


def test_deleted_names_come_back_and_objects_are_refilled_in_place(
    shell: InteractiveShell, timeline: Timeline
) -> None:
    shell.run_cell("""
class Box:
    def __init__(self):
        self.items = [1]
        self.label = "a"
box = Box()
held = {"box": box}
gone = [1, 2]
""", store_history=True)
    original = shell.user_ns["box"]
    count = shell.run_cell("box.items.append(2)\nbox.label = 'b'\ndel gone",
                           store_history=True).execution_count
    assert timeline.points[-1].deleted == ["gone"]
    report = timeline.rewind(count)
    ns = shell.user_ns
    assert set(report["restored"]) == {"box", "held", "gone"} and report["removed"] == []
    assert ns["gone"] == [1, 2]
    assert ns["box"].items == [1] and ns["box"].label == "a"
    assert ns["held"]["box"] is ns["box"] is original
