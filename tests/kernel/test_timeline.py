"""The kernel's timeline and its rewind, in real kernels: plain Python, NumPy and pandas
values rewound by one cell and by ten, a cell that failed half way, a rewind asked while a
cell runs, what cannot come back, shared references and identities kept, the limits, the
timeline request and the magics.

Plain ``python3`` kernels (no snapshot provisioner) set up as a snapshot-ready kernel
sets itself up (``cell_record.install``, or ``%load_ext jupyter_gpu_snapshot``).
"""

from __future__ import annotations

import json
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.blocking import BlockingKernelClient

from jupyter_gpu_snapshot._constants import (
    REWIND_REPLY,
    REWIND_REQUEST,
    TIMELINE_REPLY,
    TIMELINE_REQUEST,
)
from jupyter_gpu_snapshot.kernel.timeline import TIMELINE_OFF
from tests.conftest import KernelHandle, start_kernel, stop_kernel, wait_for_output
from tests.kernel.test_cell_record import control, control_reply, request

pytestmark = pytest.mark.timeout(180)

INSTALL = "from jupyter_gpu_snapshot.kernel import cell_record; cell_record.install(get_ipython())"

# What the user's values are, as JSON (printed by a cell, compared across rewinds).
STATE = """
import json as _json
print(_json.dumps({
    "x": x, "items": items, "arr": arr.tolist(), "frame": frame.to_dict(orient="list"),
    "names": sorted(n for n in globals() if not n.startswith("_")),
}))
"""


@pytest.fixture
def kernels() -> Iterator[list[KernelHandle]]:
    started: list[KernelHandle] = []
    yield started
    for handle in started:
        stop_kernel(handle)


def new_kernel(kernels: list[KernelHandle], tmp_path: Path,
               env: dict[str, str] | None = None) -> BlockingKernelClient:
    ipython_dir = tmp_path / f"ipython-{len(kernels)}"
    handle = start_kernel("python3", env={"IPYTHONDIR": str(ipython_dir),
                                          "JUPYTER_GPU_SNAPSHOT_TIMELINE": "on", **(env or {})})
    kernels.append(handle)
    cell(handle.client, INSTALL)
    return handle.client


def cell(client: BlockingKernelClient, code: str, ok: bool = True) -> tuple[int, str]:
    """Run one cell; its execution count and what it printed (its error's text, if any)."""
    chunks: list[str] = []

    def hook(msg: dict[str, Any]) -> None:
        if msg["msg_type"] == "stream":
            chunks.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            chunks.append(f"{msg['content']['ename']}: {msg['content']['evalue']}")

    reply = client.execute_interactive(textwrap.dedent(code), timeout=120, output_hook=hook)
    content = reply["content"]
    assert (content["status"] == "ok") is ok, (content, chunks)
    return int(content["execution_count"]), "".join(chunks)


def state(client: BlockingKernelClient) -> dict[str, Any]:
    return dict(json.loads(cell(client, STATE)[1]))


def timeline(client: BlockingKernelClient) -> dict[str, Any]:
    reply = request(client, TIMELINE_REQUEST, {})
    assert reply["msg_type"] == TIMELINE_REPLY
    assert reply["content"]["status"] == "ok", reply["content"]
    return dict(reply["content"])


def rewind(client: BlockingKernelClient, before: Any) -> dict[str, Any]:
    reply = request(client, REWIND_REQUEST, {"before": before})
    assert reply["msg_type"] == REWIND_REPLY
    return dict(reply["content"])


SETUP = """
import numpy as np
import pandas as pd
x = 1
items = [1, 2]
arr = np.arange(6, dtype=np.float64)
frame = pd.DataFrame({"a": [1, 2, 3], "b": [0.5, 1.5, 2.5]})
alias = arr
arr_id = id(arr)
"""


def test_rewind_by_one_cell_and_by_ten(kernels: list[KernelHandle], tmp_path: Path) -> None:
    client = new_kernel(kernels, tmp_path)
    cell(client, SETUP)
    start = state(client)
    counts: list[int] = []
    states: list[dict[str, Any]] = []
    for step in range(10):
        count, _ = cell(client, f"""
            x = x + {step} + 1
            items.append({step})
            arr *= 2
            frame.loc[{step % 3}, "b"] = {step} * 10.0
            frame["c{step}"] = {step}
            made_{step} = [{step}] * 3
            """)
        counts.append(count)
        states.append(state(client))

    listed = timeline(client)
    assert listed["running"] is False
    points = {point["count"]: point for point in listed["points"]}
    for count in counts:
        assert count in listed["rewindable"]
        changed = set(points[count]["changed"])
        # Rebound, mutated in place (a list, an array and its alias, a frame), and new.
        assert {"x", "items", "arr", "alias", "frame"} <= changed, points[count]
    assert [p["count"] for p in listed["points"]] == sorted(points)
    assert listed["bytes"] == sum(p["bytes"] for p in listed["points"]) <= listed["limit_bytes"]

    # By one cell: as it was after the ninth step.
    reply = rewind(client, counts[-1])
    assert reply["status"] == "ok", reply
    report = reply["report"]
    assert report["before"] == counts[-1]
    assert report["undone"][0] == counts[-1]
    assert {"x", "items", "arr", "alias", "frame"} <= set(report["restored"])
    assert report["removed"] == ["made_9"]
    assert report["not_restored"] == []
    assert any("not undone" in caveat for caveat in report["caveats"])
    assert state(client) == states[-2]

    # By ten: as it was before the first step; the names made since are gone.
    reply = rewind(client, counts[0])
    assert reply["status"] == "ok", reply
    assert reply["report"]["undone"][0] == counts[0]
    assert set(reply["report"]["removed"]) == {f"made_{step}" for step in range(9)}
    assert state(client) == start
    # The array came back into the same object, which its alias still is.
    assert cell(client, "print(id(arr) == arr_id, alias is arr)")[1] == "True True\n"
    # The undone cells' points are gone; the kernel goes on recording.
    after = timeline(client)
    assert not set(counts) & {point["count"] for point in after["points"]}
    count, _ = cell(client, "x = 100")
    assert timeline(client)["points"][-1]["count"] == count
    assert rewind(client, count)["status"] == "ok"
    assert state(client) == start
    # A rewind writes into the arrays it restores: the same change made again right after
    # it is seen, and undone (8 MiB: above what is digested after every cell).
    cell(client, "big = np.ones(1 << 20)")
    for _ in range(2):
        count, _ = cell(client, "big += 1")
        assert timeline(client)["points"][-1]["changed"] == ["big"]
        assert rewind(client, count)["report"]["restored"] == ["big"]
    assert cell(client, "print(big.min(), big.max())")[1] == "1.0 1.0\n"


def test_a_cell_that_failed_half_way_is_undone(kernels: list[KernelHandle],
                                                tmp_path: Path) -> None:
    client = new_kernel(kernels, tmp_path)
    cell(client, SETUP)
    start = state(client)
    failed, text = cell(client, """
        items.append(3)
        arr[:] = 7
        frame["extra"] = 1
        partial = "made before the error"
        raise ValueError("half way")
        x = 5
        """, ok=False)
    assert "half way" in text
    point = timeline(client)["points"][-1]
    assert point["count"] == failed and point["ok"] is False
    assert {"items", "arr", "frame", "partial"} <= set(point["changed"])
    assert "x" not in point["changed"]
    reply = rewind(client, failed)
    assert reply["status"] == "ok", reply
    assert reply["report"]["removed"] == ["partial"]
    assert state(client) == start


def test_a_rewind_asked_while_a_cell_runs_is_refused(kernels: list[KernelHandle],
                                                     tmp_path: Path) -> None:
    client = new_kernel(kernels, tmp_path)
    flag = tmp_path / "go"
    count, _ = cell(client, "import os, time\ncounter = 0")
    running = client.execute(f"""
print("started", flush=True)
while not os.path.exists({str(flag)!r}):
    time.sleep(0.01)
counter += 1
print("ended", counter, flush=True)
""")
    wait_for_output(client, running, "started", 60, "stdout")
    assert timeline(client)["running"] is True
    reply = rewind(client, count)
    assert reply == {"status": "error", "ename": "KernelBusy", "traceback": [],
                     "evalue": "a cell is running: wait for it or interrupt it, then rewind"}
    flag.touch()
    wait_for_output(client, running, "ended 1", 60, "stdout")
    # The cell was not disturbed, and is recorded once it has ended.
    assert cell(client, "print(counter)")[1] == "1\n"
    listed = timeline(client)
    assert listed["running"] is False
    assert "counter" in listed["points"][-2]["changed"]


def test_what_cannot_come_back_is_named(kernels: list[KernelHandle], tmp_path: Path) -> None:
    client = new_kernel(kernels, tmp_path)
    first = tmp_path / "first.txt"
    second = tmp_path / "second.txt"
    kept, _ = cell(client, f"""
        log = open({str(first)!r}, "w")
        numbers = (i * i for i in range(10))
        n = 1
        """)
    listed = timeline(client)
    uncopied = {item["name"]: item["reason"] for item in listed["points"][-1]["uncopied"]}
    assert uncopied == {"log": "an open file cannot be copied",
                        "numbers": "a generator cannot be copied"}
    later, _ = cell(client, f"""
        log = open({str(second)!r}, "w")
        numbers = iter([])
        n = 2
        """)
    reply = rewind(client, later)
    assert reply["status"] == "ok", reply
    report = reply["report"]
    assert report["restored"] == ["n"]
    assert report["not_restored"] == [
        {"name": "log", "reason": "an open file cannot be copied"},
        {"name": "numbers", "reason": "a generator cannot be copied"},
    ]
    # They keep their current values; n came back.
    assert cell(client, "print(n, log.name.endswith('second.txt'))")[1] == "1 True\n"
    # Beyond what a point holds: a rewind out of range says which counts can be.
    refused = rewind(client, 10_000)
    assert refused["ename"] == "RewindOutOfRange"
    assert refused["evalue"].startswith("cannot rewind to before cell 10000: the cells that "
                                        "can be are ")
    assert str(kept) in refused["evalue"]
    assert rewind(client, "3")["ename"] == "RewindOutOfRange"


def test_shared_references_and_identities_stay(kernels: list[KernelHandle],
                                               tmp_path: Path) -> None:
    client = new_kernel(kernels, tmp_path)
    cell(client, """
        import numpy as np
        class Model:
            def __init__(self):
                self.weight = np.ones((4, 4))
                self.bias = np.zeros(4)
        class Optimizer:
            def __init__(self, params):
                self.params = list(params)
                self.steps = 0
            def step(self):
                for p in self.params:
                    p -= 0.5
                self.steps += 1
        model = Model()
        opt = Optimizer([model.weight, model.bias])
        first = [1]
        second = first
        weight_id = id(model.weight)
        """)
    trained, _ = cell(client, "opt.step()\nopt.step()\nfirst.append(2)")
    cell(client, "model = Model()\nsecond = [9]")
    reply = rewind(client, trained)
    assert reply["status"] == "ok", reply
    assert {"model", "opt", "first", "second"} <= set(reply["report"]["restored"])
    out = cell(client, """
        print(first is second, first,
              opt.params[0] is model.weight, opt.params[1] is model.bias,
              float(model.weight.sum()), float(model.bias.sum()), opt.steps,
              id(opt.params[0]) == weight_id)
        """)[1]
    assert out == "True [1] True True 16.0 0.0 0 True\n"


def test_the_oldest_points_are_dropped_for_the_limits(kernels: list[KernelHandle],
                                                      tmp_path: Path) -> None:
    client = new_kernel(kernels, tmp_path, env={"JUPYTER_GPU_SNAPSHOT_TIMELINE_POINTS": "3",
                                                "JUPYTER_GPU_SNAPSHOT_TIMELINE_BYTES": "3.5MiB"})
    cell(client, "import numpy as np\nvalue = 0\nblock = np.zeros(1 << 17)")  # 1 MiB
    counts = [cell(client, f"value = {step}\nblock += 1")[0] for step in range(5)]
    listed = timeline(client)
    assert [p["count"] for p in listed["points"]][-2:] == counts[-2:]
    assert len(listed["points"]) <= 3
    assert listed["dropped"] >= 3
    assert listed["bytes"] <= listed["limit_bytes"] == int(3.5 * (1 << 20))
    # The dropped points went into a base: the oldest point kept can still be rewound to,
    # and the values before it are the right ones.
    oldest = listed["points"][0]["count"]
    assert oldest in listed["rewindable"]
    step = counts.index(oldest) - 1
    assert rewind(client, oldest)["status"] == "ok"
    assert cell(client, "print(value, block[0])")[1] == f"{step} {float(step + 1)}\n"


def test_the_magics_print_the_timeline_and_the_report(kernels: list[KernelHandle],
                                                      tmp_path: Path) -> None:
    client = new_kernel(kernels, tmp_path)
    cell(client, "%load_ext jupyter_gpu_snapshot")
    # Installed twice (the recorder, then the extension): one timeline follows the cells.
    assert cell(client, """
        print(sum(type(getattr(f, "__self__", None)).__name__ == "Timeline"
                  for f in get_ipython().events.callbacks["post_run_cell"]))
        """)[1] == "1\n"
    cell(client, "import pandas as pd\nframe = pd.DataFrame({'a': [1, 2]})")
    dropped, _ = cell(client, "frame = frame.drop(columns=['a'])\nscratch = 1")
    shown = cell(client, "%gpu_snapshot timeline")[1]
    assert f"  [{dropped}] " in shown
    assert "changed frame, scratch" in shown
    assert "Rewind with %gpu_snapshot rewind N, N one of: " in shown
    printed = cell(client, f"%gpu_snapshot rewind {dropped}")[1]
    assert printed.splitlines()[:3] == [
        f"Rewound to before cell [{dropped}]: the effects of 2 cell(s) are undone "
        f"([{dropped}], [{dropped + 1}]).",
        "Put back as they were: frame.",
        "Removed (they did not exist then): scratch.",
    ]
    assert "Note: changes to files on disk" in printed
    assert cell(client, "print(list(frame.columns), 'scratch' in dir())")[1] == "['a'] False\n"
    refused = cell(client, "%gpu_snapshot rewind 999", ok=False)[1]
    assert "%gpu_snapshot rewind: cannot rewind to before cell 999: the cells that can be " \
        "are " in refused
    assert "usage: %gpu_snapshot rewind N" in cell(client, "%gpu_snapshot rewind", ok=False)[1]
    assert "usage: %gpu_snapshot rewind N" in cell(client, "%gpu_snapshot rewind x",
                                                   ok=False)[1]


def test_a_kernel_without_a_timeline_says_so(kernels: list[KernelHandle],
                                             tmp_path: Path) -> None:
    client = new_kernel(kernels, tmp_path, env={"JUPYTER_GPU_SNAPSHOT_TIMELINE": "off"})
    cell(client, "%load_ext jupyter_gpu_snapshot")
    count, _ = cell(client, "x = 1")
    reply = request(client, TIMELINE_REQUEST, {})
    assert reply["content"] == {"status": "ok", "on": False, "running": False, "points": [],
                                "rewindable": [], "bytes": 0, "limit_bytes": 0, "dropped": 0}
    reply = request(client, REWIND_REQUEST, {"before": count})
    assert reply["content"] == {"status": "error", "ename": "TimelineOff",
                                "evalue": TIMELINE_OFF, "traceback": []}
    printed = cell(client, "%gpu_snapshot timeline", ok=False)[1]
    assert f"%gpu_snapshot timeline: {TIMELINE_OFF}" in printed

    # Turned on in the running kernel: the cells from then on are points to rewind to.
    assert "The timeline is on" in cell(client, "%gpu_snapshot timeline on")[1]
    first, _ = cell(client, "x = 2")
    cell(client, "x = 3")
    assert "Rewound to before cell" in cell(client, f"%gpu_snapshot rewind {first + 1}")[1]
    assert cell(client, "print(x)")[1] == "2\n"
    reply = request(client, TIMELINE_REQUEST, {})
    assert reply["content"]["status"] == "ok" and reply["content"]["points"], reply
    # And off again: its points are let go, and the requests say it is off.
    assert "The timeline is off" in cell(client, "%gpu_snapshot timeline off")[1]
    assert request(client, REWIND_REQUEST, {"before": first})["content"]["ename"] == \
        "TimelineOff"
    assert request(client, TIMELINE_REQUEST, {})["content"]["on"] is False
    assert "usage: %gpu_snapshot timeline [on|off]" in cell(
        client, "%gpu_snapshot timeline maybe", ok=False)[1]


def test_a_cell_sent_during_a_rewind_waits_for_it(kernels: list[KernelHandle],
                                                  tmp_path: Path) -> None:
    # The rewind's copies take as long as the test says (an object whose copy waits for a
    # file once armed); a cell sent meanwhile waits, then sees the rewound values.
    client = new_kernel(kernels, tmp_path)
    armed, started, go = (tmp_path / name for name in ("armed", "started", "go"))
    cell(client, f"""
        import os, time
        class Slow:
            def __deepcopy__(self, memo):
                if os.path.exists({str(armed)!r}):
                    open({str(started)!r}, "w").close()
                    while not os.path.exists({str(go)!r}):
                        time.sleep(0.01)
                return Slow()
        slow = Slow()
        x = 1
        """)
    count, _ = cell(client, "slow = Slow()\nx = 2")
    armed.touch()
    asked = control(client, REWIND_REQUEST, {"before": count})
    deadline = time.monotonic() + 60
    while not started.exists():  # until the rewind is copying
        assert time.monotonic() < deadline, "the rewind never began its copies"
        time.sleep(0.01)
    following = client.execute("print('x is', x)")
    wait_for_output(client, following, "Waiting for a portable copy", 60, "stderr")
    go.touch()
    reply = control_reply(client, asked)
    assert reply["content"]["status"] == "ok", reply["content"]
    wait_for_output(client, following, "x is 1", 60, "stdout")


def test_names_set_outside_cells_belong_to_the_state_they_joined(
    kernels: list[KernelHandle], tmp_path: Path
) -> None:
    # As the portable fallback loads names: a silent request's user expression, no cell.
    client = new_kernel(kernels, tmp_path)
    first, _ = cell(client, "x = 1")
    reply = client.execute("", silent=True, store_history=False, reply=True, timeout=60,
                           user_expressions={"done": "globals().update(loaded=[1, 2])"})
    assert reply["content"]["user_expressions"]["done"]["status"] == "ok"
    later, _ = cell(client, "loaded.append(3)\nx = 2")
    assert "loaded" in timeline(client)["points"][-1]["changed"]
    assert rewind(client, later)["status"] == "ok"
    assert cell(client, "print(loaded, x)")[1] == "[1, 2] 1\n"
    report = rewind(client, first)["report"]
    assert set(report["removed"]) == {"x", "loaded"}
    assert cell(client, "print('loaded' in dir(), 'x' in dir())")[1] == "False False\n"


def test_a_view_of_a_value_left_alone_is_not_written_into(kernels: list[KernelHandle],
                                                          tmp_path: Path) -> None:
    client = new_kernel(kernels, tmp_path)
    cell(client, "import numpy as np\nx = np.zeros(5)\nkeep = np.ones(10)")
    rebound, _ = cell(client, "x = keep[:5]")
    assert rewind(client, rebound)["report"]["restored"] == ["x"]
    # x is zeros again, in memory of its own; keep, which no cell since changed, is intact.
    out = cell(client, "print(x.tolist(), keep.tolist(), np.shares_memory(x, keep))")[1]
    assert out == f"{[0.0] * 5} {[1.0] * 10} False\n"
